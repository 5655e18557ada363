"""Qwen3 (Qwen3ForCausalLM): Llama's network with an RMSNorm over head_dim on each query and key head before the
rotary embedding, an explicit head_dim, and optional sliding-window layers (``layer_types``).

Qwen3-MoE (``qwen3_moe``) shares the attention (:func:`attention`) and the config keys (:func:`config_from_hf`).
"""

from __future__ import annotations

from typing import Any

from kiln.contract import ModelConfig, TensorParallelMapping
from kiln.model_defs import llama
from kiln.model_defs.hf_config import layer_types
from kiln.model_defs.layers import Attention, DecoderLayer, DecoderOnlyLM, GatedMLP, RMSNorm, rope_table
from kiln.model_defs.weights import WeightSpec, identity_layout, parameter_shapes

ARCHITECTURES = ("Qwen3ForCausalLM",)
IGNORED_HF_SUFFIXES = llama.IGNORED_HF_SUFFIXES
lora_targets = llama.lora_targets   # Llama's module names and shapes (head_dim explicit)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Llama's keys, plus head_dim (transformers' default: 128), o_proj's bias (``attention_bias`` covers all four
    projections) and the sliding-window layers: with ``use_sliding_window``, the layers ``layer_types`` names
    sliding_attention (transformers 4 files: those from ``max_window_layers`` on) attend to the last
    ``sliding_window`` positions; without it every layer attends to all (as in transformers)."""
    cfg = llama.config_from_hf(hf)
    cfg.head_dim = int(hf.get("head_dim") or 128)
    n = cfg.num_layers
    window = int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0
    first = int(hf.get("max_window_layers", n))
    types = layer_types(hf, n, [("sliding_attention" if i >= first else "full_attention") for i in range(n)])
    if window and "sliding_attention" in types:
        cfg.sliding_window, cfg.layer_types = window, types
    return cfg


def attention(cfg: ModelConfig, i: int, tp: TensorParallelMapping | None) -> Attention:
    """Qwen3's attention: Llama's with q/k RMSNorms over head_dim (Llama's norm definition)."""
    return Attention(cfg, i, use_rope=True, tp=tp, qk_norm=lambda d: RMSNorm(d, cfg.norm_eps))


def create(cfg: ModelConfig, tp: TensorParallelMapping | None = None) -> DecoderOnlyLM:
    layers = [DecoderLayer(RMSNorm(cfg.hidden_size, cfg.norm_eps), attention(cfg, i, tp),
                           RMSNorm(cfg.hidden_size, cfg.norm_eps), GatedMLP(cfg, tp))
              for i in range(cfg.num_layers)]
    return DecoderOnlyLM(cfg, layers, RMSNorm(cfg.hidden_size, cfg.norm_eps), rope_table(cfg), tp=tp)


def checkpoint_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    return identity_layout(parameter_shapes(create, cfg), llama.hf_name)
