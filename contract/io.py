"""The engine's I/O contract: packed tokens of a mixed batch in, float32 logits out.

One forward pass runs context (prefill chunk) sequences and generation sequences together, their
tokens concatenated with no padding. Every name, dtype, dynamic dim and shape rule of the engine's
inputs is written here once; :func:`pack_inputs` is the one place that turns scheduled sequences into
those tensors (the executor, the tracer's example inputs, the tests and the benchmarks all use it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from kiln.contract.errors import EngineInputError
from kiln.contract.lora import LORA_AXES, LORA_INPUT_NAMES, LORA_SLOTS_DTYPE, NO_ADAPTER
from kiln.contract.model import ModelConfig

if TYPE_CHECKING:
    from kiln.contract.engine_config import EngineBounds, EngineConfig

INPUT_NAMES = (
    "input_ids", "position_ids", "seq_lens", "context_lens",
    "block_tables", "slot_mapping", "logits_indices", "kv_cache",
)
OUTPUT_NAME = "logits"
# The updated pool, a second output of the graphs that cannot write an input in place (onnx, tensorrt): their
# runtimes bind it to the kv_cache input's own memory, so the pool is still written in place.
KV_CACHE_OUTPUT = "kv_cache_out"
INDEX_DTYPES = {
    "input_ids": torch.int64, "position_ids": torch.int64, "seq_lens": torch.int32, "context_lens": torch.int32,
    "block_tables": torch.int32, "slot_mapping": torch.int64, "logits_indices": torch.int64,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV pool's dtypes: the float ones store keys/values as they are; the 8-bit ones (fp8 = e4m3) store each
# token's keys (values) of one KV head as head_dim 8-bit numbers followed by their scale, a bfloat16 in the
# row's last KV_SCALE_BYTES bytes (kiln.plugins.kv_quant owns what the bytes mean).
KV_CACHE_DTYPES = {**DTYPES, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
QUANTIZED_KV_DTYPES = ("int8", "fp8")
KV_SCALE_BYTES = 2

# Which dynamic dim each input axis is (one Dim per name: equal-size axes are provably equal).
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


def dim_ranges(bounds: EngineBounds, lora: bool = False) -> dict[str, tuple[int, int | None]]:
    """Name -> (min, max) of each dynamic dim (max None = unbounded: the pools are sized at run time);
    ``lora``: the engine takes adapters (its adapter pool has ``max_loras`` slots).

    Listed smallest range first where ranges tie (num_seqs <= num_logits <= num_tokens always holds).
    """
    ranges = {
        "num_seqs": (1, bounds.max_batch_size),
        "num_logits": (0, bounds.max_num_logits),  # 0: a step of non-final prefill chunks needs no logits
        "num_tokens": (1, bounds.max_num_tokens),
        "max_blocks_per_seq": (1, bounds.max_blocks_per_seq),
        "num_blocks": (1, bounds.max_num_blocks or None),
    }
    if lora:
        ranges["max_loras"] = (1, None)
    return ranges


def input_axes(lora: bool = False) -> dict[str, dict[int, str]]:
    """INPUT_AXES, with the adapter inputs' axes for an engine that takes adapters."""
    return {**INPUT_AXES, **LORA_AXES} if lora else INPUT_AXES


