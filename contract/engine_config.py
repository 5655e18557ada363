"""The engine directory: file names, format version and the typed ``config.json`` (:class:`EngineConfig`).

An engine directory is the only thing that passes from ``build-engine`` to the runtime::

    config.json          EngineConfig.to_dict(): format, versions, backend, precision, model, bounds,
                         memory summary, tokenizer, engine files, and the BuildConfig it was built with
    rank{r}.engine       the compiled graph of tensor-parallel rank r (rank0.engine when tp_size = 1), without
                         its weights
    rank{r}.weights      the weights of rank r, each stored once and mapped at load (kiln.contract.weights;
                         cpu and cpu-compiled engines: an onnx or tensorrt graph file keeps its weights)
    build_report.json    stage timings, pass statistics, the memory plan (for people; nothing loads it)
    tokenizer files      copied from the checkpoint

Reading is strict: the format version is checked first (an older or newer layout gets the "rebuild"
error before anything else is read), then every key of the file against the dataclasses below, so a
missing or mistyped key raises :class:`EngineLoadError` naming it; then values that are well typed but
impossible (a zero head count, a NaN epsilon, an EOS id outside the vocabulary) are named the same way.

Integrity: ``checksums`` records the SHA-256 of every file the runtime reads (the engine files of every
rank, their weights files and the tokenizer files) when the engine is built; :func:`verify_checksums`
compares them before anything is loaded, so a damaged or swapped file is refused instead of serving
garbage. config.json itself is covered by the strict reader.

Format history: 1 kept the resolved bounds inside ``build`` and an ``io`` block; 2 split the BuildConfig
knobs (``build``, readable by ``BuildConfig.from_dict``) from the bounds the runtime enforces (``bounds``);
3 adds ``checksums`` (required: an engine that cannot be verified is rebuilt, not trusted); 4 adds
``tensor_parallel`` (the mapping of the weights and KV heads over ``tp_size`` ranks,
:class:`~kiln.contract.tensor_parallel.TensorParallelMapping`) and a stamp inside every rank file of a
torch backend; ``memory`` describes one rank; 5 moves the weights of ``cpu`` and ``cpu-compiled`` engines
out of the graph files into ``rank{r}.weights`` (before, an AOTInductor package held them in its shared
library, and the loaded process held them twice). Engines of formats 1 to 4 are refused with the rebuild
message. ``lora`` (format 5, optional) describes the adapter pool of an engine built with LoRA targets
(:class:`~kiln.contract.lora.LoraLayout`); engines without it have no such key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.contract.errors import EngineLoadError
from kiln.contract.io import DTYPES, KV_CACHE_DTYPES, input_names, kv_bytes_per_token
from kiln.contract.lora import LoraLayout
from kiln.contract.model import ModelConfig
from kiln.contract.tensor_parallel import TensorParallelMapping
from kiln.contract.typed import read_dataclass
from kiln.contract.weights import weights_file

FORMAT_VERSION = 5
SUPPORTED_FORMAT_VERSIONS = (FORMAT_VERSION,)
CONFIG_FILE = "config.json"
REPORT_FILE = "build_report.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "generation_config.json", "added_tokens.json",
)
BACKENDS = ("cpu", "cpu-compiled", "onnx", "tensorrt")   # what the builder writes and the runtime loads
# backends whose engine file is a torch artifact, tied to the torch that wrote it (the others are ONNX models
# and TensorRT plans: their runtime's own checks apply when they are loaded)
TORCH_BACKENDS = ("cpu", "cpu-compiled")
# backends whose graph file holds no weights: they are in rank{r}.weights (an ONNX model keeps its own, inline
# or as external data; a TensorRT plan holds them)
SEPARATE_WEIGHTS_BACKENDS = TORCH_BACKENDS
QUANTIZATIONS = ("none", "int8_weight_only", "int4_weight_only")


def rank_file(rank: int) -> str:
    """The engine file of tensor-parallel rank ``rank``."""
    return f"rank{rank}.engine"


@dataclass(frozen=True)
class EngineBounds:
    """The largest step and sequence the engine accepts (resolved by the builder from its BuildConfig)."""

    max_batch_size: int        # sequences per step
    max_num_tokens: int        # packed tokens per step
    max_input_len: int         # longest prompt
    max_seq_len: int           # longest sequence (prompt + generated)
    tokens_per_block: int      # KV block size
    max_num_logits: int        # logits rows per step (max_batch_size, or max_num_tokens when all are gathered)
    max_blocks_per_seq: int    # block table width: ceil(max_seq_len / tokens_per_block)
    max_num_blocks: int = 0    # largest KV pool in blocks (0: unbounded; a tensorrt plan's profiles bound it)


@dataclass(frozen=True)
class MemorySummary:
    """What the builder's memory plan found for one rank, in bytes (at the largest step the bounds allow)."""

    weights_bytes: int
    activation_peak_bytes: int          # arena size
    activation_live_peak_bytes: int     # largest total of buffers live at once (lower bound on any arena)
    activation_naive_bytes: int         # every buffer its own memory
    num_buffers: int
    kv_bytes_per_token: int             # of one rank's pool
    kv_tokens_per_gib: int
    # the model's parameters (whole, not per rank) and what one decode token uses: an MoE token uses top_k of
    # num_experts experts per MoE layer (0: an engine built before these were recorded)
    total_params: int = 0
    active_params: int = 0
    decode_read_bytes: int = 0          # weight bytes a decode step of one sequence reads (one rank's; memory plan)
    gathered_weights: list[str] | None = None   # weights only row lookups read (None: an engine built before this)


