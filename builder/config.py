"""BuildConfig: every knob of an engine build, validated, with dict and YAML round trips.

Values are never adjusted silently: a value that conflicts with another (or with the
model) raises :class:`BuildConfigError` naming the values and how to fix them. A default
that depends on another field is a documented sentinel (``None`` / ``auto``) resolved from
what the user did give, so a default never contradicts a value the user set (DERIVED lists
them; ``resolved()`` applies them, and the engine's config.json records the result). An
unknown field name (keyword or YAML key) is a BuildConfigError naming the closest one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.contract import (
    BACKENDS,
    QUANTIZATIONS,
    QUANTIZED_KV_DTYPES,
    BuildConfigError,
    EngineBounds,
    ModelConfig,
    check_option_names,
    mapping_problems,
    option_names,
    reject_unknown_options,
)
from kiln.contract import DTYPES as _TORCH_DTYPES

DTYPES = tuple(_TORCH_DTYPES)
TP_BACKENDS = ("cpu", "cpu-compiled")   # backends whose graphs can hold kiln's collectives (plugin ops)
LORA_BACKENDS = ("cpu", "cpu-compiled")   # backends whose graphs can hold kiln::lora (no ONNX lowering yet)
KV_DTYPES = ("auto",) + DTYPES + QUANTIZED_KV_DTYPES
LOGITS_DTYPES = ("float32",)
ONNX_OPTIMIZATION = ("disable", "basic", "extended", "all")
DEFAULT_MAX_NUM_TOKENS = 1024

# field -> what its sentinel default means (the BuildConfig reference page lists these)
DERIVED = {
    "max_input_len": "max_seq_len",
    "max_num_tokens": f"max({DEFAULT_MAX_NUM_TOKENS}, max_batch_size, tokens_per_block)",
    "opt_num_tokens": "min(max_num_tokens, 128)",
    "kv_cache_dtype": "dtype",
    "max_num_blocks": "unbounded (tensorrt: 4 x max_batch_size x ceil(max_seq_len / tokens_per_block))",
}

__all__ = ["BACKENDS", "DERIVED", "DTYPES", "KV_DTYPES", "LOGITS_DTYPES", "ONNX_OPTIMIZATION", "QUANTIZATIONS",
           "BuildConfig", "BuildConfigError"]


def _knob(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A BuildConfig field: its help text and accepted values also make its build-engine option."""
    return field(default=default, metadata={"help": help, **({"choices": choices} if choices else {})})


