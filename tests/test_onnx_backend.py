"""The onnx and tensorrt backends: each plugin's ONNX lowering against its reference, onnx engines against
the cpu engine and transformers, TensorRT plans built by tensorrt_rtx (no GPU needed to build), and the
clear refusal to load a plan where no GPU is.

Engines are tiny and built once per session, in their own xdist group.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from test_engine import FAMILIES, run_schedule

from kiln.builder import BuildConfig, build_engine
from kiln.builder.backends import tensorrt as trt_backend
from kiln.contract import (
    INPUT_NAMES,
    KV_CACHE_OUTPUT,
    OUTPUT_NAME,
    EngineBuildError,
    EngineLoadError,
    SeqChunk,
    pack_inputs,
)
from kiln.plugins import weight_format as wf
from kiln.plugins.activations import gelu_reference, silu_mul_reference
from kiln.plugins.kv_quant import to_pool
from kiln.plugins.linear import float_linear_reference, weight_only_linear_reference
from kiln.plugins.onnx_ops import OPSET, lowerings
from kiln.plugins.paged_attention import paged_attention_reference
from kiln.plugins.rms_norm import fused_add_rms_norm_reference, rms_norm_reference
from kiln.plugins.rotary import cos_sin_table, rope_inv_freq, rotary_embedding_reference
from kiln.runtime import LLM, Engine, SamplingParams

from runtime_support import hf_greedy, random_prompts

pytestmark = pytest.mark.xdist_group("onnx")

BUILD = BuildConfig(max_batch_size=4, max_input_len=96, max_seq_len=128, max_num_tokens=256, tokens_per_block=4,
                    gather_all_logits=True)
FP32_ATOL = 1e-4
_engines: dict[tuple, Engine] = {}


@pytest.fixture(scope="session")
def engine_of(checkpoint_dir, tmp_path_factory):
    """engine_of(family, **build changes) -> Engine, built once per argument set."""

    def get(family: str, **changes) -> Engine:
        key = (family, tuple(sorted(changes.items())))
        if key not in _engines:
            out = tmp_path_factory.mktemp(f"onnx-{family}") / "engine"
            build_engine(checkpoint_dir(family), out, BUILD.replace(**changes))
            _engines[key] = Engine.from_dir(out)
        return _engines[key]

    return get


# ------------------------------------------------------------------------------ lowerings vs references
class Probe(torch.nn.Module):
    """Every plugin op once, on a mixed paged batch (context chunk with an offset, a fresh prefill, decodes;
    GQA; a sliding window), so that one export checks every lowering."""

    def __init__(self, window: int, softcap: float = 0.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.window, self.softcap = window, softcap
        self.register_buffer("norm_w", torch.randn(32, generator=g))
        self.register_buffer("table", cos_sin_table(64, rope_inv_freq(8, 10000.0, None)))
        w = torch.randn(48, 96, generator=g)
        self.register_buffer("bias", torch.randn(48, generator=g))
        self.register_buffer("w_packed", wf.pack_rows(w))
        q8, s8 = wf.quantize_int8(w)
        self.register_buffer("q8", q8)
        self.register_buffer("s8", s8)
        self.register_buffer("q8_packed", wf.pack_rows(q8))
        self.register_buffer("w_panels", wf.pack_panels(w))      # the layout the builder stores
        self.register_buffer("q8_panels", wf.pack_panels(q8))
        q4, s4 = wf.quantize_int4(torch.randn(48, 160, generator=g), 32)   # 160: two 64-blocks and a tail
        self.register_buffer("q4", q4)
        self.register_buffer("s4", s4)
        w4 = torch.randn(48, 160, generator=g)    # int4 panels: kiln's symmetric ones, and GPTQ-style zero points
        p4 = wf.quantize_int4_panels(w4, 32)
        z4 = torch.randint(0, 16, (48, 5), generator=g).to(torch.uint8)
        u4, s16, _ = wf.unpack_int4_panels(p4)
        pz = wf.pack_int4_panels(u4, s16, z4, 32)
        for name, t in (("p4", p4.qweight), ("p4s", p4.scales), ("pz", pz.qweight), ("pzs", pz.scales),
                        ("pzz", pz.zeros)):
            self.register_buffer(name, t)

    def forward(self, x, residual, xw, xw4, q, k, v, kv_cache, seq_lens, context_lens, block_tables, slot_mapping,
                position_ids):
        ops = torch.ops.kiln
        normed, summed = ops.fused_add_rms_norm(x, residual, self.norm_w, 1e-5)
        qr, kr = ops.rotary_embedding(q, k, position_ids, self.table)
        attn = ops.paged_attention_functional(qr, kr, v, kv_cache, 1, seq_lens, context_lens, block_tables,
                                              slot_mapping, 0.35, self.window, self.softcap)
        pool = ops.kv_cache_update(kv_cache, [kr, kr * 2], [v, v * 2], slot_mapping)
        return (ops.rms_norm(x, self.norm_w, 1e-5), normed, summed, qr, kr, ops.silu_mul(x, residual),
                ops.gelu(x, "tanh"), ops.gelu(x, "none"), ops.fp32_linear(xw, self.w_packed, self.bias),
                ops.weight_only_linear(xw, self.q8, self.s8, self.bias, 8, 0),
                ops.weight_only_linear(xw, self.q8_packed, self.s8, None, 8, 0),
                ops.weight_only_linear(xw4, self.q4, self.s4, self.bias, 4, 32),
                ops.fp32_linear(xw, self.w_panels, None), ops.weight_only_linear(xw, self.q8_panels, self.s8, self.bias,
                                                                                 8, 0),
                ops.weight_only_linear(xw4, self.p4, self.p4s, self.bias, 4, 32),
                ops.weight_only_linear(xw4, self.pz, self.pzs, None, 4, 32, self.pzz), attn, pool)


def probe_inputs():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 2, 24, 4, 2, 8, generator=g)
    chunks = [SeqChunk([1] * 7, 5, [3, 9, 17]), SeqChunk([1] * 4, 0, [6]), SeqChunk([1], 12, [11, 12, 13, 14]),
              SeqChunk([1], 2, [20])]
    step = pack_inputs(chunks, kv, 4)
    t = step["input_ids"].shape[0]
    return dict(x=torch.randn(t, 32, generator=g), residual=torch.randn(t, 32, generator=g),
                xw=torch.randn(t, 96, generator=g), xw4=torch.randn(t, 160, generator=g),
                q=torch.randn(t, 4, 8, generator=g), k=torch.randn(t, 2, 8, generator=g),
                v=torch.randn(t, 2, 8, generator=g), kv_cache=kv, seq_lens=step["seq_lens"],
                context_lens=step["context_lens"], block_tables=step["block_tables"],
                slot_mapping=step["slot_mapping"], position_ids=step["position_ids"])


def probe_references(m: Probe, a: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    qr, kr = rotary_embedding_reference(a["q"], a["k"], a["position_ids"], m.table)
    pool = a["kv_cache"].clone()
    paged = (a["seq_lens"], a["context_lens"], a["block_tables"], a["slot_mapping"])
    paged_attention_reference(qr, kr * 2, a["v"] * 2, pool, 1, *paged, 0.35, m.window)   # the pool of layer 1
    attn = paged_attention_reference(qr, kr, a["v"], a["kv_cache"].clone(), 1, *paged, 0.35, m.window, m.softcap)
    paged_attention_reference(qr, kr, a["v"], pool, 0, *paged, 0.35, m.window)
    return [rms_norm_reference(a["x"], m.norm_w, 1e-5), *fused_add_rms_norm_reference(a["x"], a["residual"], m.norm_w,
                                                                                        1e-5),
            qr, kr, silu_mul_reference(a["x"], a["residual"]), gelu_reference(a["x"], "tanh"),
            gelu_reference(a["x"], "none"), float_linear_reference(a["xw"], wf.unpack_rows(m.w_packed), m.bias),
            weight_only_linear_reference(a["xw"], m.q8, m.s8, m.bias, 8, 0),
            weight_only_linear_reference(a["xw"], m.q8, m.s8, None, 8, 0),
            weight_only_linear_reference(a["xw4"], m.q4, m.s4, m.bias, 4, 32),
            float_linear_reference(a["xw"], wf.unpack(m.w_panels), None),
            weight_only_linear_reference(a["xw"], m.q8, m.s8, m.bias, 8, 0),
            weight_only_linear_reference(a["xw4"], m.p4, m.p4s, m.bias, 4, 32),
            weight_only_linear_reference(a["xw4"], m.pz, m.pzs, None, 4, 32, m.pzz), attn, pool]


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.8)])
def test_every_plugin_lowering_matches_its_reference(window, softcap, tmp_path):
    m, args = Probe(window, softcap).eval(), probe_inputs()
    program = torch.onnx.export(m, (), kwargs=args, dynamo=True, opset_version=OPSET,
                                custom_translation_table=lowerings(), verbose=False)
    path = tmp_path / "probe.onnx"
    program.save(str(path))
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}, "a lowering left a custom-domain op"
    assert {"DequantizeLinear", "ScatterND", "Softmax", "Gelu"} <= {n.op_type for n in model.graph.node}
    options = ort.SessionOptions()   # as the onnx runtime sets it: fp32 activations in the fused int4/int8 GEMMs
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {i.name: args[i.name].numpy() for i in session.get_inputs()}
    got = session.run(None, feed)
    want = probe_references(m, args)
    names = ["rms_norm", "fused_norm", "fused_sum", "rotary_q", "rotary_k", "silu_mul", "gelu_tanh", "gelu",
             "fp32_linear_packed", "int8", "int8_packed", "int4", "fp32_linear_panels", "int8_panels",
             "int4_panels", "int4_panels_zeros", "paged_attention", "kv_cache_update"]
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want):
        err = (torch.from_numpy(g) - w).abs().max().item()
        assert err <= 2e-5 * max(1.0, w.abs().max().item()), f"{name}: max abs error {err}"


def test_moe_lowering_matches_the_reference(tmp_path):
    """kiln::moe's dense lowering, for every expert format the builder stores (float, int8 and its panels, int4),
    against the sparse op's reference."""
    from test_moe import experts, formats

    moe_ref = importlib.import_module("kiln.plugins.moe").moe_reference
    router, gate_up, down = experts(11)

    class Block(torch.nn.Module):
        def __init__(self, gu, gus, dn, ds, bits, group, top_k, renormalize):
            super().__init__()
            self.args = (bits, group, top_k, renormalize)
            for name, t in (("router", router), ("gu", gu), ("gus", gus), ("dn", dn), ("ds", ds)):
                self.register_buffer(name, t)

        def forward(self, x):
            bits, group, top_k, renormalize = self.args
            return torch.ops.kiln.moe(x, self.router, self.gu, self.gus, self.dn, self.ds, top_k, renormalize, bits,
                                      group)

    x = torch.randn(7, router.shape[1], generator=torch.Generator().manual_seed(12))
    for i, (name, gu, gus, dn, ds, bits, group) in enumerate(formats(gate_up, down)):
        top_k, renormalize = (2, True) if i % 2 else (3, False)
        block = Block(gu, gus, dn, ds, bits, group, top_k, renormalize).eval()
        program = torch.onnx.export(block, (x,), dynamo=True, opset_version=OPSET, custom_translation_table=lowerings(),
                                    dynamic_shapes=({0: torch.export.Dim("t")},), verbose=False)
        path = tmp_path / f"moe{i}.onnx"
        program.save(str(path))
        onnx.checker.check_model(str(path), full_check=True)
        options = ort.SessionOptions()
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for t in (1, 7):
            got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x[:t].numpy()})[0])
            want = moe_ref(x[:t], router, gu, gus, dn, ds, top_k, renormalize, bits, group)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}, {t} tokens: {m}")


