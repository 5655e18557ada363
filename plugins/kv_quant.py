"""What the KV pool's rows hold, and the conversions in and out of them (the one owner of the 8-bit layout).

A row is one token's keys (or values) of one KV head. A float pool stores the head_dim numbers as they are.
An 8-bit pool (``int8``, or ``fp8`` = float8 e4m3) stores head_dim 8-bit numbers followed by their scale, a
bfloat16 in the row's last two bytes (``kiln.contract.KV_SCALE_BYTES``): value = number x scale.

The scale of a row is its largest magnitude over the 8-bit range (127 for int8, 448 for e4m3), rounded UP to
a bfloat16 (so no number of the row exceeds the range) and never below float32's smallest normal (so an
all-zero row needs no special case: its numbers are 0). Quantizing a row reads only that row: what a token
stores does not depend on the tokens written with it, so chunked prefill, prefix reuse, preemption and
tensor parallelism (each rank its heads) store the same bytes for the same keys. The C++ kernel
(``csrc/plugin_ops.cpp``) computes the same numbers bit for bit (the tests compare pools byte for byte).
"""

from __future__ import annotations

import torch

from kiln.contract import KV_SCALE_BYTES

__all__ = ["QMAX", "is_quantized", "to_pool", "from_pool", "row_scales", "ceil_to_bfloat16", "writable"]

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}   # the largest magnitude of each 8-bit format used
_TINY = torch.finfo(torch.float32).tiny


def is_quantized(pool_dtype: torch.dtype) -> bool:
    return pool_dtype in QMAX


def writable(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as a dtype torch's scatter kernels write (int8 for an fp8 pool or rows: same bytes)."""
    return t.view(torch.int8) if t.dtype == torch.float8_e4m3fn else t


def ceil_to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    """Positive finite float32 values rounded up to the nearest bfloat16 (still float32)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)


def to_pool(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., head_dim] as a pool of ``pool_dtype`` stores them ([..., head_dim (+ 2 scale bytes)])."""
    if not is_quantized(pool_dtype):
        return x.to(pool_dtype)
    xf = x.float()
    qmax = QMAX[pool_dtype]
    scale = ceil_to_bfloat16((xf.abs().amax(-1, keepdim=True) / qmax).clamp_min(_TINY))
    numbers = (xf / scale).clamp(-qmax, qmax)
    numbers = numbers.round().to(torch.int8) if pool_dtype == torch.int8 else numbers.to(pool_dtype)
    scale_bytes = scale.to(torch.bfloat16).view(torch.int8).view(pool_dtype)   # [..., 2]
    return torch.cat([numbers, scale_bytes], -1)


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each row of an 8-bit pool ([..., 1])."""
    return rows[..., -KV_SCALE_BYTES:].contiguous().view(torch.bfloat16).float()


def from_pool(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows as the pool stores them -> their values [..., head_dim] in ``dtype`` (dequantized in float32)."""
    if not is_quantized(rows.dtype):
        return rows.to(dtype)
    return (rows[..., :-KV_SCALE_BYTES].float() * row_scales(rows)).to(dtype)
