"""Gated and plain MLP activations: SiLU-and-mul (Llama family) and GELU (GPT-2).

CPU kernels: C++ (``plugins/csrc/plugin_ops.cpp``, ATen's vectorised silu/gelu called without
Python); the plain-torch implementations below are the fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.plugins.native import define_native_op

__all__ = ["silu_mul", "gelu", "silu_mul_reference", "gelu_reference"]


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_reference(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def _silu_mul_py(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu_mul_reference(gate, up)


def _gelu_py(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return gelu_reference(x, approximate)


_lib = torch.library.Library("kiln", "FRAGMENT")
define_native_op(_lib, "silu_mul", "(Tensor gate, Tensor up) -> Tensor", _silu_mul_py,
                 lambda gate, up: torch.empty_like(gate))
define_native_op(_lib, "gelu", "(Tensor x, str approximate) -> Tensor", _gelu_py,
                 lambda x, approximate: torch.empty_like(x))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the activation of a gated MLP (``torch.ops.kiln.silu_mul``)."""
    return torch.ops.kiln.silu_mul(gate, up)


def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU; approximate='tanh' is GPT-2's gelu_new (``torch.ops.kiln.gelu``)."""
    return torch.ops.kiln.gelu(x, approximate)
