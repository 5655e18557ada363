"""kiln plan: the planner's KV pool is the runtime's, its memory arithmetic, TP terms, errors and CLI."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kiln.bench.devices import GB, GiB, get_device, parse_bytes
from kiln.bench.engine_facts import FactsError, engine_facts, hf_facts
from kiln.bench.plan_cli import plan as plan_cmd
from kiln.bench.planner import (
    ALLREDUCE_HOP_S,
    PlanError,
    WorkloadStats,
    allgather_seconds,
    allreduce_seconds,
    plan,
)

from runtime_support import get_engine

pytestmark = pytest.mark.xdist_group("tiny-engine")

LLAMA_8B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny(checkpoint_dir):
    return get_engine(checkpoint_dir("llama"))


@pytest.mark.parametrize("options", [
    dict(max_batch_size=4, kv_cache_memory_fraction=2e-5),          # limited by memory
    dict(kv_cache_memory_fraction=0.5),                             # limited by what the bounds can use
    dict(max_kv_cache_tokens=200, kv_cache_memory_fraction=None),   # limited by the token cap
    dict(max_batch_size=2, max_num_tokens=64, max_kv_cache_tokens=10**6, kv_cache_memory_fraction=0.9),
])
def test_planner_pool_equals_what_llm_allocates(tiny, options):
    from kiln.runtime import LLM

    llm = LLM(tiny, **options)
    try:
        ex = llm.executor
        p = plan(engine_facts(tiny.directory), get_device("cpu:24"), WorkloadStats.from_percentiles(40, 20),
                 available_bytes=ex.limits.available_bytes if ex.limits.available_bytes is not None else 10**12,
                 **options)
        mem = p["memory"]
        assert mem["kv_pool_blocks"]["value"] == ex.kv.num_blocks == ex.kv_cache.shape[2]
        assert mem["kv_pool_tokens"]["value"] == ex.kv.num_blocks * ex.block_size
        assert mem["kv_pool_bytes"]["value"] == ex.kv_cache.numel() * ex.kv_cache.element_size()
        assert mem["kv_pool_blocks"]["source"].endswith(ex.kv_plan)
        assert min(ex.limits.max_batch_size, p["concurrency"]["kv_sequences_at_p95"]["value"]) == \
            p["concurrency"]["max_concurrent_sequences"]["value"]
    finally:
        llm.shutdown()


def test_memory_arithmetic_and_recommended_fraction(tiny):
    facts = engine_facts(tiny.directory)
    dev = get_device("cpu:1")
    p = plan(facts, dev, WorkloadStats.from_percentiles(40, 20))
    avail = 1 * GiB - facts.weights_bytes
    assert p["memory"]["available_after_weights"]["value"] == avail
    rec = p["memory"]["kv_cache_memory_fraction"]["value"]
    assert rec == int(100 * (avail * 0.9 - facts.activation_peak_bytes) / avail) / 100
    # a fraction that leaves less than the activation peak is flagged
    tight = plan(facts, get_device("cpu:1"), WorkloadStats.from_percentiles(40, 20), kv_cache_memory_fraction=1.0)
    assert "activation peak" in tight["memory"]["warning"]["value"]


def test_hf_config_estimate_matches_known_sizes(tmp_path, tiny, checkpoint_dir):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    f = hf_facts(cfg, "bfloat16")
    assert f.kv_bytes_per_token == 128 * 1024                    # 2 x 32 layers x 8 heads x 128 dims x 2 B
    assert f.weights_bytes / 2 == pytest.approx(8.03e9, rel=0.01)  # Llama-3-8B: 8.03B parameters
    assert hf_facts(cfg, "bfloat16", "int8_weight_only").weights_bytes < 0.6 * f.weights_bytes
    # the estimate of a model we did build agrees with the builder's numbers
    built = engine_facts(tiny.directory)
    est = hf_facts(checkpoint_dir("llama"), "float32")
    assert est.kv_bytes_per_token == built.kv_bytes_per_token
    assert est.matmul_params == built.matmul_params
    assert est.weights_bytes == pytest.approx(built.weights_bytes, rel=0.05)


def test_8bit_kv_cache_plans_about_twice_the_tokens(tmp_path):
    """An int8 / fp8 pool: each row is head_dim bytes + a 2-byte scale, so a bf16 model's pool holds
    128 / 65 of the tokens; the planner sizes it with those bytes and serves more sequences."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    bf16 = hf_facts(cfg, "bfloat16", max_batch_size=256, max_seq_len=8192)
    int8 = hf_facts(cfg, "bfloat16", max_batch_size=256, max_seq_len=8192, kv_cache_dtype="int8")
    assert int8.kv_cache_dtype == "int8" and bf16.kv_cache_dtype == "bfloat16"
    assert int8.kv_bytes_per_token == 2 * 32 * 8 * (128 + 2) == 66560
    assert "(head_dim + 2 B scale) x 1 B (int8)" in int8.origin["kv_bytes_per_token"]
    w = WorkloadStats.from_percentiles(4000, 500, context_mean=1500, output_mean=200)
    a, b = plan(bf16, get_device("h100-80gb"), w), plan(int8, get_device("h100-80gb"), w)
    assert b["inputs"]["kv_cache_dtype"]["value"] == "int8"
    ratio = b["memory"]["kv_pool_tokens"]["value"] / a["memory"]["kv_pool_tokens"]["value"]
    assert ratio == pytest.approx(128 / 65, rel=0.01)
    most = [x["concurrency"]["max_concurrent_sequences"]["value"] for x in (a, b)]
    assert most[1] > 1.8 * most[0], most
    with pytest.raises(FactsError, match="kv_cache_dtype 'int4'"):
        hf_facts(cfg, "bfloat16", kv_cache_dtype="int4")


