"""BuildConfig: validation names the conflicting values, nothing is adjusted silently, round trips."""

from __future__ import annotations

import pytest

from kiln.builder import BuildConfig, BuildConfigError
from kiln.builder.config import BACKENDS, DTYPES, QUANTIZATIONS
from kiln.model_defs import ModelConfig

MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=192,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def test_defaults_are_valid_and_round_trip():
    cfg = BuildConfig()
    assert BuildConfig.from_dict(cfg.to_dict()) == cfg
    d = cfg.to_dict()
    for key in ("dtype", "backend", "max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                "opt_num_tokens", "tokens_per_block", "kv_cache_dtype", "quantization", "group_size",
                "logits_dtype", "gather_all_logits"):
        assert key in d


@pytest.mark.parametrize("changes, words", [
    (dict(max_input_len=2048, max_seq_len=1024), ["max_input_len=2048", "max_seq_len=1024", "raise max_seq_len"]),
    (dict(max_num_tokens=8, tokens_per_block=16, max_batch_size=4), ["max_num_tokens=8", "tokens_per_block=16"]),
    (dict(max_num_tokens=16, max_batch_size=32, tokens_per_block=16), ["max_num_tokens=16", "max_batch_size=32"]),
    (dict(opt_num_tokens=4096, max_num_tokens=1024), ["opt_num_tokens=4096", "max_num_tokens=1024"]),
    (dict(opt_num_tokens=4096), ["opt_num_tokens=4096", "max_num_tokens=1024"]),   # against the derived value
    (dict(dtype="float64"), ["dtype='float64'", "float32"]),
    (dict(backend="tpu"), ["backend='tpu'"]),
    (dict(num_tokens_profiles=[8, 1024]), ["num_tokens_profiles=[8, 1024]", "backend 'tensorrt'"]),
    (dict(backend="tensorrt", num_tokens_profiles=[64, 8]), ["strictly ascending", "max_num_tokens=1024"]),
    (dict(backend="tensorrt", max_batch_size=2048, num_tokens_profiles=[8, 1024]), ["end at max_num_tokens=2048"]),
    (dict(backend="tensorrt", num_tokens_profiles=[8, 512]), ["end at max_num_tokens=1024"]),
    (dict(backend="onnx", dtype="bfloat16"), ["dtype='bfloat16' with backend 'onnx'", "tensorrt"]),
    (dict(max_num_blocks=0), ["max_num_blocks=0"]),
    (dict(onnx_threads=-1), ["onnx_threads=-1"]),
    (dict(onnx_optimization="max"), ["onnx_optimization='max'"]),
    (dict(backend="onnx", tp_size=2), ["tp_size=2 with backend='onnx'", "no lowering for 'onnx'", "'cpu-compiled'"]),
    (dict(backend="tensorrt", tp_size=4), ["tp_size=4 with backend='tensorrt'", "use tp_size=1"]),
    (dict(quantization="int3"), ["quantization='int3'"]),
    (dict(kv_cache_dtype="int4"), ["kv_cache_dtype='int4'", "'int8', 'fp8'"]),
    (dict(kv_cache_dtype="fp8", backend="onnx"), ["kv_cache_dtype='fp8' with backend 'onnx'", "no bit cast", "'int8'"]),
    (dict(kv_cache_dtype="int8", backend="tensorrt"), ["kv_cache_dtype='int8' with backend 'tensorrt'"]),
    (dict(kv_calibration="prompts.txt"), ["kv_calibration='prompts.txt'", "kv_cache_dtype is 'auto'"]),
    (dict(kv_calibration="", kv_cache_dtype="int8"), ["kv_calibration=''", "text file"]),
    (dict(logits_dtype="bfloat16"), ["logits_dtype", "float32"]),
    (dict(max_batch_size=0), ["max_batch_size=0", "positive"]),
    (dict(tokens_per_block=-4), ["tokens_per_block=-4"]),
    (dict(max_seq_len="1024"), ["max_seq_len='1024'"]),
    (dict(gather_all_logits="yes"), ["gather_all_logits"]),
    (dict(quantization="int4_weight_only", group_size=33), ["group_size=33", "even"]),
    (dict(quantization="int8_weight_only", dtype="float16"), ["float16", "bfloat16"]),
])
def test_inconsistent_values_are_rejected_with_names(changes, words):
    with pytest.raises(BuildConfigError) as exc:
        BuildConfig(**changes)
    for w in words:
        assert w in str(exc.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(BuildConfigError) as exc:
        BuildConfig(dtype="fp8", backend="gpu", max_input_len=4096, max_seq_len=2048)
    msg = str(exc.value)
    assert "dtype='fp8'" in msg and "backend='gpu'" in msg and "max_input_len=4096" in msg


def test_nothing_is_adjusted_silently():
    cfg = BuildConfig(max_batch_size=3, max_num_tokens=17, tokens_per_block=5, max_input_len=7, max_seq_len=11)
    got = (cfg.max_batch_size, cfg.max_num_tokens, cfg.tokens_per_block, cfg.max_input_len, cfg.max_seq_len)
    assert got == (3, 17, 5, 7, 11)
    assert cfg.max_blocks_per_seq == 3  # ceil(11 / 5): derived, not a changed input
    assert cfg.opt_num_tokens is None and cfg.resolved_opt_num_tokens == 17
    assert cfg.kv_cache_dtype == "auto" and cfg.resolved_kv_cache_dtype == "float32"
    assert BuildConfig(gather_all_logits=True, max_num_tokens=64).max_num_logits == 64
    assert BuildConfig(max_batch_size=4).max_num_logits == 4


def test_model_checks():
    BuildConfig(max_seq_len=256, max_input_len=128).check_model(MODEL)
    with pytest.raises(BuildConfigError, match=r"max_seq_len=512 > the model's max_position_embeddings=256"):
        BuildConfig(max_seq_len=512, max_input_len=128).check_model(MODEL)
    with pytest.raises(BuildConfigError, match=r"group_size=128 does not divide .*\[64, 192\]"):
        BuildConfig(max_seq_len=256, max_input_len=128, quantization="int4_weight_only",
                    group_size=128).check_model(MODEL)
    BuildConfig(max_seq_len=256, max_input_len=128, quantization="int4_weight_only",
                group_size=32).check_model(MODEL.to_dict())


def test_tensor_parallel_size_is_checked_against_the_model():
    BuildConfig(max_seq_len=256, max_input_len=128, tp_size=2).check_model(MODEL)
    with pytest.raises(BuildConfigError, match=r"tp_size=0 must be a positive integer"):
        BuildConfig(tp_size=0)
    with pytest.raises(BuildConfigError, match=r"tp_size=3 does not divide num_heads=4"):
        BuildConfig(max_seq_len=256, max_input_len=128, tp_size=3).check_model(MODEL)
    with pytest.raises(BuildConfigError, match=r"tp_size=8 is larger than the model's num_heads=4"):
        BuildConfig(max_seq_len=256, max_input_len=128, tp_size=8).check_model(MODEL)
    # int4 groups must divide the GEMM inputs of one rank's shard: o_proj reads 32 of 64 features with 2 ranks
    with pytest.raises(BuildConfigError, match=r"group_size=64 does not divide .*\[32, 96\]"):
        BuildConfig(max_seq_len=256, max_input_len=128, quantization="int4_weight_only", group_size=64,
                    tp_size=2).check_model(MODEL)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(BuildConfigError, match=r"unknown key 'max_batchsize' \(did you mean 'max_batch_size'\?\); "
                                               r"valid keys: dtype, backend, max_batch_size, "):
        BuildConfig.from_dict({"max_batchsize": 4})
    with pytest.raises(BuildConfigError, match="mapping"):
        BuildConfig.from_dict([1, 2])


def test_unknown_keywords_are_config_errors_with_the_closest_name():
    with pytest.raises(BuildConfigError) as exc:
        BuildConfig(max_seqlen=256, dtype="bfloat16")
    msg = str(exc.value)
    assert msg.startswith("BuildConfig: unknown option 'max_seqlen' (did you mean 'max_seq_len'?); valid options: ")
    assert all(name in msg for name in ("dtype", "max_input_len", "num_tokens_profiles"))   # the whole list
    with pytest.raises(BuildConfigError, match=r"options 'zzz', 'quantisation' \(did you mean 'quantization'\?\)"):
        BuildConfig(zzz=1, quantisation="int8_weight_only")   # no close name: none suggested
    with pytest.raises(BuildConfigError, match="did you mean 'tp_size'"):
        BuildConfig().replace(tp_sise=2)


def test_max_input_len_follows_max_seq_len_unless_given():
    """A default never contradicts a value the user set: max_input_len defaults to max_seq_len (also from YAML,
    also after replace), max_num_tokens to max(1024, max_batch_size, tokens_per_block)."""
    cfg = BuildConfig(max_seq_len=256)
    assert cfg.max_input_len is None and cfg.engine_bounds().max_input_len == 256
    assert cfg.resolved().max_input_len == 256 and BuildConfig.from_dict(cfg.resolved().to_dict()) == cfg.resolved()
    assert cfg.replace(max_seq_len=64).engine_bounds().max_input_len == 64
    assert BuildConfig(max_seq_len=256, max_input_len=100).engine_bounds().max_input_len == 100
    big = BuildConfig(max_batch_size=2048)
    assert big.engine_bounds().max_num_tokens == 2048 and big.resolved_opt_num_tokens == 128
    assert BuildConfig(tokens_per_block=2048).engine_bounds().max_num_tokens == 2048
    assert BuildConfig().engine_bounds().max_num_tokens == 1024
    assert BuildConfig(max_num_tokens=64, gather_all_logits=True).engine_bounds().max_num_logits == 64
    with pytest.raises(BuildConfigError, match="max_num_tokens=16 < max_batch_size=32"):   # given: still checked
        BuildConfig(max_num_tokens=16, max_batch_size=32, tokens_per_block=16)
    with pytest.raises(BuildConfigError, match=r"max_input_len=0 must be a positive integer or null \(null: "
                                               r"max_seq_len\)"):
        BuildConfig(max_input_len=0)


def test_yaml_derives_max_input_len(tmp_path):
    path = tmp_path / "short.yaml"
    path.write_text("max_seq_len: 256\n")
    assert BuildConfig.from_yaml(path).engine_bounds().max_input_len == 256
    path.write_text("max_seq_len: 256\nmax_input_len: null\nmax_num_tokens: null\n")
    assert BuildConfig.from_yaml(path).engine_bounds().max_num_tokens == 1024
    path.write_text("max_seq_len: 256\nmax_imput_len: 128\n")
    with pytest.raises(BuildConfigError, match=r"short\.yaml: .*'max_imput_len' \(did you mean 'max_input_len'\?\)"):
        BuildConfig.from_yaml(path)


def test_yaml(tmp_path):
    path = tmp_path / "b.yaml"
    path.write_text("dtype: bfloat16\nmax_batch_size: 2\nmax_num_tokens: 32\nquantization: int8_weight_only\n")
    cfg = BuildConfig.from_yaml(path)
    got = (cfg.dtype, cfg.max_batch_size, cfg.max_num_tokens, cfg.quantization)
    assert got == ("bfloat16", 2, 32, "int8_weight_only")
    path.write_text("max_input_len: 4096\nmax_seq_len: 1024\n")
    with pytest.raises(BuildConfigError, match=r"(?s)b\.yaml.*max_input_len=4096"):
        BuildConfig.from_yaml(path)
    path.write_text("dtype: [unclosed\n")
    with pytest.raises(BuildConfigError, match="not valid YAML"):
        BuildConfig.from_yaml(path)
    with pytest.raises(BuildConfigError, match="no such build config file"):
        BuildConfig.from_yaml(tmp_path / "missing.yaml")
    assert BuildConfig.from_yaml(_empty(tmp_path)) == BuildConfig()


def _empty(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    return p


def test_shipped_build_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "build_configs"
    files = sorted(root.glob("*.yaml"))
    assert {f.stem for f in files} >= {"tiny-test", "latency", "throughput"}
    for f in files:
        cfg = BuildConfig.from_yaml(f)
        assert cfg.dtype in DTYPES and cfg.backend in BACKENDS and cfg.quantization in QUANTIZATIONS


def test_replace_validates():
    cfg = BuildConfig()
    assert cfg.replace(max_batch_size=2).max_batch_size == 2
    with pytest.raises(BuildConfigError):
        cfg.replace(max_input_len=10**6)
