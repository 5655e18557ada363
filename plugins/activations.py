"""Gated and plain MLP activations: SiLU-and-mul (Llama family) and GELU (GPT-2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["silu_mul", "gelu", "silu_mul_reference", "gelu_reference"]


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_reference(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


@torch.library.custom_op("kiln::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the activation of a gated MLP."""
    return silu_mul_reference(gate, up)


@silu_mul.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("kiln::gelu", mutates_args=())
def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU; approximate='tanh' is GPT-2's gelu_new."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return gelu_reference(x, approximate)


@gelu.register_fake
def _(x, approximate):
    return torch.empty_like(x)