def test_tensor_parallel_divides_memory_and_adds_allreduce(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    f = hf_facts(cfg, "bfloat16", max_batch_size=64, max_seq_len=8192)
    w = WorkloadStats.from_percentiles(4000, 500, context_mean=1500, output_mean=200)
    one = plan(f, get_device("h100-80gb"), w)
    two = plan(f, get_device("h100-80gb"), w, tp=2)
    table = 128256 * 4096 * 2    # the embedding table stays whole on each device
    assert two["memory"]["weights_per_device"]["value"] == int((f.weights_bytes - table) / 2 + table)
    assert two["memory"]["kv_bytes_per_token_per_device"]["value"] == f.kv_bytes_per_token // 2
    assert two["memory"]["kv_pool_blocks"]["value"] > 2 * one["memory"]["kv_pool_blocks"]["value"] * 0.99
    assert "all-reduce + logits gather 0.00 ms" in one["step_time"]["decode_step_batch_1"]["source"]
    assert "all-reduce + logits gather 0.00 ms" not in two["step_time"]["decode_step_batch_1"]["source"]
    # 2 all-reduces of hidden x 2 B per token per layer, ring over 2 devices, 5 us per hop
    expect = 32 * 2 * (2 * 1 / 2 * 16 * 4096 * 2 / 450e9 + 2 * 1 * ALLREDUCE_HOP_S)
    assert allreduce_seconds(32, 4096, 2, 16, 2, 450e9) == pytest.approx(expect)
    assert allreduce_seconds(32, 4096, 2, 16, 1, 450e9) == 0.0
    # and the vocab-parallel LM head's logits, gathered once per step: (tp - 1) / tp of 16 rows of the vocabulary
    assert allgather_seconds(128256, 2, 16, 2, 450e9) == pytest.approx(1 / 2 * 16 * 128256 * 2 / 450e9
                                                                       + ALLREDUCE_HOP_S)
    with pytest.raises(PlanError, match="tp_size=3 does not divide num_heads=32"):
        plan(f, get_device("h100-80gb"), w, tp=3)
    # 8 KV heads over 16 devices: replicated (2 devices hold each), as the builder does
    sixteen = plan(f, get_device("h100-80gb"), w, tp=16)["memory"]["kv_bytes_per_token_per_device"]
    assert sixteen["value"] == f.kv_bytes_per_token // 8 and "replicated on 2" in sixteen["source"]


def test_a_tensor_parallel_engine_is_planned_per_rank(checkpoint_dir, tmp_path):
    """A TP engine's facts are one rank's: planned as they are, on as many devices as it has ranks."""
    from kiln.builder import BuildConfig, build_engine

    from runtime_support import TEST_BUILD

    one = engine_facts(get_engine(checkpoint_dir("llama")).directory)
    two = engine_facts(build_engine(checkpoint_dir("llama"), tmp_path / "tp2", BuildConfig(**TEST_BUILD, tp_size=2)))
    assert two.tp_size == 2 and two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert one.weights_bytes / 2 < two.weights_bytes < one.weights_bytes
    w = WorkloadStats.from_percentiles(60, 30)
    dev = get_device("h100-80gb")
    p = plan(two, dev, w)
    assert p["inputs"]["tp"]["value"] == 2 and p["memory"]["weights_per_device"]["value"] == two.weights_bytes
    assert p["memory"]["kv_bytes_per_token_per_device"]["value"] == two.kv_bytes_per_token
    with pytest.raises(PlanError, match="built for 2 tensor-parallel ranks: plan it with --tp 2"):
        plan(two, dev, w, tp=1)


def test_weights_that_do_not_fit_are_refused(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64)))
    with pytest.raises(PlanError, match="quantize the weights or raise --tp"):
        plan(hf_facts(cfg, "bfloat16"), get_device("a100-80gb"), WorkloadStats.from_percentiles(1000, 100))


