"""ONNX lowering of ``kiln::rms_norm`` / ``kiln::fused_add_rms_norm`` (see :mod:`kiln.plugins.rms_norm`).

Standard ops in the reference's order (normalise in fp32, cast back, scale): ReduceMean of the squares,
Sqrt, Reciprocal. (Opset 23's RMSNormalization would be one node, but TensorRT-RTX 1.7 parses up to
the opsets this graph declares; the pattern is what TensorRT's normalization fusion matches.)
"""

from __future__ import annotations

import torch

import kiln.plugins.rms_norm  # noqa: F401  (registers the ops)
from kiln.plugins.onnx_ops import FLOAT, ints, op, scalar


def rms_norm(x, weight, eps: float):
    xf = op.Cast(x, to=FLOAT)
    mean_sq = op.ReduceMean(op.Mul(xf, xf), ints([-1]), keepdims=1)
    normed = op.Mul(xf, op.Reciprocal(op.Sqrt(op.Add(mean_sq, scalar(eps, xf)))))
    return op.Mul(weight, op.CastLike(normed, x))


def fused_add_rms_norm(x, residual, weight, eps: float):
    summed = op.Add(x, residual)
    return rms_norm(summed, weight, eps), summed


LOWERINGS = {
    torch.ops.kiln.rms_norm.default: rms_norm,
    torch.ops.kiln.fused_add_rms_norm.default: fused_add_rms_norm,
}
