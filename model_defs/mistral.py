"""Mistral (MistralForCausalLM): Llama's network plus an optional sliding attention window."""

from __future__ import annotations

from typing import Any

from kiln.contract import ModelConfig
from kiln.model_defs import llama

ARCHITECTURES = ("MistralForCausalLM",)
create = llama.create
checkpoint_layout = llama.checkpoint_layout
lora_targets = llama.lora_targets
IGNORED_HF_SUFFIXES = llama.IGNORED_HF_SUFFIXES


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    cfg = llama.config_from_hf(hf)
    cfg.sliding_window = int(hf.get("sliding_window") or 0)
    return cfg
