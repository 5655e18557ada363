"""The runtime's LoRA adapters: which are loaded (by name), and which sit in the adapter pool's slots.

:class:`AdapterRegistry` (any thread) holds the loaded adapters by name. Loading reads and converts the
adapter in the caller's thread (``lora_adapters.read_adapter``), never in the step loop; each load gets a new
id, so an adapter unloaded and loaded again under the same name never shares prefix-cache blocks with its
old weights. Unloading takes the name away at once (new requests naming it are refused); requests already
holding the adapter finish with it.

:class:`AdapterPool` (the step loop only) is the ``[max_loras, slot_numel]`` tensor every step passes to the
engine, and the book of its slots: which adapter each holds, how many scheduled requests use it. The
scheduler acquires a request's slot when it admits the request and releases it when the request is
preempted or ends. An adapter not resident is copied into a free slot, else into the least recently used
slot no request uses (an LRU swap: between steps, never under a running request); when every slot is in
use, the request waits.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from kiln.contract import AdapterLoadError, InvalidRequestError, LoraLayout
from kiln.runtime.lora_adapters import LoraAdapter, read_adapter

__all__ = ["AdapterPool", "AdapterRegistry", "LoraAdapter"]


class AdapterRegistry:
    """Loaded adapters by name, for one engine's layout and dtype."""

    def __init__(self, layout: LoraLayout, dtype: torch.dtype):
        self.layout = layout
        self.dtype = dtype
        self._lock = threading.Lock()
        self._by_name: dict[str, LoraAdapter] = {}
        self._ids = itertools.count(1)

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read the PEFT adapter at ``path`` and serve it as ``name`` (AdapterLoadError when it cannot be)."""
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise AdapterLoadError(f"a LoRA adapter name must be a non-empty string without surrounding spaces, "
                                   f"got {name!r:.60}")
        with self._lock:
            if name in self._by_name:
                raise AdapterLoadError(f"a LoRA adapter named {name!r} is already loaded (from "
                                       f"{self._by_name[name].path}); unload it first")
            adapter_id = next(self._ids)
        adapter = read_adapter(path, self.layout, self.dtype, name, adapter_id)   # seconds, off every lock
        with self._lock:
            if name in self._by_name:   # loaded meanwhile by another thread
                raise AdapterLoadError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
            self._by_name[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        with self._lock:
            if self._by_name.pop(name, None) is None:
                raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded; loaded: {sorted(self._by_name)}")

    def get(self, name: str) -> LoraAdapter:
        """The adapter a request names (InvalidRequestError naming an unknown one)."""
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise InvalidRequestError(f"unknown LoRA adapter {name!r}; loaded adapters: {sorted(self._by_name)}")
            return adapter

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def adapters(self) -> list[LoraAdapter]:
        with self._lock:
            return list(self._by_name.values())


class AdapterPool:
    """The slots of the adapter pool tensor ``weights`` ([max_loras, slot_numel])."""

    def __init__(self, weights: torch.Tensor):
        self.weights = weights
        self.max_loras = weights.shape[0]
        self._free = list(range(self.max_loras))           # never filled, or holding nothing
        self._idle: OrderedDict[int, None] = OrderedDict()  # filled, used by no request: front = least recent
        self._held: list[LoraAdapter | None] = [None] * self.max_loras
        self._users = [0] * self.max_loras
        self._slot: dict[int, int] = {}                     # adapter id -> its slot
        self.swaps_in = 0                                   # adapters copied into a slot
        self.evictions = 0                                  # of those, into a slot another adapter held

    @property
    def num_resident(self) -> int:
        return len(self._slot)

    def resident(self) -> list[str]:
        return [a.name for a in self._held if a is not None]

    def can_acquire(self, adapter: LoraAdapter) -> bool:
        """Would :meth:`acquire` find the adapter a slot now?"""
        return adapter.adapter_id in self._slot or bool(self._free) or bool(self._idle)

    def acquire(self, adapter: LoraAdapter) -> int:
        """The slot holding ``adapter`` for one more user, filled now if it is not resident (the caller checked
        :meth:`can_acquire`)."""
        slot = self._slot.get(adapter.adapter_id)
        if slot is None:
            if self._free:
                slot = self._free.pop(0)
            elif self._idle:
                slot, _ = self._idle.popitem(last=False)
                del self._slot[self._held[slot].adapter_id]
                self.evictions += 1
            else:
                raise RuntimeError(f"no adapter pool slot for {adapter.name!r}: all {self.max_loras} are in use")
            self.weights[slot].copy_(adapter.row)
            self._held[slot] = adapter
            self._slot[adapter.adapter_id] = slot
            self.swaps_in += 1
        elif self._users[slot] == 0:
            del self._idle[slot]
        self._users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """One user of ``slot`` is done (preempted or ended); an unused slot becomes the most recent idle one."""
        self._users[slot] -= 1
        if self._users[slot] < 0:
            raise RuntimeError(f"adapter pool slot {slot} released more often than acquired")
        if self._users[slot] == 0:
            self._idle[slot] = None

    def check_consistency(self) -> None:
        """AssertionError when the books do not balance (tests call this)."""
        for slot, adapter in enumerate(self._held):
            states = [slot in self._free, slot in self._idle, self._users[slot] > 0]
            assert sum(states) == 1, f"slot {slot}: free {states[0]}, idle {states[1]}, users {self._users[slot]}"
            assert (adapter is None) == (slot in self._free), f"slot {slot} holds {adapter} but is free"
            if adapter is not None:
                assert self._slot[adapter.adapter_id] == slot

    def stats(self) -> dict:
        return {"max_loras": self.max_loras, "resident": self.resident(), "in_use": sum(u > 0 for u in self._users),
                "swaps_in": self.swaps_in, "evictions": self.evictions}
