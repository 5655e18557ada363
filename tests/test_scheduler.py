"""Scheduler without an engine: budgets, decode-first, chunk alignment, priorities, capacity policies."""

from __future__ import annotations

import itertools
import time

import pytest

from kiln.contract import InvalidRequestError
from kiln.runtime.kv_cache import KVCacheManager
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler, SchedulerConfig
from kiln.runtime.stopping import stop_by_token

_seq = itertools.count()


def make(num_blocks=64, bs=4, batch=4, tokens=16, policy="guaranteed_no_evict", prefix=True, max_seq=64, max_in=48):
    kv = KVCacheManager(num_blocks, bs, prefix)
    return Scheduler(SchedulerConfig(batch, tokens, max_seq, max_in, policy), kv)


def add(s: Scheduler, n_prompt: int, max_tokens: int, rid: str, priority: int = 0, arrival: float | None = None,
        first: int = 10):
    mt = s.resolve_max_tokens(n_prompt, max_tokens)
    r = Request(rid, [first + i for i in range(n_prompt)], SamplingParams(max_tokens=mt), mt, priority=priority,
                arrival_time=arrival if arrival is not None else float(next(_seq)), seq=next(_seq))
    s.add_request(r)
    return r


def step(s: Scheduler, token: int = 7):
    """One step as the executor runs it, without an engine: every sampled token is ``token``."""
    out = s.schedule()
    assert out.num_tokens <= s.config.max_num_tokens
    assert len(out.scheduled) <= s.config.max_batch_size
    sampled = {i: token for i, x in enumerate(out.scheduled) if x.samples}
    finished = []
    for req, _ in s.update_from_output(out, sampled):
        stop = stop_by_token(req, s.config.max_seq_len)
        if stop is not None:
            finished += s.finish_requests(req.request_id, *stop)
    s.kv.check_consistency()
    return out, finished


def drain(s: Scheduler, limit: int = 1000):
    finished = []
    for _ in range(limit):
        if not s.has_unfinished():
            return finished
        finished += step(s)[1]
    raise AssertionError("scheduler did not drain")


def test_budgets_and_block_aligned_chunks():
    s = make(bs=4, tokens=10)
    r = add(s, 23, 2, "long")
    chunks = []
    while r.num_output_tokens == 0:
        out, _ = step(s)
        (x,) = out.scheduled
        chunks.append((x.start, x.num_new_tokens))
    assert chunks == [(0, 8), (8, 8), (16, 7)]   # budget 10 -> 8 (two blocks); the last chunk unaligned
    drain(s)
    assert s.kv.num_used_blocks == 0


def test_decodes_first_then_waiting_fcfs():
    s = make(bs=4, tokens=12, batch=8)
    add(s, 4, 5, "a")
    step(s)                                   # a prefilled, has 1 token
    add(s, 20, 5, "b")
    add(s, 3, 5, "c")
    out, _ = step(s)
    # a's decode took its token first; b gets a block-aligned chunk of the other 11, c its whole prompt;
    # in the forward, context chunks come before decodes
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 8), ("c", 3), ("a", 1)]
    d = add(s, 9, 5, "d", first=200)
    e = add(s, 1, 5, "e", first=300)
    out, _ = step(s)   # decodes a, c (2) + b's last 12 would exceed 10 -> b gets 8; d cannot get a block: e waits
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 8), ("a", 1), ("c", 1)]
    assert d.status is RequestStatus.WAITING and e.status is RequestStatus.WAITING   # no overtaking
    drain(s)


def test_priorities_higher_first_fcfs_within():
    s = make(batch=1)
    add(s, 4, 1, "low", priority=0, arrival=1.0)
    add(s, 4, 1, "hi2", priority=5, arrival=3.0)
    add(s, 4, 1, "hi1", priority=5, arrival=2.0)
    order = [r.request_id for r in drain(s)]
    assert order == ["hi1", "hi2", "low"]


