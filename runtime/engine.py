"""Engine: load an engine directory written by ``build-engine`` and run the contract's forward.

The runtime never imports the model definitions: config.json describes the engine, and
``rank0.engine`` holds the graph (a serialized ExportedProgram, or an AOTInductor package for
``cpu-compiled``), which calls the ``kiln`` plugin ops registered by importing ``kiln.plugins``.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import torch

import kiln.plugins  # noqa: F401  (registers torch.ops.kiln.* before an engine is loaded)
from kiln.plugins.weight_only_linear import native_kernels_available

SUPPORTED_FORMAT_VERSIONS = (1,)
ENGINE_FILE = "rank0.engine"
BACKENDS = ("cpu", "cpu-compiled")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INDEX_DTYPES = {
    "input_ids": torch.int64, "position_ids": torch.int64, "seq_lens": torch.int32, "context_lens": torch.int32,
    "block_tables": torch.int32, "slot_mapping": torch.int64, "logits_indices": torch.int64,
}
INPUT_NAMES = (
    "input_ids", "position_ids", "seq_lens", "context_lens",
    "block_tables", "slot_mapping", "logits_indices", "kv_cache",
)


class EngineLoadError(RuntimeError):
    """The engine directory cannot be loaded here; the message says why and what to do."""


def _torch_release(version: str) -> str:
    return version.split("+")[0]


class Engine:
    """A loaded engine: its description (config.json) and a callable for one forward step."""

    def __init__(self, directory: Path, config: dict[str, Any], fn: Any):
        self.directory = directory
        self.config = config
        self.model: dict[str, Any] = config["model"]
        self.build: dict[str, Any] = config["build"]
        self.backend: str = config["backend"]
        self.eos_token_ids: list[int] = list(config.get("eos_token_ids") or [])
        self.bos_token_id: int | None = config.get("bos_token_id")
        self.kv_dtype: torch.dtype = DTYPES[self.build["kv_cache_dtype"]]
        memory = config.get("memory", {})
        elem = torch.empty(0, dtype=self.kv_dtype).element_size()
        self.kv_bytes_per_token: int = int(
            memory.get("kv_bytes_per_token")
            or 2 * self.model["num_layers"] * self.model["num_kv_heads"] * self.model["head_dim"] * elem
        )
        self.weights_bytes: int = int(memory.get("weights_bytes", 0))
        self.activation_peak_bytes: int = int(memory.get("activation_peak_bytes", 0))
        self._fn = fn
        m, b = self.model, self.build
        self._kv_fixed = (m["num_layers"], 2, b["tokens_per_block"], m["num_kv_heads"], m["head_dim"])
        self._max_logits = int(b.get("max_num_logits") or (b["max_num_tokens"] if b.get("gather_all_logits") else b["max_batch_size"]))
        self._max_blocks = int(b.get("max_blocks_per_seq") or -(-b["max_seq_len"] // b["tokens_per_block"]))

    # ------------------------------------------------------------------ loading
    @staticmethod
    def read_config(path: str | Path) -> dict[str, Any]:
        """config.json of an engine directory, checked for format/torch compatibility (no graph load)."""
        directory = Path(path)
        if not directory.is_dir():
            raise EngineLoadError(f"{directory}: not an engine directory (it does not exist or is not a directory)")
        cfg_path = directory / "config.json"
        if not cfg_path.is_file():
            raise EngineLoadError(f"{cfg_path}: missing; build the engine with `build-engine --checkpoint ... --output {directory}`")
        try:
            config = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EngineLoadError(f"{cfg_path}: not valid JSON ({exc}); rebuild the engine") from None
        for key in ("format_version", "torch_version", "backend", "model", "build"):
            if key not in config:
                raise EngineLoadError(f"{cfg_path}: key {key!r} is missing; this is not a kiln engine config, rebuild it")
        fmt = config["format_version"]
        if fmt not in SUPPORTED_FORMAT_VERSIONS:
            raise EngineLoadError(
                f"{directory}: engine format version {fmt!r} (built by kiln {config.get('kiln_version', '?')}) "
                f"is not supported by this kiln, which reads format(s) {list(SUPPORTED_FORMAT_VERSIONS)}; "
                "rebuild the engine with this kiln's build-engine"
            )
        backend = config["backend"]
        if backend not in BACKENDS:
            raise EngineLoadError(f"{directory}: backend {backend!r} cannot run here; this runtime runs {list(BACKENDS)}")
        built, here = _torch_release(str(config["torch_version"])), _torch_release(torch.__version__)
        # an AOTInductor package links against libtorch: exact release; an ExportedProgram: same major.minor
        same = built == here if backend == "cpu-compiled" else built.split(".")[:2] == here.split(".")[:2]
        if not same:
            raise EngineLoadError(
                f"{directory}: engine built with torch {config['torch_version']} ({backend} backend) cannot be "
                f"loaded by torch {torch.__version__}; rebuild the engine with this torch"
            )
        return config

    @classmethod
    def from_dir(cls, path: str | Path) -> "Engine":
        directory = Path(path)
        config = cls.read_config(directory)
        engine_path = directory / ENGINE_FILE
        # Load (compiling on a fresh machine) the plugins' native kernels now, not inside the first
        # request's step: otherwise that request's TTFT carries a one-time ~20 s compile.
        native_kernels_available()
        if not engine_path.is_file():
            raise EngineLoadError(f"{engine_path}: missing; the engine directory is incomplete, rebuild it")
        if not zipfile.is_zipfile(engine_path):
            raise EngineLoadError(f"{engine_path}: corrupt engine file (not a .pt2 archive); rebuild the engine")
        try:
            if config["backend"] == "cpu":
                with open(engine_path, "rb") as f:  # a file object: the name need not end in .pt2
                    ep = torch.export.load(f)
                fn = ep.module()
            else:
                from torch._inductor import aoti_load_package

                with open(engine_path, "rb") as f:
                    fn = aoti_load_package(f)
        except Exception as exc:
            raise EngineLoadError(
                f"{engine_path}: cannot load the {config['backend']} engine ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); the file is corrupt or truncated, rebuild it"
            ) from exc
        return cls(directory, config, fn)

    # ------------------------------------------------------------------ running
    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """A zeroed KV pool [num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        m, b = self.model, self.build
        return torch.zeros(
            m["num_layers"], 2, num_blocks, b["tokens_per_block"], m["num_kv_heads"], m["head_dim"], dtype=self.kv_dtype
        )

    def check_inputs(self, inputs: dict[str, torch.Tensor]) -> None:
        """Names, dtypes and sizes against the engine's contract and bounds (ValueError naming the input).

        Cheap (no data is read); a compiled package would not check them itself.
        """
        missing = [n for n in INPUT_NAMES if n not in inputs]
        if missing:
            raise ValueError(f"engine inputs missing {missing}; the contract needs {list(INPUT_NAMES)}")
        for name, dtype in _INDEX_DTYPES.items():
            if inputs[name].dtype != dtype:
                raise ValueError(f"engine input {name} has dtype {inputs[name].dtype}, the contract says {dtype}")
        kv = inputs["kv_cache"]
        if kv.dtype != self.kv_dtype or tuple(kv.shape[:2]) + tuple(kv.shape[3:]) != self._kv_fixed:
            raise ValueError(
                f"kv_cache is {kv.dtype} {list(kv.shape)}; this engine needs {self.kv_dtype} "
                f"[{self._kv_fixed[0]}, 2, num_blocks, {', '.join(map(str, self._kv_fixed[2:]))}] (allocate_kv_cache)"
            )
        b = self.build
        sizes = (
            ("num_tokens (input_ids)", inputs["input_ids"].shape[0], 1, b["max_num_tokens"]),
            ("num_seqs (seq_lens)", inputs["seq_lens"].shape[0], 1, b["max_batch_size"]),
            # 0 logits: a step whose sequences are all mid-prefill (chunked) needs none
            ("num_logits (logits_indices)", inputs["logits_indices"].shape[0], 0, self._max_logits),
            ("blocks per sequence (block_tables)", inputs["block_tables"].shape[1], 1, self._max_blocks),
        )
        for what, n, low, limit in sizes:
            if not low <= n <= limit:
                raise ValueError(f"{what} = {n} is outside this engine's range [{low}, {limit}]")
        t, s = inputs["input_ids"].shape[0], inputs["seq_lens"].shape[0]
        for name, n, want in (("position_ids", inputs["position_ids"].shape[0], t),
                              ("slot_mapping", inputs["slot_mapping"].shape[0], t),
                              ("context_lens", inputs["context_lens"].shape[0], s),
                              ("block_tables", inputs["block_tables"].shape[0], s)):
            if n != want:
                raise ValueError(f"{name} has {n} rows, expected {want} (one per {'token' if want == t else 'sequence'})")

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One forward step: contract inputs -> float32 logits [num_logits, vocab]."""
        self.check_inputs(inputs)
        with torch.inference_mode():
            out = self._fn(**{n: inputs[n] for n in INPUT_NAMES})
        if isinstance(out, (list, tuple)):
            out = out[0]
        return out if out.dtype == torch.float32 else out.float()

    __call__ = run

    def __repr__(self) -> str:
        return f"Engine({str(self.directory)!r}, {self.model.get('architecture')}, backend={self.backend})"
