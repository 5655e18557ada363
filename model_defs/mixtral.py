"""Mixtral (MixtralForCausalLM): Mistral's attention with a sparse MoE MLP in every layer: ``num_local_experts``
SwiGLU experts of width ``intermediate_size``, each token routed to ``num_experts_per_tok`` of them (softmax over
the router logits, top-k, renormalized to sum to 1) through ``kiln::moe``."""

from __future__ import annotations

from typing import Any

from kiln.contract import ModelConfig, TensorParallelMapping
from kiln.model_defs import llama, mistral
from kiln.model_defs.hf_config import require
from kiln.model_defs.layers import Attention, DecoderLayer, DecoderOnlyLM, RMSNorm, mlp_of, rope_table
from kiln.model_defs.moe_layout import expert_specs
from kiln.model_defs.weights import WeightSpec, parameter_shapes

ARCHITECTURES = ("MixtralForCausalLM",)
IGNORED_HF_SUFFIXES = llama.IGNORED_HF_SUFFIXES
# Attention only: the experts are one fused tensor per projection in transformers 5 (PEFT adapts them through
# target_parameters, not modules) and kiln::moe computes them, so the MLP takes no adapters.
lora_targets = llama.attention_lora_targets


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    cfg = mistral.config_from_hf(hf)
    cfg.num_experts = int(require(hf, "num_local_experts"))
    cfg.num_experts_per_tok = int(require(hf, "num_experts_per_tok"))
    cfg.moe_intermediate_size = cfg.intermediate_size
    cfg.moe_layers = list(range(cfg.num_layers))
    cfg.norm_topk_prob = True   # Mixtral's router always renormalizes its top-k
    return cfg


def create(cfg: ModelConfig, tp: TensorParallelMapping | None = None) -> DecoderOnlyLM:
    layers = [DecoderLayer(RMSNorm(cfg.hidden_size, cfg.norm_eps), Attention(cfg, i, use_rope=True, tp=tp),
                           RMSNorm(cfg.hidden_size, cfg.norm_eps), mlp_of(cfg, i, tp))
              for i in range(cfg.num_layers)]
    return DecoderOnlyLM(cfg, layers, RMSNorm(cfg.hidden_size, cfg.norm_eps), rope_table(cfg), tp=tp)


def checkpoint_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Llama's names under ``model.``; the MLP under ``block_sparse_moe``: ``gate`` (the router) and per-expert
    ``experts.E.w1`` (gate), ``w3`` (up), ``w2`` (down)."""
    layout = {}
    for name, shape in parameter_shapes(create, cfg).items():
        if ".mlp.experts." in name:
            continue
        hf = llama.hf_name(name.replace(".mlp.gate.", ".block_sparse_moe.gate."))
        layout[hf] = WeightSpec(shape, lambda t, n=name: {n: t})
    for i in cfg.moe_layers:
        layout.update(expert_specs(cfg, i, f"model.layers.{i}.block_sparse_moe.experts", ("w1", "w3", "w2")))
    return layout
