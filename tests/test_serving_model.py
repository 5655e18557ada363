"""scripts/serving_model.py: the step-loop model replays arrivals through the real Scheduler on a virtual clock, so its
times follow from the knobs exactly as the scheduler applies them."""

from __future__ import annotations

import json

import pytest
from serving_model import load_runs, quantile, replay  # scripts/ (pytest's pythonpath)

BOUNDS = dict(max_batch_size=8, max_num_tokens=512, max_seq_len=1024, max_input_len=1024, tokens_per_block=16,
              max_num_logits=8)
A, B = 0.01, 0.001   # a step: 10 ms + 1 ms a token
PLAIN = dict(step=(A, B), decode_attention=0.0, prefill_attention=0.0)


def test_one_request_is_one_prefill_step_then_decode_steps():
    ttft, tpot = replay([(0.0, 100, 5)], BOUNDS, budget=None, lead=0.0, **PLAIN)
    assert ttft == [pytest.approx(A + 100 * B)]
    assert tpot == [pytest.approx(A + B)]


def test_a_short_prompt_within_the_lead_goes_before_a_long_one():
    arrivals = [(0.0, 1000, 2), (0.0, 10, 2)]   # the long one first in arrival order
    fcfs, _ = replay(arrivals, BOUNDS, budget=None, lead=0.0, **PLAIN)
    lead, _ = replay(arrivals, BOUNDS, budget=None, lead=2.0, **PLAIN)
    assert fcfs[1] == pytest.approx(fcfs[0])   # first come: it waits for the long prompt's last chunk
    assert lead[1] < fcfs[1] / 1.5              # within the lead: it rides in the long prompt's first step
    assert lead[0] >= fcfs[0] - 1e-9


def test_the_decoding_budget_shortens_the_steps_a_decode_rides_in():
    arrivals = [(0.0, 16, 10), (0.02, 1000, 2)]   # a long prompt arrives while the first request decodes
    ttft_capped, capped = replay(arrivals, BOUNDS, budget=64, lead=0.0, **PLAIN)
    ttft_free, free = replay(arrivals, BOUNDS, budget=None, lead=0.0, **PLAIN)
    # uncapped: its 9 steps carry the whole prompt (two chunks); capped: no step it rides in holds over 64 tokens
    assert free[0] >= (9 * A + 1000 * B) / 9
    assert capped[0] <= A + 64 * B + 1e-12 and capped[0] < free[0] / 1.5
    assert ttft_capped[1] > ttft_free[1]   # the prompt pays a step's fixed cost per 63-token chunk


def test_a_backlog_switches_to_the_larger_budget():
    arrivals = [(0.0, 16, 60)] + [(0.05, 600, 2)] * 3   # 1800 prompt tokens wait while the first decodes
    ttft_low, _ = replay(arrivals, BOUNDS, budget=64, lead=0.0, **PLAIN)
    ttft_switch, _ = replay(arrivals, BOUNDS, budget=64, lead=0.0, backlog_budget=512, backlog=1000, **PLAIN)
    assert max(ttft_switch) < max(ttft_low)


def test_load_runs_reads_a_bench_result(tmp_path):
    recs = [dict(sent=0.5, prompt_len=10, output_len=3, ttft=0.2, tpot=0.05),
            dict(sent=0.1, prompt_len=20, output_len=1, ttft=0.3, tpot=None)]
    (tmp_path / "result.json").write_text(json.dumps(dict(engine=dict(bounds=BOUNDS),
                                                          runs=[dict(rate=1.0, per_request=recs)])))
    bounds, runs = load_runs(tmp_path / "result.json")
    assert bounds == BOUNDS
    assert runs == [dict(rate=1.0, arrivals=[(0.1, 20, 1), (0.5, 10, 3)], ttft=[0.2, 0.3], tpot=[0.05])]
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
