"""Trace a packed-token model into a torch.export ExportedProgram with dynamic dims.

The dims, their ranges and the inputs come from the contract (``kiln.contract``) and the build's
bounds. torch.export specializes sizes 0 and 1 and may unify dims whose example sizes are equal, so
the example step uses distinct sizes >= 2 wherever the ranges allow.
"""

from __future__ import annotations

import torch
from torch.export import Dim

from kiln.builder.config import BuildConfig
from kiln.contract import (
    DTYPES,
    KV_CACHE_DTYPES,
    NO_ADAPTER,
    EngineBounds,
    LoraLayout,
    ModelConfig,
    SeqChunk,
    dim_ranges,
    input_axes,
    kv_cache_shape,
    pack_inputs,
)


def example_sizes(bounds: EngineBounds, lora: bool = False) -> dict[str, int]:
    """Distinct example sizes >= 2 within each dim's range (tightest range first, so that
    num_seqs < num_logits < num_tokens: a real step can have them)."""
    ranges = dim_ranges(bounds, lora)
    order = sorted(ranges, key=lambda n: ranges[n][1] if ranges[n][1] is not None else 1 << 62)
    used: set[int] = set()
    out: dict[str, int] = {}
    for name in order:
        hi = ranges[name][1] if ranges[name][1] is not None else 1 << 20
        choice = next((v for v in range(3, 64) if v <= hi and v not in used), None)
        if choice is None:
            choice = 2 if hi >= 2 else 1
        out[name] = choice
        used.add(choice)
    return out


def example_inputs(model: ModelConfig, build: BuildConfig, lora: LoraLayout | None = None) -> dict[str, torch.Tensor]:
    """A real step of the example sizes, packed by the contract: the first sequence takes the tokens
    and logits rows the others (one token, one row each) leave; every table is max_blocks_per_seq wide.
    With ``lora`` (an engine that takes adapters): an adapter pool of zeros, the sequences on its slots
    and on none in turn."""
    bounds = build.engine_bounds()
    n = example_sizes(bounds, lora is not None)
    s, t, lg, mb, nb = n["num_seqs"], n["num_tokens"], n["num_logits"], n["max_blocks_per_seq"], n["num_blocks"]
    bs = build.tokens_per_block
    first = t - (s - 1)
    loras = n.get("max_loras", 0)
    chunks = [
        SeqChunk(token_ids=[0] * (first if i == 0 else 1), start=0,
                 block_ids=[(i * mb + j) % nb for j in range(mb)], num_logits=lg - (s - 1) if i == 0 else 1,
                 lora_slot=i % (loras + 1) - 1 if loras else NO_ADAPTER)
        for i in range(s)
    ]
    kv_dtype = build.resolved_kv_cache_dtype
    kv = torch.zeros(kv_cache_shape(model, bs, nb, kv_dtype), dtype=KV_CACHE_DTYPES[kv_dtype])
    pool = torch.zeros(loras, lora.slot_numel, dtype=DTYPES[build.dtype]) if lora is not None else None
    return pack_inputs(chunks, kv, bs, block_table_width=mb, lora_weights=pool)


def dynamic_shapes(build: BuildConfig, lora: bool = False) -> dict[str, dict[int, Dim]]:
    dims: dict[str, Dim | None] = {}
    for name, (lo, hi) in dim_ranges(build.engine_bounds(), lora).items():
        if hi is not None and hi <= 1:
            dims[name] = None  # a range of one size is static
        else:
            dims[name] = Dim(name, min=lo, max=hi) if hi is not None else Dim(name, min=lo)
    return {inp: {axis: dims[d] for axis, d in axes.items() if dims[d] is not None}
            for inp, axes in input_axes(lora).items()}


def export(module: torch.nn.Module, model: ModelConfig, build: BuildConfig,
           lora: LoraLayout | None = None) -> torch.export.ExportedProgram:
    """torch.export ``module`` (the model, or a pass-rewritten GraphModule) over the build's dynamic dims;
    ``lora``: the module takes the adapter inputs too (``kiln.builder.lora.LoraModel``)."""
    inputs = example_inputs(model, build, lora)
    with torch.no_grad():
        return torch.export.export(module, (), kwargs=inputs, dynamic_shapes=dynamic_shapes(build, lora is not None),
                                   strict=False)
