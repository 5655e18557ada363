"""Phi-3 (Phi3ForCausalLM; Phi-3.5-mini and Phi-4-mini use it too): Llama's network with fused projections in the
checkpoint, a sliding window on every layer when config.json sets one, a partial rotary embedding
(``partial_rotary_factor``) and LongRoPE (``rope_scaling`` type longrope, formerly su).

The checkpoint's ``qkv_proj`` is split into q/k/v and ``gate_up_proj`` into gate/up here (as GPT-2's ``c_attn``), so
Phi-3 shares kiln's layers, tensor-parallel split and weight-only quantization; the builder's merge passes fuse
them back into one GEMM each.

LongRoPE: transformers turns positions with the short factors while the sequence is at most
``original_max_position_embeddings`` long and switches every position of a longer one to the long factors
(rotating the cached keys of a sequence that grows past it with other factors than its new ones). kiln builds
the short-factor table, times the attention factor: exact up to that length, so the builder refuses a
``max_seq_len`` beyond it (:meth:`kiln.builder.BuildConfig.check_model`).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.contract import LoraModule, ModelConfig
from kiln.model_defs import llama
from kiln.model_defs.hf_config import UnsupportedConfigError, partial_rotary_factor, require, rope_settings
from kiln.model_defs.lora import LoraTarget, whole
from kiln.model_defs.weights import WeightSpec, parameter_shapes

ARCHITECTURES = ("Phi3ForCausalLM",)
IGNORED_HF_SUFFIXES = llama.IGNORED_HF_SUFFIXES
create = llama.create


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf = dict(hf)
    params = hf.get("rope_parameters") or hf.get("rope_scaling")
    if params and params.get("rope_type", params.get("type")) in ("su", "yarn"):   # transformers reads both as longrope
        key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        hf[key] = {**{k: v for k, v in params.items() if k != "type"}, "rope_type": "longrope"}
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}   # read below
    cfg = llama.config_from_hf({**plain, "attention_bias": False, "mlp_bias": False})   # Phi-3 has no biases
    cfg.rope_theta, cfg.rope_scaling = rope_settings(hf, kinds=("longrope",))
    if cfg.rope_scaling is not None:
        scaling = cfg.rope_scaling
        if "original_max_position_embeddings" not in scaling:
            scaling["original_max_position_embeddings"] = require(hf, "original_max_position_embeddings")
        for key in ("short_factor", "long_factor"):
            if not isinstance(scaling.get(key), list):
                raise UnsupportedConfigError(f"rope_scaling longrope needs a {key!r} list")
        scaling.pop("partial_rotary_factor", None)
    factor = partial_rotary_factor(hf)
    rot = int(cfg.head_dim * factor)
    if not 0 < rot <= cfg.head_dim or rot % 2:
        raise UnsupportedConfigError(f"partial_rotary_factor={factor} gives {rot} rotary dims of head_dim "
                                     f"{cfg.head_dim}; kiln needs an even number between 2 and head_dim")
    cfg.rotary_dim = 0 if rot == cfg.head_dim else rot
    cfg.sliding_window = int(hf.get("sliding_window") or 0)   # transformers applies it to every layer
    return cfg


def checkpoint_layout(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Llama's names under ``model.``, except the fused tensors: ``qkv_proj`` [q; k; v] rows and ``gate_up_proj``
    [gate; up] rows, split into kiln's separate projections."""
    shapes = parameter_shapes(create, cfg)
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d

    def split(prefix: str, names: tuple[str, ...], sizes: list[int]):
        def convert(t: torch.Tensor) -> dict[str, torch.Tensor]:
            return {f"{prefix}.{n}.weight": p.contiguous() for n, p in zip(names, t.split(sizes, dim=0))}
        return convert

    layout = {}
    for name, shape in shapes.items():
        module, _, _ = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        if leaf in ("k_proj", "v_proj", "up_proj"):
            continue   # parts of a fused tensor
        if leaf == "q_proj":
            layout[llama.hf_name(f"{prefix}.qkv_proj.weight")] = WeightSpec(
                (q + 2 * kv, h), split(prefix, ("q_proj", "k_proj", "v_proj"), [q, kv, kv]))
        elif leaf == "gate_proj":
            layout[llama.hf_name(f"{prefix}.gate_up_proj.weight")] = WeightSpec(
                (2 * inter, h), split(prefix, ("gate_proj", "up_proj"), [inter, inter]))
        else:
            layout[llama.hf_name(name)] = WeightSpec(shape, lambda t, n=name: {n: t})
    return layout


def lora_targets(cfg: ModelConfig) -> list[LoraTarget]:
    """PEFT's names for Phi-3's modules. The fused ``qkv_proj`` and ``gate_up_proj`` are computed by kiln's split
    linears: each takes its rows of the adapter's B (as GPT-2's ``c_attn``)."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attn, mlp = "model.layers.{layer}.self_attn", "model.layers.{layer}.mlp"
    qkv = LoraModule("self_attn.qkv_proj", f"{attn}.qkv_proj", h, q + 2 * kv)
    gate_up = LoraModule("mlp.gate_up_proj", f"{mlp}.gate_up_proj", h, 2 * inter)
    return [
        LoraTarget(qkv, (("layers.{layer}.self_attn.q_proj", 0, q), ("layers.{layer}.self_attn.k_proj", q, q + kv),
                         ("layers.{layer}.self_attn.v_proj", q + kv, q + 2 * kv))),
        whole(LoraModule("self_attn.o_proj", f"{attn}.o_proj", q, h), "layers.{layer}.self_attn.o_proj"),
        LoraTarget(gate_up, (("layers.{layer}.mlp.gate_proj", 0, inter),
                             ("layers.{layer}.mlp.up_proj", inter, 2 * inter))),
        whole(LoraModule("mlp.down_proj", f"{mlp}.down_proj", inter, h), "layers.{layer}.mlp.down_proj"),
    ]

def build_problems(cfg: ModelConfig, max_seq_len: int) -> list[str]:
    """What an engine of ``max_seq_len`` positions cannot do exactly with this config (the builder asks)."""
    scaling = cfg.rope_scaling or {}
    original = scaling.get("original_max_position_embeddings")
    if scaling.get("rope_type") == "longrope" and max_seq_len > original:
        return [f"max_seq_len={max_seq_len} > rope_scaling longrope's original_max_position_embeddings={original}: "
                "kiln turns positions with the short factors only, which transformers uses while a sequence is at "
                f"most {original} tokens (beyond, it switches the whole sequence to the long factors); build with "
                f"max_seq_len <= {original}"]
    return []

