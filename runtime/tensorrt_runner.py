"""The ``tensorrt`` backend's step function: a deserialized TensorRT plan run on a CUDA stream.

Only where an NVIDIA GPU and TensorRT are there. Everything that is missing is checked first -- a CUDA
device visible to torch, then TensorRT's Python bindings -- and reported as EngineLoadError *before* any
TensorRT runtime is created: creating one without a GPU can crash the process. (The plan is the one the
builder wrote with ``tensorrt`` or ``tensorrt_rtx``; the same library must load it.)

The KV pool lives on the GPU (``device``: the engine allocates it there). The contract's index inputs
are copied to the GPU each step (a few KB); the logits come back to the host for the sampler. The plan
returns the updated pool as ``kv_cache_out``; it is bound to a second pool buffer and the two buffers are
swapped after each step (no copy by kiln; the plan's ScatterND copies its input into its output, one
device-memory pass per step). Binding the output to the input's own address, as the onnx runtime does, or
TensorRT's native KV-cache-update layer, would avoid that pass; neither could be checked without a GPU.
The optimization profile of each step is the first whose ranges hold the step's dims.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.contract import (
    INPUT_AXES,
    INPUT_NAMES,
    KV_CACHE_OUTPUT,
    OUTPUT_NAME,
    EngineConfig,
    EngineInputError,
    EngineLoadError,
    read_build_report,
)

MODULES = ("tensorrt", "tensorrt_rtx")


def missing_requirements() -> list[str]:
    """What this process lacks to run a TensorRT plan (empty: nothing). Creates no TensorRT object."""
    missing = []
    if not torch.cuda.is_available():
        missing.append(f"an NVIDIA GPU visible to torch (torch {torch.__version__}, CUDA "
                       f"{torch.version.cuda or 'none: a CPU-only build'}, {torch.cuda.device_count()} device(s))")
    if not _importable_modules():
        missing.append(f"TensorRT's Python bindings (none of {list(MODULES)} imports: pip install NVIDIA's "
                       "tensorrt, or 'kiln-llm[tensorrt]' for tensorrt_rtx)")
    return missing


def require_gpu_and_tensorrt(directory: Path) -> None:
    """EngineLoadError naming what this machine lacks to run a tensorrt engine (nothing TensorRT is created)."""
    missing = missing_requirements()
    if missing:
        raise EngineLoadError(f"{directory}: backend 'tensorrt' runs on an NVIDIA GPU with TensorRT; this "
                              f"machine lacks {' and '.join(missing)}. Build an onnx or cpu engine to run here.")


def _importable_modules() -> list:
    found = []
    for name in MODULES:
        try:
            module = __import__(name)
            module.Runtime  # noqa: B018  (the bindings import without their libraries on some installs)
            found.append(module)
        except Exception:  # noqa: BLE001, S112 - ImportError, OSError of a missing libnvinfer: not usable
            continue
    return found


class TensorRTRunner:
    """A deserialized plan, one execution context and a CUDA stream; ``runner(**inputs) -> logits``."""

    def __init__(self, path: Path, config: EngineConfig):
        require_gpu_and_tensorrt(path.parent)
        report = read_build_report(path.parent) or {}
        built_with = (report.get("backend") or {}).get("module")
        modules = sorted(_importable_modules(), key=lambda m: m.__name__ != built_with)
        plan = path.read_bytes()
        self.device = torch.device("cuda")
        for trt in modules:
            self._logger = trt.Logger(trt.Logger.WARNING)
            self._runtime = trt.Runtime(self._logger)
            engine = self._runtime.deserialize_cuda_engine(plan)
            if engine is not None:
                break
        else:
            raise EngineLoadError(f"{path}: no TensorRT here ({[m.__name__ for m in modules]}) can deserialize this "
                                  f"plan (built with {built_with or 'an unknown module'}); rebuild the engine here")
        self.engine = engine
        self.context = engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.vocab_size = config.model.vocab_size
        self.profiles = [{name: engine.get_tensor_profile_shape(name, p) for name in INPUT_NAMES}
                         for p in range(engine.num_optimization_profiles)]
        self._profile = -1
        self._spare: torch.Tensor | None = None

    def _pick_profile(self, inputs: dict[str, torch.Tensor]) -> int:
        for p, shapes in enumerate(self.profiles):
            if all(lo[a] <= inputs[n].shape[a] <= hi[a] for n, (lo, _, hi) in shapes.items() for a in INPUT_AXES[n]):
                return p
        raise EngineInputError(f"no optimization profile of this engine holds a step of "
                               f"{inputs['input_ids'].shape[0]} tokens / {inputs['seq_lens'].shape[0]} sequences")

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        kv = inputs["kv_cache"]
        if kv.device.type != "cuda" or not kv.is_contiguous():
            raise EngineInputError("kv_cache must be the contiguous GPU pool of the engine's allocate_kv_cache")
        profile = self._pick_profile(inputs)
        with torch.cuda.stream(self.stream):
            if profile != self._profile:
                self.context.set_optimization_profile_async(profile, self.stream.cuda_stream)
                self._profile = profile
            held = {n: inputs[n].to(self.device, non_blocking=True).contiguous()
                    for n in INPUT_NAMES if n != "kv_cache"}
            held["kv_cache"] = kv
            if self._spare is None or self._spare.shape != kv.shape or self._spare.dtype != kv.dtype:
                self._spare = torch.empty_like(kv)
            logits = torch.empty(inputs["logits_indices"].shape[0], self.vocab_size, dtype=torch.float32,
                                 device=self.device)
            for name, t in held.items():
                self.context.set_input_shape(name, tuple(t.shape))
                self.context.set_tensor_address(name, t.data_ptr())
            self.context.set_tensor_address(OUTPUT_NAME, logits.data_ptr())
            self.context.set_tensor_address(KV_CACHE_OUTPUT, self._spare.data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT failed to run the step (see its log)")
            out = logits.to("cpu", non_blocking=False)
        # the updated pool becomes the caller's tensor; its old buffer is the next step's output
        storage = kv.untyped_storage()
        kv.set_(self._spare.untyped_storage(), 0, kv.shape, kv.stride())
        self._spare = torch.empty(0, dtype=kv.dtype, device=self.device).set_(storage, 0, kv.shape, kv.stride())
        return out
