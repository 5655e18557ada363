"""A tiny paged-batch planner for tests: turns 'sequence s gets these new tokens' into contract inputs.

Blocks are handed out from a shuffled free list so block tables are non-contiguous, as
they are in a real server. This is test scaffolding, not the runtime's KV manager.
"""

from __future__ import annotations

import random

import torch


class PagedBatcher:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, seed: int = 0):
        self.block_size = block_size
        self.kv_cache = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[object, list[int]] = {}
        self.lengths: dict[object, int] = {}

    def step(self, new_tokens: list[tuple[object, list[int]]], all_logits: bool = False) -> dict[str, torch.Tensor]:
        """Contract inputs for one forward: context sequences should come before decode ones."""
        ids, pos, seq_lens, ctx_lens, slots, logits_idx, tables = [], [], [], [], [], [], []
        for seq, toks in new_tokens:
            start = self.lengths.get(seq, 0)
            end = start + len(toks)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * self.block_size < end:
                blocks.append(self.free.pop())
            for p in range(start, end):
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
            first = len(ids)
            ids += toks
            pos += list(range(start, end))
            seq_lens.append(len(toks))
            ctx_lens.append(end)
            logits_idx += list(range(first, len(ids))) if all_logits else [len(ids) - 1]
            tables.append(list(blocks))
            self.lengths[seq] = end
        width = max(len(t) for t in tables)
        return {
            "input_ids": torch.tensor(ids, dtype=torch.int64),
            "position_ids": torch.tensor(pos, dtype=torch.int64),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
            "context_lens": torch.tensor(ctx_lens, dtype=torch.int32),
            "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            "slot_mapping": torch.tensor(slots, dtype=torch.int64),
            "logits_indices": torch.tensor(logits_idx, dtype=torch.int64),
            "kv_cache": self.kv_cache,
        }
