"""Merge the gate and up projections of each gated MLP into one GEMM."""

from __future__ import annotations

from torch import fx

from kiln.builder.passes.common import count_gemms, merge_sibling_linears, sibling_groups

NAME = "merge_gate_up"
DESCRIPTION = "gate/up projections of a gated MLP -> one GEMM on concatenated weights + slices"
SUFFIXES = ("gate_proj.weight", "up_proj.weight")


def run(gm: fx.GraphModule, ctx=None) -> dict:
    before = count_gemms(gm)
    groups = sibling_groups(gm, SUFFIXES)
    merged, adapters = merge_sibling_linears(gm, groups,
                                   lambda g: g[0].args[1].target.replace("gate_proj.weight", "gate_up_proj"))
    return {"merged": merged, "adapters_merged": adapters, "gemms_before": before, "gemms_after": count_gemms(gm)}
