"""Inline the elementwise plugins (RMSNorm, fused add+RMSNorm, rotary, SiLU-and-mul, GELU) as aten ops.

Each of these ``kiln`` ops is defined by a plain-torch reference, which its C++ CPU kernel
reproduces (same rounding points). Calling it as an op costs a dispatch round trip per call,
more than the math at decode. The pass points each call at the reference function; the re-export
that follows traces it into aten ops, which the ``cpu`` backend would run one by one (no faster
than the plugin call, so the pass skips itself there) and the ``cpu-compiled`` backend fuses into
compiled loops (shorter decode steps: ``scripts/bench_build.py`` compares the backends). Numerics are unchanged
(same code, same rounding points). Paged attention stays a plugin (data-dependent control flow,
in-place KV writes).
"""

from __future__ import annotations

from torch import fx

NAME = "inline_plugins"
DESCRIPTION = "elementwise kiln plugins -> their plain-torch definitions (aten ops the backends can fuse)"


def _table():
    import torch

    import kiln.plugins  # noqa: F401
    from kiln.plugins.activations import gelu_reference, silu_mul_reference
    from kiln.plugins.rms_norm import fused_add_rms_norm_reference, rms_norm_reference
    from kiln.plugins.rotary import rotary_embedding_reference

    ops = torch.ops.kiln
    return {
        ops.rms_norm.default: rms_norm_reference,
        ops.fused_add_rms_norm.default: fused_add_rms_norm_reference,
        ops.rotary_embedding.default: rotary_embedding_reference,
        ops.silu_mul.default: silu_mul_reference,
        ops.gelu.default: gelu_reference,
    }


def run(gm: fx.GraphModule, ctx=None) -> dict:
    if ctx is not None and ctx.build.backend == "cpu":
        # on the eager ``cpu`` backend a custom-op call costs about what its handful of
        # aten ops cost, so only a compiling backend gains; keep the plugin calls (fewer graph nodes)
        return {"skipped": "backend=cpu (no compiler to fuse the inlined ops)"}
    table = _table()
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in table:
            name = node.target._schema.name.split("::")[-1]
            counts[name] = counts.get(name, 0) + 1
            node.target = table[node.target]
    return {"inlined": counts}