@dataclass(frozen=True)
class TokenizerInfo:
    files: list[str] = field(default_factory=list)     # copied into the engine directory
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None


@dataclass(frozen=True)
class EngineConfig:
    """The typed ``config.json`` of an engine directory."""

    format_version: int
    torch_version: str
    kiln_version: str
    backend: str
    dtype: str                  # weights and activations
    kv_cache_dtype: str
    quantization: str
    model: ModelConfig
    bounds: EngineBounds
    memory: MemorySummary
    tokenizer: TokenizerInfo
    engine_files: list[str]     # rank_file(r) for r in range(tp_size)
    tensor_parallel: TensorParallelMapping
    checksums: dict[str, str]   # file name -> "sha256:<hex>" of every engine, weights (all ranks) and tokenizer file
    build: dict[str, Any]       # the builder's BuildConfig.to_dict() (knobs as resolved): rebuild with it
    lora: LoraLayout | None = None   # the adapter pool's layout of an engine that takes adapters (kiln.contract.lora)

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel.tp_size

    @property
    def rank_model(self) -> ModelConfig:
        """The model as one rank computes it (its heads, KV heads, MLP slice): its KV pool's shape."""
        return self.tensor_parallel.rank_model(self.model)

    @property
    def weights_files(self) -> list[str]:
        """The weights file of each rank, for a backend that keeps its weights out of the graph file."""
        if self.backend not in SEPARATE_WEIGHTS_BACKENDS:
            return []
        return [weights_file(r) for r in range(len(self.engine_files))]   # not tp_size: a hostile one is huge

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in ONE rank's KV pool."""
        return kv_bytes_per_token(self.rank_model, self.kv_cache_dtype)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The dtype of the KV pool tensor (int8 / float8_e4m3fn for the 8-bit pools, scales in their rows)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the weights and activations (and of the adapter pool)."""
        return DTYPES[self.dtype]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The engine's inputs in order (the contract's, and the adapter pool's when it takes adapters)."""
        return input_names(self.lora is not None)

    def problems(self) -> list[str]:
        """Values that are well typed but impossible (a hand-edited or foreign file)."""
        out = []
        for name, allowed in (("dtype", tuple(DTYPES)), ("kv_cache_dtype", tuple(KV_CACHE_DTYPES)),
                              ("quantization", QUANTIZATIONS)):
            if getattr(self, name) not in allowed:
                out.append(f"{name}={getattr(self, name)!r} is not one of {list(allowed)}")
        b = self.bounds
        small = [f"bounds.{f.name}={getattr(b, f.name)}" for f in dataclasses.fields(b)
                 if getattr(b, f.name) < (0 if f.name == "max_num_blocks" else 1)]
        if small:
            out.append(f"{', '.join(small)}: bounds must be >= 1")
        tp = self.tensor_parallel.tp_size
        if len(self.engine_files) != tp or self.engine_files != [rank_file(r) for r in range(tp)]:
            out.append(f"engine_files={self.engine_files} must be rank0.engine .. rank{tp - 1}.engine "
                       f"(tensor_parallel.tp_size={tp})")
        model_problems = _model_problems(self.model)
        out += model_problems or self.tensor_parallel.problems(self.model)
        m = self.memory
        out += [f"memory.{f.name}={getattr(m, f.name)} must be >= 0" for f in dataclasses.fields(m)
                if isinstance(getattr(m, f.name), int) and getattr(m, f.name) < 0]
        bad_eos = [t for t in self.tokenizer.eos_token_ids if not 0 <= t < self.model.vocab_size]
        if bad_eos:
            out.append(f"tokenizer.eos_token_ids {bad_eos} are outside the vocabulary [0, {self.model.vocab_size})")
        out += [f"checksums has no entry for {name}" for name in [*self.engine_files, *self.weights_files]
                if name not in self.checksums]
        for name, digest in self.checksums.items():
            if Path(name).name != name or name in (".", ".."):
                out.append(f"checksums names {name!r}, not a file of the engine directory")
            elif not _CHECKSUM.fullmatch(digest):
                out.append(f"checksums[{name!r}]={digest!r:.80} is not 'sha256:' and 64 hex digits")
        if self.lora is not None:
            out += self.lora.problems()
            if self.lora.num_layers != self.model.num_layers:
                out.append(f"lora.num_layers={self.lora.num_layers} is not model.num_layers={self.model.num_layers}")
        return out

    def to_dict(self) -> dict[str, Any]:
        """The config.json content; an engine without adapters has no ``lora`` key (as before the key existed)."""
        d = dataclasses.asdict(self)
        if d["lora"] is None:
            del d["lora"]
        return d

    @classmethod
    def from_dict(cls, data: Any, source: str = CONFIG_FILE) -> EngineConfig:
        """Checked: the format version first, then every key and value; EngineLoadError names the key."""
        check_format_version(data, source)
        try:
            config = read_dataclass(cls, data, "")
        except EngineLoadError as exc:
            raise EngineLoadError(f"{source}: {exc}; this is not a valid kiln engine config, rebuild the engine") \
                from None
        issues = config.problems()
        if issues:
            raise EngineLoadError(f"{source}: " + "; ".join(issues) + "; rebuild the engine")
        return config

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / CONFIG_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")
_MODEL_DIMS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "max_position_embeddings")


