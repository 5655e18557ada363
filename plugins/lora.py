"""LoRA: each token's adapter added to a linear's output, for many adapters in one batch.

``kiln::lora(y, x, slots, weights, segments, rank) -> y + delta``

    y        [T, N]  the base linear's output (of the merged GEMM when the builder merged q/k/v or gate/up)
    x        [T, K]  the linear's input
    slots    [T]     int32: each token's adapter slot in ``weights``, -1 = none (the row of y is returned as is)
    weights  [S, numel] the adapter pool (``kiln.contract.lora``), y's dtype
    segments flat 5-int records (a_offset, b_offset, b_stride, y_col, n): for the token's slot row ``w``,
             ``A = w[a_offset : a_offset + rank * K]`` as [rank, K] and ``B^T[j, c] = w[b_offset + j * b_stride + c]``
             for c < n; ``delta[:, y_col : y_col + n] += (x @ A^T) @ B^T``. Segments of one merged GEMM share x;
             a segment may read a column range of a wider B (b_stride > n: GPT-2's fused c_attn split into
             q/k/v), and segments with the same a_offset share their ``x @ A^T``.
    rank     the pool's max rank (rows of every A and B^T; an adapter of a lower rank has zero rows there)

The delta is computed in fp32 and added to y in fp32, rounded once to y's dtype. The adapter's scaling
(alpha / r, or alpha / sqrt(r) with rsLoRA) is in B^T already (the runtime writes it there).

CPU kernel: C++ (``csrc/lora_ops.cpp``, fp32 / bf16): tokens are grouped by slot, so each adapter's A and B are
read once per step whatever its number of tokens (a decode batch of 16 with 4 adapters reads 4 adapters); no
Python per call. Other cases (fp16, kernels disabled) run :func:`_lora_py`, which groups the same way in torch
and owns the error messages; :func:`lora_reference` is the plain per-token definition the tests compare with.
"""

from __future__ import annotations

import torch

from kiln.plugins.native import define_native_op

__all__ = ["lora", "lora_reference", "segment_records"]

SEGMENT_FIELDS = 5


def segment_records(segments) -> list[tuple[int, int, int, int, int]]:
    """The flat ``segments`` list as (a_offset, b_offset, b_stride, y_col, n) records."""
    seg = [int(v) for v in segments]
    return [tuple(seg[i:i + SEGMENT_FIELDS]) for i in range(0, len(seg), SEGMENT_FIELDS)]


def lora_reference(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, segments,
                   rank: int) -> torch.Tensor:
    """Per token, in plain torch: gather the token's adapter row, then (x @ A^T) @ B^T for each segment."""
    out = y.float().clone()
    k = x.shape[-1]
    active = (slots >= 0)[:, None]
    rows = weights[slots.long().clamp(min=0)].float()   # [T, numel]
    xf = x.float()
    for a_off, b_off, stride, col, n in segment_records(segments):
        a = rows[:, a_off:a_off + rank * k].reshape(-1, rank, k)
        xa = torch.einsum("tk,trk->tr", xf, a)
        index = b_off + torch.arange(rank)[:, None] * stride + torch.arange(n)[None, :]
        b = rows[:, index]                                  # [T, rank, n]
        delta = torch.einsum("tr,trn->tn", xa, b)
        out[:, col:col + n] += torch.where(active, delta, torch.zeros((), dtype=delta.dtype))
    return out.to(y.dtype)


def _check(y, x, slots, weights, segments, rank) -> None:
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"lora: x {list(x.shape)} and y {list(y.shape)} must be [tokens, features] with the same "
                         "number of tokens")
    if slots.dtype != torch.int32 or slots.dim() != 1 or slots.shape[0] != x.shape[0]:
        raise ValueError(f"lora: slots must be int32 [{x.shape[0]}] (one per token), got {slots.dtype} "
                         f"{list(slots.shape)}")
    if weights.dim() != 2 or weights.dtype != y.dtype or x.dtype != y.dtype:
        raise ValueError(f"lora: the adapter pool must be [slots, numel] of y's dtype {y.dtype}, and x too; got "
                         f"weights {weights.dtype} {list(weights.shape)}, x {x.dtype}")
    if rank < 1 or len(segments) % SEGMENT_FIELDS or not segments:
        raise ValueError(f"lora: rank={rank} must be >= 1 and segments a non-empty list of "
                         f"{SEGMENT_FIELDS}-int records, got {len(segments)} ints")
    k, numel = x.shape[1], weights.shape[1]
    for a_off, b_off, stride, col, n in segment_records(segments):
        if (min(a_off, b_off, col) < 0 or n < 1 or stride < n or a_off + rank * k > numel
                or b_off + (rank - 1) * stride + n > numel or col + n > y.shape[1]):
            raise ValueError(f"lora: segment (a_offset={a_off}, b_offset={b_off}, b_stride={stride}, y_col={col}, "
                             f"n={n}) with rank {rank} and {k} input features does not fit an adapter row of "
                             f"{numel} elements and y's {y.shape[1]} columns")
    if slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= weights.shape[0]:
            bad = lo if lo < -1 else hi
            raise ValueError(f"lora: slots holds {bad}, outside the adapter pool's slots [0, {weights.shape[0]}) "
                             "(-1: no adapter)")


def _lora_py(y, x, slots, weights, segments, rank):
    """Grouped by slot in torch: each present adapter's A and B once, for all of its tokens."""
    _check(y, x, slots, weights, segments, rank)
    records = segment_records(segments)
    out = y.clone(memory_format=torch.contiguous_format)
    s = slots.long()
    k = x.shape[1]
    for slot in torch.unique(s[s >= 0]).tolist():
        idx = (s == slot).nonzero().squeeze(1)
        xs = x[idx].float()
        row = weights[slot].contiguous()   # a view of a contiguous pool: no copy
        shrunk: dict[int, torch.Tensor] = {}
        for a_off, b_off, stride, col, n in records:
            if a_off not in shrunk:
                shrunk[a_off] = xs @ row[a_off:a_off + rank * k].view(rank, k).float().T
            b = row.as_strided((rank, n), (stride, 1), row.storage_offset() + b_off).float()
            cols = out[idx, col:col + n]
            out[idx, col:col + n] = (cols.float() + shrunk[a_off] @ b).to(out.dtype)
    return out


_lib = torch.library.Library("kiln", "FRAGMENT")
define_native_op(_lib, "lora", "(Tensor y, Tensor x, Tensor slots, Tensor weights, int[] segments, int rank) -> Tensor",
                 _lora_py, lambda y, x, slots, weights, segments, rank: torch.empty_like(y))


def lora(y, x, slots, weights, segments, rank: int):
    """``torch.ops.kiln.lora``: ``y`` plus each token's adapter delta (see the module docstring)."""
    return torch.ops.kiln.lora(y, x, slots, weights, list(segments), rank)