def test_functional_attention_matches_the_reference():
    """The torch form of the lowering's formulation (token-level mask over the gathered contexts)."""
    a = probe_inputs()
    for window, softcap in ((0, 0.0), (3, 0.0), (0, 0.5)):
        pool = a["kv_cache"].clone()
        paged = (a["seq_lens"], a["context_lens"], a["block_tables"], a["slot_mapping"], 0.2, window, softcap)
        want = paged_attention_reference(a["q"], a["k"], a["v"], pool, 0, *paged)
        got = torch.ops.kiln.paged_attention_functional(a["q"], a["k"], a["v"], a["kv_cache"], 0, *paged)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        updated = torch.ops.kiln.kv_cache_update(a["kv_cache"], [a["k"]], [a["v"]], a["slot_mapping"])
        torch.testing.assert_close(updated[0], pool[0])


class Int8KvProbe(torch.nn.Module):
    """Attention and the KV write over an int8 pool (the 8-bit rows: numbers + their scale's bytes)."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def forward(self, q, k, v, kv_cache, seq_lens, context_lens, block_tables, slot_mapping):
        ops = torch.ops.kiln
        attn = ops.paged_attention_functional(q, k, v, kv_cache, 1, seq_lens, context_lens, block_tables,
                                              slot_mapping, 0.35, self.window)
        return attn, ops.kv_cache_update(kv_cache, [k, k * 2], [v, v * 2], slot_mapping)


@pytest.mark.parametrize("window", [0, 5])
def test_int8_kv_lowering_matches_the_reference(window, tmp_path):
    """The lowering quantizes as kiln.plugins.kv_quant does (pool bytes equal, scales from 1e-3 to 1e2, an
    all-zero row) and attends over the dequantized rows (DequantizeLinear) like the reference."""
    a = probe_inputs()
    g = torch.Generator().manual_seed(2)
    t = a["k"].shape[0]
    k = a["k"] * torch.logspace(-3, 2, t)[:, None, None]
    k[0, 0] = 0.0
    args = {**{n: a[n] for n in ("q", "v", "seq_lens", "context_lens", "block_tables", "slot_mapping")}, "k": k,
            "kv_cache": to_pool(torch.randn(a["kv_cache"].shape, generator=g) * 3, torch.int8)}
    program = torch.onnx.export(Int8KvProbe(window).eval(), (), kwargs=args, dynamo=True, opset_version=OPSET,
                                custom_translation_table=lowerings(), verbose=False)
    path = tmp_path / "int8_kv.onnx"
    program.save(str(path))
    onnx.checker.check_model(str(path), full_check=True)
    assert "DequantizeLinear" in {n.op_type for n in onnx.load(str(path)).graph.node}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    attn, pool = session.run(None, {i.name: args[i.name].numpy() for i in session.get_inputs()})
    paged = (args["seq_lens"], args["context_lens"], args["block_tables"], args["slot_mapping"], 0.35, window)
    want = paged_attention_reference(args["q"], k, args["v"], args["kv_cache"].clone(), 1, *paged)
    want_pool = args["kv_cache"].clone()
    paged_attention_reference(args["q"], k, args["v"], want_pool, 0, *paged)
    paged_attention_reference(args["q"], k * 2, args["v"] * 2, want_pool, 1, *paged)
    torch.testing.assert_close(torch.from_numpy(attn), want, atol=2e-5, rtol=1e-5)
    assert torch.equal(torch.from_numpy(pool), want_pool)
    torch_attn, torch_pool = Int8KvProbe(window)(**args)    # the torch form of the same formulation
    torch.testing.assert_close(torch_attn, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(torch_pool, want_pool)


# ------------------------------------------------------------------------------ onnx engines
@pytest.mark.parametrize("family", FAMILIES)
def test_onnx_engine_matches_the_cpu_engine(family, engine_of):
    ref, eng = engine_of(family), engine_of(family, backend="onnx")
    assert eng.backend == "onnx"
    onnx.checker.check_model(str(eng.directory / "rank0.engine"), full_check=True)
    model = onnx.load(str(eng.directory / "rank0.engine"), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert list(dims) == list(INPUT_NAMES) and [o.name for o in model.graph.output] == [OUTPUT_NAME, KV_CACHE_OUTPUT]
    assert dims["block_tables"] == ["num_seqs", "max_blocks_per_seq"] and dims["kv_cache"][2] == "num_blocks"
    assert dims["input_ids"] == dims["slot_mapping"] == ["num_tokens"]
    vocab = ref.config.model.vocab_size
    tokens, want = run_schedule(ref, vocab)
    tokens2, got = run_schedule(eng, vocab)
    assert tokens == tokens2
    err = max((got[s][p] - want[s][p]).abs().max().item() for s in want for p in want[s])
    print(f"\n{family}: onnx engine vs cpu engine, max abs logit error {err:.2e} over the mixed schedule")
    assert err <= FP32_ATOL, err
    report = json.loads((eng.directory / "build_report.json").read_text())
    assert report["backend"]["opset"] == OPSET and report["passes"]["functional_kv"]["layers"] > 0
    assert "skipped" in report["passes"]["fast_linear"]


def test_onnx_int8_kv_engine_matches_the_cpu_one(engine_of):
    """An int8 KV pool through onnxruntime gives the cpu engine's int8 logits over the mixed schedule (chunks,
    decodes, a sliding window), up to keys that differ by a rounding step where the two graphs' fp32 keys differ
    by an ulp: far closer to it than either is to the fp32 pool."""
    ref, eng = engine_of("mistral", kv_cache_dtype="int8"), engine_of("mistral", backend="onnx", kv_cache_dtype="int8")
    assert eng.kv_dtype == torch.int8 and eng.kv_bytes_per_token == ref.kv_bytes_per_token
    vocab = ref.config.model.vocab_size
    _, want = run_schedule(ref, vocab)
    _, got = run_schedule(eng, vocab)
    _, fp32 = run_schedule(engine_of("mistral"), vocab)

    def diff(a, b):
        return max((a[s][p] - b[s][p]).abs().max().item() for s in b for p in b[s])

    err, quant_err = diff(got, want), diff(want, fp32)
    print(f"\nint8 KV: onnx vs cpu {err:.2e}, cpu int8 vs fp32 pool {quant_err:.2e} (max abs logit error)")
    assert err <= 0.25 * quant_err and err < 1e-2, (err, quant_err)
    report = json.loads((eng.directory / "build_report.json").read_text())
    assert report["backend"]["dequantize_nodes"] > 0


def test_onnx_engine_writes_the_pool_in_place(engine_of):
    ref, eng = engine_of("mistral"), engine_of("mistral", backend="onnx")
    pools = []
    for e in (ref, eng):
        kv = e.allocate_kv_cache(40)
        steps = [[SeqChunk(list(range(3, 14)), 0, [7, 2, 30]), SeqChunk([5, 6], 0, [11])],
                 [SeqChunk([9], 11, [7, 2, 30]), SeqChunk([4, 8, 9], 2, [11, 12])]]
        ptr = kv.data_ptr()
        for chunks in steps:
            e.run(pack_inputs(chunks, kv, 4))
        assert kv.data_ptr() == ptr
        pools.append(kv)
    assert pools[1].abs().sum() > 0
    torch.testing.assert_close(pools[1], pools[0], atol=1e-5, rtol=1e-5)


def test_onnx_engine_without_logits_rows(engine_of):
    eng = engine_of("llama", backend="onnx")
    kv = eng.allocate_kv_cache(8)
    inputs = pack_inputs([SeqChunk([3, 4, 5, 6], 0, [1])], kv, 4)
    inputs["logits_indices"] = inputs["logits_indices"][:0]
    assert eng.run(inputs).shape == (0, eng.config.model.vocab_size)
    assert kv.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_onnx_engine_concurrent_greedy_matches_transformers(family, engine_of, checkpoint_dir):
    ckpt = checkpoint_dir(family)
    eng = engine_of(family, backend="onnx")
    prompts = random_prompts(6, eng.config.model.vocab_size, 3, 40, seed=11)
    with LLM(eng) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ckpt, prompt, 12, ignore_eos=True), f"{family}: prompt {prompt}"


def test_onnx_engine_speculative_greedy_matches_transformers(engine_of, checkpoint_dir):
    """ngram speculation on an onnx engine: the (1 + k)-row verify steps go through onnxruntime's graph like any
    packed step (their logits rows by logits_indices), so greedy outputs stay transformers' and proposals are
    accepted and rolled back (the KV books balance after)."""
    ckpt = checkpoint_dir("llama")
    eng = engine_of("llama", backend="onnx")
    vocab = eng.config.model.vocab_size
    seg = random_prompts(3, vocab, 4, 9, seed=5)
    prompts = [s * 3 for s in seg] + random_prompts(2, vocab, 3, 30, seed=6)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(eng, speculative_config=spec) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        stats = llm.stats()["speculative"]
        llm.executor.kv.check_consistency()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ckpt, prompt, 16, ignore_eos=True), f"prompt {prompt}"
    assert 0 < stats["accepted_tokens"] <= stats["proposed_tokens"], stats


def test_onnx_weight_only_engines_match_the_cpu_ones(engine_of):
    """Same quantized weights, same definition (dequantize, fp32 GEMM): the onnx int8/int4 engines agree with
    the cpu engine's kernels to their activation rounding."""
    for quant in ("int8_weight_only", "int4_weight_only"):
        ref = engine_of("llama", quantization=quant, group_size=32)
        eng = engine_of("llama", backend="onnx", quantization=quant, group_size=32)
        facts = json.loads((eng.directory / "build_report.json").read_text())["backend"]
        assert facts["dequantize_nodes"] == facts["dequantize_on_initializers"] > 0, facts
        _, want = run_schedule(ref, ref.config.model.vocab_size)
        _, got = run_schedule(eng, eng.config.model.vocab_size)
        err = max((got[s][p] - want[s][p]).abs().max().item() for s in want for p in want[s])
        assert err <= 5e-3, (quant, err)


