"""Pre-quantized int4 checkpoints (GPTQ v1/v2 with and without act order, AWQ gemm) built without re-quantizing.

The test checkpoints are made here in the formats' on-disk packing (written from the formats' description, not
with kiln's reader): random 4-bit values, zero points and fp16 scales for every linear of a tiny Llama. Their
plain fp32 reconstruction ``(q - z) * s`` is saved as an ordinary checkpoint, which transformers runs as the
reference; kiln's engine built from the packed checkpoint must give its logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.builder import BuildConfig, build_engine
from kiln.contract import BuildConfigError, CheckpointError
from kiln.model_defs import load_checkpoint
from kiln.plugins import weight_format as fmt
from kiln.runtime import Engine

from paged_batch import PagedBatcher

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK = (0, 2, 4, 6, 1, 3, 5, 7)   # AWQ: nibble j of an int32 holds output 8c + AWQ_PACK[j]
BUILD = BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=96, max_num_tokens=128, tokens_per_block=8,
                    gather_all_logits=True)


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values < 2**32 -> the int32 with those bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack8(vals: torch.Tensor) -> torch.Tensor:
    """[..., 8] nibbles -> [...] int32, nibble j in bits 4j..4j+3."""
    return _int32((vals.long() << (4 * torch.arange(8))).sum(-1))


def make_quantized(src: Path, dst: Path, method: str, *, group_size: int = 32, act_order: bool = False,
                   v2: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """(packed checkpoint, its fp32 reconstruction as a plain checkpoint) from the float checkpoint ``src``."""
    g = torch.Generator().manual_seed(seed)
    state = load_file(str(src / "model.safetensors"))
    packed, ref = dict(state), dict(state)
    for name in [n for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        n, k = state[name].shape
        groups = k // group_size
        q = torch.randint(0, 16, (n, k), generator=g)
        z = torch.randint(1 if not v2 and method == "gptq" else 0, 16, (n, groups), generator=g)
        s = (torch.rand(n, groups, generator=g) * 0.04 + 0.01).half()
        gi = torch.arange(k) // group_size
        if act_order:   # the groups of a column permutation, as GPTQ's desc_act leaves them
            gi = torch.empty(k, dtype=torch.long)
            gi[torch.randperm(k, generator=g)] = torch.arange(k) // group_size
        ref[name] = (q - z[:, gi]).float() * s.float()[:, gi]
        base = name.removesuffix(".weight")
        del packed[name]
        if method == "gptq":
            packed[base + ".qweight"] = _pack8(q.t().reshape(k // 8, 8, n).transpose(1, 2))
            packed[base + ".qzeros"] = _pack8((z.t() - (0 if v2 else 1)).reshape(groups, n // 8, 8))
            packed[base + ".g_idx"] = gi.to(torch.int32)
        else:
            order = torch.tensor(AWQ_PACK)
            packed[base + ".qweight"] = _pack8(q.t().reshape(k, n // 8, 8)[..., order])
            packed[base + ".qzeros"] = _pack8(z.t().reshape(groups, n // 8, 8)[..., order])
        packed[base + ".scales"] = s.t().contiguous()
    cfg = json.loads((src / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": group_size}
    qc.update({"desc_act": act_order, "sym": False, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
              if method == "gptq" else {"version": "gemm", "zero_point": True})
    out, plain = dst / "quantized", dst / "reference"
    for d, tensors, c in ((out, packed, {**cfg, "quantization_config": qc}), (plain, ref, cfg)):
        shutil.copytree(src, d)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(c))
    return out, plain


def _logits(engine: Engine, seqs: list[list[int]]) -> torch.Tensor:
    b = PagedBatcher(engine.config.model, 64, engine.config.bounds.tokens_per_block, dtype=engine.kv_dtype)
    return engine.run(b.step(list(enumerate(seqs)), all_logits=True))


def _hf_logits(path: Path, seqs: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([model(torch.tensor([s])).logits[0] for s in seqs])


@pytest.mark.parametrize("method, act_order, v2", [("gptq", False, False), ("gptq", True, False),
                                                    ("gptq", False, True), ("awq", False, False)])
def test_engine_matches_transformers_on_the_reconstruction(native, checkpoint_dir, tmp_path, method, act_order, v2):
    src = checkpoint_dir("llama")
    qdir, ref = make_quantized(src, tmp_path, method, act_order=act_order, v2=v2)
    # kiln's reading is the plain reconstruction, exactly
    _, weights = load_checkpoint(qdir)
    want = load_file(str(ref / "model.safetensors"))
    for base in ("layers.0.self_attn.k_proj", "layers.1.mlp.down_proj"):
        p = fmt.Int4Panels(weights[base + ".int4_qweight"], weights[base + ".int4_scales"],
                           weights[base + ".int4_zeros"], 32)
        w = fmt.dequantize_int4_panels(p)
        if act_order:
            perm = weights[base + ".int4_perm"]
            assert perm.shape == (w.shape[1],)
            w = w[:, torch.argsort(perm)]
        assert torch.equal(w, want[f"model.{base}.weight"]), base
    engine = Engine.from_dir(build_engine(qdir, tmp_path / "engine", BUILD))
    report = json.loads((tmp_path / "engine" / "build_report.json").read_text())
    assert report["prequantized"]["method"] == method
    seqs = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((17, 9, 30))]
    got, hf = _logits(engine, seqs), _hf_logits(ref, seqs)
    err = (got - hf).abs().max().item()
    assert err <= 2e-3 * hf.abs().max().item(), err   # x is quantised to int16 per row in the int4 kernels
    assert (got.argmax(-1) == hf.argmax(-1)).float().mean() >= 0.98


def test_bf16_engine_from_a_gptq_checkpoint(native, checkpoint_dir, tmp_path):
    qdir, ref = make_quantized(checkpoint_dir("llama"), tmp_path, "gptq", seed=1)
    engine = Engine.from_dir(build_engine(qdir, tmp_path / "engine", BUILD.replace(dtype="bfloat16")))
    seqs = [[(5 * j) % 500 + 3 for j in range(20)]]
    got, hf = _logits(engine, seqs).float(), _hf_logits(ref, seqs)
    # bf16 activations through every layer (measured 5.4% of max |logit| on these random 4-bit weights)
    assert (got - hf).abs().max() <= 0.1 * hf.abs().max()
    assert (got.argmax(-1) == hf.argmax(-1)).float().mean() >= 0.9


def _rewrite(qdir: Path, config=None, tensors=None) -> None:
    if config is not None:
        c = json.loads((qdir / "config.json").read_text())
        config(c["quantization_config"])
        (qdir / "config.json").write_text(json.dumps(c))
    if tensors is not None:
        t = load_file(str(qdir / "model.safetensors"))
        tensors(t)
        save_file(t, str(qdir / "model.safetensors"))


@pytest.mark.parametrize("change, message", [
    (lambda q: q.update(bits=8), "bits=8"),
    (lambda q: q.update(quant_method="bitsandbytes"), "quant_method 'bitsandbytes'"),
    (lambda q: q.update(group_size=12), "group_size=12"),
    (lambda q: q.update(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
])
def test_unreadable_quantization_configs_are_named(checkpoint_dir, tmp_path, change, message):
    qdir, _ = make_quantized(checkpoint_dir("llama"), tmp_path, "gptq")
    _rewrite(qdir, config=change)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(qdir)


def test_awq_gemv_packing_is_refused(checkpoint_dir, tmp_path):
    qdir, _ = make_quantized(checkpoint_dir("llama"), tmp_path, "awq")
    _rewrite(qdir, config=lambda q: q.update(version="gemv"))
    with pytest.raises(CheckpointError, match="AWQ version 'gemv'"):
        load_checkpoint(qdir)


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.pop("model.layers.0.self_attn.q_proj.qzeros"), "missing tensor 'layers.0.self_attn.q_proj.qzeros'"),
    (lambda t: t.update({"model.layers.1.mlp.up_proj.qweight": torch.zeros(4, 4, dtype=torch.int32)}),
     r"up_proj.qweight' has shape \[4, 4\]"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.scales": torch.ones(4, 64)}), "dtype torch.float32"),
])
def test_damaged_tensors_are_named(checkpoint_dir, tmp_path, damage, message):
    qdir, _ = make_quantized(checkpoint_dir("llama"), tmp_path, "gptq")
    _rewrite(qdir, tensors=damage)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(qdir)


def test_tensor_parallel_build_is_refused(checkpoint_dir, tmp_path):
    qdir, _ = make_quantized(checkpoint_dir("llama"), tmp_path, "gptq")
    with pytest.raises(BuildConfigError, match="tensor parallelism"):
        build_engine(qdir, tmp_path / "engine", BUILD.replace(tp_size=2))


# ---- compressed-tensors (llm-compressor's format), made by compressed_tensors itself ---------------------------

def make_compressed_tensors(src: Path, dst: Path, *, symmetric: bool, strategy: str = "group", group_size: int = 32,
                            dtype: torch.dtype = torch.float32) -> tuple[Path, Path]:
    """(pack-quantized checkpoint, the float checkpoint of its weights) made from ``src`` by compressed_tensors: its
    min-max quantization parameters, its fake-quantization (the reference weights) and its packing and config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).eval()
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group_size if strategy == "group" else None)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    reference = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            if hasattr(m, "weight_scale"):
                w = m.weight if strategy == "channel" else m.weight.unflatten(-1, (-1, group_size))
                scale, zp = calculate_qparams(w.amin(-1), w.amax(-1), m.quantization_scheme.weights)
                if strategy == "channel":
                    scale, zp = scale[:, None], zp[:, None]
                m.weight_scale.copy_(scale)
                if hasattr(m, "weight_zero_point"):
                    m.weight_zero_point.copy_(zp)
                reference[name + ".weight"] = fake_quantize(m.weight, scale, zp, m.quantization_scheme.weights)
    out, plain = dst / "quantized", dst / "reference"
    shutil.copytree(src, plain)
    state = load_file(str(src / "model.safetensors"))
    state.update({k: v.to(state[k].dtype) for k, v in reference.items()})
    save_file(state, str(plain / "model.safetensors"))
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    shutil.copytree(src, out)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out, plain