def test_devices_and_sizes():
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("80GB") == 80 * GB and parse_bytes("24G") == 24 * GiB
    assert parse_bytes("512") == 512
    assert get_device("cpu:24").memory_bytes == 24 * GiB
    assert get_device("H200").memory_bytes == 141 * GB
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        get_device("tpu")
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")


def test_plan_cli_writes_json_with_a_source_for_every_number(tiny, tmp_path):
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(plan_cmd, ["--engine", str(tiny.directory), "--device", "cpu:24", "--context-p95", "60",
                                      "--output-p95", "30", "--rate", "50", "--ttft-p95", "500ms",
                                      "--output", str(out)])
    assert r.exit_code == 0, r.output
    assert "max_concurrent_sequences" in r.output and "instances" in r.output
    data = json.loads(out.read_text())
    for section in data["plan"].values():
        for name, v in section.items():
            assert v["source"], name
    r = CliRunner().invoke(plan_cmd, ["--engine", str(tiny.directory), "--context-p95", "60", "--output-p95", "30"])
    assert r.exit_code != 0 and "--device NAME or --memory SIZE" in r.output
    r = CliRunner().invoke(plan_cmd, ["--engine", str(tiny.directory), "--device", "cpu:24", "--context-p95", "60",
                                      "--output-p95", "30", "--calibration", str(out)])
    assert r.exit_code != 0 and "not a kiln bench result" in r.output