def _model_problems(m: ModelConfig) -> list[str]:
    out = [f"model.{name}={getattr(m, name)} must be >= 1" for name in _MODEL_DIMS if getattr(m, name) < 1]
    if m.sliding_window < 0:
        out.append(f"model.sliding_window={m.sliding_window} must be >= 0 (0: full attention)")
    out += [f"model.{name}={getattr(m, name)} must be > 0" for name in ("norm_eps", "rope_theta")
            if not getattr(m, name) > 0]
    return out


def file_checksum(path: str | Path) -> str:
    """"sha256:<hex>" of a file, read in 1 MiB pieces (a GB-sized engine is never held in memory)."""
    h = hashlib.sha256()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return "sha256:" + h.hexdigest()


def verify_checksums(directory: str | Path, config: EngineConfig) -> None:
    """EngineLoadError naming the first file of the engine directory that is missing or whose content is not
    what was built (a damaged, truncated or replaced file)."""
    directory = Path(directory)
    for name, digest in config.checksums.items():
        path = directory / name
        if not path.is_file():
            raise EngineLoadError(f"{path}: missing; the engine directory is incomplete, rebuild it")
        actual = file_checksum(path)
        if actual != digest:
            raise EngineLoadError(f"{path}: checksum mismatch (built as {digest[:19]}..., now {actual[:19]}...): "
                                  "the file is damaged or was changed after the build; rebuild the engine")


