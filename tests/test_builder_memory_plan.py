"""Memory plan: arena properties (hypothesis) and the plan of a real traced model at its max profile."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.builder import BuildConfig, memory_plan, trace
from kiln.builder.memory_plan import Buffer, arena_size, live_peak, plan_arena


@st.composite
def buffer_sets(draw):
    n = draw(st.integers(0, 40))
    out = []
    for i in range(n):
        start = draw(st.integers(0, 60))
        length = draw(st.integers(0, 20))
        size = draw(st.one_of(st.just(0), st.integers(1, 4096)))
        out.append(Buffer(f"b{i}", size, start, start + length))
    return out


@settings(max_examples=150, deadline=None)
@given(buffer_sets())
def test_arena_never_overlaps_live_buffers(buffers):
    placements = plan_arena(buffers)
    assert sorted(p.buffer.name for p in placements) == sorted(b.name for b in buffers)
    for i, a in enumerate(placements):
        assert a.offset >= 0
        for b in placements[i + 1:]:
            if a.buffer.size == 0 or b.buffer.size == 0:
                continue
            if memory_plan.overlaps_in_time(a.buffer, b.buffer):
                disjoint = a.offset + a.buffer.size <= b.offset or b.offset + b.buffer.size <= a.offset
                assert disjoint, (a, b)


@settings(max_examples=150, deadline=None)
@given(buffer_sets())
def test_arena_peak_bounds(buffers):
    placements = plan_arena(buffers)
    peak = arena_size(placements)
    # never below the largest set of simultaneously live tensors, never above no reuse at all
    assert peak >= live_peak(buffers)
    assert peak <= sum(b.size for b in buffers)


def test_live_peak_by_hand():
    bufs = [Buffer("a", 100, 0, 2), Buffer("b", 50, 1, 1), Buffer("c", 70, 2, 3), Buffer("d", 10, 4, 4)]
    assert live_peak(bufs) == 170  # step 1: a+b = 150, step 2: a+c = 170, step 3: c, step 4: d
    bufs = [Buffer("a", 100, 0, 1), Buffer("b", 100, 2, 3)]
    placements = plan_arena(bufs)
    assert arena_size(placements) == 100  # b reuses a's memory


@pytest.fixture(scope="module")
def tiny_llama(checkpoint_dir):
    from kiln.model_defs import build_model, load_checkpoint

    cfg, weights = load_checkpoint(checkpoint_dir("llama"))
    return cfg, build_model(cfg, weights)


def test_plan_of_a_traced_model_uses_the_max_profile(tiny_llama):
    cfg, model = tiny_llama
    plans = {}
    for max_tokens in (32, 64):
        build = BuildConfig(max_batch_size=4, max_num_tokens=max_tokens, max_input_len=32, max_seq_len=64,
                            tokens_per_block=4)
        ep = trace.export(model, cfg, build)
        plans[max_tokens] = memory_plan.plan(ep)
    p = plans[32]
    assert p["unsized"] == []
    assert p["num_buffers"] > 10
    assert p["live_peak_bytes"] <= p["activation_peak_bytes"] <= p["naive_bytes"]
    assert p["activation_peak_bytes"] < p["naive_bytes"] / 2  # reuse matters on a real graph
    sizes = {b["name"]: b["size"] for b in p["buffers"]}
    # the embedding output at max profile: max_num_tokens x hidden x 4 bytes
    assert sizes["embedding"] == 32 * cfg.hidden_size * 4
    # the lm_head output: max_num_logits (= max_batch_size) x vocab x 4 bytes
    assert max(sizes.values()) >= 4 * cfg.vocab_size * 4
    assert plans[64]["activation_peak_bytes"] > plans[32]["activation_peak_bytes"]
    # every buffer is placed inside the arena, and live-overlapping buffers do not share bytes
    bufs = p["buffers"]
    for i, a in enumerate(bufs):
        assert a["offset"] + a["size"] <= p["activation_peak_bytes"]
        for b in bufs[i + 1:]:
            if a["start"] <= b["end"] and b["start"] <= a["end"]:
                assert a["offset"] + a["size"] <= b["offset"] or b["offset"] + b["size"] <= a["offset"]


def test_weights_bytes(tiny_llama):
    cfg, model = tiny_llama
    build = BuildConfig(max_batch_size=2, max_num_tokens=16, max_input_len=16, max_seq_len=32, tokens_per_block=4)
    ep = trace.export(model, cfg, build)
    expected = sum(p.numel() * 4 for p in model.parameters()) + model.rope_table.numel() * 4
    assert memory_plan.weights_bytes(ep) == expected
