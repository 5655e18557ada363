"""Which native kernel each linear of an engine runs, with the kernel tuning of this machine (kiln inspect --load)."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.contract import load_weights

__all__ = ["weight_kind", "linear_kernels"]


def weight_kind(t: torch.Tensor) -> str | None:
    """The panel layout a stored weight is in ('fp32_panel', 'bf16_panel', 'int8_panel', 'int4_panel'), or None."""
    if t.dim() == 3 and t.dtype == torch.uint8 and t.shape[2] == 64:
        return "int4_panel"
    if t.dim() == 3 and t.dtype == torch.float32 and t.shape[2] == 16:
        return "fp32_panel"
    if t.dim() == 4 and tuple(t.shape[2:]) == (16, 2):
        return {torch.bfloat16: "bf16_panel", torch.int8: "int8_panel"}.get(t.dtype)
    return None


def linear_kernels(engine_dir: str | Path, rows: dict[str, int]) -> list[dict]:
    """Per panel-layout weight of rank 0 (name, kind, [out, in]): the kernel at each of ``rows`` ({label: M})."""
    from kiln.plugins import native
    from kiln.runtime.engine import Engine

    config = Engine.read_config(engine_dir)
    files = config.weights_files
    if not files:
        return []
    out = []
    for name, t in load_weights(Path(engine_dir) / files[0]).items():
        kind = weight_kind(t)
        if kind is None:
            continue
        n = t.shape[0] * 16
        k = t.shape[1] * (8 if kind == "int4_panel" else 1 if kind == "fp32_panel" else 2)
        out.append({"name": name, "kind": kind, "shape": [n, k],
                    "kernels": {label: native.describe_kernel(kind, m, n) for label, m in rows.items()}})
    return out
