"""bf16 GEMMs -> ``kiln.bf16_linear`` (the plugin's fast CPU kernel) when the engine dtype is bfloat16."""

from __future__ import annotations

from torch import fx

from kiln.builder.passes.common import attr, is_linear, linear_bias, register_gemm_target

NAME = "bf16_linear"
DESCRIPTION = "bfloat16 GEMMs -> kiln.bf16_linear (fast CPU kernel) when dtype=bfloat16"


def run(gm: fx.GraphModule, ctx) -> dict:
    if ctx is None or ctx.build.dtype != "bfloat16":
        return {"skipped": f"dtype={ctx.build.dtype if ctx else '?'}"}
    import torch

    try:
        import kiln.plugins.weight_only_linear  # noqa: F401  (registers kiln::bf16_linear)
    except ImportError:
        return {"skipped": "kiln.plugins.weight_only_linear not available"}
    op = torch.ops.kiln.bf16_linear.default
    register_gemm_target(op)
    count = 0
    for node in list(gm.graph.nodes):
        if not is_linear(node) or attr(gm, node.args[1].target).dtype != torch.bfloat16:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(op, (node.args[0], node.args[1], linear_bias(node)))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    return {"replaced": count}
