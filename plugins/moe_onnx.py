"""ONNX lowering of ``kiln::moe`` (see :mod:`kiln.plugins.moe`): the dense form, in standard ops.

A static graph has no data-dependent shapes, so the lowering cannot gather each expert's tokens: the router's
top-k weights are scattered into a dense [T, E] matrix (zero off each token's top_k), every expert runs on every
token as one batched ``MatMul`` per projection ([E, T, 2I] and [E, T, H]), and the outputs are summed with those
weights. The result equals the sparse op's (the unchosen experts get weight 0); the cost is E / top_k times the
expert FLOPs and an [E, T, 2I] intermediate, so the onnx backend suits small MoE models or runtimes that fuse it.

Expert weights come in the builder's formats (:mod:`kiln.plugins.weight_format`, stacked on the expert dim) and are
turned back into [E, N, K] with folded layout ops; int8 and int4 stay quantized initializers under a
``DequantizeLinear`` (per row; int4 blocked along the input), as in :mod:`kiln.plugins.linear_onnx`.
"""

from __future__ import annotations

import torch

import kiln.plugins.moe  # noqa: F401  (registers the op)
from kiln.plugins.linear_onnx import INT4, _unpack_int4
from kiln.plugins.onnx_ops import FLOAT, ints, op, scalar
from kiln.plugins.weight_format import PAIR, PANEL


def _experts(w, scales, bits: int, group_size: int):
    """fp32 [E, N, K] of stacked expert weights in any of the op's formats (static shapes)."""
    shape = [int(d) for d in w.shape]
    e = shape[0]
    if len(shape) == 4 and shape[3] == PANEL:                          # fp32 panels [E, N/16, K, 16]
        w = op.Reshape(op.Transpose(w, perm=[0, 1, 3, 2]), ints([e, shape[1] * PANEL, shape[2]]))
    elif len(shape) == 5 and shape[3:] == [PANEL, PAIR]:                # bf16 / int8 panels [E, N/16, K/2, 16, 2]
        w = op.Reshape(op.Transpose(w, perm=[0, 1, 3, 2, 4]), ints([e, shape[1] * PANEL, shape[2] * PAIR]))
    if not bits:
        return op.Cast(w, to=FLOAT)
    n = shape[1] * PANEL if len(shape) > 3 else shape[1]
    if bits == 8:
        k = shape[2] * PAIR if len(shape) == 5 else shape[2]
        flat = op.DequantizeLinear(op.Reshape(w, ints([e * n, k])), op.Reshape(op.Cast(scales, to=FLOAT), ints([-1])),
                                   axis=0)
    elif bits == 4:
        k = 2 * shape[2]
        values = op.Cast(_unpack_int4(op.Reshape(w, ints([e * n, shape[2]])), (e * n, shape[2])), to=INT4)
        flat = op.DequantizeLinear(values, op.Reshape(op.Cast(scales, to=FLOAT), ints([e * n, k // group_size])),
                                   axis=1, block_size=group_size)
    else:
        raise ValueError(f"moe: bits must be 0, 4 or 8, got {bits}")
    return op.Reshape(flat, ints([e, n, k]))


def moe(x, router, gate_up, gate_up_scales, down, down_scales, top_k: int, renormalize: bool, bits: int,
        group_size: int):
    xf = op.Cast(x, to=FLOAT)
    probs = op.Softmax(op.Cast(op.MatMul(x, op.Transpose(router, perm=[1, 0])), to=FLOAT), axis=-1)   # [T, E]
    weights, chosen = op.TopK(probs, ints([top_k]), axis=-1, largest=1, sorted=1)
    if renormalize:
        weights = op.Div(weights, op.ReduceSum(weights, ints([-1]), keepdims=1))
    dense = op.ScatterElements(op.Mul(probs, scalar(0.0, probs)), chosen, weights, axis=1)        # [T, E]
    gu = _experts(gate_up, gate_up_scales, bits, group_size)                                        # [E, 2I, H]
    dn = _experts(down, down_scales, bits, group_size)                                              # [E, H, I]
    h = op.MatMul(op.Unsqueeze(xf, ints([0])), op.Transpose(gu, perm=[0, 2, 1]))                  # [E, T, 2I]
    gate, up = op.Split(h, axis=-1, num_outputs=2)
    y = op.MatMul(op.Mul(op.Mul(gate, op.Sigmoid(gate)), up), op.Transpose(dn, perm=[0, 2, 1]))   # [E, T, H]
    out = op.ReduceSum(op.Mul(y, op.Unsqueeze(op.Transpose(dense, perm=[1, 0]), ints([2]))), ints([0]), keepdims=0)
    return op.CastLike(out, x)


LOWERINGS = {torch.ops.kiln.moe.default: moe}