def test_rejections_are_clear():
    s = make(num_blocks=4, bs=4, max_seq=64, max_in=48)
    assert s.resolve_max_tokens(10, None) == 7          # None: as many as the engine and the pool allow
    with pytest.raises(InvalidRequestError, match="max_input_len"):
        s.resolve_max_tokens(49, 1)
    with pytest.raises(InvalidRequestError, match="max_seq_len"):
        s.resolve_max_tokens(40, 30)
    with pytest.raises(InvalidRequestError, match="whole pool"):
        s.resolve_max_tokens(10, 8)         # 17 tokens of KV = 5 blocks > 4
    with pytest.raises(InvalidRequestError, match="empty"):
        s.resolve_max_tokens(0, 1)
    add(s, 3, 2, "x")
    with pytest.raises(InvalidRequestError, match="already in use"):
        add(s, 3, 2, "x")


def test_guaranteed_no_evict_reserves_and_never_preempts():
    s = make(num_blocks=10, bs=4, batch=8, tokens=64)
    rs = [add(s, 6, 10, f"r{i}") for i in range(4)]    # each needs ceil(15/4) = 4 blocks at most
    out, _ = step(s)
    assert len(out.scheduled) == 2                      # 2 x 4 reserved of 10; a third would break the promise
    finished = drain(s)
    assert s.num_preemptions == 0 and len(finished) == 4
    assert all(r.num_output_tokens == 10 for r in rs)
    s.kv.check_consistency()
    assert s.kv.num_used_blocks == 0


def test_max_utilization_preempts_lowest_priority_latest_and_recomputes():
    s = make(num_blocks=6, bs=4, batch=8, tokens=64, policy="max_utilization")
    a = add(s, 6, 12, "a", priority=1, arrival=1.0)
    b = add(s, 6, 12, "b", priority=0, arrival=2.0)
    c = add(s, 6, 12, "c", priority=0, arrival=3.0)
    step(s)
    assert {r.request_id for r in s.running} == {"a", "b", "c"}   # admitted greedily (2 blocks each)
    preempted = []
    while s.has_unfinished():
        out, _ = step(s)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and preempted[0] == "c"            # lowest priority, latest arrival goes first
    assert "a" not in preempted
    assert all(r.num_output_tokens == 12 and r.status is RequestStatus.FINISHED_LENGTH for r in (a, b, c))
    assert c.metrics.num_preemptions >= 1
    s.kv.check_consistency()
    assert s.kv.num_used_blocks == 0


def test_prefix_hit_skips_computed_tokens():
    s = make(bs=4, tokens=64)
    add(s, 13, 1, "a", first=100)
    drain(s)
    b = add(s, 15, 1, "b", first=100)                    # same first 13 tokens
    out, _ = step(s)
    (x,) = out.scheduled
    assert x.start == 12 and x.num_new_tokens == 3       # 3 full cached blocks reused
    assert b.metrics.num_cached_tokens == 12
    drain(s)


def test_abort_frees_blocks_any_state():
    s = make(bs=4, tokens=8, batch=2)
    a = add(s, 20, 5, "a")
    b = add(s, 4, 5, "b")
    step(s)
    assert a.status is RequestStatus.RUNNING and a.num_computed_tokens == 8
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert a.status is RequestStatus.FINISHED_ABORTED and b.status is RequestStatus.FINISHED_ABORTED
    assert not s.has_unfinished() and s.kv.num_used_blocks == 0


def test_stop_conditions():
    s = make()
    mt = 5
    r = Request("e", [5, 6], SamplingParams(max_tokens=mt, min_tokens=2), mt, eos_token_ids=(2,))
    s.add_request(r)
    step(s, token=2)            # EOS before min_tokens: not a stop (the sampler masks it anyway)
    assert not r.is_finished
    step(s, token=2)
    assert not r.is_finished and r.num_output_tokens == 2
    step(s, token=2)
    assert r.status is RequestStatus.FINISHED_STOPPED
    r2 = Request("s", [5, 6], SamplingParams(max_tokens=mt, stop_token_ids=[9]), mt, eos_token_ids=(2,))
    s.add_request(r2)
    step(s, token=9)
    assert r2.status is RequestStatus.FINISHED_STOPPED and r2.stop_reason == 9
    r3 = Request("i", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True), 3, eos_token_ids=(2,))
    s.add_request(r3)
    for _ in range(3):
        step(s, token=2)
    assert r3.status is RequestStatus.FINISHED_LENGTH and r3.output_token_ids == [2, 2, 2]


