"""``cpu-compiled``: rank0.engine is an AOTInductor package (.pt2 with a compiled shared library).

Custom ops registered from Python (the kiln plugins) stay calls into Python kernels; the
surrounding aten graph is compiled. The package is tied to the exact torch version.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

SKIPPED_PASSES = {"functional_kv": "kiln.paged_attention writes the KV pool in place"}


def compile(ep: torch.export.ExportedProgram, path: Path, inputs: dict[str, torch.Tensor], build=None) -> dict:
    import torch._inductor

    buf = io.BytesIO()  # a buffer: the engine file name need not end in .pt2
    torch._inductor.aoti_compile_and_package(ep, package_path=buf)
    path.write_bytes(buf.getvalue())
    return {"format": "aoti", "package_bytes": len(buf.getvalue())}
