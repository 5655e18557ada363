"""The recommended per-step token budgets: each bound they are chosen between holds, the TPOT bound caps the steps
that carry decodes (decoding_max_num_tokens), both are block-aligned within the engine's bound, and kiln plan prints
them with the prefill chunk and the queue's short-prompt lead."""

from __future__ import annotations

import itertools
import math

import pytest

from kiln.bench.serving_knobs import recommend_token_budget


def step(a, b, n):
    return a + b * n


@pytest.mark.parametrize("a, b, tpot, ttft, p95", list(itertools.product(
    (0.005, 0.03, 0.08), (1e-4, 5e-4, 2e-3), (None, 0.1, 0.2, 0.5), (None, 1.0, 2.0), (200, 1800))))
def test_every_recommendation_is_consistent(a, b, tpot, ttft, p95):
    r = recommend_token_budget(a, b, block=16, engine_max=2048, decodes=8, prompt_p95=p95, slo_ttft_s=ttft,
                               slo_tpot_s=tpot)
    n = r.max_num_tokens
    d = r.decoding_max_num_tokens or n                 # the budget of a step that carries decodes
    assert 16 + 8 <= n <= 2048 and (n % 16 == 0 or n == 2048)
    assert 16 + 7 <= d <= n and (d % 16 == 0 or d == n)
    assert r.prefill_chunk == d - 8
    assert r.amortized_min == math.ceil(9 * a / b)
    if tpot is not None and r.tpot_max >= 32:          # a feasible TPOT bound is never exceeded by a decode's step
        assert step(a, b, d) <= tpot + 1e-12
    assert (r.short_prompt_lead_s is None) == (ttft is None)
    assert r.tpot_target_s == (None if tpot is None else tpot / 2)
    feasible_ttft = ttft is not None and p95 * b < ttft
    assert (r.ttft_min is not None) == feasible_ttft
    if tpot is None:   # nothing caps it: at least what amortizes the fixed cost and what TTFT needs (or the bound)
        assert n >= min(2048, max(r.amortized_min, r.ttft_min or 0) // 16 * 16)
    if feasible_ttft and (r.tpot_max is None or r.tpot_max >= r.ttft_min + 16) and r.ttft_min <= 2048:
        chunks = math.ceil(p95 / (d - 8))
        assert p95 * b + chunks * step(a, b, 8) <= ttft + 1e-9   # the p95 prompt's chunks fit its TTFT target
    assert r.reason


def test_tpot_bound_caps_decoding_steps_and_looser_slos_never_shrink_the_budgets():
    tight = recommend_token_budget(0.05, 1.5e-3, block=16, engine_max=2048, decodes=4, prompt_p95=1800,
                                   slo_ttft_s=5.0, slo_tpot_s=0.2)
    assert tight.tpot_max == 100 and tight.decoding_max_num_tokens == 96 and tight.prefill_chunk == 92
    assert tight.max_num_tokens == 304 and "decoding_max_num_tokens" in tight.reason   # 9 a / b = 300 -> 304
    # a full batch of decodes must leave a block for a chunk: the executor's floor raises the TPOT bound
    wide = recommend_token_budget(0.05, 1.5e-3, block=16, engine_max=2048, decodes=4, prompt_p95=1800,
                                  slo_ttft_s=5.0, slo_tpot_s=0.2, max_batch_size=128)
    assert wide.decoding_max_num_tokens == 143 and "raised to the 143" in wide.reason
    prev = (0, 0)
    for tpot in (0.1, 0.2, 0.4, 0.8, None):
        r = recommend_token_budget(0.05, 1.5e-3, block=16, engine_max=2048, decodes=4, prompt_p95=1800,
                                   slo_ttft_s=5.0, slo_tpot_s=tpot)
        now = (r.max_num_tokens, r.decoding_max_num_tokens or r.max_num_tokens)
        assert now >= prev and now[0] >= prev[0] and now[1] >= prev[1]
        prev = now
    capped = recommend_token_budget(0.05, 1e-5, block=16, engine_max=512, decodes=4, prompt_p95=100)
    assert capped.max_num_tokens == 512 and "capped at the engine's" in capped.reason


def test_unreachable_ttft_is_said_and_a_bad_fit_refused():
    r = recommend_token_budget(0.05, 2e-3, block=16, engine_max=2048, decodes=4, prompt_p95=1800, slo_ttft_s=2.0)
    assert r.ttft_min is None and "past the TTFT target" in r.reason
    for a, b in ((0.0, 1e-3), (0.01, 0.0), (-1.0, 1e-3)):
        with pytest.raises(ValueError, match="a > 0 and b > 0"):
            recommend_token_budget(a, b, block=16, engine_max=2048, decodes=1, prompt_p95=10)


def test_kiln_plan_prints_the_budget_and_the_chunk(tmp_path):
    import json

    from click.testing import CliRunner

    from kiln.bench.plan_cli import plan

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
                               "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16,
                               "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 2048,
                               "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(plan, ["--hf-config", str(cfg), "--device", "cpu:24", "--bandwidth", "20", "--flops",
                                  "2", "--context-p95", "1800", "--context-mean", "640", "--output-p95", "60",
                                  "--output-mean", "22", "--ttft-p95", "2s", "--tpot-p95", "200ms",
                                  "--output", str(out)])
    assert r.exit_code == 0, r.output
    st = json.loads(out.read_text())["plan"]["settings"]
    n, chunk = st["max_num_tokens"]["value"], st["prefill_chunk"]["value"]
    decoding = st["decoding_max_num_tokens"]["value"]
    assert 16 <= decoding < n <= 8192 and n % 16 == 0 and decoding % 16 == 0 and 0 < chunk < decoding
    assert "TPOT" in st["decoding_max_num_tokens"]["source"] and st["short_prompt_lead_s"]["value"] == 1.0
    assert st["tpot_target_s"]["value"] == 0.1
    for name in ("max_num_tokens", "decoding_max_num_tokens", "prefill_chunk", "short_prompt_lead_s", "tpot_target_s"):
        assert name in r.output
