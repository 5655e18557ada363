"""config.json -> ModelConfig for each family, and the refusals: a config value kiln does not implement is
refused naming its key (never ignored). Configs are plain dicts in both transformers 4 and 5 spellings."""

from __future__ import annotations

import pytest

from kiln.model_defs import CheckpointError
from kiln.model_defs.checkpoint import family_of

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6)


def config(arch: str, **changes):
    hf = {**BASE, "architectures": [arch], **changes}
    return family_of(arch).config_from_hf({k: v for k, v in hf.items() if v is not None})


def refused(arch: str, *fragments: str, **changes) -> str:
    with pytest.raises(CheckpointError) as info:
        config(arch, **changes)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {info.value}"
    return str(info.value)


# ------------------------------------------------------------------------------------------------ Qwen3
def test_qwen3_head_dim_and_biases():
    c = config("Qwen3ForCausalLM", head_dim=32, attention_bias=True)
    assert (c.head_dim, c.attention_bias, c.attention_out_bias, c.layer_types, c.sliding_window) == (32, True, True,
                                                                                                     [], 0)
    assert config("Qwen3ForCausalLM").head_dim == 128   # transformers' default when config.json has none


def test_qwen3_sliding_layers_transformers4_and_5():
    v4 = config("Qwen3ForCausalLM", head_dim=16, use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert v4.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2 and v4.sliding_window == 32
    assert [v4.window_of(i) for i in range(4)] == [0, 0, 32, 32]
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    v5 = config("Qwen3ForCausalLM", head_dim=16, use_sliding_window=True, sliding_window=16, layer_types=types)
    assert v5.layer_types == types and [v5.window_of(i) for i in range(4)] == [16, 0, 16, 0]
    # as in transformers: without use_sliding_window every layer attends to all positions
    off = config("Qwen3ForCausalLM", head_dim=16, use_sliding_window=False, sliding_window=16, layer_types=types)
    assert off.layer_types == [] and off.sliding_window == 0


def test_qwen3_refusals():
    refused("Qwen3ForCausalLM", "layer_types", "full_attention", head_dim=16, use_sliding_window=True,
            sliding_window=8, layer_types=["chunked_attention"] * 4)
    refused("Qwen3ForCausalLM", "'yarn'", head_dim=16, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    refused("Qwen3ForCausalLM", "hidden_act", head_dim=16, hidden_act="gelu")


def test_kv_window_is_zero_when_any_layer_attends_to_all():
    """The runtime releases KV blocks before the window only when every layer attends within it."""
    mixed = config("Qwen3ForCausalLM", head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert mixed.kv_window == 0
    every = config("Qwen3ForCausalLM", head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert every.layer_types == ["sliding_attention"] * 4 and every.kv_window == 8
    assert config("MistralForCausalLM", sliding_window=16).kv_window == 16


# ------------------------------------------------------------------------------------------------ Gemma 2 / 3
GEMMA = dict(head_dim=16, sliding_window=32, query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh")


def test_gemma2_defaults_alternate_windows_and_cap():
    c = config("Gemma2ForCausalLM", **GEMMA, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    assert [c.window_of(i) for i in range(4)] == [32, 0, 32, 0]   # transformers' default: every other layer
    assert (c.attn_logit_softcapping, c.final_logit_softcapping, c.attention_scale) == (50.0, 30.0, 0.25)
    assert c.tie_word_embeddings and c.hidden_act == "gelu_pytorch_tanh" and c.kv_window == 0
    off = config("Gemma2ForCausalLM", **GEMMA, attn_logit_softcapping=None, final_logit_softcapping=None)
    assert (off.attn_logit_softcapping, off.final_logit_softcapping) == (0.0, 0.0)


def test_gemma3_transformers4_rope_keys():
    """transformers 4 files: rope_theta + rope_scaling for the full layers, rope_local_base_freq for the sliding
    ones, one full layer in sliding_window_pattern."""
    c = config("Gemma3ForCausalLM", **GEMMA, num_hidden_layers=6, rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=3)
    assert [c.window_of(i) for i in range(6)] == [32, 32, 0, 32, 32, 0]
    assert (c.rope_theta, c.rope_scaling, c.local_rope_theta, c.local_rope_scaling) == (
        1e6, {"rope_type": "linear", "factor": 8.0}, 1e4, None)
    assert c.attn_logit_softcapping == 0.0


def test_gemma3_transformers5_rope_parameters_per_layer_type():
    params = {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
              "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 2e4}}
    c = config("Gemma3ForCausalLM", **GEMMA, rope_parameters=params)
    assert (c.rope_theta, c.rope_scaling, c.local_rope_theta) == (5e5, None, 2e4)
    assert c.local_rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("arch,changes,fragments", [
    ("Gemma2ForCausalLM", dict(hidden_activation="gelu"), ("hidden_activation", "'gelu'")),
    ("Gemma2ForCausalLM", dict(use_bidirectional_attention=True), ("use_bidirectional_attention",)),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), ("use_bidirectional_attention",)),
    ("Gemma3ForCausalLM", dict(attn_logit_softcapping=50.0), ("attn_logit_softcapping", "does not apply")),
    ("Gemma3ForCausalLM", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     ("rope_parameters", "full_attention")),
    ("Gemma3ForCausalLM", dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0},
                                                "sliding_attention": {}}), ("'yarn'",)),
    ("Gemma2ForCausalLM", dict(layer_types=["sliding_attention"] * 3), ("layer_types", "4 layers")),
])
def test_gemma_refusals(arch, changes, fragments):
    refused(arch, *fragments, **{**GEMMA, **changes})


# ------------------------------------------------------------------------------------------------ Phi-3
LONGROPE = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}


def test_phi3_longrope_keys_transformers4_and_5():
    v4 = config("Phi3ForCausalLM", rope_scaling=LONGROPE, original_max_position_embeddings=512, sliding_window=64)
    assert v4.rope_scaling["rope_type"] == "longrope" and v4.rope_scaling["original_max_position_embeddings"] == 512
    assert (v4.sliding_window, v4.layer_types, v4.rotary_dim, v4.attention_bias) == (64, [], 0, False)
    su = config("Phi3ForCausalLM", rope_scaling={**LONGROPE, "type": "su"}, original_max_position_embeddings=512)
    assert su.rope_scaling["rope_type"] == "longrope"
    v5 = config("Phi3ForCausalLM", rope_parameters={**LONGROPE, "rope_type": "longrope", "rope_theta": 1e4,
                                                    "partial_rotary_factor": 0.5,
                                                    "original_max_position_embeddings": 512})
    assert v5.rotary_dim == 8 and v5.rope_scaling["original_max_position_embeddings"] == 512
    assert "partial_rotary_factor" not in v5.rope_scaling


def test_phi3_longrope_beyond_its_original_length_is_refused_by_the_builder():
    from kiln.builder import BuildConfig
    from kiln.contract import BuildConfigError

    cfg = config("Phi3ForCausalLM", rope_scaling=LONGROPE, original_max_position_embeddings=512)
    BuildConfig(max_seq_len=512, max_input_len=256).check_model(cfg)
    with pytest.raises(BuildConfigError, match="longrope.*original_max_position_embeddings=512.*max_seq_len <= 512"):
        BuildConfig(max_seq_len=1024, max_input_len=256).check_model(cfg)


@pytest.mark.parametrize("changes,fragments", [
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), ("'dynamic'", "longrope")),
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8}, original_max_position_embeddings=512),
     ("long_factor",)),
    (dict(rope_scaling=LONGROPE), ("original_max_position_embeddings",)),
    (dict(partial_rotary_factor=0.1), ("partial_rotary_factor",)),
    (dict(hidden_act="gelu_new"), ("hidden_act",)),
])
def test_phi3_refusals(changes, fragments):
    refused("Phi3ForCausalLM", *fragments, **changes)


