"""How checkpoint tensors become kiln parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class WeightSpec(NamedTuple):
    """One checkpoint tensor: the shape it must have and the kiln parameters it becomes."""

    shape: tuple[int, ...]
    convert: Callable[[torch.Tensor], dict[str, torch.Tensor]]


def identity_layout(kiln_shapes: dict[str, tuple[int, ...]], hf_name: Callable[[str], str]) -> dict[str, WeightSpec]:
    """Layout for families whose checkpoint names map one-to-one onto kiln's."""
    return {hf_name(n): WeightSpec(shape, lambda t, n=n: {n: t}) for n, shape in kiln_shapes.items()}


def parameter_shapes(create: Callable, cfg) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a family's parameters, from a module built on the meta device (no memory)."""
    with torch.device("meta"):
        module = create(cfg)
    return {name: tuple(p.shape) for name, p in module.named_parameters()}
