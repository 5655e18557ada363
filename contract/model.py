"""ModelConfig: the architecture facts an engine is built from and the runtime sizes its KV pool by.

``kiln.model_defs`` maps a Hugging Face config.json onto it; the builder writes it as the ``model``
section of the engine's config.json; the runtime reads it back from there (never from model_defs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


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
    tie_word_embeddings: bool = False
    sliding_window: int = 0  # 0 = full attention; else each token attends to the last sliding_window positions
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "model") -> ModelConfig:
        """Checked: a missing, unknown or mistyped key raises EngineLoadError naming ``where.key``."""
        from kiln.contract.typed import read_dataclass

        return read_dataclass(cls, data, where)
