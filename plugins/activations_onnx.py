"""ONNX lowerings of ``kiln::silu_mul`` and ``kiln::gelu`` (see :mod:`kiln.plugins.activations`):
x * Sigmoid(x) * up, and the opset-20 ``Gelu`` op (exact or tanh approximation)."""

from __future__ import annotations

import torch

import kiln.plugins.activations  # noqa: F401  (registers the ops)
from kiln.plugins.onnx_ops import op


def silu_mul(gate, up):
    return op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)


def gelu(x, approximate: str):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return op.Gelu(x, approximate=approximate)


LOWERINGS = {torch.ops.kiln.silu_mul.default: silu_mul, torch.ops.kiln.gelu.default: gelu}
