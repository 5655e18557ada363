"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block.

``fused_add_rms_norm(x, residual, w)`` returns ``(rms_norm(x + residual), x + residual)`` so a
decoder layer reads its activations once instead of twice.

CPU kernels: C++ (``plugins/csrc/plugin_ops.cpp``, fp32/bf16, in the native library, see
:mod:`kiln.plugins.native`); other cases and ``KILN_DISABLE_NATIVE_KERNELS=1`` run the plain-torch
implementations below.
"""

from __future__ import annotations

import torch

from kiln.plugins.native import define_native_op

__all__ = ["rms_norm", "fused_add_rms_norm", "rms_norm_reference", "fused_add_rms_norm_reference"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's definition: normalise in fp32, cast back, then scale."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in plain torch."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


_lib = torch.library.Library("kiln", "FRAGMENT")
define_native_op(_lib, "rms_norm", "(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm_reference,
                 lambda x, weight, eps: torch.empty_like(x))
define_native_op(_lib, "fused_add_rms_norm",
                 "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
                 fused_add_rms_norm_reference,
                 lambda x, residual, weight, eps: (torch.empty_like(x), torch.empty_like(x)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.ops.kiln.rms_norm``."""
    return torch.ops.kiln.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.kiln.fused_add_rms_norm``: ``(rms_norm(x + residual), x + residual)``."""
    return torch.ops.kiln.fused_add_rms_norm(x, residual, weight, eps)