def test_onnx_engine_load_errors(engine_of, tmp_path):
    import shutil

    src = engine_of("gpt2", backend="onnx").directory
    d = tmp_path / "engine"
    shutil.copytree(src, d)
    (d / "rank0.engine").write_bytes(b"not an onnx model" * 10)
    with pytest.raises(EngineLoadError, match="checksum mismatch"):
        Engine.from_dir(d)
    with pytest.raises(EngineLoadError, match="onnxruntime cannot load the onnx engine"):
        Engine.from_dir(d, verify=False)


# ------------------------------------------------------------------------------ tensorrt
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tensorrt_plan_has_the_build_configs_profiles_and_io(family, checkpoint_dir, tmp_path):
    build = BUILD.replace(backend="tensorrt", num_tokens_profiles=[4, 256], opt_num_tokens=64, max_num_blocks=200)
    out = build_engine(checkpoint_dir(family), tmp_path / "engine", build)
    facts = json.loads((out / "build_report.json").read_text())["backend"]
    assert facts["format"] == "tensorrt-plan" and facts["plan_bytes"] == (out / "rank0.engine").stat().st_size > 0
    net = facts["network"]
    assert [t["name"] for t in net["inputs"]] == list(INPUT_NAMES)
    assert [t["name"] for t in net["outputs"]] == [OUTPUT_NAME, KV_CACHE_OUTPUT]
    assert [t["dtype"] for t in net["inputs"]] == ["INT64", "INT64", "INT32", "INT32", "INT32", "INT64", "INT64",
                                                   "FLOAT"]
    # the bounds the BuildConfig implies, written out here (not taken from the backend's own helper)
    b = build.engine_bounds()
    mb = b.max_blocks_per_seq
    want = [
        {"num_tokens": [1, 4, 4], "num_seqs": [1, 4, 4], "num_logits": [0, 4, 4], "max_blocks_per_seq": [1, mb, mb],
         "num_blocks": [1, 4 * mb, 200]},
        {"num_tokens": [5, 64, 256], "num_seqs": [1, 4, 4], "num_logits": [0, 64, 256],
         "max_blocks_per_seq": [1, mb, mb], "num_blocks": [1, 4 * mb, 200]},
    ]
    assert [p["dims"] for p in facts["profiles"]] == want
    m = json.loads((out / "config.json").read_text())["model"]
    pool = [m["num_layers"], 2, None, 4, m["num_kv_heads"], m["head_dim"]]
    for profile, dims in zip(facts["profiles"], want):   # the shapes read back from TensorRT's profile objects
        shapes = profile["shapes"]
        for k in range(3):
            assert shapes["input_ids"][k] == [dims["num_tokens"][k]]
            assert shapes["block_tables"][k] == [dims["num_seqs"][k], dims["max_blocks_per_seq"][k]]
            assert shapes["logits_indices"][k] == [dims["num_logits"][k]]
            assert shapes["kv_cache"][k] == [*pool[:2], dims["num_blocks"][k], *pool[3:]]
    assert facts["engine_layers"] and any(line.startswith("INFO") for line in facts["log"])
    assert facts["onnx"]["opset"] == OPSET
    # the plan cannot run here: the load says what is missing, before any TensorRT runtime exists
    with pytest.raises(EngineLoadError, match="backend 'tensorrt' runs on an NVIDIA GPU.*lacks an NVIDIA GPU"):
        Engine.from_dir(out)
    # and kiln inspect shows the plan's facts
    from click.testing import CliRunner

    from kiln.runtime.cli import inspect

    shown = CliRunner().invoke(inspect, [str(out)])
    assert shown.exit_code == 0, shown.output
    assert "tensorrt plan" in shown.output and "profile 1" in shown.output and "num_tokens 5..256" in shown.output