def test_higher_priority_arrival_preempts_lowest_priority_latest_first():
    s = make(num_blocks=10, bs=4, batch=8, tokens=64, policy="max_utilization", max_in=48)
    a = add(s, 8, 12, "a", priority=0, arrival=1.0)
    b = add(s, 8, 12, "b", priority=1, arrival=2.0)
    c = add(s, 8, 12, "c", priority=0, arrival=3.0)
    step(s)                                            # a, b, c hold 2 blocks each (8 prompt tokens)
    assert s.kv.num_free_blocks == 4
    hi = add(s, 28, 4, "hi", priority=5, arrival=4.0, first=500)  # needs 7 blocks: two low ones must go
    out, _ = step(s)
    assert [r.request_id for r in out.preempted] == ["c", "a"]   # lowest priority, latest arrival first
    assert hi.status is RequestStatus.RUNNING and b.status is RequestStatus.RUNNING
    assert ("hi", 28) in [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]
    finished = drain(s)
    assert {r.request_id for r in finished} == {"a", "b", "c", "hi"}
    assert all(r.num_output_tokens == r.max_tokens for r in (a, b, c, hi))
    assert hi.metrics.num_preemptions == 0 and hi.metrics.priority == 5 and c.metrics.num_preemptions >= 1
    assert s.kv.num_used_blocks == 0


def test_higher_priority_arrival_takes_a_seat_and_equal_priority_never_preempts():
    s = make(num_blocks=64, bs=4, batch=2, tokens=64, policy="max_utilization")
    low = add(s, 4, 8, "low", priority=0, arrival=1.0)
    mid = add(s, 4, 8, "mid", priority=3, arrival=2.0)
    step(s)
    same = add(s, 4, 2, "same", priority=3, arrival=3.0)   # no seat: "low" (below it) gives up its own
    out, _ = step(s)
    assert [r.request_id for r in out.preempted] == ["low"] and same.status is RequestStatus.RUNNING
    peer = add(s, 4, 2, "peer", priority=3, arrival=4.0)   # only equal priorities run: it waits
    out, _ = step(s)
    assert not out.preempted and peer.status is RequestStatus.WAITING
    drain(s)
    assert mid.metrics.num_preemptions == 0 and low.metrics.num_preemptions == 1


def test_guaranteed_no_evict_orders_by_priority_but_never_preempts():
    s = make(num_blocks=10, bs=4, batch=8, tokens=64)
    for i in range(2):
        add(s, 8, 12, f"low{i}", priority=0, arrival=float(i))
    step(s)
    hi = add(s, 20, 4, "hi", priority=5, arrival=9.0)
    out, _ = step(s)
    assert not out.preempted and hi.status is RequestStatus.WAITING
    drain(s)
    assert s.num_preemptions == 0 and hi.num_output_tokens == 4


