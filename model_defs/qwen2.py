"""Qwen2 (Qwen2ForCausalLM): Llama's network with biased q/k/v projections; tied or untied embeddings."""

from __future__ import annotations

from typing import Any

from kiln.contract import ModelConfig
from kiln.model_defs import llama
from kiln.model_defs.hf_config import UnsupportedConfigError

ARCHITECTURES = ("Qwen2ForCausalLM",)
create = llama.create
checkpoint_layout = llama.checkpoint_layout
lora_targets = llama.lora_targets
IGNORED_HF_SUFFIXES = llama.IGNORED_HF_SUFFIXES


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("use_sliding_window"):
        raise UnsupportedConfigError(
            "Qwen2 with use_sliding_window=true (per-layer windows) is not supported; "
            "released Qwen2 checkpoints set it to false"
        )
    cfg = llama.config_from_hf({**hf, "attention_bias": False})
    cfg.attention_bias = True  # q/k/v carry a bias, o_proj does not
    cfg.attention_out_bias = False
    return cfg
