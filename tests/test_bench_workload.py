"""kiln.bench workloads: trace parsing (and its errors), scaling, seeded arrivals, prompts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.bench import workload as wl


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


AZURE_LIKE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:05.5000000,110,27
"""


def test_csv_trace_with_iso_timestamps_of_seven_fractional_digits(tmp_path):
    rows = wl.read_trace(write(tmp_path, "t.csv", AZURE_LIKE))
    assert [r.prompt_len for r in rows] == [4808, 3180, 110]
    assert [r.output_len for r in rows] == [10, 8, 27]
    assert rows[0].arrival == 0.0
    assert rows[1].arrival == pytest.approx(0.052, abs=1e-6)
    assert rows[2].arrival == pytest.approx(1.52004, abs=1e-6)
    assert [r.line for r in rows] == [2, 3, 4]


def test_jsonl_trace_in_seconds_is_sorted_by_arrival(tmp_path):
    lines = [{"arrival_time": 2.0, "prompt_len": 5, "output_len": 1},
             {"arrival_time": 0.5, "prompt_len": 7, "output_len": 3}]
    rows = wl.read_trace(write(tmp_path, "t.jsonl", "\n".join(map(json.dumps, lines)) + "\n\n"))
    assert [(r.arrival, r.prompt_len, r.line) for r in rows] == [(0.0, 7, 2), (1.5, 5, 1)]


@pytest.mark.parametrize("row, message", [
    ("2023-11-16 18:17:04.1,abc,8", "line 3: ContextTokens 'abc' is not an integer"),
    ("2023-11-16 18:17:04.1,12,-1", "line 3: GeneratedTokens -1 must be >= 1"),
    ("2023-11-16 18:17:04.1,0,5", "line 3: ContextTokens 0 must be >= 1"),
    ("yesterday,12,3", "line 3: TIMESTAMP 'yesterday' is neither seconds nor an ISO date-time"),
    ("2023-11-16 18:17:04.1,12", "line 3: expected 3 fields"),
    ("2023-11-16 18:17:04.1,,3", "line 3: field ContextTokens is missing"),
])
def test_malformed_csv_row_names_its_line_and_field(tmp_path, row, message):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,4808,10\n" + row + "\n"
    with pytest.raises(wl.TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        wl.read_trace(write(tmp_path, "bad.csv", text))


def test_malformed_jsonl_and_missing_columns(tmp_path):
    with pytest.raises(wl.TraceError, match=r"bad.jsonl line 2: not valid JSON"):
        wl.read_trace(write(tmp_path, "bad.jsonl", '{"arrival": 0, "prompt_len": 3, "output_len": 1}\n{oops\n'))
    with pytest.raises(wl.TraceError, match=r"no output-length column; expected one of"):
        wl.read_trace(write(tmp_path, "cols.csv", "timestamp,prompt_len\n0,5\n"))
    with pytest.raises(wl.TraceError, match="no such trace file"):
        wl.read_trace(tmp_path / "missing.csv")
    with pytest.raises(wl.TraceError, match="has no requests"):
        wl.read_trace(write(tmp_path, "empty.csv", "timestamp,prompt_len,output_len\n"))


def test_window_max_requests_length_scales_and_clipping(tmp_path):
    text = "arrival,prompt_len,output_len\n" + "".join(f"{t},{p},{o}\n" for t, p, o in
                                                      [(0, 100, 10), (1, 2000, 3), (2, 40, 700), (3, 8, 1), (9, 50, 5)])
    rows = wl.read_trace(write(tmp_path, "t.csv", text))
    w = wl.trace_workload(rows, window=(1, 5), max_requests=2, prompt_scale=0.1, output_scale=0.5)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in w.requests] == [(0.0, 200, 2), (1.0, 4, 350)]
    tiny = wl.trace_workload(rows, window=(3, 4), prompt_scale=0.01, output_scale=0.01)
    assert [(r.prompt_len, r.output_len) for r in tiny.requests] == [(1, 1)]     # rounded, never below 1 token
    clipped = wl.clip_to_bounds(wl.trace_workload(rows), max_input_len=512, max_seq_len=600)
    assert [(r.prompt_len, r.output_len) for r in clipped.requests] == [(100, 10), (512, 3), (40, 560), (8, 1), (50, 5)]
    assert clipped.description["clip"]["prompts_clipped"] == 1 and clipped.description["clip"]["outputs_clipped"] == 1
    # an engine whose max_input_len is its max_seq_len: a prompt at the bound leaves room for one token
    fit = wl.clip_to_bounds(wl.trace_workload(rows), max_input_len=600, max_seq_len=600)
    assert [(r.prompt_len, r.output_len) for r in fit.requests] == [(100, 10), (599, 1), (40, 560), (8, 1), (50, 5)]
    assert all(r.prompt_len <= 599 and r.prompt_len + r.output_len <= 600 for r in fit.requests)
    clip = fit.description["clip"]
    counts = (clip["prompts_clipped"], clip["outputs_clipped"], clip["requests_clipped"], clip["requests"])
    assert counts == (1, 2, 2, 5)
    assert wl.clip_summary(clip).startswith("--clip-to-engine: 2 of 5 requests clipped (1 prompts to <= 599 tokens")
    with pytest.raises(ValueError, match="max_seq_len=1"):
        wl.clip_to_bounds(fit, max_input_len=1, max_seq_len=1)
    with pytest.raises(wl.TraceError, match="no request in window"):
        wl.trace_workload(rows, window=(100, 200))


