"""KVCacheManager: the paged KV pool's bookkeeping (which block belongs to whom), with prefix reuse.

The pool tensor (the contract's ``kv_cache_shape``) is allocated once by the executor; this class only
hands out block ids, and it alone knows which blocks each request holds (its block table).

* Admission is two calls: :meth:`get_computed_blocks` finds the longest cached prefix of a waiting
  request (taking nothing), then :meth:`allocate_slots` takes those blocks and the new ones the step
  needs, or nothing at all when the pool is short. A running request grows by ``allocate_slots`` alone.
* Every block has a reference count. A block with count 0 sits in the *free queue*, kept in eviction
  order (front = evicted first): blocks that carry no reusable content go to the front, blocks that hold
  a cached prefix go to the back when their last user leaves, so the least recently used is evicted first.
* A full block is identified by a hash chained over its tokens and the previous block's hash, so equal
  hashes mean equal prefixes. ``hash -> block`` lets a new request pick up the blocks of a prefix that an
  earlier (or concurrent) request already computed; they are shared (count > 1), never copied.
* Taking a block from the free queue that still holds a cached prefix evicts it (drops its hash).
* :meth:`record_events` makes the manager log each hash it caches and evicts (``events``, in order), so
  another process can follow what this pool holds (the disaggregated frontend's prefix-aware routing).
* Sliding-window models (``sliding_window > 0``): a token attends to the last ``sliding_window``
  positions only, so blocks that fall wholly before the window of the next token are released as the
  request advances. The block table keeps its positions (position p is in entry p // block_size); a
  released entry is filled with the request's first block still held, so the table never names a block
  the request gave up (the attention kernels mask those positions; the native decode kernel does not
  read them at all).

Sizing: :func:`plan_num_blocks` turns a memory budget into a block count and says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.contract import ConfigError
from kiln.runtime.request import Request

logger = logging.getLogger("kiln.runtime")

_ROOT_HASH = b"kiln-prefix-root"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes | None, tokens: list[int], salt: bytes | None = None) -> bytes:
    """Hash of one full block: chained over the parent block's hash, so it names the whole prefix. The first
    block's chain starts from ``salt`` when given (a LoRA adapter: its KV differs for the same tokens)."""
    h = hashlib.blake2b(parent or (_ROOT_HASH + salt if salt else _ROOT_HASH), digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class KVCacheStats:
    num_blocks: int
    block_size: int
    used_blocks: int          # referenced by at least one request
    free_blocks: int          # not referenced (includes cached ones, which are evictable)
    cached_blocks: int        # holding a reusable prefix (referenced or not)
    usage: float              # used / total
    prefix_queries: int       # prompt tokens looked up in the prefix cache
    prefix_hits: int          # of those, tokens found cached
    hit_rate: float
    evictions: int            # cached blocks dropped to make room

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_reuse: bool = True, sliding_window: int = 0):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_reuse = enable_prefix_reuse
        self.sliding_window = sliding_window
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}      # request id -> block table (positional)
        self._released: dict[str, int] = {}          # request id -> leading entries released by the window
        self._registered: dict[str, int] = {}        # request id -> leading blocks offered to the prefix cache
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0
        self.events: deque[tuple[bool, bytes]] | None = None   # (cached?, hash) since the last drain

    def record_events(self) -> None:
        """From now on log every hash cached (True, h) and evicted (False, h) in ``events``: appended by the step
        loop, taken by :meth:`drain_events` in any thread (deque appends and pops are atomic)."""
        self.events = deque()

    def drain_events(self) -> list[tuple[bool, bytes]]:
        """The events logged since the last drain, oldest first (one drainer at a time keeps them in order)."""
        ev = self.events
        return [] if ev is None else [ev.popleft() for _ in range(len(ev))]

    # ---- accounting -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks, block_size=self.block_size, used_blocks=self.num_used_blocks,
            free_blocks=self.num_free_blocks, cached_blocks=len(self.cached), usage=self.usage,
            prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits,
            hit_rate=self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            evictions=self.evictions,
        )

    def block_table(self, request_id: str) -> list[int]:
        """The request's block table (entry i holds positions [i * block_size, (i + 1) * block_size))."""
        return self._tables.get(request_id, [])

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks the request holds a reference to (its table less the entries the window released)."""
        return self.block_table(request_id)[self._released.get(request_id, 0):]

    def check_consistency(self) -> None:
        """Raise AssertionError if the books do not balance (tests call this)."""
        refs = [0] * self.num_blocks
        for rid, table in self._tables.items():
            held = self.held_blocks(rid)
            assert set(table) <= set(held), f"{rid}: its table names blocks it released"
            for b in held:
                refs[b] += 1
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] == refs[b], f"block {b}: count {self.ref_cnt[b]}, held by {refs[b]} requests"
            assert (self.ref_cnt[b] == 0) == (b in self.free_queue), f"block {b}: count {self.ref_cnt[b]} vs free queue"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cached hash of block {b} does not match"
        assert sum(h is not None for h in self.block_hash) == len(self.cached), "hashed blocks not in the cache map"

    # ---- prefix reuse -------------------------------------------------------------------------------
    def _update_hashes(self, request: Request, num_blocks: int) -> None:
        """Extend the request's hash chain to cover its first ``num_blocks`` full blocks."""
        hashes, bs, toks = request.block_hashes, self.block_size, request.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, toks[i * bs:(i + 1) * bs], request.cache_salt))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of a request that holds no blocks yet (nothing is taken).

        At least one token is always left to compute: the last one produces the logits.
        """
        if not self.enable_prefix_reuse:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        self._update_hashes(request, limit)
        found = []
        for h in request.block_hashes[:limit]:
            b = self.cached.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens, so others can reuse them."""
        rid = request.request_id
        table = self._tables.get(rid)
        if not self.enable_prefix_reuse or table is None:
            return
        full = min(request.num_computed_tokens // self.block_size, len(table))
        done = self._registered.get(rid, 0)
        if full <= done:
            return
        self._update_hashes(request, full)
        for i in range(max(done, self._released.get(rid, 0)), full):
            b, h = table[i], request.block_hashes[i]
            if self.block_hash[b] is not None or h in self.cached:
                continue  # already cached (a prefix hit), or the same prefix lives in another block
            self.cached[h] = b
            self.block_hash[b] = h
            if self.events is not None:
                self.events.append((True, h))
        self._registered[rid] = full

    # ---- allocation ---------------------------------------------------------------------------------
    def _take_free(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
                if self.events is not None:
                    self.events.append((False, h))
            self.block_hash[b] = None
            self.evictions += 1
        self.ref_cnt[b] = 1
        return b

    def _unref(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. Blocks without reusable content go to the front of the free
        queue; cached ones to the back in the order given, so pass a prefix tail first."""
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def _release_outside_window(self, request: Request) -> None:
        """Sliding window: give back the blocks wholly before the window of the next token to compute
        (it attends to positions >= num_computed_tokens - sliding_window + 1); the last block stays."""
        rid = request.request_id
        table = self._tables[rid]
        first = self._released.get(rid, 0)
        upto = min((request.num_computed_tokens - self.sliding_window + 1) // self.block_size, len(table) - 1)
        if upto <= first:
            return
        self._unref(table[first:upto][::-1])
        self._released[rid] = upto
        table[:upto] = [table[upto]] * upto

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = (),
                       keep_free: int = 0) -> bool:
        """Make room for ``num_new_tokens`` more tokens of the request, after its ``num_computed_tokens``
        and the ``computed_blocks`` (its cached prefix, from :meth:`get_computed_blocks`, when it is being
        admitted). Returns False, taking nothing, when that would leave fewer than ``keep_free`` blocks
        free (``keep_free``: blocks promised to others). Prefix-hit statistics are counted at admission."""
        rid = request.request_id
        table = self._tables.get(rid)
        admitting = table is None
        if admitting:
            table = []
        elif self.sliding_window > 0:
            self._release_outside_window(request)
        computed = len(computed_blocks) * self.block_size
        need = max(0, cdiv(request.num_computed_tokens + computed + num_new_tokens, self.block_size)
                   - len(table) - len(computed_blocks))
        taken_from_free = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)
        if need + taken_from_free > len(self.free_queue) - keep_free:
            return False
        for b in computed_blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
        if admitting:
            self._tables[rid] = table
            self._registered[rid] = len(computed_blocks)
            if self.enable_prefix_reuse:
                self.prefix_queries += request.num_tokens
                self.prefix_hits += computed
        table.extend(computed_blocks)
        table.extend(self._take_free() for _ in range(need))
        return True

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's ``num_computed_tokens`` (speculative decoding rolled it back
        over rejected proposals: a block that holds none of its tokens any more is freed). Such blocks were
        never full of computed tokens, so no hash names them."""
        table = self._tables[request.request_id]
        keep = max(1, cdiv(request.num_computed_tokens, self.block_size))
        if len(table) > keep:
            self._unref(table[keep:][::-1])
            del table[keep:]

    def free(self, request: Request) -> None:
        """Drop the request's references (tail blocks first, so a cached prefix's head outlives its tail)."""
        rid = request.request_id
        if rid not in self._tables:
            return
        self._unref(self.held_blocks(rid)[::-1])
        del self._tables[rid]
        self._released.pop(rid, None)
        self._registered.pop(rid, None)


def available_memory_bytes(device: str = "cpu") -> int:
    """Memory free for the KV pool now: CUDA free memory, or the OS's MemAvailable on CPU."""
    if str(device).startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_num_blocks(
    kv_bytes_per_token: int,
    block_size: int,
    *,
    memory_fraction: float | None,
    max_kv_cache_tokens: int | None,
    useful_tokens: int | None = None,
    available_bytes: int | None = None,
) -> tuple[int, str]:
    """Number of KV blocks from a memory budget; the smallest limit wins. Returns (blocks, reason).

    memory_fraction: fraction of the memory available now (after the engine is loaded).
    max_kv_cache_tokens: an absolute cap in tokens.
    useful_tokens: tokens beyond which more pool cannot help (e.g. 2 x max_batch_size x max_seq_len).
    """
    limits: list[tuple[int, str]] = []
    bytes_per_block = kv_bytes_per_token * block_size
    if memory_fraction is not None:
        if not 0.0 < memory_fraction <= 1.0:
            raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1], got {memory_fraction}")
        avail = available_memory_bytes() if available_bytes is None else available_bytes
        limits.append((int(avail * memory_fraction) // bytes_per_block,
                       f"kv_cache_memory_fraction {memory_fraction} of {avail / 2**30:.2f} GiB available"))
    if max_kv_cache_tokens is not None:
        if max_kv_cache_tokens < block_size:
            raise ConfigError(f"max_kv_cache_tokens ({max_kv_cache_tokens}) is below one block ({block_size} tokens)")
        limits.append((max_kv_cache_tokens // block_size, f"max_kv_cache_tokens {max_kv_cache_tokens}"))
    if useful_tokens is not None:
        limits.append((cdiv(useful_tokens, block_size), f"{useful_tokens} tokens is all the engine's bounds can use"))
    if not limits:
        raise ConfigError("set kv_cache_memory_fraction or max_kv_cache_tokens to size the KV cache")
    blocks, why = min(limits, key=lambda x: x[0])
    if blocks < 1:
        raise ConfigError(f"the KV cache budget ({why}) is smaller than one block of {block_size} tokens "
                         f"({bytes_per_block} bytes)")
    reason = (f"KV cache: {blocks} blocks x {block_size} tokens = {blocks * block_size} tokens, "
              f"{blocks * bytes_per_block / 2**20:.1f} MiB ({kv_bytes_per_token} B/token); limited by {why}")
    others = [w for n, w in limits if w != why]
    if others:
        reason += " (other limits: " + "; ".join(f"{w}" for w in others) + ")"
    return blocks, reason
