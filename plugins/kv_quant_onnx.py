"""The int8 KV pool's rows (:mod:`kiln.plugins.kv_quant`) in standard ONNX ops, for the attention lowering.

A row is head_dim int8 numbers followed by the two bytes of its bfloat16 scale. ONNX has no bit cast, so the
scale's bytes are computed and read with float arithmetic on small integers, all exact: the scale rounded up
to a bfloat16 is m x 2^(e-7) with m in [128, 256); its bits are (e + 127) x 128 + (m - 128). The exponent comes
from ``Log`` and is corrected against exact powers of two (``Pow(2, integer)``), so a rounding of ``Log``
cannot move it. Numbers: ``QuantizeLinear`` (x / scale, round half to even, saturated) with one scale per row;
values: ``DequantizeLinear`` per row. fp8 pools have no lowering (reading their bytes as float8 needs the bit
cast): the builder refuses them for onnx and tensorrt.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from kiln.plugins.onnx_ops import FLOAT, ints, op

INT8 = ir.DataType.INT8
QMAX = 127.0
_TINY = float(np.finfo(np.float32).tiny)


def _f(value: float):
    return op.Constant(value_float=float(value))


def _pow2(e):
    return op.Pow(_f(2.0), e)


def _scale_and_bytes(s):
    """s (float32 > 0, normal) -> (s rounded up to a bfloat16, its low byte, its high byte as int8)."""
    e = op.Floor(op.Div(op.Log(s), _f(math.log(2.0))))
    e = op.Sub(e, op.Cast(op.Greater(_pow2(e), s), to=FLOAT))                      # 2^e <= s
    e = op.Add(e, op.Cast(op.LessOrEqual(op.Mul(_pow2(e), _f(2.0)), s), to=FLOAT))  # s < 2^(e+1)
    m = op.Ceil(op.Div(s, _pow2(op.Sub(e, _f(7.0)))))                               # [128, 256]
    carry = op.GreaterOrEqual(m, _f(256.0))
    m = op.Where(carry, _f(128.0), m)
    e = op.Add(e, op.Cast(carry, to=FLOAT))
    scale = op.Mul(m, _pow2(op.Sub(e, _f(7.0))))
    biased = op.Add(e, _f(127.0))
    high = op.Floor(op.Div(biased, _f(2.0)))
    low = op.Add(op.Mul(op.Sub(biased, op.Mul(high, _f(2.0))), _f(128.0)), op.Sub(m, _f(128.0)))   # 0..255
    low = op.Sub(low, op.Mul(op.Cast(op.GreaterOrEqual(low, _f(128.0)), to=FLOAT), _f(256.0)))     # as int8
    return scale, op.Cast(low, to=INT8), op.Cast(high, to=INT8)


def quantize_rows(x, head_dim: int):
    """Float rows [..., head_dim] -> the int8 pool's rows [..., head_dim + 2] (kv_quant.to_pool)."""
    xf = op.Cast(x, to=FLOAT)
    amax = op.ReduceMax(op.Abs(xf), ints([-1]), keepdims=1)                          # [..., 1]
    scale, low, high = _scale_and_bytes(op.Max(op.Div(amax, _f(QMAX)), _f(_TINY)))
    lead = op.Shape(xf, start=0, end=-1)
    flat = op.Reshape(xf, ints([-1, head_dim]))
    per_row = op.Reshape(scale, ints([-1]))
    zero = op.Expand(op.Constant(value=ir.tensor(np.int8(0))), op.Shape(per_row))  # int8 output, one per row
    numbers = op.QuantizeLinear(flat, per_row, zero, axis=0)
    numbers = op.Reshape(numbers, op.Concat(lead, ints([head_dim]), axis=0))
    return op.Concat(numbers, low, high, axis=-1)


def _row_scales(rows, head_dim: int):
    """The float32 scale of each row [..., 1] from its two bytes."""
    low = op.Cast(op.Slice(rows, ints([head_dim]), ints([head_dim + 1]), ints([-1])), to=FLOAT)
    high = op.Cast(op.Slice(rows, ints([head_dim + 1]), ints([head_dim + 2]), ints([-1])), to=FLOAT)
    low = op.Add(low, op.Mul(op.Cast(op.Less(low, _f(0.0)), to=FLOAT), _f(256.0)))   # 0..255
    low_exp = op.Floor(op.Div(low, _f(128.0)))
    mantissa = op.Sub(low, op.Mul(low_exp, _f(128.0)))
    biased = op.Add(op.Mul(high, _f(2.0)), low_exp)
    return op.Mul(op.Add(_f(1.0), op.Div(mantissa, _f(128.0))), _pow2(op.Sub(biased, _f(127.0))))


def dequantize_rows(rows, head_dim: int):
    """The int8 pool's rows [..., head_dim + 2] -> float32 values [..., head_dim] (kv_quant.from_pool)."""
    lead = op.Shape(rows, start=0, end=-1)
    numbers = op.Reshape(op.Slice(rows, ints([0]), ints([head_dim]), ints([-1])), ints([-1, head_dim]))
    values = op.DequantizeLinear(numbers, op.Reshape(_row_scales(rows, head_dim), ints([-1])), axis=0)
    return op.Reshape(values, op.Concat(lead, ints([head_dim]), axis=0))


__all__ = ["quantize_rows", "dequantize_rows"]
