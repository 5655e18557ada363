"""kiln.model_defs: model families read from Hugging Face checkpoints, in packed-token form."""

from kiln.model_defs.checkpoint import (
    DTYPES,
    FAMILIES,
    CheckpointError,
    build_model,
    load_checkpoint,
    load_config,
    load_model,
)
from kiln.model_defs.config import ModelConfig
from kiln.model_defs.layers import INPUT_NAMES

__all__ = [
    "CheckpointError", "DTYPES", "FAMILIES", "INPUT_NAMES", "ModelConfig",
    "build_model", "load_checkpoint", "load_config", "load_model",
]
