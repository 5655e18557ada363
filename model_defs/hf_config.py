"""Helpers to read Hugging Face config.json values the same way across transformers versions."""

from __future__ import annotations

from typing import Any

from kiln.contract import CheckpointError


class UnsupportedConfigError(CheckpointError):
    """The checkpoint's config asks for a feature kiln does not implement."""


def rope_settings(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers 5 ``rope_parameters`` or 4.x keys."""
    params = hf.get("rope_parameters")
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
        if kind not in ("linear", "llama3"):
            raise UnsupportedConfigError(
                f"rope scaling type {kind!r} is not supported; kiln supports 'default', 'linear' and 'llama3'"
            )
        scaling["rope_type"] = kind
        scaling.pop("type", None)
    return theta, scaling


def require(hf: dict[str, Any], key: str) -> Any:
    if key not in hf or hf[key] is None:
        raise UnsupportedConfigError(f"config.json has no {key!r}, which this architecture needs")
    return hf[key]
