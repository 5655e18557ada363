"""Shared fixtures: small random-weight Hugging Face checkpoints made with transformers."""

from __future__ import annotations

import copy
import faulthandler
import warnings
from pathlib import Path

import pytest
import torch

from synthetic_checkpoints import make_checkpoint  # in scripts/ (pytest's pythonpath, pyproject.toml)

torch.set_num_threads(1)  # tests run on 2 cores with 2 xdist workers

# `make test-fast` (pytest -m fast): the modules that build no engine and run no end-to-end generation:
# scheduler, KV manager, sampler, configs, the contract, CLI options, detokenizer, checkpoint loading,
# the plugins against their references, chat templates, the benchmark's workloads and statistics. Under
# a minute on 2 cores; `make test` runs everything.
FAST_MODULES = {
    "test_scheduler", "test_kv_cache", "test_sampler", "test_builder_config", "test_contract", "test_clikit",
    "test_runtime_detokenizer", "test_checkpoint_errors", "test_request_validation", "test_plugins",
    "test_plugin_ops_native", "test_weight_only_linear", "test_native_library", "test_serving_chat_template",
    "test_bench_workload", "test_bench_stats", "test_panel_kernels", "test_docs", "test_structured_output",
    "test_tool_parsers", "test_prompt_bounds", "test_triton_protocol", "test_lora_op", "test_batch_lines",
    "test_family_configs", "test_moe", "test_kv_quant", "test_disagg_router",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in FAST_MODULES:
            item.add_marker(pytest.mark.fast)
    # the packaging tests (a minute of pip and compiling) run first, so that they overlap with the rest
    # instead of running alone at the end
    items.sort(key=lambda item: item.path.name != "test_packaging.py")


FAMILIES = ["llama", "mistral", "qwen2", "gpt2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"]
# Per family: what makes its test checkpoint exercise the family's special features.
FAMILY_OVERRIDES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": dict(sliding_window=8),
    "qwen2": dict(tie_word_embeddings=True),
    "gpt2": dict(),
    # layer 0 full attention, layer 1 a window of 8; untied head
    "qwen3": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, tie_word_embeddings=False),
    # layer 0 a window of 8, layer 1 full; soft-capping low enough to change the scores and logits; a softmax scale
    # that is not head_dim's. Untied: with Gemma's sqrt(hidden) embedding scale a random tied head predicts the
    # input token again and again (a degenerate reference); tying is the families' shared code
    "gemma2": dict(sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=5.0,
                   query_pre_attn_scalar=24, tie_word_embeddings=False),
    # the same layers, a linear-scaled rotary base on the full layer and the default one on the sliding layer;
    # final-logit soft-capping; untied head
    "gemma3": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=6.0,
                   query_pre_attn_scalar=20, tie_word_embeddings=False,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # fused qkv / gate_up in the checkpoint, a window of 8 on every layer, half of each head rotated, LongRoPE's
    # short factors and attention factor (2048 positions over an original 256)
    "phi3": dict(sliding_window=8, partial_rotary_factor=0.5, original_max_position_embeddings=256,
                 rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                               "long_factor": [2.0, 3.0, 5.0, 9.0]}),
    # 8 experts, top 2 renormalized, a window of 8 (synthetic_checkpoints' MoE preset)
    "mixtral": dict(sliding_window=8),
    # 16 small experts, top 4 not renormalized (norm_topk_prob false); layer 0 a dense MLP (mlp_only_layers)
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, mlp_only_layers=[0]),
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
            # a deep copy: transformers adds keys to a rope_scaling dict in place, which changed the key of the
            # next call, so the same checkpoint (and every engine of it) was made twice
            cache[key] = make_checkpoint(out, family, "tiny", shard_size=shard_size, train_steps=train_steps,
                                         **copy.deepcopy(args))
        return cache[key]

    return make


@pytest.fixture(scope="module")
def llama_engine(checkpoint_dir):
    """The tiny Llama checkpoint's engine (runtime_support.TEST_BUILD), built once per process."""
    from runtime_support import get_engine

    return get_engine(checkpoint_dir("llama"))


@pytest.fixture(scope="session")
def native():
    """The native kernel library, loaded (compiled on a cold cache) once; the tests that use this
    fixture fail loudly if it does not load."""
    from kiln.plugins import native as native_lib

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a compile failure warns: make it an error here
        ok = native_lib.native_kernels_available()
    assert ok, "native kernels did not build"
    return native_lib.library()


@pytest.fixture
def hang_watchdog():
    """For modules whose bugs show up as hangs (the step loop, collectives): after 240 s the worker exits with
    every thread's traceback instead of stalling the suite. Modules opt in with
    ``pytest.mark.usefixtures("hang_watchdog")``."""
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