def test_batch_max_share_caps_batch_tokens_per_step():
    """Batch work (BATCH_PRIORITY) takes at most its share of each step's tokens; online work the rest."""
    from kiln.runtime.outputs import BATCH_PRIORITY

    s = make(num_blocks=64, bs=4, batch=8, tokens=16, max_in=48)
    s.config.batch_max_share = s.config.batch_min_share = 0.25   # 4 of 16 tokens, with or without online work
    batch = [add(s, 8, 3, f"b{i}", priority=BATCH_PRIORITY, arrival=float(i)) for i in range(3)]
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b0", 4)]   # one aligned chunk
    online = add(s, 8, 3, "online", priority=0, arrival=9.0, first=100)
    out, _ = step(s)
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"b0": 4, "online": 8}
    assert s.class_counts() == {"running_online": 1, "running_batch": 1, "waiting_online": 0, "waiting_batch": 2}
    for _ in range(200):
        if not s.has_unfinished():
            break
        out, _ = step(s)
        assert sum(x.num_new_tokens for x in out.scheduled if x.request.priority == BATCH_PRIORITY) <= 4
    assert not s.has_unfinished() and all(r.num_output_tokens == 3 for r in [*batch, online])


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_batch_min_share_keeps_batch_progressing_under_online_load(policy):
    """Online prompts that would fill every step leave the batch floor free: a waiting batch request is admitted
    past the blocked online head and finishes while online work is still running; with a floor of a quarter
    token per step it waits (its credit reaches one block, the smallest prefill chunk, after 16 steps)."""
    from kiln.runtime.outputs import BATCH_PRIORITY

    for floor, first_step in ((0.25, {"o0": 12, "b": 4}), (1 / 64, {"o0": 16})):
        s = make(num_blocks=64, bs=4, batch=8, tokens=16, max_in=48, policy=policy)
        s.config.batch_min_share = floor   # 4 of 16 tokens
        online = [add(s, 40, 2, f"o{i}", priority=0, arrival=float(i), first=100 * (i + 1)) for i in range(3)]
        b = add(s, 8, 2, "b", priority=BATCH_PRIORITY, arrival=9.0)
        out, _ = step(s)
        assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == first_step
        for _ in range(4):
            step(s)
        assert (b.num_output_tokens == 2) == (floor == 0.25)
        assert any(r.num_output_tokens < 2 for r in online)   # online work was running all along
        drain(s)
        assert all(r.num_output_tokens == 2 for r in [*online, b])


def _scanned_counts(s: Scheduler) -> dict[str, int]:
    """The per-class counts by a scan of the queues: what the scheduler's kept counts must equal."""
    from kiln.runtime.outputs import REQUEST_CLASSES, request_class

    out = {f"{q}_{c}": 0 for q in ("running", "waiting") for c in REQUEST_CLASSES}
    for q in ("running", "waiting"):
        for r in getattr(s, q):
            out[f"{q}_{request_class(r.priority)}"] += 1
    return out


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_class_counts_follow_every_queue_move(policy):
    """The counts the batch share reads each step (O(1), no scan) track admissions, preemptions (a small pool under
    max_utilization preempts), aborts of waiting and running requests, and finishes."""
    import random

    from kiln.runtime.outputs import BATCH_PRIORITY

    rng = random.Random(3)
    s = make(num_blocks=12, bs=4, batch=3, tokens=12, policy=policy)
    live, moves = [], 0
    for i in range(60):
        if rng.random() < 0.5:
            prio = rng.choice([BATCH_PRIORITY, 0, 1])
            live.append(add(s, rng.randint(1, 12), rng.randint(1, 8), f"r{i}", priority=prio).request_id)
        if live and rng.random() < 0.15:
            rid = live.pop(rng.randrange(len(live)))
            s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        before = s.num_preemptions
        for r in step(s)[1]:
            live.remove(r.request_id)
        moves += s.num_preemptions - before
        assert s.class_counts() == _scanned_counts(s)
    drain(s)
    assert s.class_counts() == _scanned_counts(s) == dict.fromkeys(_scanned_counts(s), 0)
    if policy == "max_utilization":
        assert moves > 0   # the pool was small enough to exercise preemption


def make_with(**knobs) -> Scheduler:
    """A scheduler with block 4, batch 4, 16 tokens a step, max input 48, and the given SchedulerConfig knobs."""
    return Scheduler(SchedulerConfig(4, 16, 64, 48, **knobs), KVCacheManager(64, 4, True))


def test_decoding_budget_caps_steps_only_while_a_sequence_decodes():
    s = make_with(decoding_max_num_tokens=8)
    add(s, 3, 6, "a")
    out, _ = step(s)
    assert out.num_tokens == 3                    # a prefilled
    b = add(s, 40, 2, "b")
    out, _ = step(s)
    # a decodes: the step holds 8 tokens, a's 1 + b's block-aligned 4 (not 16 - 1 -> 12)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 4), ("a", 1)]
    while s.requests.get("a") is not None:
        out, _ = step(s)
        assert out.num_tokens <= 8
    before = b.num_computed_tokens
    out, _ = step(s)                              # no sequence decodes: the full budget again
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 16)]
    assert b.num_computed_tokens == before + 16
    drain(s)
    assert s.kv.num_used_blocks == 0