def test_tensorrt_rejected_node_is_named(tmp_path):
    """A node TensorRT's parser rejects fails the build with its name and op type."""
    trt = trt_backend.import_tensorrt()
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])
    node = helper.make_node("KilnMystery", ["x"], ["y"], name="layers.3.mystery", domain="kiln.test")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("kiln.test", 1)])
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    log = trt_backend._Log(trt)
    network = trt.Builder(log.logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    with pytest.raises(EngineBuildError, match=r"node 'layers\.3\.mystery' \(op type KilnMystery\)"):
        trt_backend.parse_onnx(trt, network, path, log.logger)


def test_tensorrt_engine_load_without_gpu_does_not_crash(engine_of, tmp_path):
    """In a fresh process (a crash would kill it): a tensorrt engine directory on this machine gives the
    EngineLoadError naming what is missing."""
    import shutil

    d = tmp_path / "engine"
    shutil.copytree(engine_of("qwen2", backend="onnx").directory, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["backend"] = "tensorrt"
    (d / "config.json").write_text(json.dumps(cfg))
    code = ("from kiln.runtime import Engine\nfrom kiln.contract import EngineLoadError\n"
            f"try:\n    Engine.from_dir({str(d)!r})\nexcept EngineLoadError as e:\n    print('LOAD-ERROR', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOAD-ERROR" in done.stdout and "NVIDIA GPU" in done.stdout, done.stdout




def test_onnx_engine_with_external_weights(checkpoint_dir, engine_of, tmp_path, monkeypatch):
    """Above 2 GB the weights go to rank0.engine.data (forced here by a zero threshold): it is checksummed
    with the engine, and the engine runs as the inline one does."""
    from kiln.builder.backends import onnx as onnx_backend

    monkeypatch.setattr(onnx_backend, "EXTERNAL_DATA_BYTES", 0)
    out = build_engine(checkpoint_dir("qwen2"), tmp_path / "engine", BUILD.replace(backend="onnx"))
    cfg = json.loads((out / "config.json").read_text())
    assert (out / "rank0.engine.data").is_file() and "rank0.engine.data" in cfg["checksums"]
    assert (out / "rank0.engine").stat().st_size < (out / "rank0.engine.data").stat().st_size
    eng, ref = Engine.from_dir(out), engine_of("qwen2", backend="onnx")
    _, got = run_schedule(eng, eng.config.model.vocab_size)
    _, want = run_schedule(ref, ref.config.model.vocab_size)
    assert max((got[s][p] - want[s][p]).abs().max().item() for s in want for p in want[s]) == 0.0
    (out / "rank0.engine.data").unlink()
    with pytest.raises(EngineLoadError, match=r"rank0\.engine\.data"):
        Engine.from_dir(out)