# ------------------------------------------------------------------------------------------------ MoE
def test_mixtral_experts():
    c = config("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (8, 2, 128, True)
    assert c.moe_layers == [0, 1, 2, 3] and c.is_moe and c.sliding_window == 0


def test_qwen3_moe_sparse_step_and_dense_layers():
    c = config("Qwen3MoeForCausalLM", head_dim=16, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=32,
               decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    assert c.moe_layers == [1] and c.moe_intermediate_size == 32 and c.norm_topk_prob   # layer 3 is dense
    v5 = config("Qwen3MoeForCausalLM", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, use_sliding_window=True, sliding_window=64)
    assert v5.num_experts == 4 and v5.moe_layers == [0, 1, 2, 3] and v5.kv_window == 64   # every layer's window


@pytest.mark.parametrize("changes,fragments", [
    (dict(mlp_only_layers=[7]), ("mlp_only_layers", "[7]", "4")),
    (dict(num_experts_per_tok=9), ("num_experts_per_tok=9", "num_experts=8")),
    (dict(num_experts=None), ("num_experts",)),
])
def test_qwen3_moe_refusals(changes, fragments):
    base = dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    refused("Qwen3MoeForCausalLM", *fragments, **{**base, **changes})


def test_moe_tensor_parallel_split_needs_the_expert_width():
    from kiln.contract import mapping_problems

    c = config("Qwen3MoeForCausalLM", head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=30)
    assert mapping_problems(c, 2) == []
    assert any("moe_intermediate_size=30" in p for p in mapping_problems(c, 4))