def test_short_prompt_lead_lets_later_short_prompts_go_first_within_the_lead():
    s = make_with(short_prompt_lead_s=4.0)
    # a 48-token prompt (the longest input) yields 4 s, a 24-token one 2 s, a 6-token one 0.5 s
    add(s, 48, 1, "long", arrival=10.0)
    add(s, 24, 1, "mid", arrival=11.0)            # place 13.0: after "short" (12.5), before "late" (14.1)
    add(s, 6, 1, "short", arrival=12.0)
    add(s, 4, 1, "late", arrival=13.8)            # place 14.13: after long's 14.0 (beyond its 4 s lead)
    assert [r.request_id for r in s.waiting] == ["short", "mid", "long", "late"]
    assert [r.request_id for r in drain(s)] == ["short", "mid", "long", "late"]


def test_short_prompt_lead_stays_under_priorities_and_off_by_default():
    s = make_with(short_prompt_lead_s=100.0)
    add(s, 48, 1, "long-hi", priority=5, arrival=1.0)
    add(s, 4, 1, "short-lo", priority=0, arrival=0.0)
    add(s, 40, 1, "long-lo", priority=0, arrival=0.5)
    assert [r.request_id for r in s.waiting] == ["long-hi", "short-lo", "long-lo"]
    s = make_with()
    add(s, 48, 1, "long", arrival=1.0)
    add(s, 4, 1, "short", arrival=2.0)
    assert [r.request_id for r in s.waiting] == ["long", "short"]   # FCFS


def test_a_waiting_prompt_that_ranks_first_takes_the_budget_before_a_running_prefill():
    s = make_with(short_prompt_lead_s=4.0)
    long = add(s, 48, 1, "long", arrival=10.0)          # place 14.0
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("long", 16)]
    add(s, 4, 1, "short", arrival=11.0, first=300)   # place 11.33: before long's, which is already running
    out, finished = step(s)
    # short's whole prompt first, long's next chunk from what is left (block-aligned 12)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("short", 4), ("long", 12)]
    assert [r.request_id for r in finished] == ["short"]
    assert long.num_computed_tokens == 28
    drain(s)
    assert s.kv.num_used_blocks == 0
    # first come, first served (no lead): the running prompt keeps the budget, the later one waits for it
    s = make_with()
    add(s, 48, 1, "long", arrival=10.0)
    step(s)
    add(s, 4, 1, "short", arrival=11.0, first=300)
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("long", 16)]


def test_a_higher_priority_arrival_takes_the_budget_before_a_running_prefill():
    s = make_with()
    add(s, 48, 1, "low", priority=0, arrival=1.0)
    step(s)
    add(s, 8, 1, "high", priority=3, arrival=2.0, first=200)   # no prefix shared with "low"
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("high", 8), ("low", 8)]


def test_a_step_without_decodes_adds_prompts_after_its_first_only_up_to_the_decoding_budget():
    s = make_with(decoding_max_num_tokens=8)
    add(s, 10, 2, "a", arrival=1.0)
    add(s, 10, 2, "b", arrival=2.0, first=100)
    out, _ = step(s)
    # a's whole prompt; b would make the step 16 tokens long and a's first token wait for it
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 10)]
    out, _ = step(s)                               # a decodes: the decoding budget
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 4), ("a", 1)]
    drain(s)
    # a short first prompt: the next one fills the step up to the decoding budget (block-aligned)
    add(s, 2, 2, "c", arrival=3.0, first=400)
    add(s, 20, 2, "d", arrival=4.0, first=200)
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("c", 2), ("d", 4)]
    drain(s)
    assert s.kv.num_used_blocks == 0
    # without a decoding budget a step packs prompts up to max_num_tokens, as before
    s = make_with()
    add(s, 10, 2, "a", arrival=1.0)
    add(s, 10, 2, "b", arrival=2.0, first=100)
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 10), ("b", 4)]


