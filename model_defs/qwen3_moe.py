"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k norms) with many small experts: the layers in
``moe_layers`` (every ``decoder_sparse_step``-th, minus ``mlp_only_layers``) route each token to
``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of width ``moe_intermediate_size`` (top-k of the router's
softmax, renormalized when ``norm_topk_prob``); the others keep a dense MLP of ``intermediate_size``."""

from __future__ import annotations

from typing import Any

from kiln.contract import ModelConfig, TensorParallelMapping
from kiln.model_defs import llama, qwen3
from kiln.model_defs.hf_config import UnsupportedConfigError, require
from kiln.model_defs.layers import DecoderLayer, DecoderOnlyLM, RMSNorm, mlp_of, rope_table
from kiln.model_defs.moe_layout import expert_specs
from kiln.model_defs.weights import WeightSpec, parameter_shapes

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
IGNORED_HF_SUFFIXES = llama.IGNORED_HF_SUFFIXES
# Attention only: the experts are one fused tensor per projection in transformers 5 (PEFT adapts them through
# target_parameters, not modules) and kiln::moe computes them, so the MLP takes no adapters.
lora_targets = llama.attention_lora_targets


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Qwen3's keys (the window, with use_sliding_window, applies to every layer, as in transformers) and the
    experts: ``num_experts`` (transformers 5 saves it as ``num_local_experts``)."""
    cfg = qwen3.config_from_hf({k: v for k, v in hf.items() if k not in ("layer_types", "max_window_layers")})
    cfg.sliding_window = int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0
    cfg.layer_types = []
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise UnsupportedConfigError("config.json has no 'num_experts', which Qwen3MoeForCausalLM needs")
    cfg.num_experts = int(experts)
    cfg.num_experts_per_tok = int(require(hf, "num_experts_per_tok"))
    cfg.moe_intermediate_size = int(require(hf, "moe_intermediate_size"))
    cfg.norm_topk_prob = bool(hf.get("norm_topk_prob", False))
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    if not dense <= set(range(cfg.num_layers)):
        raise UnsupportedConfigError(f"mlp_only_layers {sorted(dense)} names layers the model does not have "
                                     f"(it has {cfg.num_layers})")
    cfg.moe_layers = [i for i in range(cfg.num_layers)
                      if cfg.num_experts > 0 and i not in dense and (i + 1) % step == 0]
    if cfg.num_experts and not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise UnsupportedConfigError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be between 1 and "
                                     f"num_experts={cfg.num_experts}")
    return cfg


def create(cfg: ModelConfig, tp: TensorParallelMapping | None = None) -> DecoderOnlyLM:
    layers = [DecoderLayer(RMSNorm(cfg.hidden_size, cfg.norm_eps), qwen3.attention(cfg, i, tp),
                           RMSNorm(cfg.hidden_size, cfg.norm_eps), mlp_of(cfg, i, tp))
              for i in range(cfg.num_layers)]
    return DecoderOnlyLM(cfg, layers, RMSNorm(cfg.hidden_size, cfg.norm_eps), rope_table(cfg), tp=tp)


def checkpoint_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Llama's names under ``model.``; an MoE layer's router ``mlp.gate`` and per-expert
    ``mlp.experts.E.{gate,up,down}_proj``."""
    layout = {llama.hf_name(name): WeightSpec(shape, lambda t, n=name: {n: t})
              for name, shape in parameter_shapes(create, cfg).items() if ".mlp.experts." not in name}
    for i in cfg.moe_layers:
        layout.update(expert_specs(cfg, i, f"model.layers.{i}.mlp.experts", ("gate_proj", "up_proj", "down_proj")))
    return layout