@reject_unknown_options(BuildConfigError)
@dataclass
class BuildConfig:
    dtype: str = _knob("float32", "Engine dtype of weights and activations.", DTYPES)
    backend: str = _knob("cpu", "cpu: a serialized torch.export program; cpu-compiled: an AOTInductor package; "
                                "onnx: an ONNX model run by onnxruntime; tensorrt: a TensorRT plan (NVIDIA GPU).",
                         BACKENDS)
    max_batch_size: int = _knob(8, "Most sequences in one step (context and generation together).")
    max_input_len: int | None = _knob(None, "Longest prompt accepted (default: max_seq_len).")
    max_seq_len: int = _knob(1024, "Longest sequence (prompt + generated); at most the model's positions.")
    max_num_tokens: int | None = _knob(None, "Most packed tokens in one step (prefill chunks + one per decoding "
                                             f"sequence; default: max({DEFAULT_MAX_NUM_TOKENS}, max_batch_size, "
                                             "tokens_per_block)).")
    opt_num_tokens: int | None = _knob(None, "Tokens per step the engine is tuned for (default: "
                                             "min(max_num_tokens, 128)).")
    tokens_per_block: int = _knob(16, "KV block size in tokens.")
    kv_cache_dtype: str = _knob("auto", "KV pool dtype (auto: the engine dtype; int8 / fp8 (e4m3): 8-bit keys and "
                                        "values with a scale per token and KV head, about half of bf16's bytes).",
                                KV_DTYPES)
    kv_calibration: str | None = _knob(None, "Text file of calibration prompts (separated by blank lines) for the "
                                             "8-bit KV cache's accuracy report (default: text the checkpoint writes "
                                             "itself).")
    quantization: str = _knob("none", "Weight-only quantization of the GEMMs.", QUANTIZATIONS)
    group_size: int = _knob(128, "int4 group size (weights per scale along the input).")
    logits_dtype: str = _knob("float32", "Dtype of the logits (the engine contract returns float32).",
                              LOGITS_DTYPES)
    gather_all_logits: bool = _knob(False, "Logits for every token of a step, not only each sequence's last.")
    tp_size: int = _knob(1, "Tensor-parallel ranks: one engine file per rank, each holding its shard of the weights "
                            "and KV heads (heads, KV heads and MLP width split; LM head split by vocabulary).")
    disabled_passes: list[str] = field(default_factory=list, metadata={
        "help": "Graph passes to skip (build-engine --passes lists them)."})
    max_num_blocks: int | None = _knob(None, "Largest KV pool (blocks) the engine accepts (default: unbounded; "
                                             "tensorrt: max_batch_size x max_blocks_per_seq x 4).")
    onnx_threads: int = _knob(0, "onnx: onnxruntime intra-op threads (0: torch's thread count when loaded).")
    onnx_optimization: str = _knob("all", "onnx: onnxruntime graph optimization level.", ONNX_OPTIMIZATION)
    lora_target_modules: list[str] = field(default_factory=list, metadata={
        "help": "Modules that take LoRA adapters at run time, as PEFT's target_modules names them (q_proj, k_proj, "
                "v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2: c_attn, c_proj, c_fc; Phi-3: qkv_proj, "
                "o_proj, gate_up_proj, down_proj; MoE families: the attention's four; or all-linear); "
                "comma-separated or repeated. Default: none (an engine without adapters)."})
    max_lora_rank: int = _knob(16, "Largest LoRA rank the engine's adapter pool holds (with lora_target_modules).")
    num_tokens_profiles: list[int] = field(default_factory=list, metadata={
        "help": "tensorrt: one optimization profile per value, covering num_tokens up to it (ascending, the last "
                "= max_num_tokens; default: one profile)."})

    def __post_init__(self) -> None:
        if isinstance(self.lora_target_modules, str):   # YAML "q_proj,v_proj"; the command line gives a list
            self.lora_target_modules = [self.lora_target_modules]
        if isinstance(self.lora_target_modules, list) and all(isinstance(n, str) for n in self.lora_target_modules):
            self.lora_target_modules = [n.strip() for entry in self.lora_target_modules for n in entry.split(",")
                                        if n.strip()]
        self.validate()

    # ------------------------------------------------------------------ validation
    def problems(self) -> list[str]:
        """Every inconsistency of this config on its own (see :meth:`check_model` for the model)."""
        out: list[str] = []

        def choice(name: str, allowed: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in allowed:
                out.append(f"{name}={value!r} is not one of {list(allowed)}")

        choice("dtype", DTYPES)
        choice("backend", BACKENDS)
        choice("kv_cache_dtype", KV_DTYPES)
        choice("quantization", QUANTIZATIONS)
        choice("onnx_optimization", ONNX_OPTIMIZATION)
        if self.logits_dtype not in LOGITS_DTYPES:
            out.append(f"logits_dtype={self.logits_dtype!r}: the engine contract returns float32 logits; use 'float32'")
        ints = ("max_batch_size", "max_seq_len", "tokens_per_block", "group_size", "tp_size", "max_lora_rank")
        bad_int = False
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                out.append(f"{name}={value!r} must be a positive integer")
                bad_int = True
        for name in ("max_input_len", "max_num_tokens", "opt_num_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                out.append(f"{name}={value!r} must be a positive integer or null (null: {DERIVED[name]})")
                bad_int = True
        if not isinstance(self.gather_all_logits, bool):
            out.append(f"gather_all_logits={self.gather_all_logits!r} must be true or false")
        if self.max_num_blocks is not None and (isinstance(self.max_num_blocks, bool)
                                                or not isinstance(self.max_num_blocks, int) or self.max_num_blocks < 1):
            out.append(f"max_num_blocks={self.max_num_blocks!r} must be a positive integer or null")
        if isinstance(self.onnx_threads, bool) or not isinstance(self.onnx_threads, int) or self.onnx_threads < 0:
            out.append(f"onnx_threads={self.onnx_threads!r} must be an integer >= 0 (0: torch's thread count)")
        if not isinstance(self.num_tokens_profiles, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in self.num_tokens_profiles):
            out.append(f"num_tokens_profiles={self.num_tokens_profiles!r} must be a list of positive integers")
            bad_int = True
        if not isinstance(self.disabled_passes, list) or not all(isinstance(p, str) for p in self.disabled_passes):
            out.append(f"disabled_passes={self.disabled_passes!r} must be a list of pass names")
        if not isinstance(self.lora_target_modules, list):
            out.append(f"lora_target_modules={self.lora_target_modules!r} must be a list of module names")
        elif self.lora_target_modules and self.backend not in LORA_BACKENDS:
            out.append(f"lora_target_modules with backend={self.backend!r}: the LoRA op has no ONNX lowering yet, so "
                       f"adapters are served by the {list(LORA_BACKENDS)} backends; build with one of them, or without "
                       "lora_target_modules")
        elif self.lora_target_modules and self.tp_size > 1:
            out.append(f"lora_target_modules with tp_size={self.tp_size}: adapters are not split over "
                       "tensor-parallel ranks yet; build with tp_size=1, or without lora_target_modules")
        if bad_int:
            return out
        # only values the user gave can conflict: a derived default follows what it is derived from
        if self.max_input_len is not None and self.max_input_len > self.max_seq_len:
            out.append(
                f"max_input_len={self.max_input_len} > max_seq_len={self.max_seq_len}: a prompt cannot be longer "
                f"than the whole sequence; raise max_seq_len to >= {self.max_input_len} or lower max_input_len "
                "(or leave it out: it defaults to max_seq_len)"
            )
        tokens = self.resolved_max_num_tokens
        if self.max_num_tokens is not None and tokens < self.tokens_per_block:
            out.append(
                f"max_num_tokens={tokens} < tokens_per_block={self.tokens_per_block}: one step could not "
                f"fill a single KV block; raise max_num_tokens to >= {self.tokens_per_block} or lower tokens_per_block"
            )
        if self.max_num_tokens is not None and tokens < self.max_batch_size:
            out.append(
                f"max_num_tokens={tokens} < max_batch_size={self.max_batch_size}: a step decoding "
                f"max_batch_size sequences needs one token each; raise max_num_tokens to >= {self.max_batch_size} "
                "or lower max_batch_size"
            )
        if self.opt_num_tokens is not None and self.opt_num_tokens > tokens:
            out.append(
                f"opt_num_tokens={self.opt_num_tokens} > max_num_tokens={tokens}; "
                "lower opt_num_tokens or set it to null"
            )
        profiles = self.num_tokens_profiles
        if profiles and self.backend != "tensorrt":
            out.append(f"num_tokens_profiles={profiles} is for backend 'tensorrt' (this build is "
                       f"{self.backend!r}); remove it or build with --backend tensorrt")
        elif profiles and (profiles != sorted(set(profiles)) or profiles[-1] != tokens):
            out.append(f"num_tokens_profiles={profiles} must be strictly ascending and end at "
                       f"max_num_tokens={tokens} (e.g. [{self.max_batch_size}, {tokens}])")
        if self.backend == "onnx" and self.dtype != "float32":
            out.append(f"dtype={self.dtype!r} with backend 'onnx': onnxruntime's CPU kernels are float32 (no bfloat16 "
                       "MatMul); use dtype 'float32', or backend 'tensorrt' for 16-bit engines")
        if self.tp_size > 1 and self.backend not in TP_BACKENDS:
            out.append(f"tp_size={self.tp_size} with backend={self.backend!r}: tensor-parallel engines build for "
                       f"{list(TP_BACKENDS)} (the collectives have no lowering for {self.backend!r} yet); use "
                       "tp_size=1 or one of those backends")
        out += self._kv_problems()
        if self.quantization == "int4_weight_only" and self.group_size % 2:
            out.append(f"group_size={self.group_size} must be even for int4 (two weights per byte)")
        if self.quantization != "none" and self.dtype == "float16":
            out.append(
                f"quantization={self.quantization!r} with dtype='float16': the weight-only kernels take float32 or "
                "bfloat16 activations; use dtype 'bfloat16' or 'float32'"
            )
        return out

    def _kv_problems(self) -> list[str]:
        out = []
        kv = self.kv_cache_dtype
        if kv == "fp8" and self.backend in ("onnx", "tensorrt"):
            out.append(f"kv_cache_dtype='fp8' with backend {self.backend!r}: the graph would have to read the pool's "
                       "bytes as float8, and ONNX has no bit cast; use kv_cache_dtype 'int8' (DequantizeLinear), or "
                       "backend 'cpu' / 'cpu-compiled' for fp8")
        elif kv == "int8" and self.backend == "tensorrt":
            out.append("kv_cache_dtype='int8' with backend 'tensorrt': TensorRT's ONNX parser rejects the lowering's "
                       "QuantizeLinear with per-row scales computed in the graph (tensorrt_rtx 1.7); use "
                       "kv_cache_dtype 'auto', or backend 'onnx' / 'cpu' for an int8 KV cache")
        if self.kv_calibration is not None and (not isinstance(self.kv_calibration, str) or not self.kv_calibration):
            out.append(f"kv_calibration={self.kv_calibration!r} must be the path of a text file or null")
        elif self.kv_calibration is not None and kv not in QUANTIZED_KV_DTYPES:
            out.append(f"kv_calibration={self.kv_calibration!r} calibrates the accuracy report of an 8-bit KV cache; "
                       f"kv_cache_dtype is {kv!r}: set kv_cache_dtype int8 or fp8, or drop kv_calibration")
        return out

    def validate(self) -> BuildConfig:
        issues = self.problems()
        if issues:
            raise BuildConfigError("invalid build config:\n  - " + "\n  - ".join(issues))
        return self

    def check_model(self, model: Any) -> None:
        """Problems that need the model: positions, the tensor-parallel split, int4 group size vs. the GEMM
        widths (of one rank's shard).

        ``model`` is a ModelConfig or its dict (the builder passes the ModelConfig).
        """
        model = ModelConfig.from_dict(model) if isinstance(model, dict) else model
        m = model.to_dict()
        issues = mapping_problems(model, self.tp_size)
        max_pos = int(m["max_position_embeddings"])
        if self.max_seq_len > max_pos:
            issues.append(
                f"max_seq_len={self.max_seq_len} > the model's max_position_embeddings={max_pos}: positions beyond "
                f"it were never trained; lower max_seq_len to <= {max_pos}"
            )
        from kiln.model_defs import build_problems  # the family's own limits (Phi-3's LongRoPE length)

        issues.extend(build_problems(model, self.max_seq_len))
        if self.quantization == "int4_weight_only" and not issues:
            tp = self.tp_size   # the row-parallel GEMMs (o_proj, down_proj) read 1 / tp of their input
            widths = {int(m["hidden_size"]), int(m["intermediate_size"]) // tp,
                      int(m["num_heads"]) // tp * int(m["head_dim"])}
            if model.num_experts:   # an MoE layer's down GEMMs read the experts' width
                widths.add(model.moe_intermediate_size // tp)
            bad = sorted(w for w in widths if w % self.group_size)
            if bad:
                fits = [g for g in (32, 64, 128, 256) if all(w % g == 0 for w in widths)]
                issues.append(
                    f"group_size={self.group_size} does not divide the model's GEMM input widths {bad}; "
                    f"use a group_size that divides {sorted(widths)} (e.g. {fits[-1] if fits else 'a divisor'})"
                )
        if issues:
            raise BuildConfigError("build config does not fit the model:\n  - " + "\n  - ".join(issues))

    # ------------------------------------------------------------------ derived values
    @property
    def resolved_kv_cache_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def resolved_max_input_len(self) -> int:
        return self.max_input_len if self.max_input_len is not None else self.max_seq_len

    @property
    def resolved_max_num_tokens(self) -> int:
        if self.max_num_tokens is not None:
            return self.max_num_tokens
        return max(DEFAULT_MAX_NUM_TOKENS, self.max_batch_size, self.tokens_per_block)

    @property
    def resolved_opt_num_tokens(self) -> int:
        return self.opt_num_tokens if self.opt_num_tokens is not None else min(self.resolved_max_num_tokens, 128)

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_seq_len / self.tokens_per_block)

    @property
    def resolved_max_num_blocks(self) -> int | None:
        """The KV pool bound (tensorrt needs one for its optimization profiles; others: unbounded)."""
        if self.max_num_blocks is not None or self.backend != "tensorrt":
            return self.max_num_blocks
        return 4 * self.max_batch_size * self.max_blocks_per_seq

    @property
    def max_num_logits(self) -> int:
        return self.resolved_max_num_tokens if self.gather_all_logits else self.max_batch_size

    def engine_bounds(self) -> EngineBounds:
        """The bounds the engine is traced with and the runtime enforces (config.json ``bounds``)."""
        return EngineBounds(
            max_batch_size=self.max_batch_size, max_num_tokens=self.resolved_max_num_tokens,
            max_input_len=self.resolved_max_input_len,
            max_seq_len=self.max_seq_len, tokens_per_block=self.tokens_per_block, max_num_logits=self.max_num_logits,
            max_blocks_per_seq=self.max_blocks_per_seq, max_num_blocks=self.resolved_max_num_blocks or 0,
        )

    def resolved(self) -> BuildConfig:
        """This config with its documented sentinels (DERIVED) replaced by what they mean: what config.json
        records, and what rebuilds the same engine."""
        return self.replace(max_input_len=self.resolved_max_input_len, max_num_tokens=self.resolved_max_num_tokens,
                            kv_cache_dtype=self.resolved_kv_cache_dtype, opt_num_tokens=self.resolved_opt_num_tokens,
                            max_num_blocks=self.resolved_max_num_blocks)

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["disabled_passes"] = list(self.disabled_passes)
        d["num_tokens_profiles"] = list(self.num_tokens_profiles)
        d["lora_target_modules"] = list(self.lora_target_modules)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildConfig:
        if not isinstance(data, dict):
            raise BuildConfigError(f"a build config must be a mapping, got {type(data).__name__}")
        check_option_names(data, option_names(cls), "a build config", kind="key", error=BuildConfigError)
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> BuildConfig:
        import yaml

        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise BuildConfigError(f"{path}: no such build config file") from None
        except yaml.YAMLError as exc:
            raise BuildConfigError(f"{path}: not valid YAML ({exc})") from None
        try:
            return cls.from_dict(data or {})
        except BuildConfigError as exc:
            raise BuildConfigError(f"{path}: {exc}") from None

    def replace(self, **changes: Any) -> BuildConfig:
        """A copy with ``changes`` applied (validated again)."""
        return BuildConfig.from_dict({**self.to_dict(), **changes})
