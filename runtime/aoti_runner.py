"""The ``cpu-compiled`` backend's step function: an AOTInductor package run through its C++ loader.

``torch._inductor.aoti_load_package`` would do the same, but importing it brings in torch._dynamo and
torch._inductor (~1 s), and it probes the CPU's vector ISA by compiling and loading test programs in
subprocesses (~0.8 s) only to log a warning when the package was compiled for another ISA. Here the
package's own metadata is read and a package compiled for AVX-512 is refused on a CPU without it (it
would die of SIGILL in its first step), and the loader (``torch._C._aoti.AOTIModelPackageLoader``,
what aoti_load_package wraps) is used directly: loading the package takes milliseconds.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from kiln.contract import EngineLoadError
from kiln.plugins import native

MODEL_NAME = "model"   # the name aoti_compile_and_package gives the one model of a package


def cpu_capability() -> str:
    """The widest vector ISA torch finds on this CPU ("AVX512", "AVX2", "DEFAULT")."""
    return torch.backends.cpu.get_cpu_capability()


def check_package_isa(package_isa: str, path: Path) -> None:
    """EngineLoadError when the package was compiled for AVX-512 and this CPU lacks it."""
    if "AVX512" in package_isa.upper().split() and cpu_capability() != "AVX512":
        raise EngineLoadError(
            f"{path}: this cpu-compiled engine was compiled for {package_isa} (the CPU it was built on), and this "
            f"CPU has {cpu_capability()}; rebuild the engine on this machine (a cpu engine runs anywhere)")


class AotiRunner:
    """``runner(**inputs) -> [logits, ...]`` over an AOTInductor package whose constants the caller loads."""

    device = torch.device("cpu")

    def __init__(self, path: Path):
        aoti = torch._C._aoti
        # the loader reads a path whose name ends in .pt2 (rank0.engine does not); the graph file is a few MB
        with tempfile.TemporaryDirectory(prefix="kiln-aoti-") as tmp:
            package = Path(tmp) / "package.pt2"
            shutil.copyfile(path, package)
            metadata = aoti.AOTIModelPackageLoader.load_metadata_from_package(str(package), MODEL_NAME)
            check_package_isa(metadata.get("AOTI_CPU_ISA", ""), path)
            native.load_for_compiled_engines()   # the ops' C shims the graph calls (kiln.plugins.aoti_shims)
            try:
                self.loader = aoti.AOTIModelPackageLoader(str(package), MODEL_NAME, False, 1, -1)
            except RuntimeError as e:
                if "undefined symbol: aoti_torch_cpu_" not in str(e):
                    raise
                raise EngineLoadError(
                    f"{path}: this cpu-compiled engine calls kiln's native kernels directly, and the native library "
                    f"does not load here ({str(e)[-200:]}); see the warning above for why, fix that, or rebuild the "
                    "engine where it loads (a cpu engine runs without it)") from None
        in_spec = pytree.treespec_loads(self.loader.get_call_spec()[0])
        self.input_names: list[str] = list(in_spec.child(1).context)   # the kwargs, in the graph's order

    def get_constant_fqns(self) -> list[str]:
        return self.loader.get_constant_fqns()

    def load_constants(self, constants: dict[str, torch.Tensor]) -> None:
        """Hand the weights to the model as they are (user-managed: no copy into a buffer of its own; the
        caller keeps them alive), checking that every constant it reads is given."""
        self.loader.load_constants(constants, False, True, True, False)  # inactive, full, user-managed, h2d

    def __call__(self, **inputs: torch.Tensor) -> list[torch.Tensor]:
        return self.loader.boxed_run([inputs[name] for name in self.input_names])
