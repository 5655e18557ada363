"""Engine: load an engine directory written by ``build-engine`` and run the contract's forward.

The runtime never imports the model definitions or the builder: ``config.json`` (a checked
class:`~kiln.contract.EngineConfig`) describes the engine, and ``rank{r}.engine`` holds the graph of rank r
(a serialized ExportedProgram, or an AOTInductor package for ``cpu-compiled``, which call the ``kiln``
plugin ops registered by importing ``kiln.plugins``; an ONNX model run by onnxruntime for ``onnx``,
:mod:`kiln.runtime.onnx_runner`; a TensorRT plan for ``tensorrt``, :mod:`kiln.runtime.tensorrt_runner`).
An engine of more than one tensor-parallel rank (``cpu`` / ``cpu-compiled`` only) loads as a
:class:`~kiln.runtime.tensor_parallel.TensorParallelEngine` (same interface, plus the other ranks).
The ``cpu`` and ``cpu-compiled`` graphs hold no weights: ``rank{r}.weights`` is mapped, not read
(:func:`kiln.contract.load_weights`), the weights a step streams are moved into huge pages
(:mod:`kiln.runtime.weight_pages`), and the tensors are given to the graph as they are, so the process holds
each weight once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import kiln.plugins  # noqa: F401  (registers torch.ops.kiln.* before an engine is loaded)
from kiln.contract import (
    ConfigError,
    EngineConfig,
    EngineLoadError,
    check_inputs,
    check_rank_file,
    kv_cache_shape,
    load_weights,
    read_engine_config,
    verify_checksums,
    weights_file,
)
from kiln.plugins.native import native_kernels_available
from kiln.runtime import weight_pages
from kiln.runtime.aoti_runner import AotiRunner
from kiln.runtime.zero_pages import zero_pages

SKIP_CHECKSUM_ENV = "KILN_SKIP_ENGINE_CHECKSUM"   # "1": load without verifying the files' checksums


def import_loader(backend: str) -> None:
    """Import the torch modules that load a ``backend`` engine (tens of MB and ~1-2 s for ``cpu``, once per
    process; a cpu-compiled engine needs none: kiln.runtime.aoti_runner)."""
    if backend == "cpu":
        import torch._export.serde.serialize  # noqa: F401


def _attach_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Put the weights file's tensors where the loaded program's meta placeholders are (by name)."""
    for name, t in weights.items():
        owner_path, _, leaf = name.rpartition(".")
        try:
            owner = module.get_submodule(owner_path) if owner_path else module
        except AttributeError:
            continue  # a weight this program does not read
        if leaf in owner._parameters:
            owner._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
        elif leaf in owner._buffers:
            owner._buffers[leaf] = t
        elif isinstance(getattr(owner, leaf, None), torch.Tensor):
            setattr(owner, leaf, t)
    read = [n.target for m in module.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "get_attr"]
    tensors = [*module.named_parameters(), *module.named_buffers()]
    tensors += [(name, _resolve(module, name)) for name in read]
    missing = sorted({n for n, t in tensors if isinstance(t, torch.Tensor) and t.is_meta})
    if missing:
        raise EngineLoadError(f"the weights file has no tensor for {missing[:5]} ({len(missing)} missing); "
                              "the engine files do not belong together, rebuild the engine")


def _resolve(module: torch.nn.Module, name: str):
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj


