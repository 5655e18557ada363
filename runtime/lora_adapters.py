"""PEFT LoRA adapters read into one row of an engine's adapter pool (the layout of ``kiln.contract.lora``).

An adapter directory is what PEFT's ``save_pretrained`` writes: ``adapter_config.json`` (rank ``r``,
``lora_alpha``, ``use_rslora``, ``rank_pattern`` / ``alpha_pattern``, ...) and ``adapter_model.safetensors``
(``base_model.model.<module path>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r] per adapted module).
:func:`read_adapter` checks everything against the engine first -- the file, every tensor's module (one the
engine adapts), its rank (at most the engine's ``max_lora_rank``), shape and values -- and refuses what does
not fit with :class:`~kiln.contract.AdapterLoadError` naming it; then it writes each module's ``A`` and
``B^T * scaling`` (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA, per module as PEFT computes it) at the
module's offsets of one slot, in the engine's dtype. That row is what the pool copies into a slot when a
request needs the adapter; reading and converting happen in the caller's thread, off the step loop.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.contract import AdapterLoadError, LoraLayout

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
# adapter_config.json keys whose non-empty value asks for something an adapter pool row cannot hold
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA) scales the base weight itself",
    "modules_to_save": "modules_to_save replaces whole modules of the model",
    "layer_replication": "layer_replication changes the model's layers",
    "target_parameters": "target_parameters adapts parameters, not modules",
    "trainable_token_indices": "trainable_token_indices changes embedding rows",
    "lora_bias": "lora_bias adds a bias to lora_B",
    "use_qalora": "QALoRA pools the input",
    "alora_invocation_tokens": "aLoRA activates only after invocation tokens",
}


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: its identity and the pool row holding it."""

    name: str
    path: str
    adapter_id: int              # unique per load (the prefix cache keys KV blocks by it)
    rank: int                    # the largest rank of its modules
    modules: tuple[str, ...]     # the engine's LoRA module names it adapts
    row: torch.Tensor            # [layout.slot_numel] in the engine dtype

    @property
    def nbytes(self) -> int:
        return self.row.numel() * self.row.element_size()


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise AdapterLoadError(f"LoRA adapter {directory}: not a directory (give the folder PEFT's "
                               "save_pretrained wrote)")
    if not path.is_file():
        raise AdapterLoadError(f"{path}: missing; a PEFT LoRA adapter directory has adapter_config.json and "
                               f"{WEIGHTS_FILE}")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterLoadError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterLoadError(f"{path}: must be a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterLoadError(f"{path}: peft_type {config.get('peft_type')!r}; kiln serves LoRA adapters only")
    for key, why in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterLoadError(f"{path}: {key}={config[key]!r:.60}: {why}, which kiln's adapter pool cannot "
                                   "serve; use an adapter without it")
    if config.get("bias", "none") != "none":
        raise AdapterLoadError(f"{path}: bias={config['bias']!r} trains the base model's biases, which kiln's "
                               "adapter pool cannot serve; use an adapter trained with bias='none'")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise AdapterLoadError(f"{path}: {key}={value!r} must be a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise AdapterLoadError(f"{path}: {key} must be a mapping of module pattern to value")
    return config


def _pattern_value(patterns: dict[str, Any], module_path: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern matching the module path's end."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module_path):
            return value
    return default


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    path = directory / WEIGHTS_FILE
    if not path.is_file():
        hint = (" (only adapter_model.bin is there: kiln reads safetensors; save the adapter with "
                "save_pretrained(..., safe_serialization=True))") if (directory / "adapter_model.bin").is_file() else ""
        raise AdapterLoadError(f"{path}: missing{hint}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise AdapterLoadError(f"{path}: cannot read safetensors file ({exc}); the file is damaged") from None


def read_adapter(path: str | Path, layout: LoraLayout, dtype: torch.dtype, name: str,
                 adapter_id: int) -> LoraAdapter:
    """The adapter at ``path`` as a pool row of ``layout`` in ``dtype`` (AdapterLoadError naming what does
    not fit the engine)."""
    directory = Path(path)
    config = _read_config(directory)
    tensors = _read_tensors(directory)
    where = directory / WEIGHTS_FILE
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        found = _KEY.fullmatch(key.removeprefix(KEY_PREFIX))
        if found is None:
            raise AdapterLoadError(f"{where}: tensor {key!r} is not a LoRA A or B matrix of a linear module "
                                   "(lora_embedding_*, DoRA magnitudes and saved modules are not served)")
        pairs.setdefault(found["module"], {})[found["part"]] = t
    if not pairs:
        raise AdapterLoadError(f"{where}: holds no lora_A / lora_B tensors")
    engine_modules = [m.name for m in layout.modules]
    row = torch.zeros(layout.slot_numel, dtype=torch.float32)
    adapted: set[str] = set()
    top_rank = 0
    for module_path, parts in sorted(pairs.items()):
        match = layout.match_path(module_path)
        if match is None:
            raise AdapterLoadError(f"{where}: adapts module {module_path!r}, which this engine does not adapt (its "
                                   f"LoRA modules: {engine_modules} of {layout.num_layers} layers); rebuild the "
                                   "engine with --lora-target-modules naming it")
        layer, module = match
        if set(parts) != {"A", "B"}:
            raise AdapterLoadError(f"{where}: module {module_path!r} has lora_{''.join(parts)} but not "
                                   f"lora_{'B' if 'A' in parts else 'A'}")
        a, b = parts["A"], parts["B"]
        r = int(_pattern_value(config.get("rank_pattern") or {}, module_path, config["r"]))
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module_path, config["lora_alpha"]))
        if r > layout.max_rank:
            raise AdapterLoadError(f"{where}: module {module_path!r} has rank {r}, above this engine's max_lora_rank "
                                   f"{layout.max_rank}; rebuild the engine with --max-lora-rank {r} or more")
        want_a, want_b = (r, module.in_features), (module.out_features, r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterLoadError(f"{where}: module {module_path!r} has lora_A {list(a.shape)} and lora_B "
                                   f"{list(b.shape)}; rank {r} on this engine's {module.name} needs {list(want_a)} and "
                                   f"{list(want_b)} (is the adapter for another model?)")
        for part, t in (("lora_A", a), ("lora_B", b)):
            if not t.is_floating_point():
                raise AdapterLoadError(f"{where}: {module_path}.{part} is {t.dtype}, not a floating-point weight")
            if not bool(torch.isfinite(t).all()):
                raise AdapterLoadError(f"{where}: {module_path}.{part} has NaN or infinite values; the adapter is "
                                       "damaged")
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        a_off, b_off = layout.offsets(layer, module.name)
        row[a_off:a_off + r * module.in_features] = a.float().reshape(-1)
        row[b_off:b_off + r * module.out_features] = (b.float().t() * scaling).reshape(-1)
        adapted.add(module.name)
        top_rank = max(top_rank, r)
    packed = row.to(dtype)
    if not bool(torch.isfinite(packed).all()):
        raise AdapterLoadError(f"{where}: values beyond the range of the engine's {dtype} once scaled; the adapter "
                               "cannot be served by this engine")
    order = [m for m in engine_modules if m in adapted]
    return LoraAdapter(name, str(directory), adapter_id, top_rank, tuple(order), packed)
