"""What the plugins' ONNX lowerings share: the opset they are written in and small constant helpers.

Each plugin's lowering lives beside it (``<plugin>_onnx.py``) as onnxscript functions that build the op
from standard ONNX ops (no custom domain: TensorRT-RTX has no plugin API, and onnxruntime then runs the
graph on any execution provider). The builder's ONNX exporter hands them to ``torch.onnx.export`` as its
``custom_translation_table`` (:func:`lowerings`). Opset 21: the first with int4 and blocked
``DequantizeLinear`` (the weight-only int4 lowering); onnxruntime and TensorRT both read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx_ir as ir
from onnxscript import opset21 as op

OPSET = 21
FLOAT = ir.DataType.FLOAT
INT64 = ir.DataType.INT64

__all__ = ["OPSET", "FLOAT", "INT64", "op", "ints", "scalar", "lowerings"]


def ints(values: Sequence[int]):
    """A constant int64 vector (axes, shapes, indices)."""
    return op.Constant(value_ints=list(values))


def scalar(value: float, like):
    """A float constant of ``like``'s dtype."""
    return op.CastLike(op.Constant(value_float=float(value)), like)


def lowerings() -> dict[Callable, Callable]:
    """torch op overload -> its ONNX lowering, for every kiln plugin op a graph may hold at export."""
    from kiln.plugins import activations_onnx, linear_onnx, moe_onnx, paged_attention_onnx, rms_norm_onnx, rotary_onnx

    table: dict[Callable, Callable] = {}
    for module in (activations_onnx, linear_onnx, moe_onnx, paged_attention_onnx, rms_norm_onnx, rotary_onnx):
        table.update(module.LOWERINGS)
    return table
