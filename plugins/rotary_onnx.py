"""ONNX lowering of ``kiln::rotary_embedding`` (see :mod:`kiln.plugins.rotary`): the cos/sin rows of the
tokens' positions gathered from the table, the rotate-half product in fp32, cast back."""

from __future__ import annotations

import torch

import kiln.plugins.rotary  # noqa: F401  (registers the op)
from kiln.plugins.onnx_ops import FLOAT, ints, op


def _rotate(x, cos, sin):
    xf = op.Cast(x, to=FLOAT)
    x1, x2 = op.Split(xf, axis=-1, num_outputs=2)
    rotated = op.Concat(op.Sub(op.Mul(x1, cos), op.Mul(x2, sin)), op.Add(op.Mul(x2, cos), op.Mul(x1, sin)), axis=-1)
    return op.CastLike(rotated, x)


def rotary_embedding(q, k, position_ids, table):
    rows = op.Unsqueeze(op.Gather(table, position_ids, axis=0), ints([1]))   # [T, 1, rot_dim]
    cos, sin = op.Split(op.Cast(rows, to=FLOAT), axis=-1, num_outputs=2)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


LOWERINGS = {torch.ops.kiln.rotary_embedding.default: rotary_embedding}
