"""Load a Hugging Face checkpoint directory into a ModelConfig and kiln-named, checked weights.

Every tensor is checked against the family's layout before anything is built: an
unsupported architecture, a missing, unexpected or mis-shaped tensor, or an unreadable
file raises :class:`CheckpointError` naming the file, the tensor and what was expected.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import torch
from safetensors import safe_open

from kiln.contract import DTYPES, CheckpointError, ModelConfig, TensorParallelMapping
from kiln.model_defs import gemma2, gemma3, gpt2, llama, mistral, mixtral, phi3, prequantized, qwen2, qwen3, qwen3_moe
from kiln.model_defs.hf_config import UnsupportedConfigError
from kiln.model_defs.weights import Part

_MODULES = (llama, mistral, qwen2, gpt2, qwen3, gemma2, gemma3, phi3, mixtral, qwen3_moe)
FAMILIES: dict[str, ModuleType] = {arch: fam for fam in _MODULES for arch in fam.ARCHITECTURES}


def family_of(architecture: str) -> ModuleType:
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise CheckpointError(
            f"unsupported architecture {architecture!r}; kiln supports {sorted(FAMILIES)}"
        ) from None


def build_problems(config: ModelConfig, max_seq_len: int) -> list[str]:
    """Why an engine of ``max_seq_len`` positions would not compute this model as transformers does (a family's
    ``build_problems``, e.g. Phi-3's LongRoPE beyond its original length); empty when it would."""
    check = getattr(family_of(config.architecture), "build_problems", None)
    return check(config, max_seq_len) if check else []


def read_hf_config(ckpt_dir: Path) -> dict:
    if not ckpt_dir.exists():
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist")
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt_dir} is not a directory")
    path = ckpt_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json; is {ckpt_dir} a Hugging Face checkpoint directory?")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: must be a JSON object, got {type(hf).__name__}")
    archs = hf.get("architectures")
    if not archs:
        raise CheckpointError(f"{path}: 'architectures' is missing; cannot tell which model family this is")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{path}: 'architectures' must be a list of model class names, got {archs!r:.60}")
    return hf


def load_config(ckpt_dir: str | Path) -> ModelConfig:
    """Only the ModelConfig (reads config.json, no weights)."""
    hf = read_hf_config(Path(ckpt_dir))
    try:
        family = family_of(hf["architectures"][0])
    except CheckpointError as exc:
        raise CheckpointError(f"{Path(ckpt_dir) / 'config.json'}: {exc}") from None
    try:
        return family.config_from_hf(hf)
    except UnsupportedConfigError as exc:
        raise CheckpointError(f"{Path(ckpt_dir) / 'config.json'}: {exc}") from None


def checkpoint_quantization(ckpt_dir: str | Path) -> prequantized.Prequantization | None:
    """The pre-quantization (GPTQ / AWQ int4) config.json declares, or None for a float checkpoint."""
    path = Path(ckpt_dir)
    return prequantized.read_quantization(read_hf_config(path), str(path / "config.json"))


def index_weight_map(ckpt_dir: Path) -> dict[str, str] | None:
    """tensor name -> shard file name from model.safetensors.index.json, or None when unsharded."""
    index = ckpt_dir / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid safetensors index ({exc!r})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' is not a mapping of tensor name to shard file")
    return weight_map