def test_rate_scaling_keeps_the_pattern():
    base = wl.Workload([wl.RequestSpec(i, t, 10, 5) for i, t in enumerate([0.0, 1.0, 1.5, 4.0])])
    assert base.mean_rate == pytest.approx(3 / 4.0)
    fast = base.at_rate(3.0)
    assert fast.mean_rate == pytest.approx(3.0)
    assert [r.arrival for r in fast.requests] == pytest.approx([0.0, 0.25, 0.375, 1.0])
    assert fast.description["time_scale"] == pytest.approx(0.25)
    burst = base.at_rate(float("inf"))
    assert all(r.arrival == 0.0 for r in burst.requests) and burst.description["rate"] == "max"


def test_seeded_arrivals_are_reproducible_and_have_the_rate():
    a = wl.arrival_offsets(4000, rate=2.0, seed=7)
    b = wl.arrival_offsets(4000, rate=2.0, seed=7)
    c = wl.arrival_offsets(4000, rate=2.0, seed=8)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)             # Poisson: CV 1
    bursty = np.diff(wl.arrival_offsets(4000, rate=2.0, seed=7, burstiness=0.25))
    assert bursty.mean() == pytest.approx(0.5, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)         # gamma shape k: CV 1/sqrt(k)


def test_synthetic_lengths_and_length_spec_errors(tmp_path):
    w = wl.synthetic_workload(200, seed=3, prompt_len=wl.LengthSpec.parse("10:20"), output_len=wl.LengthSpec.parse("7"))
    assert {r.output_len for r in w.requests} == {7}
    assert {r.prompt_len for r in w.requests} <= set(range(10, 21)) and len({r.prompt_len for r in w.requests}) > 5
    assert [r.prompt_len for r in w.requests] == [r.prompt_len for r in wl.synthetic_workload(
        200, seed=3, prompt_len=wl.LengthSpec.parse("10:20"), output_len=wl.LengthSpec.parse("7")).requests]
    rows = wl.read_trace(write(tmp_path, "t.csv", AZURE_LIKE))
    emp = wl.synthetic_workload(50, prompt_len=wl.LengthSpec.parse("trace"), output_len=wl.LengthSpec.parse("trace"),
                                trace_rows=rows)
    assert {r.prompt_len for r in emp.requests} <= {4808, 3180, 110}
    for bad in ("0", "20:10", "x", "5:"):
        with pytest.raises(ValueError, match="length"):
            wl.LengthSpec.parse(bad)
    with pytest.raises(ValueError, match="needs --trace"):
        wl.synthetic_workload(3, prompt_len=wl.LengthSpec.parse("trace"))


def test_prompts_are_exact_seeded_per_request_and_avoid_special_tokens():
    specs = [wl.RequestSpec(i, 0.0, n, 4) for i, n in enumerate([5, 64, 1])]
    synth = wl.PromptSynthesizer(vocab_size=50, seed=1, exclude={0, 1, 2})
    prompts = [synth.prompt(s) for s in specs]
    assert [len(p) for p in prompts] == [5, 64, 1]
    assert all(3 <= t < 50 for p in prompts for t in p)
    assert synth.prompt(specs[1]) == prompts[1]                                   # deterministic
    assert wl.PromptSynthesizer(50, seed=1, exclude={0, 1, 2}).prompt(specs[1]) == prompts[1]
    assert synth.prompt(specs[1], run=1) != prompts[1]                            # a later run: fresh tokens
    shared = wl.with_shared_prefix(wl.Workload(specs), num_prefixes=2, prefix_len=16, seed=0)
    sp = [synth.prompt(s) for s in shared.requests]
    assert [len(p) for p in sp] == [21, 80, 17]
    by_prefix = {}
    for s, p in zip(shared.requests, sp):
        by_prefix.setdefault(s.prefix_id, set()).add(tuple(p[:16]))
    assert all(len(v) == 1 for v in by_prefix.values())                           # one system prompt per id
    assert sp[0][16:] == prompts[0]                                               # the request's own tokens follow