def check_format_version(data: Any, source: str = CONFIG_FILE) -> None:
    """A config.json of a format this kiln reads, else the rebuild error (checked before anything else)."""
    if not isinstance(data, dict):
        raise EngineLoadError(f"{source}: not a JSON object; this is not a kiln engine config, rebuild the engine")
    if "format_version" not in data:
        raise EngineLoadError(f"{source}: key 'format_version' is missing; this is not a kiln engine config, "
                              "rebuild it")
    fmt = data["format_version"]
    if type(fmt) is not int or fmt not in SUPPORTED_FORMAT_VERSIONS:
        hint = ("it was written by a newer kiln: upgrade kiln, or rebuild the engine with this kiln's build-engine"
                if type(fmt) is int and fmt > FORMAT_VERSION else "rebuild the engine with this kiln's build-engine")
        raise EngineLoadError(
            f"{source}: engine format version {fmt!r} (built by kiln {data.get('kiln_version', '?')!s:.40}) is not "
            f"supported by this kiln, which reads format(s) {list(SUPPORTED_FORMAT_VERSIONS)}; {hint}"
        )


def _torch_release(version: str) -> str:
    return version.split("+")[0]


def check_compatible(config: EngineConfig, source: str, runnable_backends: tuple[str, ...] = BACKENDS) -> None:
    """EngineLoadError unless this process can read the engine: its backend, and for torch artifacts the torch
    they were built with (an AOTInductor package links against libtorch: the exact release; an
    ExportedProgram: major.minor). Whether an onnx/tensorrt engine's runtime is installed (and a GPU there)
    is checked when the engine is loaded, so that its config can still be inspected anywhere."""
    if config.backend not in runnable_backends:
        raise EngineLoadError(f"{source}: backend {config.backend!r} cannot run here; this runtime runs "
                              f"{list(runnable_backends)}")
    if config.backend not in TORCH_BACKENDS:
        return
    built, here = _torch_release(config.torch_version), _torch_release(torch.__version__)
    same = built == here if config.backend == "cpu-compiled" else built.split(".")[:2] == here.split(".")[:2]
    if not same:
        raise EngineLoadError(
            f"{source}: engine built with torch {config.torch_version} ({config.backend} backend) cannot be "
            f"loaded by torch {torch.__version__}; rebuild the engine with this torch"
        )


def is_engine_dir(path: str | Path) -> bool:
    """Does ``path`` look like a directory build-engine wrote (a config.json with a format version)?"""
    cfg = Path(path) / CONFIG_FILE
    try:
        return cfg.is_file() and "format_version" in json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False


def read_engine_config(path: str | Path) -> EngineConfig:
    """The checked EngineConfig of an engine directory, compatible with this process (no graph is loaded)."""
    directory = Path(path)
    if not directory.is_dir():
        raise EngineLoadError(f"{directory}: not an engine directory (it does not exist or is not a directory)")
    cfg_path = directory / CONFIG_FILE
    if not cfg_path.is_file():
        raise EngineLoadError(f"{cfg_path}: missing; build the engine with `build-engine --checkpoint ... "
                              f"--output {directory}`")
    try:
        data = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineLoadError(f"{cfg_path}: not valid JSON ({exc}); rebuild the engine") from None
    if isinstance(data, dict) and "format_version" not in data and ("architectures" in data or "model_type" in data):
        raise EngineLoadError(f"{directory} is a Hugging Face checkpoint, not an engine: kiln.LLM({str(directory)!r}) "
                              f"and `kiln serve {directory}` build (and cache) its engine, or build one with "
                              f"`build-engine --checkpoint {directory} --output ENGINE_DIR`")
    config = EngineConfig.from_dict(data, str(cfg_path))
    check_compatible(config, str(directory))
    return config


def read_build_report(path: str | Path) -> dict[str, Any] | None:
    """build_report.json of an engine directory (None when absent or unreadable: it is informational)."""
    report = Path(path) / REPORT_FILE
    try:
        return json.loads(report.read_text())
    except (OSError, ValueError):
        return None