class Engine:
    """A loaded engine: its description (``config``, an EngineConfig) and a callable for one forward step."""

    def __init__(self, directory: Path, config: EngineConfig, fn: Any):
        self.directory = directory
        self.config = config
        self._fn = fn

    # ---- the facts the runtime reads, named -----------------------------------------------------------
    @property
    def backend(self) -> str:
        return self.config.backend

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.config.torch_kv_dtype

    @property
    def device(self) -> torch.device:
        """Where the KV pool lives (the GPU for tensorrt engines, else the CPU)."""
        return getattr(self._fn, "device", torch.device("cpu"))

    @property
    def kv_bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token

    @property
    def weights_bytes(self) -> int:
        return self.config.memory.weights_bytes

    @property
    def eos_token_ids(self) -> list[int]:
        return self.config.tokenizer.eos_token_ids

    # ------------------------------------------------------------------ loading
    @staticmethod
    def read_config(path: str | Path) -> EngineConfig:
        """config.json of an engine directory, checked for format/torch compatibility (no graph load)."""
        return read_engine_config(path)

    @classmethod
    def from_dir(cls, path: str | Path, verify: bool | None = None, *, threads_per_rank: int | None = None) -> Engine:
        """Load an engine directory. ``verify`` (default: on unless the environment sets
        ``KILN_SKIP_ENGINE_CHECKSUM=1``) first compares every file (every rank's) with the checksum recorded at
        build time (about a second per GB: see scripts/bench_engine_load.py), so a damaged engine is refused
        with EngineLoadError instead of serving garbage. A tensor-parallel engine (tp_size > 1) starts its
        other ranks (``threads_per_rank``: their torch threads, see ``kiln.runtime.tensor_parallel``);
        ``close()`` stops them."""
        directory = Path(path)
        config = read_engine_config(directory)
        if config.backend == "tensorrt":   # what is missing (a GPU, TensorRT) is said first, before any file is read
            from kiln.runtime.tensorrt_runner import require_gpu_and_tensorrt

            require_gpu_and_tensorrt(directory)
        if verify is None:
            verify = os.environ.get(SKIP_CHECKSUM_ENV, "") != "1"
        if verify:
            verify_checksums(directory, config)
        # Load (compiling on a fresh machine) the plugins' native kernels now, not inside the first
        # request's step, whose TTFT would otherwise carry the one-time compile.
        native_kernels_available()
        if config.tp_size > 1:
            from kiln.runtime.tensor_parallel import TensorParallelEngine

            return TensorParallelEngine.start(directory, config, threads_per_rank)
        engine_path = directory / config.engine_files[0]
        if config.backend in ("tensorrt", "onnx"):
            if not engine_path.is_file():
                raise EngineLoadError(f"{engine_path}: missing; the engine directory is incomplete, rebuild it")
            if config.backend == "tensorrt":
                from kiln.runtime.tensorrt_runner import TensorRTRunner

                return cls(directory, config, TensorRTRunner(engine_path, config))
            from kiln.runtime.onnx_runner import OnnxRunner

            return cls(directory, config, OnnxRunner(engine_path, config))
        return cls(directory, config, load_rank_graph(directory, config, 0))

    def close(self) -> None:
        """Release what the engine holds besides memory (nothing for one rank; a tensor-parallel engine stops
        its other ranks)."""

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer run a step, or None. A one-rank engine always can; a tensor-parallel
        engine cannot once a rank died (the executor refuses new work and health checks report it)."""
        return None

    # ------------------------------------------------------------------ running
    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """A KV pool of ``num_blocks`` blocks in the contract's layout (``kv_cache_shape``), reading as zeros: on
        the CPU over fresh zero pages (:mod:`kiln.runtime.zero_pages`: resident only as blocks are written)."""
        if num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {num_blocks}")
        if self.config.bounds.max_num_blocks and num_blocks > self.config.bounds.max_num_blocks:
            raise ConfigError(f"num_blocks={num_blocks} is above this engine's max_num_blocks="
                              f"{self.config.bounds.max_num_blocks} (rebuild with a larger --max-num-blocks)")
        shape = kv_cache_shape(self.config.rank_model, self.config.bounds.tokens_per_block, num_blocks,
                               self.config.kv_cache_dtype)
        if torch.device(self.device).type == "cpu":
            return zero_pages(shape, self.kv_dtype)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def allocate_lora_pool(self, max_loras: int, zeroed: bool = True) -> torch.Tensor:
        """The adapter pool of an engine that takes adapters: ``max_loras`` slots in the layout of
        ``config.lora`` (kiln.contract.lora), in the engine's dtype (zeroed, or left as allocated)."""
        if self.config.lora is None:
            raise ConfigError("this engine takes no LoRA adapters; rebuild it with --lora-target-modules")
        if max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {max_loras}")
        alloc = torch.zeros if zeroed else torch.empty
        return alloc(max_loras, self.config.lora.slot_numel, dtype=self.config.torch_dtype, device=self.device)

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One forward step: contract inputs -> float32 logits [num_logits, vocab] (EngineInputError when the
        inputs break the contract or the engine's bounds)."""
        check_inputs(inputs, self.config)
        with torch.inference_mode():
            out = self._fn(**{n: inputs[n] for n in self.config.input_names})
        if isinstance(out, (list, tuple)):
            out = out[0]
        return out if out.dtype == torch.float32 else out.float()

    __call__ = run

    def __repr__(self) -> str:
        return f"Engine({str(self.directory)!r}, {self.config.model.architecture}, backend={self.backend})"


def load_rank_graph(directory: Path, config: EngineConfig, rank: int) -> Any:
    """The callable graph of rank ``rank``'s engine file with its weights (``rank{r}.weights``, mapped) in
    place, after checking the file is that rank's of this build (EngineLoadError naming the file otherwise)."""
    engine_path = check_rank_file(directory, config.tensor_parallel, rank, config.engine_files[rank])
    import_loader(config.backend)
    weights_path = directory / weights_file(rank)
    weights = load_weights(weights_path)
    try:   # the weights are placed (weight_pages) after the graph has loaded: its transient memory is gone by then
        if config.backend == "cpu":
            with open(engine_path, "rb") as f:  # a file object: the name need not end in .pt2
                # no per-call checks of the program's own (its guards module and its input pre-hook, ~85 us a
                # step on Zen 3): Engine.run checks every input against the contract and the same bounds first
                fn = torch.export.load(f).module(check_guards=False)
            fn.validate_inputs = False
            _attach_weights(fn, weight_pages.place(weights, weights_path, config.memory.gathered_weights))
            return fn
        fn = AotiRunner(engine_path)
        missing = sorted(set(fn.get_constant_fqns()) - set(weights))
        if missing:
            raise EngineLoadError(f"the weights file has no tensor for {missing[:5]} ({len(missing)} "
                                  "missing); the engine files do not belong together, rebuild the engine")
        # in place: no buffer of the model's own
        fn.load_constants(weight_pages.place(weights, weights_path, config.memory.gathered_weights))
        return fn
    except EngineLoadError:
        raise
    except Exception as exc:
        raise EngineLoadError(
            f"{engine_path}: cannot load the {config.backend} engine ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); the file is corrupt or truncated, rebuild it"
        ) from exc
