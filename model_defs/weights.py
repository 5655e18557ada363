"""How checkpoint tensors become kiln parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class Part(NamedTuple):
    """A block of a stacked kiln parameter (the experts of an MoE layer): the loader writes a checkpoint tensor
    ``t`` into rows ``start:start + len(t)`` of expert ``index`` of parameter ``name`` (whole shape ``shape``),
    allocated once, so no stack of copies is ever made."""

    name: str
    index: int
    start: int
    shape: tuple[int, ...]


class WeightSpec(NamedTuple):
    """One checkpoint tensor: the shape it must have and the kiln parameters (or parts of one) it becomes."""

    shape: tuple[int, ...]
    convert: Callable[[torch.Tensor], dict[str | Part, torch.Tensor]]


def identity_layout(kiln_shapes: dict[str, tuple[int, ...]], hf_name: Callable[[str], str]) -> dict[str, WeightSpec]:
    """Layout for families whose checkpoint names map one-to-one onto kiln's."""
    return {hf_name(n): WeightSpec(shape, lambda t, n=n: {n: t}) for n, shape in kiln_shapes.items()}


def parameter_shapes(create: Callable, cfg) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a family's parameters, from a module built on the meta device (no memory)."""
    with torch.device("meta"):
        module = create(cfg)
    return {name: tuple(p.shape) for name, p in module.named_parameters()}
