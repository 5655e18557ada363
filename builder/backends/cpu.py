"""``cpu``: rank0.engine is the serialized ExportedProgram (torch.export.save, a .pt2 zip)."""

from __future__ import annotations

from pathlib import Path

import torch

SKIPPED_PASSES = {"functional_kv": "kiln.paged_attention writes the KV pool in place"}


def compile(ep: torch.export.ExportedProgram, path: Path, inputs: dict[str, torch.Tensor], build=None) -> dict:
    with open(path, "wb") as f:  # a file object: the engine file name need not end in .pt2
        torch.export.save(ep, f)
    return {"format": "torch.export"}