def input_names(lora: bool = False) -> tuple[str, ...]:
    """The engine's inputs in order: INPUT_NAMES, then LORA_INPUT_NAMES for an engine that takes adapters."""
    return INPUT_NAMES + LORA_INPUT_NAMES if lora else INPUT_NAMES


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def kv_row_size(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements of one token's keys (or values) of one KV head in the pool: head_dim, plus the scale's bytes
    for an 8-bit pool."""
    return head_dim + KV_SCALE_BYTES if kv_cache_dtype in QUANTIZED_KV_DTYPES else head_dim


def kv_cache_shape(model: ModelConfig, tokens_per_block: int, num_blocks: int, kv_cache_dtype: str
                   ) -> tuple[int, ...]:
    """The paged KV pool: [num_layers, 2 (K, V), num_blocks, tokens_per_block, num_kv_heads, row], row =
    :func:`kv_row_size` (head_dim for a float pool, head_dim + 2 scale bytes for an 8-bit one), of dtype
    ``KV_CACHE_DTYPES[kv_cache_dtype]``."""
    return (model.num_layers, 2, num_blocks, tokens_per_block, model.num_kv_heads,
            kv_row_size(model.head_dim, kv_cache_dtype))


def kv_bytes_per_token(model: ModelConfig, kv_cache_dtype: str) -> int:
    """Bytes one token's keys and values take in the pool, across all layers (scales included)."""
    elem = torch.empty(0, dtype=KV_CACHE_DTYPES[kv_cache_dtype]).element_size()
    return 2 * model.num_layers * model.num_kv_heads * kv_row_size(model.head_dim, kv_cache_dtype) * elem


class SeqChunk(NamedTuple):
    """One sequence's part of a step: its new tokens and where they go.

    start: tokens of the sequence already in the pool (the position of the first new token).
    block_ids: the sequence's block table (position p lives in block ``block_ids[p // tokens_per_block]``).
    num_logits: logits rows for the last ``num_logits`` new tokens (1: the next token; 0: a prefill chunk
    that does not reach the end of the prompt; len(token_ids): every position, for checks).
    lora_slot: the adapter pool slot of the sequence's adapter (NO_ADAPTER: the base model); read only by
    engines that take adapters.
    """

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    num_logits: int = 1
    lora_slot: int = NO_ADAPTER


def pack_inputs(chunks: Sequence[SeqChunk], kv_cache: torch.Tensor, tokens_per_block: int,
                block_table_width: int | None = None,
                lora_weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The contract's inputs for one step: ``chunks`` in order (context sequences before generation
    ones), block tables padded to the widest (or ``block_table_width``) with block 0, which is never
    read past a sequence's context length. ``lora_weights`` (the adapter pool, for an engine that takes
    adapters) adds it and each token's ``lora_slots``."""
    bs = tokens_per_block
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    ctx_lens: list[int] = []
    logits: list[int] = []
    tables: list[Sequence[int]] = []
    lora_slots: list[int] = []
    for c in chunks:
        n = len(c.token_ids)
        end = c.start + n
        blocks = c.block_ids
        if len(blocks) * bs < end or not 0 <= c.num_logits <= n:
            raise EngineInputError(f"a sequence of {end} tokens has {len(blocks)} blocks of {bs} tokens and asks "
                                   f"for {c.num_logits} logits rows of its {n} new tokens")
        ids.extend(c.token_ids)
        r = range(c.start, end)
        pos.extend(r)
        slots.extend(blocks[p // bs] * bs + p % bs for p in r)
        seq_lens.append(n)
        ctx_lens.append(end)
        logits.extend(range(len(ids) - c.num_logits, len(ids)))
        tables.append(blocks)
        lora_slots.extend([c.lora_slot] * n)
    width = block_table_width or max(len(t) for t in tables)
    inputs = {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "position_ids": torch.tensor(pos, dtype=torch.int64),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "context_lens": torch.tensor(ctx_lens, dtype=torch.int32),
        "block_tables": torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "logits_indices": torch.tensor(logits, dtype=torch.int64),
        "kv_cache": kv_cache,
    }
    if lora_weights is not None:
        inputs["lora_slots"] = torch.tensor(lora_slots, dtype=LORA_SLOTS_DTYPE)
        inputs["lora_weights"] = lora_weights
    return inputs


def check_inputs(inputs: dict[str, torch.Tensor], config: EngineConfig) -> None:
    """Names, dtypes and sizes against the contract and the engine's bounds (EngineInputError naming the
    input; the pools are one rank's). Cheap (no data is read); a compiled package would not check them itself."""
    lora = config.lora is not None
    names = input_names(lora)
    missing = [n for n in names if n not in inputs]
    if missing:
        why = " (this engine takes adapters: pass allocate_lora_pool's pool)" if set(missing) <= set(
            LORA_INPUT_NAMES) else ""
        raise EngineInputError(f"engine inputs missing {missing}; the contract needs {list(names)}{why}")
    for name, dtype in INDEX_DTYPES.items():
        if inputs[name].dtype != dtype:
            raise EngineInputError(f"engine input {name} has dtype {inputs[name].dtype}, the contract says {dtype}")
    kv, b = inputs["kv_cache"], config.bounds
    want = kv_cache_shape(config.rank_model, b.tokens_per_block, kv.shape[2] if kv.dim() == 6 else 0,
                          config.kv_cache_dtype)
    pool_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype]
    if kv.dtype != pool_dtype or tuple(kv.shape) != want:
        fixed = ", ".join(map(str, want[3:]))
        raise EngineInputError(f"kv_cache is {kv.dtype} {list(kv.shape)}; this engine needs "
                               f"{pool_dtype} [{want[0]}, 2, num_blocks, {fixed}] (allocate_kv_cache)")
    if lora:
        _check_lora_inputs(inputs, config)
    axes_of = input_axes(lora)
    first = {}   # dim -> the input axis that defines its size (the first one listed)
    for name, axes in axes_of.items():
        for axis, dim in axes.items():
            first.setdefault(dim, (name, axis))
    for dim, (lo, hi) in dim_ranges(b, lora).items():
        name, axis = first[dim]
        n = inputs[name].shape[axis]
        if hi is not None and not lo <= n <= hi:
            what = "blocks per sequence" if dim == "max_blocks_per_seq" else dim
            raise EngineInputError(f"{what} ({name}) = {n} is outside this engine's range [{lo}, {hi}]")
    for name, axes in axes_of.items():
        for axis, dim in axes.items():
            ref, ref_axis = first[dim]
            n, want = inputs[name].shape[axis], inputs[ref].shape[ref_axis]
            if n != want:
                per = {"num_tokens": "token", "num_seqs": "sequence"}[dim]
                raise EngineInputError(f"{name} has {n} rows, expected {want} (one per {per})")


def _check_lora_inputs(inputs: dict[str, torch.Tensor], config: EngineConfig) -> None:
    slots, pool = inputs["lora_slots"], inputs["lora_weights"]
    if slots.dtype != LORA_SLOTS_DTYPE or slots.dim() != 1:
        raise EngineInputError(f"lora_slots is {slots.dtype} {list(slots.shape)}; the contract says "
                               f"{LORA_SLOTS_DTYPE} [num_tokens]")
    numel, dtype = config.lora.slot_numel, DTYPES[config.dtype]
    if pool.dtype != dtype or pool.dim() != 2 or pool.shape[1] != numel or pool.shape[0] < 1:
        raise EngineInputError(f"lora_weights is {pool.dtype} {list(pool.shape)}; this engine needs {dtype} "
                               f"[max_loras >= 1, {numel}] (allocate_lora_pool)")


def io_spec(config: EngineConfig) -> dict[str, Any]:
    """Names, dtypes and shapes (dim names or sizes) of the engine's inputs and output, and each dim's range."""
    lora = config.lora is not None
    kv = list(kv_cache_shape(config.rank_model, config.bounds.tokens_per_block, 0, config.kv_cache_dtype))
    shapes: dict[str, list[Any]] = {}
    for name, axes in input_axes(lora).items():
        shapes[name] = [axes[a] for a in sorted(axes)] if name != "kv_cache" else [*kv[:2], "num_blocks", *kv[3:]]
    dtype = {**{n: str(d).removeprefix("torch.") for n, d in INDEX_DTYPES.items()}, "kv_cache": config.kv_cache_dtype}
    if lora:
        shapes["lora_weights"] = ["max_loras", config.lora.slot_numel]
        dtype.update(lora_slots=str(LORA_SLOTS_DTYPE).removeprefix("torch."), lora_weights=config.dtype)
    return {
        "inputs": [{"name": n, "dtype": dtype[n], "shape": shapes[n]} for n in input_names(lora)],
        "outputs": [{"name": OUTPUT_NAME, "dtype": "float32", "shape": ["num_logits", config.model.vocab_size]}],
        "dims": {k: [lo, hi] for k, (lo, hi) in dim_ranges(config.bounds, lora).items()},
    }
