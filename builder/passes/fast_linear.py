"""Remaining float GEMMs -> the plugin's streaming-GEMV linears: ``kiln.fp32_linear`` / ``kiln.bf16_linear``.

Decode is a GEMV per weight matrix: its speed is the rate at which the weights stream from
memory. torch's fp32 GEMV reads one weight stream per core (~70% of the bandwidth on the AVX2
machines), and its bf16 GEMV is slower than fp32 per byte; the plugin's kernels read several
streams per core and switch to a GEMM for large M (prefill), so the same op serves both.
"""

from __future__ import annotations

from torch import fx

from kiln.builder.passes.common import attr, is_linear, linear_bias, register_gemm_target

NAME = "fast_linear"
DESCRIPTION = "float32 / bfloat16 GEMMs -> kiln.fp32_linear / kiln.bf16_linear (streaming GEMV at decode)"


def run(gm: fx.GraphModule, ctx) -> dict:
    import torch

    import kiln.plugins.weight_only_linear  # noqa: F401  (registers the ops)

    ops = {torch.float32: torch.ops.kiln.fp32_linear.default, torch.bfloat16: torch.ops.kiln.bf16_linear.default}
    for op in ops.values():
        register_gemm_target(op)
    counts: dict[str, int] = {}
    for node in list(gm.graph.nodes):
        if not is_linear(node):
            continue
        w = attr(gm, node.args[1].target)
        x = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
        op = ops.get(w.dtype)
        if op is None or w.dim() != 2 or (x is not None and x.dtype != w.dtype):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(op, (node.args[0], node.args[1], linear_bias(node)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        key = str(w.dtype).removeprefix("torch.")
        counts[key] = counts.get(key, 0) + 1
    return {"replaced": counts}
