"""Merge the q/k/v projections of each attention layer into one GEMM (weights concatenated at build time)."""

from __future__ import annotations

from torch import fx

from kiln.builder.passes.common import count_gemms, merge_sibling_linears, sibling_groups

NAME = "merge_qkv"
DESCRIPTION = "q/k/v projections on the same input -> one GEMM on concatenated weights + slices"
SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight")


def run(gm: fx.GraphModule, ctx=None) -> dict:
    before = count_gemms(gm)
    groups = sibling_groups(gm, SUFFIXES)
    merged, adapters = merge_sibling_linears(gm, groups,
                                             lambda g: g[0].args[1].target.replace("q_proj.weight", "qkv_proj"))
    return {"merged": merged, "adapters_merged": adapters, "gemms_before": before, "gemms_after": count_gemms(gm)}
