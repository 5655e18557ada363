"""Helpers to read Hugging Face config.json values the same way across transformers versions."""

from __future__ import annotations

from typing import Any

from kiln.contract import LAYER_TYPES, CheckpointError

ROPE_TYPES = ("linear", "llama3")   # the rope scalings every rotary family takes (plus "default": none)


class UnsupportedConfigError(CheckpointError):
    """The checkpoint's config asks for a feature kiln does not implement."""


def rope_settings(hf: dict[str, Any], params: dict[str, Any] | None = None,
                  kinds: tuple[str, ...] = ROPE_TYPES) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers 5 ``rope_parameters`` or 4.x keys; ``params``: a
    rope_parameters dict to read instead (Gemma 3 keeps one per layer type); ``kinds``: the scaling types the
    family implements (another one is refused, naming it)."""
    params = params if params is not None else hf.get("rope_parameters")
    if params:
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf["rope_scaling"]) if hf.get("rope_scaling") else None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return theta, None
        if kind not in kinds:
            raise UnsupportedConfigError(
                f"rope scaling type {kind!r} is not supported for {hf['architectures'][0]}; kiln supports "
                f"{['default', *kinds]}"
            )
        scaling["rope_type"] = kind
        scaling.pop("type", None)
    return theta, scaling


def partial_rotary_factor(hf: dict[str, Any]) -> float:
    """The share of head_dim the rotary embedding turns (4.x top-level key or inside rope_parameters)."""
    params = hf.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)


def layer_types(hf: dict[str, Any], num_layers: int, default: list[str] | None = None) -> list[str]:
    """``layer_types`` of config.json (transformers 5 writes it), else ``default``; each checked."""
    types = hf.get("layer_types")
    if types is None:
        return list(default or [])
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise UnsupportedConfigError(
            f"layer_types {types!r:.200} must list one of {list(LAYER_TYPES)} for each of the {num_layers} layers")
    return list(types)


def refuse_if(hf: dict[str, Any], key: str, supported: Any, why: str) -> None:
    """Refuse a config.json whose ``key`` is set to something other than ``supported`` (None/absent pass)."""
    value = hf.get(key)
    if value is not None and value != supported:
        raise UnsupportedConfigError(f"{key}={value!r} is not supported: {why}")


def require(hf: dict[str, Any], key: str) -> Any:
    if key not in hf or hf[key] is None:
        raise UnsupportedConfigError(f"config.json has no {key!r}, which this architecture needs")
    return hf[key]
