"""Llama 2/3 (LlamaForCausalLM): RMSNorm, rotary (plain, linear or llama3 scaling), GQA, SwiGLU.

Mistral and Qwen2 are the same network with other config keys; their files reuse ``create``.
"""

from __future__ import annotations

from typing import Any

from kiln.contract import LoraModule, ModelConfig, TensorParallelMapping
from kiln.model_defs.hf_config import UnsupportedConfigError, require, rope_settings
from kiln.model_defs.layers import Attention, DecoderLayer, DecoderOnlyLM, GatedMLP, RMSNorm, rope_table
from kiln.model_defs.lora import LoraTarget, whole
from kiln.model_defs.weights import WeightSpec, identity_layout, parameter_shapes

ARCHITECTURES = ("LlamaForCausalLM",)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(f"hidden_act {hf['hidden_act']!r} is not supported; expected 'silu'")
    heads = require(hf, "num_attention_heads")
    theta, scaling = rope_settings(hf)
    return ModelConfig(
        architecture=hf["architectures"][0],
        vocab_size=require(hf, "vocab_size"),
        hidden_size=require(hf, "hidden_size"),
        intermediate_size=require(hf, "intermediate_size"),
        num_layers=require(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position_embeddings=require(hf, "max_position_embeddings"),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        attention_out_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


def create(cfg: ModelConfig, tp: TensorParallelMapping | None = None) -> DecoderOnlyLM:
    """The module (of one tensor-parallel rank when ``tp`` is given) with uninitialised weights (build under
    ``torch.device('meta')`` to get shapes)."""
    layers = [
        DecoderLayer(
            RMSNorm(cfg.hidden_size, cfg.norm_eps),
            Attention(cfg, i, use_rope=True, tp=tp),
            RMSNorm(cfg.hidden_size, cfg.norm_eps),
            GatedMLP(cfg, tp),
        )
        for i in range(cfg.num_layers)
    ]
    return DecoderOnlyLM(cfg, layers, RMSNorm(cfg.hidden_size, cfg.norm_eps), rope_table(cfg), tp=tp)


def hf_name(kiln_name: str) -> str:
    """Checkpoint name of a kiln parameter: the Hugging Face layout is ours under ``model.``."""
    return kiln_name if kiln_name.startswith("lm_head.") else "model." + kiln_name


def checkpoint_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    return identity_layout(parameter_shapes(create, cfg), hf_name)


def attention_lora_targets(cfg: ModelConfig) -> list[LoraTarget]:
    """The four attention projections, as PEFT names them (every family with Llama's attention names)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h)}
    return [whole(LoraModule(name, f"model.layers.{{layer}}.{name}", i, o), f"layers.{{layer}}.{name}")
            for name, (i, o) in shapes.items()]


def lora_targets(cfg: ModelConfig) -> list[LoraTarget]:
    """The attention projections and the gated MLP's three linears, as PEFT names them."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter), "mlp.down_proj": (inter, h)}
    return attention_lora_targets(cfg) + [
        whole(LoraModule(name, f"model.layers.{{layer}}.{name}", i, o), f"layers.{{layer}}.{name}")
        for name, (i, o) in shapes.items()]


# Old Llama checkpoints store the rotary frequencies; kiln computes them from the config.
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)
