"""ONNX lowerings of kiln's linears (see :mod:`kiln.plugins.linear`): ``DequantizeLinear`` + ``MatMul``.

The weights arrive in kiln's kernel formats (:mod:`kiln.plugins.weight_format`: 8-row tiles, 16-row
panels, kiln's int4 nibble order); the lowering turns them back into [in, out] with standard ops
(Transpose/Reshape, nibble shifts) that the exporter folds into new initializers, so the engine stores
each weight once, in the layout below.

- int8: ``DequantizeLinear`` per output channel (axis 1 of [in, out], scales [out]). TensorRT reads it as
  weight-only int8; onnxruntime runs it as written.
- int4: ``DequantizeLinear`` on an INT4 [in, out] initializer, blocked along the input (``block_size`` =
  group_size, scales [in/group, out]), the opset-21 form. onnxruntime fuses DQ + MatMul on a constant
  int4 weight blocked on axis 0 into its ``MatMulNBits`` kernel (com.microsoft, which only onnxruntime
  reads, so the graph keeps the standard form); TensorRT reads it as weight-only int4 block quantization.
  int4 panels (fp16 scales, zero points or 8): ``DequantizeLinear`` on a UINT4 [in, out] initializer with a
  UINT4 zero point of the same blocking.
- fp32/bf16 (``fp32_linear``/``bf16_linear``, packed or not): MatMul on the unpacked weight.

Activations are computed in fp32 and cast back to x's dtype, as the references do.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

import kiln.plugins.linear  # noqa: F401  (registers the ops)
from kiln.plugins.onnx_ops import FLOAT, ints, op
from kiln.plugins.weight_format import K_STEP, PAIR, PANEL, ROW_TILE

INT4 = 22   # onnx.TensorProto.INT4
UINT4 = 21  # onnx.TensorProto.UINT4
INT8 = 3    # onnx.TensorProto.INT8


def _unpacked_rows(weight):
    """[out, in] of a weight plain, in 8-row tiles [out/8, in/16, 8, 16] or in panels ([out/16, in, 16]
    fp32, [out/16, in/2, 16, 2] bf16/int8) (static shapes)."""
    shape = list(weight.shape)
    if len(shape) == 4 and shape[2:] == [ROW_TILE, K_STEP]:
        tiles = op.Transpose(weight, perm=[0, 2, 1, 3])
        return op.Reshape(tiles, ints([shape[0] * ROW_TILE, shape[1] * K_STEP]))
    if len(shape) == 4 and shape[2:] == [PANEL, PAIR]:
        panels = op.Transpose(weight, perm=[0, 2, 1, 3])
        return op.Reshape(panels, ints([shape[0] * PANEL, shape[1] * PAIR]))
    if len(shape) == 3 and shape[2] == PANEL:
        return op.Reshape(op.Transpose(weight, perm=[0, 2, 1]), ints([shape[0] * PANEL, shape[1]]))
    return weight


def _unpack_int4(packed, shape: tuple[int, int] | None = None):
    """kiln's int4 bytes [out, in/2] -> int8 values [out, in] in -8..7 (inverse of ``pack_int4``); ``shape``: the
    bytes' (out, in/2) when ``packed`` is computed (its shape not known statically)."""
    n, half = shape or (int(d) for d in packed.shape)
    k = 2 * half
    lo = op.BitwiseAnd(packed, op.Constant(value=_u8(15)))
    hi = op.BitShift(packed, op.Constant(value=_u8(4)), direction="RIGHT")
    vals = op.Cast(op.Concat(op.Unsqueeze(lo, ints([-1])), op.Unsqueeze(hi, ints([-1])), axis=-1), to=INT8)
    vals = op.Where(op.GreaterOrEqual(vals, op.Constant(value=_i8(8))), op.Sub(vals, op.Constant(value=_i8(16))),
                    vals)                                                   # [n, in/2, 2]
    kb = (k // 64) * 64
    parts = []
    if kb:   # 64-element blocks: word l of block b holds element 64b + 16j + l in nibble j
        blk = op.Slice(vals, ints([0]), ints([kb // 2]), ints([1]))
        blk = op.Transpose(op.Reshape(blk, ints([n, kb // 64, 16, 4])), perm=[0, 1, 3, 2])
        parts.append(op.Reshape(blk, ints([n, kb])))
    if k > kb:  # the plain tail
        parts.append(op.Reshape(op.Slice(vals, ints([kb // 2]), ints([half]), ints([1])), ints([n, k - kb])))
    return op.Concat(*parts, axis=1) if len(parts) > 1 else parts[0]


def _int4_panel_values(qweight):
    """int4 panels [out/16, in/8, 64] bytes -> uint8 values [out, in] in 0..15 (inverse of ``pack_int4_panels``)."""
    npan, blocks, _ = (int(d) for d in qweight.shape)
    b = op.Reshape(qweight, ints([npan, blocks, 32, 2, 1]))           # [.., word, byte, 1]
    lo = op.BitwiseAnd(b, op.Constant(value=_u8(15)))
    hi = op.BitShift(b, op.Constant(value=_u8(4)), direction="RIGHT")
    nib = op.Concat(lo, hi, axis=-1)                                    # [.., word, byte, 2]: nibble c = 2*byte + half
    nib = op.Reshape(nib, ints([npan, blocks, PANEL, 2, 4]))            # [.., row, e, c]
    nib = op.Transpose(nib, perm=[0, 2, 1, 4, 3])                       # [panel, row, block, c, e]
    return op.Reshape(nib, ints([npan * PANEL, blocks * 8]))


def _per_row(t):
    """[out/16, G, 16] -> [out, G]."""
    npan, g, _ = (int(d) for d in t.shape)
    return op.Reshape(op.Transpose(t, perm=[0, 2, 1]), ints([npan * PANEL, g]))


def _int4_panels(x, qweight, scales, bias, group_size: int, zeros):
    w = op.Cast(op.Transpose(_int4_panel_values(qweight), perm=[1, 0]), to=UINT4)      # uint4 [in, out]
    s = op.Transpose(op.Cast(_per_row(scales), to=FLOAT), perm=[1, 0])                 # [in/group, out]
    if zeros is None:
        z = op.Expand(op.Constant(value=_u8(8)), op.Shape(s))
    else:
        z = op.Transpose(_per_row(zeros), perm=[1, 0])
    return _matmul(x, op.DequantizeLinear(w, s, op.Cast(z, to=UINT4), axis=0, block_size=group_size), bias)


def _u8(v: int):
    return ir.tensor(np.array(v, dtype=np.uint8))


def _i8(v: int):
    return ir.tensor(np.array(v, dtype=np.int8))


def _matmul(x, weight_in_out, bias):
    y = op.MatMul(op.Cast(x, to=FLOAT), weight_in_out)
    if bias is not None:
        y = op.Add(y, op.Cast(bias, to=FLOAT))
    return op.CastLike(y, x)


def weight_only_linear(x, qweight, scales, bias, bits: int, group_size: int, zeros=None):
    if bits == 4 and len(qweight.shape) == 3:
        return _int4_panels(x, qweight, scales, bias, group_size, zeros)
    if bits == 8:
        w = op.Transpose(_unpacked_rows(qweight), perm=[1, 0])            # int8 [in, out]
        return _matmul(x, op.DequantizeLinear(w, op.Cast(scales, to=FLOAT), axis=1), bias)
    if bits == 4:
        w = op.Cast(op.Transpose(_unpack_int4(qweight), perm=[1, 0]), to=INT4)   # int4 [in, out]
        s = op.Transpose(op.Cast(scales, to=FLOAT), perm=[1, 0])           # [in/group, out]
        return _matmul(x, op.DequantizeLinear(w, s, axis=0, block_size=group_size), bias)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def float_linear(x, weight, bias):
    return _matmul(x, op.Transpose(op.Cast(_unpacked_rows(weight), to=FLOAT), perm=[1, 0]), bias)


LOWERINGS = {
    torch.ops.kiln.weight_only_linear.default: weight_only_linear,
    torch.ops.kiln.fp32_linear.default: float_linear,
    torch.ops.kiln.bf16_linear.default: float_linear,
}
