"""Gemma 3, text only (Gemma3ForCausalLM): Gemma 2's network (:mod:`kiln.model_defs.gemma2`) with RMSNorms (1 + w)
over head_dim on each query and key head before the rotary embedding, and a rotary base of its own on the
sliding-window layers (``rope_parameters.sliding_attention``; transformers 4: ``rope_local_base_freq``), the full
layers keeping ``rope_theta`` and ``rope_scaling``. Five sliding layers to one full layer by default.

The multimodal checkpoints (Gemma3ForConditionalGeneration) are another architecture, refused by name.
"""

from __future__ import annotations

from typing import Any

from kiln.contract import ModelConfig, TensorParallelMapping
from kiln.model_defs import gemma2
from kiln.model_defs.hf_config import UnsupportedConfigError, refuse_if, rope_settings
from kiln.model_defs.layers import DecoderOnlyLM
from kiln.model_defs.weights import WeightSpec, identity_layout, parameter_shapes

ARCHITECTURES = ("Gemma3ForCausalLM",)
IGNORED_HF_SUFFIXES = gemma2.IGNORED_HF_SUFFIXES
lora_targets = gemma2.lora_targets
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0   # transformers' defaults


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    cfg = gemma2.base_config(hf, sliding_pattern=int(hf.get("sliding_window_pattern")
                                                   or hf.get("_sliding_window_pattern") or 6))
    refuse_if(hf, "attn_logit_softcapping", None,
              "transformers' Gemma 3 does not apply it (remove it or set it to null)")
    params = hf.get("rope_parameters")
    if params and ("full_attention" in params or "sliding_attention" in params):   # transformers 5: per layer type
        full = {"rope_theta": GLOBAL_THETA, **(params.get("full_attention") or {})}
        local = {"rope_theta": LOCAL_THETA, **(params.get("sliding_attention") or {})}
    elif params:
        raise UnsupportedConfigError("rope_parameters must hold 'full_attention' and 'sliding_attention' entries "
                                     f"for Gemma 3, got keys {sorted(params)}")
    else:   # transformers 4: rope_theta / rope_scaling for the full layers, rope_local_base_freq for the sliding ones
        full = {"rope_theta": hf.get("rope_theta", GLOBAL_THETA), **(hf.get("rope_scaling") or {})}
        local = {"rope_theta": hf.get("rope_local_base_freq", LOCAL_THETA)}
    cfg.rope_theta, cfg.rope_scaling = rope_settings(hf, full)
    cfg.local_rope_theta, cfg.local_rope_scaling = rope_settings(hf, local)
    return cfg


def create(cfg: ModelConfig, tp: TensorParallelMapping | None = None) -> DecoderOnlyLM:
    return gemma2.create(cfg, tp, qk_norm=True)


def checkpoint_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    return identity_layout(parameter_shapes(create, cfg), gemma2.llama.hf_name)
