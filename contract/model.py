"""ModelConfig: the architecture facts an engine is built from and the runtime sizes its KV pool by.

``kiln.model_defs`` maps a Hugging Face config.json onto it; the builder writes it as the ``model``
section of the engine's config.json; the runtime reads it back from there (never from model_defs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelConfig:
    """One record for every supported family; fields a family does not use keep their defaults."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rotary_dim: int = 0      # dims of each head the rotary embedding turns (the first ones); 0 = head_dim
    tie_word_embeddings: bool = False
    sliding_window: int = 0  # 0 = full attention; else each token attends to the last sliding_window positions
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # Per-layer attention (Qwen3, Gemma 2/3): empty = every layer alike (sliding_window, if any, applies to all);
    # else one of LAYER_TYPES per layer, and sliding_window applies to the "sliding_attention" ones only.
    layer_types: list[str] = field(default_factory=list)
    attention_scale: float | None = None     # softmax scale of q.k; None = head_dim ** -0.5 (Gemma: its own)
    attn_logit_softcapping: float = 0.0      # 0 = off; else scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float = 0.0     # 0 = off; else logits -> cap * tanh(logits / cap) (Gemma 2/3)
    local_rope_theta: float = 0.0            # > 0: the sliding layers' own rotary base (Gemma 3) ...
    local_rope_scaling: dict[str, Any] | None = None  # ... and scaling; the full layers use rope_theta/rope_scaling
    # Mixture of experts (Mixtral, Qwen3-MoE): the MLP of each layer in moe_layers routes every token to
    # num_experts_per_tok of num_experts gated MLPs of width moe_intermediate_size (the other layers' MLP is
    # intermediate_size wide); norm_topk_prob renormalizes the chosen experts' router probabilities to sum to 1.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: list[int] = field(default_factory=list)
    norm_topk_prob: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def window_of(self, layer: int) -> int:
        """The sliding window of ``layer`` (0: full attention)."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    @property
    def kv_window(self) -> int:
        """The window every layer attends within (0: some layer attends to the whole sequence): KV blocks wholly
        before it are needed by no layer (the runtime releases them)."""
        windows = {self.window_of(i) for i in range(self.num_layers)}
        return 0 if 0 in windows else min(windows)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "model") -> ModelConfig:
        """Checked: a missing, unknown or mistyped key raises EngineLoadError naming ``where.key``."""
        from kiln.contract.typed import read_dataclass

        return read_dataclass(cls, data, where)