@pytest.mark.parametrize("symmetric, strategy, dtype", [(True, "group", torch.float32), (False, "group", torch.float32),
                                                        (True, "channel", torch.float16)])
def test_compressed_tensors_engine_matches_transformers(native, checkpoint_dir, tmp_path, symmetric, strategy, dtype):
    qdir, ref = make_compressed_tensors(checkpoint_dir("llama"), tmp_path, symmetric=symmetric, strategy=strategy,
                                        dtype=dtype)
    assert json.loads((qdir / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    engine = Engine.from_dir(build_engine(qdir, tmp_path / "engine", BUILD))
    report = json.loads((tmp_path / "engine" / "build_report.json").read_text())
    assert report["prequantized"] == {"method": "compressed-tensors", "group_size": 32 if strategy == "group" else -1,
                                      "bits": 4}
    seqs = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((17, 9, 30))]
    got, want = _logits(engine, seqs), _hf_logits(ref, seqs)
    # x rounded to int16 per row, and fp32 scales to kiln's fp16 ones (2^-11 relative)
    assert (got - want).abs().max() <= 2e-3 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.98
    if symmetric:   # what a user of transformers runs: the compressed checkpoint itself (transformers decompresses it)
        hf = _hf_logits(qdir, seqs)
        assert (got - hf).abs().max() <= 2e-3 * hf.abs().max()


@pytest.mark.parametrize("change, message", [
    (lambda q: q["config_groups"]["group_0"].update(format="float-quantized"), "format 'float-quantized'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "int weights of 8 bits"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int"}),
     "quantizes activations"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"), "strategy 'tensor'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=12), "group_size=12"),
    (lambda q: q["config_groups"].update(group_1={**q["config_groups"]["group_0"], "weights": {
        **q["config_groups"]["group_0"]["weights"], "group_size": 64}}), r"different group sizes \[32, 64\]"),
])
def test_unreadable_compressed_tensors_configs_are_named(checkpoint_dir, tmp_path, change, message):
    qdir, _ = make_compressed_tensors(checkpoint_dir("llama"), tmp_path, symmetric=True)
    _rewrite(qdir, config=change)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(qdir)


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.pop("model.layers.0.self_attn.q_proj.weight_packed"), "missing tensor 'layers.0.self_attn.q_proj"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight_shape": torch.tensor([3, 3])}),
     r"weight_shape is \[3, 3\]"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale": torch.full((64, 4), 1e6)}), "float16's range"),
])
def test_damaged_compressed_tensors_are_named(checkpoint_dir, tmp_path, damage, message):
    qdir, _ = make_compressed_tensors(checkpoint_dir("llama"), tmp_path, symmetric=True)
    _rewrite(qdir, tensors=damage)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(qdir)


@pytest.mark.slow
@pytest.mark.xdist_group("aoti")
def test_cpu_compiled_gptq_engine_matches_the_cpu_engine(native, checkpoint_dir, tmp_path):
    """A cpu-compiled graph calls weight_only_linear through its C shim (kiln.plugins.aoti_shims), here with int4
    panels that carry zero points: its logits are the cpu engine's, whose graph dispatches the same kernels."""
    qdir, _ = make_quantized(checkpoint_dir("llama"), tmp_path, "gptq")
    seqs = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((17, 1, 30))]
    want = _logits(Engine.from_dir(build_engine(qdir, tmp_path / "cpu", BUILD)), seqs)
    out = build_engine(qdir, tmp_path / "compiled", BUILD.replace(backend="cpu-compiled"))
    assert "kiln::weight_only_linear" in json.loads((out / "build_report.json").read_text())["backend"]["c_shims"]
    got = _logits(Engine.from_dir(out), seqs)
    # the graphs differ elsewhere (inductor's fused norms), which moves x's int16 rounding in the int4 kernels a little
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * want.abs().max().item())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.98
