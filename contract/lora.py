"""The LoRA part of the engine contract: which modules take adapters, and the adapter pool's layout.

An engine built with ``lora_target_modules`` adds ``x @ A^T @ B^T * scale`` of each token's adapter to the
targeted linears. The adapters are not in the engine: like the KV pool, the runtime owns them as one pool,

    lora_weights  [max_loras, slot_numel]  engine dtype: one row ("slot") per resident adapter
    lora_slots    [num_tokens]             int32: the slot of each packed token's adapter, -1 = none (base model)

passed to every step. One slot holds, for every layer and then every module of :attr:`LoraLayout.modules` in
order, ``A`` as [max_rank, in_features] (PEFT's ``lora_A.weight``) followed by ``B^T * scale`` as
[max_rank, out_features] (PEFT's ``lora_B.weight`` transposed, times the adapter's scaling); an adapter of a
lower rank fills the first rows and leaves the rest zero, a module it does not adapt stays zero. The builder
bakes the offsets of this layout into the graph (``kiln::lora`` segments); the runtime fills slots by the same
offsets (:meth:`LoraLayout.offsets`): one owner, this module.

Module names are PEFT's (what ``target_modules`` matches): ``hf_path`` is the module's path in the Hugging Face
model with ``{layer}`` for the layer index, which is how an adapter file names its tensors
(``base_model.model.<hf_path>.lora_A.weight``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

LORA_INPUT_NAMES = ("lora_slots", "lora_weights")
LORA_SLOTS_DTYPE = torch.int32
LORA_AXES: dict[str, dict[int, str]] = {"lora_slots": {0: "num_tokens"}, "lora_weights": {0: "max_loras"}}
NO_ADAPTER = -1   # the lora_slots value of a token served by the base model


@dataclass(frozen=True)
class LoraModule:
    """One kind of adapted module (the same in every layer)."""

    name: str           # unique within the engine: "q_proj", "mlp.c_proj"
    hf_path: str        # "model.layers.{layer}.self_attn.q_proj"
    in_features: int
    out_features: int


@dataclass(frozen=True)
class LoraLayout:
    """The adapter pool of an engine: ``config.json``'s ``lora`` section."""

    max_rank: int
    num_layers: int
    modules: list[LoraModule] = field(default_factory=list)

    @property
    def layer_numel(self) -> int:
        return self.max_rank * sum(m.in_features + m.out_features for m in self.modules)

    @property
    def slot_numel(self) -> int:
        """Elements of one adapter slot (one row of ``lora_weights``)."""
        return self.num_layers * self.layer_numel

    def slot_bytes(self, dtype: torch.dtype) -> int:
        return self.slot_numel * torch.empty(0, dtype=dtype).element_size()

    def module(self, name: str) -> LoraModule:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(name)

    def offsets(self, layer: int, name: str) -> tuple[int, int]:
        """(offset of A, offset of B^T) of module ``name`` of ``layer`` within a slot."""
        off = layer * self.layer_numel
        for m in self.modules:
            if m.name == name:
                return off, off + self.max_rank * m.in_features
            off += self.max_rank * (m.in_features + m.out_features)
        raise KeyError(name)

    def match_path(self, path: str) -> tuple[int, LoraModule] | None:
        """(layer, module) a Hugging Face module path names (``model.layers.3.self_attn.q_proj``), or None."""
        for m in self.modules:
            found = re.fullmatch(re.escape(m.hf_path).replace(re.escape("{layer}"), r"(\d+)"), path)
            if found and int(found.group(1)) < self.num_layers:
                return int(found.group(1)), m
        return None

    def problems(self) -> list[str]:
        out = []
        if self.max_rank < 1 or self.num_layers < 1:
            out.append(f"lora.max_rank={self.max_rank} and lora.num_layers={self.num_layers} must be >= 1")
        if not self.modules:
            out.append("lora.modules is empty")
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            out.append(f"lora.modules has duplicate names {names}")
        out += [f"lora module {m.name!r}: in_features={m.in_features}, out_features={m.out_features} must be >= 1"
                for m in self.modules if m.in_features < 1 or m.out_features < 1]
        out += [f"lora module {m.name!r}: hf_path {m.hf_path!r} has no '{{layer}}'"
                for m in self.modules if m.hf_path.count("{layer}") != 1]
        return out
