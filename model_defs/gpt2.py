"""GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm, GELU-tanh MLP, Conv1D ([in, out]) weights.

The checkpoint's fused ``c_attn`` is split into q/k/v here so GPT-2 shares kiln's attention
layer; the builder's QKV-merge pass fuses them back into one GEMM.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.contract import LoraModule, ModelConfig, TensorParallelMapping
from kiln.model_defs.hf_config import UnsupportedConfigError, require
from kiln.model_defs.layers import Attention, DecoderLayer, DecoderOnlyLM, GeluMLP, LayerNorm
from kiln.model_defs.lora import LoraTarget, whole
from kiln.model_defs.weights import WeightSpec

ARCHITECTURES = ("GPT2LMHeadModel",)
_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
# Buffers old GPT-2 checkpoints carry (causal mask tables ``h.N.attn.bias``); they hold no weights.
# The leading dot matters: ``h.N.attn.c_attn.bias`` is a real weight and must not match.
IGNORED_HF_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise UnsupportedConfigError(f"activation_function {act!r} is not supported; "
                                     f"expected one of {sorted(_ACTIVATIONS)}")
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise UnsupportedConfigError("scale_attn_by_inverse_layer_idx=true is not supported")
    if not hf.get("scale_attn_weights", True):
        raise UnsupportedConfigError("scale_attn_weights=false (unscaled attention scores) is not supported")
    hidden, heads = require(hf, "n_embd"), require(hf, "n_head")
    return ModelConfig(
        architecture="GPT2LMHeadModel",
        vocab_size=require(hf, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        num_layers=require(hf, "n_layer"),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=require(hf, "n_positions"),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),  # GPT-2 ties unless told otherwise
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        hidden_act=act,
    )


def create(cfg: ModelConfig, tp: TensorParallelMapping | None = None) -> DecoderOnlyLM:
    approximate = _ACTIVATIONS[cfg.hidden_act]
    layers = [
        DecoderLayer(
            LayerNorm(cfg.hidden_size, eps=cfg.norm_eps),
            Attention(cfg, i, use_rope=False, tp=tp),
            LayerNorm(cfg.hidden_size, eps=cfg.norm_eps),
            GeluMLP(cfg, approximate, tp),
        )
        for i in range(cfg.num_layers)
    ]
    return DecoderOnlyLM(cfg, layers, LayerNorm(cfg.hidden_size, eps=cfg.norm_eps), None, learned_positions=True,
                         tp=tp)


def lora_targets(cfg: ModelConfig) -> list[LoraTarget]:
    """PEFT's names for GPT-2's Conv1D modules (``c_proj`` matches both the attention's and the MLP's). The
    fused ``c_attn`` is computed by kiln's q/k/v linears: each takes its third of the adapter's B."""
    h, inner = cfg.hidden_size, cfg.intermediate_size
    c_attn = LoraModule("attn.c_attn", "transformer.h.{layer}.attn.c_attn", h, 3 * h)
    qkv = tuple((f"layers.{{layer}}.self_attn.{p}_proj", i * h, (i + 1) * h) for i, p in enumerate("qkv"))
    return [
        LoraTarget(c_attn, qkv),
        whole(LoraModule("attn.c_proj", "transformer.h.{layer}.attn.c_proj", h, h), "layers.{layer}.self_attn.o_proj"),
        whole(LoraModule("mlp.c_fc", "transformer.h.{layer}.mlp.c_fc", h, inner), "layers.{layer}.mlp.fc_in"),
        whole(LoraModule("mlp.c_proj", "transformer.h.{layer}.mlp.c_proj", inner, h), "layers.{layer}.mlp.fc_out"),
    ]


def normalize_hf_name(name: str) -> str:
    """Checkpoints come with or without the ``transformer.`` prefix (the original GPT-2 files lack it)."""
    return name.removeprefix("transformer.")


def checkpoint_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Checkpoint tensor (normalized name) -> its shape and how it becomes kiln parameters."""
    h, inner = cfg.hidden_size, cfg.intermediate_size

    def same(kiln: str):
        return lambda t: {kiln: t}

    def conv1d(kiln: str):  # Conv1D stores [in, out]; nn.Linear wants [out, in]
        return lambda t: {kiln: t.t().contiguous()}

    def split_qkv(prefix: str, suffix: str):
        def convert(t: torch.Tensor) -> dict[str, torch.Tensor]:
            parts = t.split(h, dim=-1)
            if suffix == "weight":
                parts = [p.t().contiguous() for p in parts]
            return {f"{prefix}.{name}.{suffix}": p for name, p in zip(("q_proj", "k_proj", "v_proj"), parts)}

        return convert

    layout = {
        "wte.weight": WeightSpec((cfg.vocab_size, h), same("embed_tokens.weight")),
        "wpe.weight": WeightSpec((cfg.max_position_embeddings, h), same("embed_positions.weight")),
        "ln_f.weight": WeightSpec((h,), same("norm.weight")),
        "ln_f.bias": WeightSpec((h,), same("norm.bias")),
    }
    if not cfg.tie_word_embeddings:
        layout["lm_head.weight"] = WeightSpec((cfg.vocab_size, h), same("lm_head.weight"))
    for i in range(cfg.num_layers):
        src, dst = f"h.{i}", f"layers.{i}"
        for ln, kiln_ln in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            layout[f"{src}.{ln}.weight"] = WeightSpec((h,), same(f"{dst}.{kiln_ln}.weight"))
            layout[f"{src}.{ln}.bias"] = WeightSpec((h,), same(f"{dst}.{kiln_ln}.bias"))
        layout[f"{src}.attn.c_attn.weight"] = WeightSpec((h, 3 * h), split_qkv(f"{dst}.self_attn", "weight"))
        layout[f"{src}.attn.c_attn.bias"] = WeightSpec((3 * h,), split_qkv(f"{dst}.self_attn", "bias"))
        layout[f"{src}.attn.c_proj.weight"] = WeightSpec((h, h), conv1d(f"{dst}.self_attn.o_proj.weight"))
        layout[f"{src}.attn.c_proj.bias"] = WeightSpec((h,), same(f"{dst}.self_attn.o_proj.bias"))
        layout[f"{src}.mlp.c_fc.weight"] = WeightSpec((h, inner), conv1d(f"{dst}.mlp.fc_in.weight"))
        layout[f"{src}.mlp.c_fc.bias"] = WeightSpec((inner,), same(f"{dst}.mlp.fc_in.bias"))
        layout[f"{src}.mlp.c_proj.weight"] = WeightSpec((inner, h), conv1d(f"{dst}.mlp.fc_out.weight"))
        layout[f"{src}.mlp.c_proj.bias"] = WeightSpec((h,), same(f"{dst}.mlp.fc_out.bias"))
    return layout