def paced(**knobs) -> Scheduler:
    """Block 4, batch 4, 64 tokens a step; a step costs 0.1 s + 0.01 s a token (the executor's fit)."""
    return Scheduler(SchedulerConfig(4, 64, 128, 120, step_time=(0.1, 0.01), **knobs), KVCacheManager(64, 4, True))


def first_token_ago(req: Request, seconds: float) -> None:
    """What the executor records when it emits a request's first token, as if that was ``seconds`` ago."""
    req.metrics.first_token_time = time.monotonic() - seconds


def test_the_pace_spends_what_decoding_streams_are_ahead_of_it_on_prefill():
    s = paced(tpot_target_s=0.5)
    a = add(s, 3, 20, "a")
    step(s)                                        # a prefilled: its first token
    first_token_ago(a, 0.0)                        # 1 token, target 0.5 s a token: a step may last 0.5 s
    b = add(s, 120, 2, "b", first=200)
    out, _ = step(s)
    # 0.5 s holds (0.5 - 0.1) / 0.01 = 40 tokens: a's decode and a block-aligned 36 of b's prompt
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 36), ("a", 1)]
    first_token_ago(a, 0.2)                        # 2 tokens in 0.2 s: 1.0 - 0.2 = 0.8 s banked: 70 tokens,
    out, _ = step(s)                               # more than the 64-token step: 63, block-aligned 60
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 60), ("a", 1)]
    first_token_ago(a, 30.0)                       # far behind the pace: a block of prefill beside the decode
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 4), ("a", 1)]
    assert b.num_computed_tokens == 100
    drain(s)
    assert s.kv.num_used_blocks == 0


def test_the_step_waits_for_the_stream_with_the_least_banked():
    s = paced(tpot_target_s=0.5)
    a, b = add(s, 3, 20, "a"), add(s, 3, 20, "b", first=100)
    step(s)
    first_token_ago(a, 0.0)                        # 0.5 s banked
    first_token_ago(b, 0.29)                       # 0.21 s: (0.21 - 0.1) / 0.01 = 11 tokens, 9 for c: 8
    add(s, 40, 2, "c", first=200)
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("c", 8), ("a", 1), ("b", 1)]


def test_no_pace_without_a_target_a_fit_or_a_decode():
    for knobs in ({"tpot_target_s": 0.0}, {"tpot_target_s": 0.5, "step_time": None}):
        s = Scheduler(SchedulerConfig(4, 64, 128, 120, **{"step_time": (0.1, 0.01), **knobs}),
                      KVCacheManager(64, 4, True))
        a = add(s, 3, 20, "a")
        step(s)
        first_token_ago(a, 30.0)                   # behind any pace
        add(s, 100, 2, "b", first=200)
        out, _ = step(s)
        assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 60), ("a", 1)]
    s = paced(tpot_target_s=0.01)                  # a pace no step meets, but nothing decodes: the whole budget
    add(s, 100, 2, "b")
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 64)]


def test_a_decoding_budget_given_caps_the_paced_one():
    s = paced(tpot_target_s=0.5, decoding_max_num_tokens=9)
    a = add(s, 3, 20, "a")
    step(s)
    first_token_ago(a, 0.0)                        # the pace allows 40 tokens, the budget 9
    add(s, 100, 2, "b", first=200)
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 8), ("a", 1)]


def test_batch_streams_have_no_pace():
    from kiln.runtime.outputs import BATCH_PRIORITY

    s = paced(tpot_target_s=0.5, batch_max_share=1.0)
    a = add(s, 3, 20, "a", priority=BATCH_PRIORITY)
    step(s)
    first_token_ago(a, 30.0)                       # far behind any pace, but nobody reads it token by token
    add(s, 100, 2, "b", first=200, priority=BATCH_PRIORITY)
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 60), ("a", 1)]


def test_requests_submitted_unpaced_set_no_pace():
    s = paced(tpot_target_s=0.5)
    a = add(s, 3, 20, "a")
    a.paced = False                                # LLM.generate's: nobody reads its tokens as they come
    step(s)
    first_token_ago(a, 30.0)
    add(s, 100, 2, "b", first=200)
    out, _ = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("b", 60), ("a", 1)]
