"""Gemma 2 (Gemma2ForCausalLM): embeddings scaled by sqrt(hidden), RMSNorm with (1 + w) applied in fp32, a norm
before and after both the attention and the MLP ("sandwich" blocks), GeGLU (tanh GELU), the softmax scale
``query_pre_attn_scalar ** -0.5``, attention-logit and final-logit soft-capping, and alternating sliding-window /
full-attention layers (``layer_types``).

Gemma 3 (text) is the same network with q/k norms, a rotary base of its own on the sliding layers and no
attention-logit soft-capping; :mod:`kiln.model_defs.gemma3` reuses this module's pieces.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.contract import ModelConfig, TensorParallelMapping
from kiln.model_defs import llama
from kiln.model_defs.hf_config import UnsupportedConfigError, layer_types, refuse_if, require, rope_settings
from kiln.model_defs.layers import Attention, DecoderOnlyLM, GatedMLP, StepInputs, rope_table
from kiln.model_defs.weights import WeightSpec, identity_layout, parameter_shapes

ARCHITECTURES = ("Gemma2ForCausalLM",)
IGNORED_HF_SUFFIXES = llama.IGNORED_HF_SUFFIXES
lora_targets = llama.lora_targets   # Llama's module names (the GeGLU MLP is gate/up/down too)
ACTIVATIONS = ("gelu_pytorch_tanh",)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``(x * rsqrt(mean(x^2) + eps) * (1 + w))`` in fp32, then cast (Llama casts before the
    scale); the checkpoint stores w (zero-centred). Plain torch ops: a compiling backend fuses them."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class SandwichDecoderLayer(nn.Module):
    """x + post_attention_norm(attn(input_norm(x))), then x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))."""

    def __init__(self, cfg: ModelConfig, self_attn: Attention, mlp: nn.Module):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, step: StepInputs, rope_table: torch.Tensor | None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), step, rope_table))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def base_config(hf: dict[str, Any], sliding_pattern: int) -> ModelConfig:
    """What Gemma 2 and 3 read alike. ``sliding_pattern``: without ``layer_types`` in config.json (transformers 4
    files), layer i slides unless (i + 1) is a multiple of it (transformers' default)."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise UnsupportedConfigError(f"hidden_activation {act!r} is not supported; expected one of {list(ACTIVATIONS)}")
    refuse_if(hf, "use_bidirectional_attention", False, "kiln's attention is causal (set it to false or remove it)")
    heads = require(hf, "num_attention_heads")
    n = require(hf, "num_hidden_layers")
    head_dim = int(hf.get("head_dim") or 256)   # transformers' default
    window = int(hf.get("sliding_window") or 0)
    types = layer_types(hf, n, [("sliding_attention" if (i + 1) % sliding_pattern else "full_attention")
                                for i in range(n)])
    if "sliding_attention" not in types:
        types, window = [], 0
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        architecture=hf["architectures"][0],
        vocab_size=require(hf, "vocab_size"),
        hidden_size=require(hf, "hidden_size"),
        intermediate_size=require(hf, "intermediate_size"),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=require(hf, "max_position_embeddings"),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sliding_window=window,
        layer_types=types,
        attention_bias=bias,
        attention_out_bias=bias,
        hidden_act=act,
        attention_scale=float(hf.get("query_pre_attn_scalar") or 256) ** -0.5,
        final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0),
    )


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    cfg = base_config(hf, sliding_pattern=2)
    cfg.rope_theta, cfg.rope_scaling = rope_settings(hf)
    cfg.attn_logit_softcapping = float(hf.get("attn_logit_softcapping") or 0.0)
    return cfg


def create(cfg: ModelConfig, tp: TensorParallelMapping | None = None, qk_norm: bool = False) -> DecoderOnlyLM:
    """Gemma 2's module; ``qk_norm``: Gemma 3's per-head q/k norms (Gemma's RMSNorm over head_dim)."""
    norm = (lambda d: GemmaRMSNorm(d, cfg.norm_eps)) if qk_norm else None
    layers = [SandwichDecoderLayer(cfg, Attention(cfg, i, use_rope=True, tp=tp, qk_norm=norm), GatedMLP(cfg, tp))
              for i in range(cfg.num_layers)]
    local = rope_table(cfg, cfg.local_rope_theta, cfg.local_rope_scaling) if cfg.local_rope_theta > 0 else None
    return DecoderOnlyLM(cfg, layers, GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps), rope_table(cfg), tp=tp,
                         local_rope_table=local, embed_scale=cfg.hidden_size**0.5)


def checkpoint_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    return identity_layout(parameter_shapes(create, cfg), llama.hf_name)
