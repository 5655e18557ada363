"""kiln.model_defs: model families read from Hugging Face checkpoints, in packed-token form."""

from kiln.contract import CheckpointError, ModelConfig
from kiln.model_defs.checkpoint import (
    DTYPES,
    FAMILIES,
    build_model,
    build_problems,
    checkpoint_quantization,
    load_checkpoint,
    load_config,
    load_model,
    parameter_counts,
)
from kiln.model_defs.lora import LoraTarget, lora_targets, select_targets
from kiln.model_defs.tensor_parallel import shard_weights

__all__ = [
    "CheckpointError", "DTYPES", "FAMILIES", "LoraTarget", "ModelConfig",
    "build_model", "build_problems", "checkpoint_quantization", "load_checkpoint", "load_config", "load_model",
    "lora_targets", "parameter_counts", "select_targets", "shard_weights",
]
