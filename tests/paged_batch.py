"""A tiny paged-batch planner for tests: turns 'sequence s gets these new tokens' into contract inputs.

Blocks are handed out from a shuffled free list so block tables are non-contiguous, as
they are in a real server; the tensors come from the contract's packer. This is test
scaffolding, not the runtime's KV manager.
"""

from __future__ import annotations

import random

import torch

from kiln.contract import KV_CACHE_DTYPES, ModelConfig, SeqChunk, kv_cache_shape, pack_inputs


class PagedBatcher:
    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 seed: int = 0, kv_cache: torch.Tensor | None = None):
        """``kv_cache``: a pool of ``num_blocks`` blocks to use (a tensor-parallel engine's, from its
        ``allocate_kv_cache``, whose other ranks hold theirs), else one of ``dtype`` (int8 / float8_e4m3fn:
        an 8-bit pool) is allocated for ``model``."""
        self.block_size = block_size
        if kv_cache is None:
            name = next(n for n, d in KV_CACHE_DTYPES.items() if d == dtype)
            kv_cache = torch.zeros(kv_cache_shape(model, block_size, num_blocks, name), dtype=dtype)
        self.kv_cache = kv_cache
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[object, list[int]] = {}
        self.lengths: dict[object, int] = {}

    def step(self, new_tokens: list[tuple[object, list[int]]], all_logits: bool = False) -> dict[str, torch.Tensor]:
        """Contract inputs for one forward: context sequences should come before decode ones."""
        chunks = []
        for seq, toks in new_tokens:
            start = self.lengths.get(seq, 0)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * self.block_size < start + len(toks):
                blocks.append(self.free.pop())
            chunks.append(SeqChunk(toks, start, list(blocks), len(toks) if all_logits else 1))
            self.lengths[seq] = start + len(toks)
        return pack_inputs(chunks, self.kv_cache, self.block_size)
