"""The 2026 families end to end (Qwen3, Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE): engines built from random
transformers checkpoints (each with its special features: per-layer windows shorter than the prompts,
soft-capping, local rotary bases, fused projections, experts), served through ``LLM``.

Per family: the greedy outputs of 24 concurrent requests of mixed lengths equal transformers' greedy generation of
each prompt alone (fp32); an int8 weight-only engine's top-1 agreement with transformers is printed (and bounded
loosely: it measures quantization, not a bug). The onnx backend for Qwen3 and Gemma 3. (Logits parity in fp32 and
bf16 over mixed packed steps: tests/test_model_parity.py; TP=2: tests/test_tensor_parallel.py.)
"""

from __future__ import annotations

import json
import random

import pytest

from kiln.runtime import LLM, SamplingParams

from runtime_support import get_engine, hf_greedy, random_prompts

pytestmark = [pytest.mark.xdist_group("families"), pytest.mark.usefixtures("hang_watchdog")]

VOCAB = 512
NEW_FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"]
ONNX_FAMILIES = ["qwen3", "gemma3", "qwen3_moe"]


def workload(seed: int, n: int = 24):
    """n prompts of 1..60 tokens (longer than the test checkpoints' windows of 8) and 1..16 new tokens each."""
    rng = random.Random(seed)
    prompts = random_prompts(n, VOCAB, 1, 60, seed=seed)
    return prompts, [rng.randint(1, 16) for _ in prompts]


def mismatches(ckpt, prompts, max_tokens, outs) -> list[str]:
    return [f"request {i} ({len(p)} prompt tokens): kiln {o.token_ids} != hf {ref}"
            for i, (p, m, o) in enumerate(zip(prompts, max_tokens, outs))
            if o.token_ids != (ref := hf_greedy(ckpt, p, m))]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_24_concurrent_greedy_requests_match_transformers(family, checkpoint_dir):
    ckpt = checkpoint_dir(family)
    prompts, max_tokens = workload(seed=len(family))
    engine = get_engine(ckpt)
    passes = json.loads((engine.directory / "build_report.json").read_text())["passes"]
    layers = engine.config.model.num_layers
    assert passes["merge_qkv"]["merged"] == layers, "q/k/v (Phi-3: split from qkv_proj) were not merged back"
    assert passes["fast_linear"]["packed_moe_layers"] == len(engine.config.model.moe_layers)   # experts in panels
    with LLM(engine) as llm:
        outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])
        biggest = max(s.batch_size for s in llm.executor.metrics.steps)
    bad = mismatches(ckpt, prompts, max_tokens, outs)
    assert not bad, "\n".join(bad)
    assert biggest >= 8, "requests were not batched"
    assert max(len(p) for p in prompts) > 16


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_int8_top1_agreement(family, checkpoint_dir):
    """The first generated token (the argmax after each whole prompt) of an int8 weight-only engine against
    transformers fp32; printed for the report."""
    ckpt = checkpoint_dir(family)
    prompts, _ = workload(seed=100 + len(family))
    engine = get_engine(ckpt, quantization="int8_weight_only")
    passes = json.loads((engine.directory / "build_report.json").read_text())["passes"]
    assert passes["weight_only_quant"]["quantized_moe_layers"] == len(engine.config.model.moe_layers)
    with LLM(engine) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    agree = sum(o.token_ids == hf_greedy(ckpt, p, 1, ignore_eos=True) for p, o in zip(prompts, outs)) / len(prompts)
    print(f"\n{family}: int8 weight-only top-1 agreement with transformers fp32: {agree:.0%} of {len(prompts)}")
    assert agree >= 0.5, f"{family}: int8 top-1 agreement {agree:.0%} (random guessing: 0.2%)"


@pytest.mark.parametrize("family", ONNX_FAMILIES)
def test_onnx_engine_greedy_matches_transformers(family, checkpoint_dir):
    ckpt = checkpoint_dir(family)
    prompts, _ = workload(seed=200 + len(family), n=6)
    engine = get_engine(ckpt, backend="onnx")
    assert engine.backend == "onnx"
    with LLM(engine) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ckpt, p, 10, ignore_eos=True), f"{family}: prompt of {len(p)} tokens"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_cpu_compiled_moe_engine_greedy_matches_transformers(family, checkpoint_dir):
    """A cpu-compiled MoE graph calls kiln::moe through its C shim (kiln.plugins.aoti_shims; top-k renormalized in
    Mixtral, not in Qwen3-MoE): greedy outputs equal transformers'."""
    import zipfile

    ckpt = checkpoint_dir(family)
    prompts, _ = workload(seed=300 + len(family), n=6)
    engine = get_engine(ckpt, backend="cpu-compiled")
    with zipfile.ZipFile(engine.directory / "rank0.engine") as z:
        src = next(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))
    assert "aoti_torch_cpu_moe(" in src and "proxy_executor_call_function(" not in src
    with LLM(engine) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(ckpt, p, 10, ignore_eos=True), f"{family}: prompt of {len(p)} tokens"


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3"])
def test_engine_knows_total_and_active_parameters_and_bytes_read(family, checkpoint_dir):
    """config.json's memory section: the parameters (transformers' count), those one token uses (an MoE token: its
    top_k experts), and the weight bytes a decode step of one sequence reads (the memory plan: one embedding row, the
    chosen share of the experts); ``kiln inspect`` and ``kiln plan`` show them."""
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from kiln.bench.devices import get_device
    from kiln.bench.engine_facts import engine_facts
    from kiln.bench.planner import WorkloadStats, plan
    from kiln.contract import load_weights
    from kiln.runtime.cli import main as kiln_main

    ckpt = checkpoint_dir(family)
    engine = get_engine(ckpt)
    m, mem = engine.config.model, engine.config.memory
    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    assert mem.total_params == sum(p.numel() for p in hf.parameters())
    stored = load_weights(engine.directory / "rank0.weights")
    experts = sum(t.numel() * t.element_size() for n, t in stored.items() if "experts" in n)
    share = m.num_experts_per_tok / m.num_experts if m.is_moe else 1.0
    table = m.vocab_size * m.hidden_size * 4   # an untied embedding table: one row read
    expected = mem.weights_bytes - experts * (1 - share) - (0 if m.tie_word_embeddings else table * (1 - 1 / 512))
    assert mem.decode_read_bytes == pytest.approx(expected, abs=16)
    # what runtime.weight_pages leaves mapped: the untied table (a tied one is the LM head's panels, read whole)
    assert mem.gathered_weights == ([] if m.tie_word_embeddings else ["embed_tokens.weight"])
    rows = dict(tuple(p.strip() for p in line.split("|", 1)) for line in
                CliRunner().invoke(kiln_main, ["inspect", str(engine.directory)]).output.splitlines() if "|" in line)
    assert rows["decode reads"].endswith("of weights per step of one sequence")
    facts = engine_facts(engine.directory)
    assert facts.streamed_weight_bytes == mem.decode_read_bytes and facts.expert_share == share
    step = plan(facts, get_device("cpu:24"), WorkloadStats.from_percentiles(40, 20))["step_time"]
    if m.is_moe:
        unused = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n) * (1 - share)
        assert mem.active_params == mem.total_params - unused
        assert rows["parameters"].endswith(f"active per token (4 of 16 experts in {len(m.moe_layers)} of 2 layers)")
        assert "(25% of the experts)" in step["decode_step_batch_1"]["source"]
        assert facts.expert_bytes > 0 and facts.active_params == mem.active_params
    else:
        assert mem.active_params == mem.total_params and "active" not in rows["parameters"]
