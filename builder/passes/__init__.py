"""Graph passes over the exported model (``ep.module()``: an fx.GraphModule, weights as get_attr).

Each pass is one module with ``NAME``, ``DESCRIPTION`` and ``run(gm, ctx) -> dict`` (statistics
for the build report); it rewrites ``gm`` in place. They run in the order of ``PASSES``; any can
be disabled (``build-engine --disable-pass NAME``) for debugging. A backend skips the passes its
``SKIPPED_PASSES`` names (name -> why), e.g. the CPU kernels' weight layouts on the ONNX backends, or
the functional KV rewrite on the backends that write the pool in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from kiln.builder.config import BuildConfig
from kiln.builder.passes import (
    dead_code,
    fast_linear,
    functional_kv,
    fuse_add_norm,
    inline_plugins,
    merge_gate_up,
    merge_qkv,
    weight_only_quant,
)
from kiln.contract import BuildConfigError, ModelConfig

PASSES: list[ModuleType] = [
    merge_qkv, merge_gate_up, fuse_add_norm, weight_only_quant, fast_linear, inline_plugins, functional_kv, dead_code,
]
PASS_NAMES = [p.NAME for p in PASSES]


@dataclass
class PassContext:
    build: BuildConfig
    model: ModelConfig
    stats: dict[str, Any] = field(default_factory=dict)


def check_names(names: list[str]) -> None:
    unknown = [n for n in names if n not in PASS_NAMES]
    if unknown:
        raise BuildConfigError(f"unknown pass name(s) {unknown}; passes are {PASS_NAMES}")


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext,
               disabled: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Run every enabled pass in order; returns {pass name: stats} ('disabled' for skipped ones, and
    {"skipped": why} for those the build's backend does not use)."""
    from kiln.builder.backends import BACKENDS
    from kiln.builder.passes.common import prune_unused_attrs

    check_names(list(disabled))
    skipped = getattr(BACKENDS[ctx.build.backend], "SKIPPED_PASSES", {})
    stats: dict[str, Any] = {}
    for p in PASSES:
        if p.NAME in disabled:
            stats[p.NAME] = "disabled"
            continue
        if p.NAME in skipped:
            stats[p.NAME] = {"skipped": f"backend={ctx.build.backend} ({skipped[p.NAME]})"}
            continue
        stats[p.NAME] = p.run(gm, ctx) or {}
        gm.graph.lint()
        prune_unused_attrs(gm)  # weights a pass replaced are dropped now, not at the end
    gm.recompile()
    return stats
