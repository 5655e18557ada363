"""Shared fixtures: small random-weight Hugging Face checkpoints made with transformers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # tests run on 2 cores with 2 xdist workers
sys.path.insert(0, str(Path(__file__).parent))

from kiln.model_defs.synthetic import make_checkpoint  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "gpt2"]
# Per family: what makes its test checkpoint exercise the family's special features.
FAMILY_OVERRIDES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": dict(sliding_window=8),
    "qwen2": dict(tie_word_embeddings=True),
    "gpt2": dict(),
}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """checkpoint_dir(family, **overrides) -> path; cached per argument set for the session."""
    cache: dict[tuple, Path] = {}

    def make(family: str, shard_size: str | None = None, train_steps: int = 0, **overrides) -> Path:
        args = {**FAMILY_OVERRIDES[family], **overrides}
        key = (family, shard_size, train_steps, repr(sorted(args.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{family}")
            cache[key] = make_checkpoint(out, family, "tiny", shard_size=shard_size, train_steps=train_steps, **args)
        return cache[key]

    return make