def weight_files(ckpt_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards of the index, or model.safetensors."""
    index = ckpt_dir / "model.safetensors.index.json"
    weight_map = index_weight_map(ckpt_dir)
    if weight_map is not None:
        files = [ckpt_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) {missing} that are not in {ckpt_dir}")
        return files
    single = ckpt_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if list(ckpt_dir.glob("*.bin")):
        raise CheckpointError(
            f"{ckpt_dir}: only PyTorch .bin weights found; kiln reads safetensors "
            "(convert with transformers: model.save_pretrained(dir, safe_serialization=True))"
        )
    raise CheckpointError(f"{ckpt_dir}: no model.safetensors or model.safetensors.index.json")


def _read(handle, raw_name: str, path: Path) -> torch.Tensor:
    try:
        return handle.get_tensor(raw_name)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read tensor {raw_name!r} ({exc}); the file is corrupt or "
                              "truncated") from None


def _count_non_finite(t: torch.Tensor) -> int:
    return t.numel() - int(torch.isfinite(t).sum())


def load_checkpoint(ckpt_dir: str | Path,
                    dtype: torch.dtype | str = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config and weights, check each tensor against the family's layout, convert to ``dtype``."""
    ckpt_dir = Path(ckpt_dir)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    config = load_config(ckpt_dir)
    family = family_of(config.architecture)
    layout = family.checkpoint_layout(config)
    normalize = getattr(family, "normalize_hf_name", lambda name: name)
    pq = checkpoint_quantization(ckpt_dir)
    pending: dict[str, dict[str, torch.Tensor]] = {}   # quantized linear "<hf prefix>" -> suffix -> tensor
    weights: dict[str, torch.Tensor] = {}
    seen: dict[str, Path] = {}
    for path in weight_files(ckpt_dir):
        try:
            handle = safe_open(str(path), framework="pt")
            names = list(handle.keys())
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{path}: cannot read safetensors file ({exc}); the file is corrupt or "
                                  "truncated") from None
        for raw_name in names:
            name = normalize(raw_name)
            if name.endswith(family.IGNORED_HF_SUFFIXES):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # tied: the head is the embedding; a stored copy is redundant
            if pq is not None and name.endswith(prequantized.PREQUANT_SUFFIXES):
                prefix, dot, suffix = name.rpartition(".")
                if layout.get(prefix + ".weight") is not None and len(layout[prefix + ".weight"].shape) == 2:
                    pending.setdefault(prefix, {})["." + suffix] = _read(handle, raw_name, path)
                    seen.setdefault(prefix + ".weight", path)
                    continue
            spec = layout.get(name)
            if spec is None:
                raise CheckpointError(
                    f"{path}: unexpected tensor {raw_name!r}: {config.architecture} with this config.json "
                    "has no such weight (does config.json match the weights?)"
                )
            if name in seen:
                raise CheckpointError(f"{path}: tensor {raw_name!r} also appears in {seen[name]}")
            tensor = _read(handle, raw_name, path)
            if tuple(tensor.shape) != tuple(spec.shape):
                raise CheckpointError(
                    f"{path}: tensor {raw_name!r} has shape {list(tensor.shape)}, expected {list(spec.shape)} "
                    "from config.json"
                )
            if not tensor.is_floating_point():
                raise CheckpointError(f"{path}: tensor {raw_name!r} has dtype {tensor.dtype}, "
                                      "expected a floating-point weight")
            bad = _count_non_finite(tensor)
            if bad:
                raise CheckpointError(f"{path}: tensor {raw_name!r} has {bad} NaN or infinite values; the checkpoint "
                                      "is damaged (an engine built from it would compute garbage)")
            seen[name] = path
            for kiln_name, value in spec.convert(tensor).items():
                value = value.to(dtype)
                if isinstance(kiln_name, Part):   # an expert's block of a stacked parameter
                    if kiln_name.name not in weights:
                        weights[kiln_name.name] = torch.empty(kiln_name.shape, dtype=dtype)
                    weights[kiln_name.name][kiln_name.index, kiln_name.start:kiln_name.start + len(value)] = value
                else:
                    weights[kiln_name] = value
                bad = _count_non_finite(value)
                if bad:
                    raise CheckpointError(
                        f"{path}: tensor {raw_name!r} has {bad} value{'s' if bad > 1 else ''} beyond the range of "
                        f"{dtype} (largest magnitude {tensor.abs().max().item():.3g}); build with a wider --dtype "
                        "(float32 or bfloat16)")
    for prefix, parts in pending.items():
        shape = layout[prefix + ".weight"].shape
        names = list(layout[prefix + ".weight"].convert(torch.empty(shape, device="meta")))
        if len(names) != 1 or not names[0].endswith(".weight"):
            raise CheckpointError(f"{ckpt_dir}: pre-quantized {prefix} maps onto {names}; kiln reads pre-quantized "
                                  f"checkpoints of families whose linears keep their checkpoint layout")
        weights.update(prequantized.convert_linear(pq, names[0].removesuffix(".weight"), parts, shape[0], shape[1],
                                                   str(ckpt_dir)))
    missing = [name for name in layout if name not in seen]
    if missing:
        weight_map = index_weight_map(ckpt_dir) or {}
        raw = {normalize(n): n for n in weight_map}

        def where(name: str) -> str:  # a sharded checkpoint says which file should have held it
            return f" (the index puts it in {weight_map[raw[name]]})" if name in raw else ""

        shown = ", ".join(f"{n!r} {list(layout[n].shape)}{where(n)}" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{ckpt_dir}: missing tensor(s) {shown}{more} (expected for {config.architecture})")
    return config, weights


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of the model: each counted once (a tied head is the embedding); active
    leaves out, in every MoE layer, the experts a token does not use ((num_experts - top_k) / num_experts of them)."""
    from kiln.model_defs.layers import MoE

    with torch.device("meta"):
        module = family_of(config.architecture).create(config)
    total = sum(p.numel() for p in module.parameters())
    experts = sum(p.numel() for m in module.modules() if isinstance(m, MoE) for p in m.experts.parameters())
    unused = experts * (config.num_experts - config.num_experts_per_tok) // config.num_experts if experts else 0
    return total, total - unused


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor],
                tp: TensorParallelMapping | None = None) -> torch.nn.Module:
    """The family's packed-token module holding ``weights`` (no copy), in eval mode; with ``tp`` (more than
    one rank), the module of one rank, holding that rank's shard (``tensor_parallel.shard_weights``)."""
    family = family_of(config.architecture)
    tp = tp if tp is not None and tp.tp_size > 1 else None
    tied = config.tie_word_embeddings and tp is None   # a rank's LM head is a slice: its own weight
    with torch.device("meta"):
        module = family.create(config) if tp is None else family.create(config, tp)
        if any(name.endswith(".int4_qweight") for name in weights):
            if tp is not None:
                raise CheckpointError("a pre-quantized (GPTQ / AWQ) checkpoint cannot be split for tensor "
                                      "parallelism yet; build it with tp_size 1")
            prequantized.install(module, weights)
    state = dict(weights)
    if tied:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    module.load_state_dict(state, strict=True, assign=True)
    if tied:
        module.lm_head.weight = module.embed_tokens.weight
    return module.eval().requires_grad_(False)


def load_model(ckpt_dir: str | Path, dtype: torch.dtype | str = torch.float32) -> torch.nn.Module:
    """load_checkpoint + build_model."""
    return build_model(*load_checkpoint(ckpt_dir, dtype))