def test_load_model_onset_is_the_first_limit_reached(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    f = hf_facts(cfg, "bfloat16", max_batch_size=64, max_num_tokens=2048, max_seq_len=8192)
    w = WorkloadStats.from_percentiles(4000, 500, context_mean=1500, output_mean=200)
    load = plan(f, get_device("l4"), w)["load"]
    A, K = load["fixed_step_cost"]["value"], load["engine_time_per_request"]["value"]
    lam = load["token_budget_rate"]["value"]
    assert lam * (1500 + 200) * A / (1 - lam * K) == pytest.approx(2048)     # tokens per step = the budget
    assert load["saturation_rate"]["value"] == pytest.approx(1 / K)
    assert load["queueing_onset_rate"]["value"] == min(lam, load["seat_limit_rate"]["value"])
    assert load["queueing_onset_rate"]["value"] < load["saturation_rate"]["value"]
    assert 0 < load["queueing_onset_concurrency"]["value"] <= 64


MIXTRAL_8X7B = dict(architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                    max_position_embeddings=32768, tie_word_embeddings=False, num_local_experts=8,
                    num_experts_per_tok=2)


def test_hf_config_estimate_of_an_moe_model(tmp_path):
    """Mixtral-8x7B: 46.7B parameters, 12.9B of them active per token (Mistral AI's figures); a decode step of one
    sequence streams 2 of 8 experts, a batch of 16 nearly all of them."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MIXTRAL_8X7B))
    f = hf_facts(cfg, "bfloat16", max_batch_size=64, max_seq_len=8192)
    assert f.total_params == pytest.approx(46.7e9, rel=0.01) and f.active_params == pytest.approx(12.9e9, rel=0.01)
    assert f.expert_share == 0.25 and f.expert_bytes == pytest.approx(32 * 8 * 3 * 4096 * 14336 * 2)
    assert f.streamed_weight_bytes == pytest.approx(2 * 12.9e9 - 2 * 32000 * 4096, rel=0.02)
    p = plan(f, get_device("h200"), WorkloadStats.from_percentiles(2000, 200), max_batch_size=16)
    step = p["step_time"]
    assert "(25% of the experts)" in step["decode_step_batch_1"]["source"]
    assert "(99% of the experts)" in step["decode_step_batch_16"]["source"]
    params = p["inputs"]["parameters"]["value"]
    assert params.startswith("46.70") and "12.880B active" in params


def _spec(engine, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(engine.directory), "num_speculative_tokens": k}


@pytest.mark.parametrize("options", [dict(max_batch_size=4, kv_cache_memory_fraction=2e-5),
                                     dict(max_kv_cache_tokens=200, kv_cache_memory_fraction=None)])
def test_a_draft_models_memory_is_what_llm_allocates(tiny, options):
    """Both pools from one budget split by bytes per token, the draft's weights out of the memory first: the
    planner's blocks and bytes are the executor's, for the target's pool and the draft's."""
    from kiln.bench.spec_plan import SpeculationInputs
    from kiln.runtime import LLM

    facts = engine_facts(tiny.directory)
    with LLM(tiny, speculative_config=_spec(tiny), **options) as llm:
        ex = llm.executor
        given = ex.limits.available_bytes + facts.weights_bytes if ex.limits.available_bytes is not None else 10**12
        p = plan(facts, get_device("cpu:24"), WorkloadStats.from_percentiles(40, 20), available_bytes=given,
                 speculation=SpeculationInputs("draft_model", 4, None, facts), **options)
        mem, draft = p["memory"], ex.proposer
        assert mem["kv_pool_blocks"]["value"] == ex.kv.num_blocks
        assert mem["draft_kv_pool_blocks"]["value"] == draft.kv.num_blocks
        assert mem["draft_kv_pool_bytes"]["value"] == draft.kv_cache.numel() * draft.kv_cache.element_size()
        assert mem["draft_weights"]["value"] == facts.weights_bytes
        assert mem["available_after_weights"]["value"] == given - facts.weights_bytes
    without = plan(facts, get_device("cpu:24"), WorkloadStats.from_percentiles(40, 20), available_bytes=given,
                   **options)
    if options.get("kv_cache_memory_fraction"):   # memory-bound: a draft's pool takes its share of the tokens
        assert without["memory"]["kv_pool_blocks"]["value"] > mem["kv_pool_blocks"]["value"]


def test_speculation_speed_model(tiny):
    """Acceptance 0 costs a step's extra work, acceptance 1 yields k + 1 tokens a step, the break-even rate is
    where the expected tokens pay the verify step plus the draft round, ngram has no draft round."""
    from kiln.bench.spec_plan import Acceptance, SpeculationInputs

    facts, work, dev = engine_facts(tiny.directory), WorkloadStats.from_percentiles(40, 20), get_device("cpu:24")

    def section(method, rate, k=4):
        acc = Acceptance(rate, None, "test") if rate is not None else None
        s = SpeculationInputs(method, k, acc, facts if method == "draft_model" else None)
        return plan(facts, dev, work, speculation=s)["speculative"]

    ngram0, ngram1, draft1 = section("ngram", 0.0), section("ngram", 1.0), section("draft_model", 1.0)
    assert ngram0["tokens_per_step"]["value"] == 1 and ngram0["speedup_batch_1"]["value"] < 1
    assert ngram1["tokens_per_step"]["value"] == 5
    assert "draft_round" not in ngram1 and draft1["draft_round"]["value"] > 0
    assert draft1["speedup_batch_1"]["value"] < ngram1["speedup_batch_1"]["value"]
    cost = ngram1["break_even_tokens_per_step"]["value"]
    assert cost == pytest.approx((ngram1["verify_step"]["value"]) / ngram1["plain_step"]["value"])
    a = ngram1["break_even_acceptance"]["value"]
    assert section("ngram", a)["speedup_batch_1"]["value"] == pytest.approx(1.0, abs=0.01)
    assert "note" in section("ngram", None)
    # the target as its own draft pays a full extra step per proposal: no acceptance makes that pay at k = 4
    assert draft1["break_even_tokens_per_step"]["value"] > 5 and draft1["break_even_acceptance"]["value"] is None


def test_plan_cli_speculation_options_and_errors(tiny, checkpoint_dir, tmp_path):
    base = ["--engine", str(tiny.directory), "--device", "cpu:24", "--context-p95", "60", "--output-p95", "30"]
    other_vocab = get_engine(checkpoint_dir("llama", vocab_size=640, num_hidden_layers=1))
    r = CliRunner().invoke(plan_cmd, base + ["--speculative-config", json.dumps(_spec(tiny)), "--spec-acceptance",
                                             "0.7"])
    assert r.exit_code == 0, r.output
    assert "draft_kv_pool_blocks" in r.output and "speedup_batch_1" in r.output
    r = CliRunner().invoke(plan_cmd, base + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                                             "--spec-acceptance", "0.5"])
    assert r.exit_code == 0 and "draft_weights" not in r.output and "tokens_per_step" in r.output, r.output
    bad = [(["--speculative-config", '{"method": "eagle"}'], "method"),
           (["--speculative-config", "{nope"], "not valid JSON"),
           (["--spec-acceptance", "0.5"], "goes with --speculative-config"),
           (["--speculative-config", '{"method": "ngram"}', "--spec-acceptance", "1.5"], "rate in [0, 1]"),
           (["--speculative-config", '{"method": "ngram"}', "--spec-acceptance", str(tmp_path / "none.json")],
            "no such file"),
           (["--speculative-config", json.dumps(_spec(other_vocab))], "vocabulary of 640 tokens")]
    for extra, message in bad:
        r = CliRunner().invoke(plan_cmd, base + extra)
        assert r.exit_code != 0 and message in r.output, (extra, r.output)
