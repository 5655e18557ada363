"""load_checkpoint on malformed checkpoints: each raises CheckpointError naming the file, the tensor
and what was expected. Every case starts from a good checkpoint copied into a fresh directory."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.model_defs import CheckpointError, build_model, load_checkpoint, load_config


@pytest.fixture
def llama(checkpoint_dir, tmp_path) -> Path:
    """A writable copy of the single-file Llama checkpoint."""
    return Path(shutil.copytree(checkpoint_dir("llama"), tmp_path / "llama"))


@pytest.fixture
def sharded(checkpoint_dir, tmp_path) -> Path:
    path = Path(shutil.copytree(checkpoint_dir("llama", shard_size="100KB"), tmp_path / "sharded"))
    assert (path / "model.safetensors.index.json").is_file()
    return path


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(file: Path, fn) -> None:
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def shard_of(path: Path, tensor: str) -> Path:
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def raises(path: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in error message: {message}"
    return message


def test_good_checkpoints_load(llama, sharded):
    for path in (llama, sharded):
        config, weights = load_checkpoint(path)
        assert config.architecture == "LlamaForCausalLM"
        assert all(w.dtype == torch.float32 for w in weights.values())
    _, bf16 = load_checkpoint(llama, "bfloat16")
    assert all(w.dtype == torch.bfloat16 for w in bf16.values())


def test_unsupported_architecture(llama):
    edit_config(llama, architectures=["FalconForCausalLM"])
    msg = raises(llama, "config.json", "FalconForCausalLM", "LlamaForCausalLM")
    assert "unsupported architecture" in msg
    with pytest.raises(CheckpointError, match="FalconForCausalLM"):
        load_config(llama)


def test_no_architectures_key(llama):
    edit_config(llama, architectures=None)
    raises(llama, "config.json", "architectures")


def test_no_config_json(llama):
    (llama / "config.json").unlink()
    raises(llama, "config.json", str(llama))


def test_config_json_not_json(llama):
    (llama / "config.json").write_text("{ not json")
    raises(llama, "config.json", "JSON")


@pytest.mark.parametrize("scaling", [
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},  # transformers 5 key
    {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},  # transformers 4 key
])
def test_unsupported_rope_type(llama, scaling):
    edit_config(llama, **scaling)
    kind = (scaling.get("rope_parameters") or scaling.get("rope_scaling"))
    kind = kind.get("rope_type") or kind.get("type")
    raises(llama, "config.json", repr(kind), "llama3")


def test_missing_tensor(llama):
    name = "model.layers.1.mlp.down_proj.weight"
    edit_tensors(llama / "model.safetensors", lambda t: t.pop(name))
    raises(llama, "missing tensor", repr(name), "[64, 128]", "LlamaForCausalLM")


def test_missing_tensor_in_shard_names_the_shard(sharded):
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = shard_of(sharded, name)
    edit_tensors(shard, lambda t: t.pop(name))
    raises(sharded, "missing tensor", repr(name), "[64, 64]", shard.name)


def test_missing_lm_head_when_untied(checkpoint_dir, tmp_path):
    path = Path(shutil.copytree(checkpoint_dir("qwen2", tie_word_embeddings=False), tmp_path / "q"))
    edit_tensors(path / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    raises(path, "missing tensor", "'lm_head.weight'", "[512, 64]")


def test_unexpected_tensor(llama):
    name = "model.layers.0.self_attn.rotary.scale"
    edit_tensors(llama / "model.safetensors", lambda t: t.__setitem__(name, torch.zeros(4)))
    raises(llama, "model.safetensors", "unexpected tensor", repr(name))


def test_extra_layer_is_unexpected(llama):
    """Weights of a deeper model than config.json says: the first extra tensor is named."""
    def add(t):
        for key in [k for k in t if k.startswith("model.layers.1.")]:
            t[key.replace("layers.1.", "layers.2.")] = t[key].clone()
    edit_tensors(llama / "model.safetensors", add)
    msg = raises(llama, "model.safetensors", "unexpected tensor", "model.layers.2.")
    assert re.search(r"'model\.layers\.2\.[\w.]+'", msg)


def test_misshaped_tensor(llama):
    name = "model.layers.0.self_attn.k_proj.weight"  # 2 kv heads × 16 = [32, 64]
    edit_tensors(llama / "model.safetensors", lambda t: t.__setitem__(name, torch.zeros(64, 64)))
    raises(llama, "model.safetensors", repr(name), "[64, 64]", "expected [32, 64]")


def test_misshaped_tensor_in_shard(sharded):
    name = "model.embed_tokens.weight"
    shard = shard_of(sharded, name)
    edit_tensors(shard, lambda t: t.__setitem__(name, torch.zeros(500, 64)))
    raises(sharded, shard.name, repr(name), "[500, 64]", "expected [512, 64]")


def test_integer_tensor(llama):
    name = "model.norm.weight"
    edit_tensors(llama / "model.safetensors", lambda t: t.__setitem__(name, torch.ones(64, dtype=torch.int32)))
    raises(llama, "model.safetensors", repr(name), "floating")


@pytest.mark.parametrize("damage", ["truncated", "garbage-header", "empty", "header-only"])
def test_corrupt_safetensors(llama, damage):
    file = llama / "model.safetensors"
    data = file.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    if damage == "truncated":
        data = data[: len(data) - 1000]
    elif damage == "garbage-header":
        data = (10**12).to_bytes(8, "little") + b"\xff" * 64
    elif damage == "empty":
        data = b""
    elif damage == "header-only":
        data = data[: 8 + header_len]
    file.write_bytes(data)
    raises(llama, str(file), "corrupt")


def test_corrupt_shard(sharded):
    shard = shard_of(sharded, "model.norm.weight")
    shard.write_bytes(shard.read_bytes()[:-16])
    raises(sharded, shard.name, "corrupt")


def test_missing_shard(sharded):
    shard = shard_of(sharded, "model.layers.1.mlp.up_proj.weight")
    shard.unlink()
    raises(sharded, "model.safetensors.index.json", shard.name)


def test_bad_index(sharded):
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    raises(sharded, "model.safetensors.index.json", "weight_map")


def test_tensor_in_two_shards(sharded):
    name = "model.norm.weight"
    home = shard_of(sharded, name)
    other = next(f for f in sorted(sharded.glob("model-*.safetensors")) if f != home)
    edit_tensors(other, lambda t: t.__setitem__(name, torch.ones(64)))
    raises(sharded, repr(name), home.name, other.name)


def test_no_weights(llama):
    (llama / "model.safetensors").unlink()
    raises(llama, "model.safetensors", str(llama))


def test_only_bin_weights(llama):
    (llama / "model.safetensors").rename(llama / "pytorch_model.bin")
    raises(llama, ".bin", "safetensors")


def test_qwen2_sliding_window_rejected(checkpoint_dir, tmp_path):
    path = Path(shutil.copytree(checkpoint_dir("qwen2"), tmp_path / "q"))
    edit_config(path, use_sliding_window=True, sliding_window=16)
    raises(path, "config.json", "use_sliding_window")


@pytest.mark.parametrize("change", [{"activation_function": "relu"}, {"scale_attn_weights": False}])
def test_gpt2_unsupported_options(checkpoint_dir, tmp_path, change):
    path = Path(shutil.copytree(checkpoint_dir("gpt2"), tmp_path / "g"))
    edit_config(path, **change)
    raises(path, "config.json", next(iter(change)))


def test_gpt2_legacy_names_and_buffers_load(checkpoint_dir, tmp_path):
    """Original GPT-2 files: no 'transformer.' prefix, plus causal-mask buffers that hold no weights."""
    good = checkpoint_dir("gpt2")
    path = Path(shutil.copytree(good, tmp_path / "g"))

    def legacy(t):
        for key in list(t):
            t[key.removeprefix("transformer.")] = t.pop(key)
        t["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))
        t["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    edit_tensors(path / "model.safetensors", legacy)
    _, expected = load_checkpoint(good)
    _, got = load_checkpoint(path)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert "layers.0.self_attn.q_proj.bias" in got  # c_attn.bias is a weight, not one of those buffers


def test_gpt2_untied_head_is_used(checkpoint_dir):
    from transformers import AutoModelForCausalLM

    path = checkpoint_dir("gpt2", tie_word_embeddings=False)
    config, weights = load_checkpoint(path)
    assert not config.tie_word_embeddings
    model = build_model(config, weights)
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_bf16_checkpoint_converts(tmp_path):
    """A checkpoint saved in bf16 loads as fp32 (exact upcast) or stays bf16 when asked."""
    from safetensors import safe_open

    from synthetic_checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "bf16", "qwen2", "tiny", dtype=torch.bfloat16)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.layers.0.self_attn.q_proj.bias")
    assert stored.dtype == torch.bfloat16
    _, fp32 = load_checkpoint(path, torch.float32)
    _, bf16 = load_checkpoint(path, "bfloat16")
    assert fp32["layers.0.self_attn.q_proj.bias"].dtype == torch.float32
    assert torch.equal(fp32["layers.0.self_attn.q_proj.bias"], stored.float())
    assert torch.equal(bf16["layers.0.self_attn.q_proj.bias"], stored)


def test_train_on_corpus_lowers_the_loss_and_rejects_a_short_corpus():
    """The trained test checkpoints come from train_on_corpus: it must actually fit the text."""
    from transformers import AutoModelForCausalLM

    from synthetic_checkpoints import CORPUS, corpus_token_ids, hf_config, train_on_corpus, train_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("llama", "tiny"))
    ids = corpus_token_ids(train_tokenizer(512))
    assert len(ids) > len(CORPUS) // 8
    first = train_on_corpus(model, ids, 1, seed=1)
    last = train_on_corpus(model, ids, 40, seed=1)
    assert last < 0.5 * first, (first, last)
    assert not model.training
    with pytest.raises(ValueError, match="fewer than a training window"):
        train_on_corpus(model, ids[:10], 1)


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*nowhere does not exist"):
        load_config(tmp_path / "nowhere")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*afile is not a directory"):
        load_checkpoint(tmp_path / "afile")


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "config.json: must be a JSON object, got list"),
    ('"LlamaForCausalLM"', "config.json: must be a JSON object, got str"),
    ('{"architectures": "LlamaForCausalLM"}', "'architectures' must be a list of model class names, got 'Llama"),
    ('{"architectures": [7]}', "'architectures' must be a list of model class names, got [7]"),
])
def test_config_json_of_the_wrong_shape(llama, content, message):
    (llama / "config.json").write_text(content)
    with pytest.raises(CheckpointError) as exc:
        load_config(llama)
    assert message in str(exc.value), str(exc.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_named(llama, bad):
    def poison(t):
        w = t["model.layers.1.mlp.down_proj.weight"]
        w[3, 5] = bad
        w[0, 0] = bad
    edit_tensors(llama / "model.safetensors", poison)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight' has 2 NaN or "
                                              r"infinite values"):
        load_checkpoint(llama)


def test_weights_that_overflow_the_build_dtype_are_named(llama):
    edit_tensors(llama / "model.safetensors", lambda t: t["model.norm.weight"].__setitem__(0, 1e6))
    load_checkpoint(llama, torch.float32)
    load_checkpoint(llama, torch.bfloat16)      # bfloat16 has float32's range
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' has 1 values? beyond the range of "
                                              r"torch\.float16"):
        load_checkpoint(llama, torch.float16)


def test_moe_checkpoint_missing_an_expert_is_named(checkpoint_dir, tmp_path):
    """Per-expert tensors fill one stacked parameter: a missing or extra expert is named, never left empty."""
    path = Path(shutil.copytree(checkpoint_dir("mixtral"), tmp_path / "mixtral"))
    config, weights = load_checkpoint(path)
    assert weights["layers.0.mlp.experts.gate_up_proj"].shape == (8, 2 * config.moe_intermediate_size, 64)
    edit_tensors(path / "model.safetensors", lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight"))
    raises(path, "missing tensor(s)", "'model.layers.1.block_sparse_moe.experts.3.w3.weight'")
    edit_config(path, num_local_experts=4)
    raises(path, "unexpected tensor", "block_sparse_moe.experts.")
