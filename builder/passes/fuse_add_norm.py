"""Fold a residual add into the RMSNorm that reads it: add -> rms_norm becomes kiln.fused_add_rms_norm.

``fused_add_rms_norm(x, residual, w, eps)`` returns ``(rms_norm(x + residual), x + residual)``; the
norm's users take item 0, the other users of the sum (the next residual) take item 1.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

import kiln.plugins  # noqa: F401

NAME = "fuse_add_norm"
DESCRIPTION = "residual add + RMSNorm -> kiln.fused_add_rms_norm (one read of the activations)"


def run(gm: fx.GraphModule, ctx=None) -> dict:
    rms = torch.ops.kiln.rms_norm.default
    fused_op = torch.ops.kiln.fused_add_rms_norm.default
    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.add.Tensor:
            continue
        if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
            continue
        a, b = node.args
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            continue
        va, vb = a.meta.get("val"), b.meta.get("val")
        if va is None or vb is None or va.shape != vb.shape or va.dtype != vb.dtype:
            continue  # broadcasting adds are not residuals
        norms = [u for u in node.users if u.op == "call_function" and u.target is rms and u.args[0] is node]
        if not norms:
            continue
        norm = norms[0]
        weight = norm.args[1]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        if isinstance(weight, fx.Node) and order[weight] > order[node]:
            if weight.op != "get_attr":
                continue
            node.prepend(weight)  # a constant can move up
        # at the add's place: users of the sum may come before the norm
        with gm.graph.inserting_before(node):
            f = gm.graph.call_function(fused_op, (a, b, norm.args[1], norm.args[2]))
            normed = gm.graph.call_function(operator.getitem, (f, 0))
            summed = gm.graph.call_function(operator.getitem, (f, 1))
        normed.meta["val"] = norm.meta.get("val")
        summed.meta["val"] = node.meta.get("val")
        f.meta["val"] = (normed.meta["val"], summed.meta["val"])
        norm.replace_all_uses_with(normed)
        gm.graph.erase_node(norm)
        # the sum is used after the norm (next residual): every remaining user reads item 1
        node.replace_all_uses_with(summed)
        gm.graph.erase_node(node)
        fused += 1
    return {"fused": fused}
