"""KVCacheManager: the paged KV pool's bookkeeping (which block belongs to whom), with prefix reuse.

The pool tensor ``[layers, 2, num_blocks, tokens_per_block, kv_heads, head_dim]`` is allocated once by the
executor (``Engine.allocate_kv_cache``); this class only hands out block ids.

* Every block has a reference count. A block with count 0 sits in the *free queue*, kept in eviction
  order (front = evicted first): blocks that carry no reusable content go to the front, blocks that hold
  a cached prefix go to the back when their last user leaves, so the least recently used is evicted first.
* A full block is identified by a hash chained over its tokens and the previous block's hash, so equal
  hashes mean equal prefixes. ``hash -> block`` lets a new request pick up the blocks of a prefix that an
  earlier (or concurrent) request already computed; they are shared (count > 1), never copied.
* Taking a block from the free queue that still holds a cached prefix evicts it (drops its hash).

Sizing: :func:`plan_num_blocks` turns a memory budget into a block count and says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kiln.runtime.request import Request

logger = logging.getLogger("kiln.runtime")

_ROOT_HASH = b"kiln-prefix-root"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    """Hash of one full block: chained over the parent block's hash, so it names the whole prefix."""
    h = hashlib.blake2b(parent or _ROOT_HASH, digest_size=16)
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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_reuse: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_reuse = enable_prefix_reuse
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0

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

    def check_consistency(self) -> None:
        """Raise AssertionError if the books do not balance (tests call this)."""
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0, f"block {b} has a negative reference count"
            assert (self.ref_cnt[b] == 0) == (b in self.free_queue), f"block {b}: count {self.ref_cnt[b]} vs free queue"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"cached hash of block {b} does not match"
        assert sum(h is not None for h in self.block_hash) == len(self.cached), "hashed blocks not in the cache map"

    # ---- prefix reuse -------------------------------------------------------------------------------
    def update_hashes(self, request: Request, num_blocks: int) -> None:
        """Extend the request's hash chain to cover its first ``num_blocks`` full blocks."""
        hashes, bs, toks = request.block_hashes, self.block_size, request.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, toks[i * bs:(i + 1) * bs]))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens (not yet taken).

        At least one token is always left to compute: the last one produces the logits.
        """
        if not self.enable_prefix_reuse:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        self.update_hashes(request, limit)
        found = []
        for h in request.block_hashes[:limit]:
            b = self.cached.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def num_evictable_in(self, blocks: list[int]) -> int:
        """How many of these blocks are in the free queue (taking them shrinks the free pool)."""
        return sum(1 for b in blocks if self.ref_cnt[b] == 0)

    def acquire_prefix(self, request: Request, blocks: list[int]) -> None:
        """Give the request the cached prefix blocks found by ``find_cached_prefix``; counts hit stats."""
        assert not request.block_ids, "acquire_prefix on a request that already holds blocks"
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
        request.block_ids = list(blocks)
        request.num_registered_blocks = len(blocks)
        request.num_computed_tokens = len(blocks) * self.block_size
        if self.enable_prefix_reuse:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += request.num_computed_tokens

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens, so others can reuse them."""
        if not self.enable_prefix_reuse:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if full <= request.num_registered_blocks:
            return
        self.update_hashes(request, full)
        for i in range(request.num_registered_blocks, full):
            b = request.block_ids[i]
            h = request.block_hashes[i]
            if self.block_hash[b] is not None or h in self.cached:
                continue  # already cached (a prefix hit), or the same prefix lives in another block
            self.cached[h] = b
            self.block_hash[b] = h
        request.num_registered_blocks = full

    # ---- allocation ---------------------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        return max(0, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(request.block_ids))

    def _take_free(self) -> int:
        b, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None
            self.evictions += 1
        self.ref_cnt[b] = 1
        return b

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of the request; False (nothing taken) if the pool is short."""
        need = self.blocks_needed(request, num_new_tokens)
        if need > len(self.free_queue):
            return False
        for _ in range(need):
            request.block_ids.append(self._take_free())
        return True

    def free(self, request: Request) -> None:
        """Drop the request's references. Blocks without reusable content go to the front of the free queue;
        cached ones to the back, tail blocks first, so a prefix's head outlives its tail."""
        for b in reversed(request.block_ids):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)
        request.block_ids = []
        request.num_registered_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks in use keep their content). Returns how many were dropped."""
        n = len(self.cached)
        for b in self.cached.values():
            self.block_hash[b] = None
        self.cached.clear()
        return n


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
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {memory_fraction}")
        avail = available_memory_bytes() if available_bytes is None else available_bytes
        limits.append((int(avail * memory_fraction) // bytes_per_block,
                       f"kv_cache_memory_fraction {memory_fraction} of {avail / 2**30:.2f} GiB available"))
    if max_kv_cache_tokens is not None:
        if max_kv_cache_tokens < block_size:
            raise ValueError(f"max_kv_cache_tokens ({max_kv_cache_tokens}) is below one block ({block_size} tokens)")
        limits.append((max_kv_cache_tokens // block_size, f"max_kv_cache_tokens {max_kv_cache_tokens}"))
    if useful_tokens is not None:
        limits.append((cdiv(useful_tokens, block_size), f"{useful_tokens} tokens is all the engine's bounds can use"))
    if not limits:
        raise ValueError("set kv_cache_memory_fraction or max_kv_cache_tokens to size the KV cache")
    blocks, why = min(limits, key=lambda x: x[0])
    if blocks < 1:
        raise ValueError(f"the KV cache budget ({why}) is smaller than one block of {block_size} tokens "
                         f"({bytes_per_block} bytes)")
    reason = (f"KV cache: {blocks} blocks x {block_size} tokens = {blocks * block_size} tokens, "
              f"{blocks * bytes_per_block / 2**20:.1f} MiB ({kv_bytes_per_token} B/token); limited by {why}")
    others = [w for n, w in limits if w != why]
    if others:
        reason += " (other limits: " + "; ".join(f"{w}" for w in others) + ")"
    return blocks, reason
