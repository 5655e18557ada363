"""``cpu``: rank0.engine is the serialized ExportedProgram (torch.export.save, a .pt2 zip) with its weights
replaced by meta tensors (shapes and dtypes only): the runtime attaches the weights file's tensors."""

from __future__ import annotations

from pathlib import Path

import torch

SKIPPED_PASSES = {"functional_kv": "kiln.paged_attention writes the KV pool in place"}
SEPARATE_WEIGHTS = True  # the graph is saved with meta weights; the builder writes rank0.weights


def compile(ep: torch.export.ExportedProgram, path: Path, inputs: dict[str, torch.Tensor], build=None) -> dict:
    real = (dict(ep.state_dict), dict(ep.constants))
    try:
        for name, t in real[0].items():
            meta = t.detach().to("meta")
            ep.state_dict[name] = torch.nn.Parameter(meta, requires_grad=False) if isinstance(
                t, torch.nn.Parameter) else meta
        for name, t in real[1].items():
            if isinstance(t, torch.Tensor):
                ep.constants[name] = t.detach().to("meta")
        with open(path, "wb") as f:  # a file object: the engine file name need not end in .pt2
            torch.export.save(ep, f)
    finally:
        ep.state_dict.update(real[0])
        ep.constants.update(real[1])
    return {"format": "torch.export", "graph_bytes": path.stat().st_size}
