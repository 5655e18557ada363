"""Incremental detokenization with characters split across byte-level BPE tokens; metrics histograms."""

from __future__ import annotations

import pytest

from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.metrics import Histogram, RuntimeMetrics, StepRecord
from kiln.runtime.outputs import RequestMetrics

from synthetic_checkpoints import train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(512)


@pytest.mark.parametrize("text", [
    "Héllo wörld — naïve café, 東京 and 北京 🙂🚀✨ done.",
    "🙂🙂🙂 ✨✨ Ελληνικά русский 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
])
def test_deltas_concatenate_to_the_full_decode(tok, text):
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode([t]) for t in ids), "the test needs a character split across tokens"
    prompt = tok.encode("The kiln fires ").ids
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.step([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("🙂").ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, ids[:-1])   # the prompt stops mid-emoji
    out = "".join(detok.step([t]) for t in tok.encode(" ok 東京").ids) + detok.flush()
    assert out == " ok 東京"


def test_histogram_and_summary():
    h = Histogram(buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 2.0):
        h.observe(v)
    assert h.cumulative() == [(0.1, 1), (1.0, 3), (float("inf"), 4)]
    assert h.percentile(50) == pytest.approx(0.5) and h.summary()["count"] == 4
    m = RuntimeMetrics()
    kv = dict(num_blocks=10, used_blocks=2, cached_blocks=1, usage=0.2, hit_rate=0.5, evictions=0)
    m.record_step(StepRecord(time=0, step_time=0.1, engine_time=0.09, num_running=2, num_waiting=1, num_preempted=0,
                             batch_size=2, prefill_tokens=10, decode_tokens=1, sampled_tokens=2, kv_usage=0.2,
                             prefix_hit_rate=0.5), kv)
    snap = m.snapshot()
    assert snap["recent_steps"]["overhead_fraction"] == pytest.approx(0.1)
    assert snap["counters"]["generation_tokens"] == 2
    step = snap["histograms"]["step_time"]
    assert step["buckets"][-1] == (float("inf"), 1) and step["sum"] == pytest.approx(0.1)
    assert snap["gauges"]["kv_blocks_used"] == 2
    m.record_request(RequestMetrics(arrival_time=0.0, first_token_time=0.5, finished_time=1.0), "length")
    assert m.snapshot()["outcomes"] == {"stop": 0, "length": 1, "abort": 0, "error": 0}
