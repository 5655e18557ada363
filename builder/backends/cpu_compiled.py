"""``cpu-compiled``: rank0.engine is an AOTInductor package (.pt2 with a compiled shared library).

The package holds no weights (``package_constants_in_so`` off): the runtime hands the weights file's
tensors to the loaded model (``load_constants(..., user_managed=True)``), which uses them in place. A
package with its weights inside its library copies them out of the library's mapping into a buffer
of its own at load, and the process then holds them twice. The package is tied to the exact torch
version; the kiln plugin ops it calls are dispatched to their C++ kernels, the hot ones (linears, attention)
through C shims of the native library (kiln.plugins.aoti_shims), which the engine then needs at load.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from kiln.contract import EngineBuildError

SKIPPED_PASSES = {"functional_kv": "kiln.paged_attention writes the KV pool in place"}
SEPARATE_WEIGHTS = True  # built with package_constants_in_so off; the builder writes rank0.weights


def compile(ep: torch.export.ExportedProgram, path: Path, inputs: dict[str, torch.Tensor], build=None) -> dict:
    import torch._inductor
    from torch._inductor import aoti_load_package

    from kiln.plugins.aoti_shims import custom_ops_to_c_shims

    configs: dict = {"aot_inductor.package_constants_in_so": False}
    shims = custom_ops_to_c_shims()   # the kiln ops the graph calls directly (none without the native library)
    if shims:
        configs["aot_inductor.custom_ops_to_c_shims"] = shims
    buf = io.BytesIO()  # a buffer: the engine file name need not end in .pt2
    torch._inductor.aoti_compile_and_package(ep, package_path=buf, inductor_configs=configs)
    path.write_bytes(buf.getvalue())
    # Every constant the compiled model reads must be a weight the builder stores (a constant that
    # inductor created, e.g. by folding, would be missing at load).
    with open(path, "rb") as f:
        needed = set(aoti_load_package(f).get_constant_fqns())
    stored = set(ep.state_dict) | {k for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}
    if not needed <= stored:
        raise EngineBuildError(f"the compiled model reads constants that are not weights of the program: "
                               f"{sorted(needed - stored)[:8]}; this graph cannot be built with cpu-compiled")
    return {"format": "aoti", "package_bytes": len(buf.getvalue()), "constants": len(needed),
            "c_shims": sorted(op.name() for op in shims)}
