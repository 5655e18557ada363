"""Rotary position embedding (rotate-half / NeoX layout, as in Llama, Mistral, Qwen2).

The cos/sin table is computed once at model build time from the model's rope settings
(plain, ``linear`` scaling, ``llama3`` frequency scaling or ``longrope``'s short factors and attention
factor) and looked up by absolute position, so chunked prefill and decode use the same positions as a full
forward. A partial rotary embedding (Phi-4-mini) rotates the first dims of each head: the model passes those.

CPU kernel: C++ (``plugins/csrc/plugin_ops.cpp``, fp32/bf16, int64 positions); the plain-torch
reference is the fallback.
"""

from __future__ import annotations

import math

import torch

from kiln.plugins.native import define_native_op

__all__ = ["rotary_embedding", "rotary_embedding_reference", "rope_inv_freq", "rope_attention_factor", "cos_sin_table"]


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for ``rot_dim`` rotated dims, with optional rope scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "longrope":   # the short factors (transformers uses them below original_max_position_embeddings)
        factors = torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu")
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope short_factor has {factors.numel()} entries, expected {inv_freq.numel()} "
                             f"(rotary dims / 2)")
        shape = torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim
        return 1.0 / (factors * theta**shape)
    raise ValueError(
        f"unsupported rope_scaling type {kind!r}: kiln supports 'default', 'linear', 'llama3' and 'longrope'"
    )


def rope_attention_factor(scaling: dict | None, max_positions: int) -> float:
    """The factor longrope multiplies cos and sin by: ``attention_factor``, else sqrt(1 + ln(s) / ln(original)) with
    s = max_positions / original_max_position_embeddings (1 when s <= 1); 1 for the other kinds."""
    if not scaling or scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def cos_sin_table(max_positions: int, inv_freq: torch.Tensor, attention_factor: float = 1.0) -> torch.Tensor:
    """[max_positions, rot_dim] table: cos in the first half, sin in the second (fp32), both times
    ``attention_factor`` (longrope's)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table * attention_factor if attention_factor != 1.0 else table


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, D/2]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_embedding_reference(
    q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    half = table.shape[-1] // 2
    rows = table[position_ids]
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


_lib = torch.library.Library("kiln", "FRAGMENT")
define_native_op(_lib, "rotary_embedding",
                 "(Tensor q, Tensor k, Tensor position_ids, Tensor table) -> (Tensor, Tensor)",
                 rotary_embedding_reference,
                 lambda q, k, position_ids, table: (torch.empty_like(q), torch.empty_like(k)))


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by the angles of their absolute positions."""
    return torch.ops.kiln.rotary_embedding(q, k, position_ids, table)
