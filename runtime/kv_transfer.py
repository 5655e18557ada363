"""What a request's KV blocks carry between two executors (prefill/decode disaggregation, ``kiln.runtime.disagg``).

The executor exports a prefilled request's blocks (``Executor.submit(..., kv_export=fn)``: at its first token,
in the step loop, before the blocks can be reused) as one tensor in the pool's own layout, block by block
(``kv_cache.index_select(2, table)``: [layers, 2, blocks, tokens_per_block, kv_heads, row]); nothing is repacked
per token. The importing executor (``Executor.submit_imported``) allocates the blocks first, has them filled
(``land``), copies them into its pool with one ``index_copy_`` and admits the request as running, its prompt
computed and its first token emitted. The transport between the two is the caller's (torch.distributed in
``kiln.runtime.disagg``); this module only names what passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.contract import InvalidRequestError


@dataclass
class KVExport:
    """A prefilled request: its prompt's KV blocks and the state that continues it elsewhere."""

    request_id: str
    blocks: torch.Tensor                 # [layers, 2, n, tokens_per_block, kv_heads, row], the pool's dtype
    first_token: int
    logprobs: dict[int, float] | None    # the first token's, when the request asked for logprobs
    generator_state: torch.Tensor | None   # a seeded request's sampler generator after the first token
    first_scheduled_time: float | None
    first_token_time: float | None
    num_cached_tokens: int               # prompt tokens the prefill side found in its prefix cache

    def meta(self) -> ImportMeta:
        """Everything but the blocks (what travels on the control channel)."""
        b = self.blocks
        return ImportMeta(self.first_token, self.logprobs, self.generator_state, self.first_scheduled_time,
                          self.first_token_time, self.num_cached_tokens, tuple(b.shape), str(b.dtype), b.nbytes)


@dataclass(frozen=True)
class ImportMeta:
    """A KVExport without its blocks: what the importing side needs to allocate, receive and continue."""

    first_token: int
    logprobs: dict[int, float] | None
    generator_state: torch.Tensor | None
    first_scheduled_time: float | None
    first_token_time: float | None
    num_cached_tokens: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    def empty(self) -> torch.Tensor:
        """A buffer the blocks can land in."""
        return torch.empty(self.shape, dtype=getattr(torch, self.dtype.removeprefix("torch.")))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (what the transport moves, whatever the KV dtype)."""
    return t.reshape(-1).view(torch.uint8)


def untransferable(lora: object = None, structured_output: object = None) -> InvalidRequestError | None:
    """The one refusal of what a KV transfer does not carry yet (a LoRA adapter's state, a grammar matcher's):
    ``Executor.validate(kv_transfer=True)`` raises it, for export, import and the disaggregated frontend alike.
    None when neither is set."""
    what = [name for name, value in (("a LoRA adapter", lora), ("structured output", structured_output))
            if value is not None]
    if not what:
        return None
    return InvalidRequestError(f"{' and '.join(what)}: disaggregated serving (KV blocks moved between prefill and "
                               "decode workers) does not carry this yet; serve the request from a colocated server")
