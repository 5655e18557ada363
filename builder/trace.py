"""Trace a packed-token model into a torch.export ExportedProgram with dynamic dims.

The dims' ranges come from the BuildConfig. torch.export specializes sizes 0 and 1 and
may unify dims whose example sizes are equal, so the example inputs use distinct sizes
>= 2 wherever the ranges allow.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export import Dim

from kiln.builder.config import BuildConfig

INPUT_NAMES = (
    "input_ids", "position_ids", "seq_lens", "context_lens",
    "block_tables", "slot_mapping", "logits_indices", "kv_cache",
)
INPUT_DTYPES = {
    "input_ids": torch.int64, "position_ids": torch.int64, "seq_lens": torch.int32, "context_lens": torch.int32,
    "block_tables": torch.int32, "slot_mapping": torch.int64, "logits_indices": torch.int64,
}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dim_ranges(build: BuildConfig) -> dict[str, tuple[int, int | None]]:
    """Name -> (min, max) of each dynamic dim (max None = unbounded)."""
    return {
        "num_tokens": (1, build.max_num_tokens),
        "num_seqs": (1, build.max_batch_size),
        "num_logits": (0, build.max_num_logits),  # 0: a step of non-final prefill chunks needs no logits
        "max_blocks_per_seq": (1, build.max_blocks_per_seq),
        "num_blocks": (1, None),
    }


# Which dim each input axis is (shared Dims make equal-size axes provably equal).
INPUT_AXES: dict[str, dict[int, str]] = {
    "input_ids": {0: "num_tokens"},
    "position_ids": {0: "num_tokens"},
    "seq_lens": {0: "num_seqs"},
    "context_lens": {0: "num_seqs"},
    "block_tables": {0: "num_seqs", 1: "max_blocks_per_seq"},
    "slot_mapping": {0: "num_tokens"},
    "logits_indices": {0: "num_logits"},
    "kv_cache": {2: "num_blocks"},
}


def example_sizes(build: BuildConfig) -> dict[str, int]:
    """Distinct example sizes >= 2 within each dim's range (tightest range first)."""
    ranges = dim_ranges(build)
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


def kv_cache_shape(model: dict[str, Any], build: BuildConfig, num_blocks: int) -> list[int]:
    return [int(model["num_layers"]), 2, num_blocks, build.tokens_per_block,
            int(model["num_kv_heads"]), int(model["head_dim"])]


def example_inputs(model: dict[str, Any], build: BuildConfig) -> dict[str, torch.Tensor]:
    """Contract inputs with the example sizes (values are valid but arbitrary: tracing runs fake kernels)."""
    n = example_sizes(build)
    t, s, lg, mb, nb = n["num_tokens"], n["num_seqs"], n["num_logits"], n["max_blocks_per_seq"], n["num_blocks"]
    kv_dtype = TORCH_DTYPES[build.resolved_kv_cache_dtype]
    return {
        "input_ids": torch.zeros(t, dtype=torch.int64),
        "position_ids": torch.arange(t, dtype=torch.int64),
        "seq_lens": torch.ones(s, dtype=torch.int32),
        "context_lens": torch.ones(s, dtype=torch.int32),
        "block_tables": torch.zeros(s, mb, dtype=torch.int32),
        "slot_mapping": torch.arange(t, dtype=torch.int64),
        "logits_indices": torch.zeros(lg, dtype=torch.int64),
        "kv_cache": torch.zeros(kv_cache_shape(model, build, nb), dtype=kv_dtype),
    }


def dynamic_shapes(build: BuildConfig) -> dict[str, dict[int, Dim]]:
    dims: dict[str, Any] = {}
    for name, (lo, hi) in dim_ranges(build).items():
        if hi is not None and hi <= 1:
            dims[name] = None  # a range of one size is static
        else:
            dims[name] = Dim(name, min=lo, max=hi) if hi is not None else Dim(name, min=lo)
    return {inp: {axis: dims[d] for axis, d in axes.items() if dims[d] is not None} for inp, axes in INPUT_AXES.items()}


def export(module: torch.nn.Module, model: dict[str, Any], build: BuildConfig) -> torch.export.ExportedProgram:
    """torch.export ``module`` (the model, or a pass-rewritten GraphModule) over the build's dynamic dims."""
    inputs = example_inputs(model, build)
    with torch.no_grad():
        return torch.export.export(module, (), kwargs=inputs, dynamic_shapes=dynamic_shapes(build), strict=False)


def io_spec(model: dict[str, Any], build: BuildConfig) -> dict[str, Any]:
    """Names, dtypes and shape ranges of the engine's inputs and output (stored in config.json)."""
    ranges = {k: [lo, hi] for k, (lo, hi) in dim_ranges(build).items()}
    kv = kv_cache_shape(model, build, 0)
    kv[2] = "num_blocks"
    shapes = {
        "input_ids": ["num_tokens"], "position_ids": ["num_tokens"], "seq_lens": ["num_seqs"],
        "context_lens": ["num_seqs"], "block_tables": ["num_seqs", "max_blocks_per_seq"],
        "slot_mapping": ["num_tokens"], "logits_indices": ["num_logits"], "kv_cache": kv,
    }
    inputs = [
        {"name": name, "dtype": str(INPUT_DTYPES.get(name, TORCH_DTYPES[build.resolved_kv_cache_dtype])).removeprefix("torch."),
         "shape": shapes[name]}
        for name in INPUT_NAMES
    ]
    outputs = [{"name": "logits", "dtype": "float32", "shape": ["num_logits", int(model["vocab_size"])]}]
    return {"inputs": inputs, "outputs": outputs, "dims": ranges}
