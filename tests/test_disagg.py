"""Disaggregated prefill/decode: KV export/import between two executors in one process (the runtime hook), then
``DisaggLLM`` with worker processes (torch.distributed gloo transfers) against the colocated LLM on the same
engine: greedy outputs token for token, transfer counters, prefix-aware routing between two prefill workers, a
SIGKILLed decode worker, and refused requests."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kiln.runtime import LLM, InvalidRequestError, SamplingParams
from kiln.runtime.disagg import DisaggLLM
from kiln.runtime.kv_cache import cdiv

from runtime_support import assert_no_leak, random_prompts

pytestmark = [pytest.mark.xdist_group("disagg"), pytest.mark.usefixtures("hang_watchdog")]

VOCAB = 512


@pytest.fixture(scope="module")
def prompts():
    """Mixed lengths spanning many 8-token blocks, some sharing a 40-token prefix (prefix reuse on)."""
    base = random_prompts(12, VOCAB, 3, 90, seed=29)
    shared = random_prompts(1, VOCAB, 40, 40, seed=30)[0]
    return base + [shared + p[:20] for p in random_prompts(4, VOCAB, 5, 20, seed=31)]


@pytest.fixture(scope="module")
def colocated(llama_engine, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(llama_engine) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


def test_export_import_between_two_executors_equals_colocated(llama_engine, prompts, colocated):
    """A prefill-only executor exports each prompt's blocks at its first token; another imports them and decodes:
    the same greedy tokens as one executor, and both pools end with no block held."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(llama_engine) as pre, LLM(llama_engine) as dec:
        done = {i: threading.Event() for i in range(len(prompts))}
        results: dict[int, list[int]] = {}

        def run(i: int, ids: list[int]) -> None:
            exported = []

            def on_out(out):
                if out.finished:
                    results[i] = out.token_ids
                    done[i].set()

            pre.executor.submit(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                request_id=f"p{i}", kv_export=exported.append)
            while not exported:
                time.sleep(0.001)
            exp = exported[0]
            assert exp.blocks.shape[2] == cdiv(len(ids), llama_engine.config.bounds.tokens_per_block)

            def reserved(rid, blocks):
                assert len(blocks) == exp.blocks.shape[2]
                threading.Thread(target=dec.executor.land, args=(rid, exp.blocks.clone())).start()

            dec.executor.submit_imported(ids, params, exp.meta(), reserved, request_id=f"d{i}", callback=on_out)

        for i, ids in enumerate(prompts):
            run(i, ids)
        for e in done.values():
            assert e.wait(60)
        assert [results[i] for i in range(len(prompts))] == colocated
        assert_no_leak(pre)
        assert_no_leak(dec)


def test_import_refuses_blocks_of_another_shape(llama_engine):
    with LLM(llama_engine) as dec, LLM(llama_engine) as pre:
        got = []
        pre.executor.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=1), kv_export=got.append)
        pre.executor.wait_idle(10)
        with pytest.raises(InvalidRequestError, match="do not fit this pool"):
            dec.executor.submit_imported([5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(), got[0].meta(),
                                         lambda *_: None, request_id="x")


def test_kv_transfer_refuses_lora_and_structured_output_in_one_place(llama_engine):
    """Export (submit with kv_export) and import (submit_imported) refuse what a transfer does not carry with the
    one check of Executor.validate(kv_transfer=True), before any grammar is compiled; each refusal counts once."""
    json_out = SamplingParams(max_tokens=4, structured_output={"json": {"type": "object"}})
    with LLM(llama_engine) as llm:
        ex = llm.executor
        got = []
        ex.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=1), kv_export=got.append)
        ex.wait_idle(10)
        with pytest.raises(InvalidRequestError, match="^structured output: disaggregated serving"):
            ex.submit([5, 6, 7], json_out, kv_export=lambda _: None)
        with pytest.raises(InvalidRequestError, match="^a LoRA adapter: disaggregated serving"):
            ex.submit([5, 6, 7], SamplingParams(max_tokens=4), lora="x", kv_export=lambda _: None)
        with pytest.raises(InvalidRequestError, match="^structured output: disaggregated serving"):
            ex.submit_imported([5, 6, 7], json_out, got[0].meta(), lambda *_: None, request_id="y")
        assert ex.metrics.counters["requests_rejected"] == 3
        assert ex.metrics.counters.get("structured_requests", 0) == 0


def test_failed_transfer_fails_only_its_request(llama_engine):
    with LLM(llama_engine) as pre, LLM(llama_engine) as dec:
        got = []
        pre.executor.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=1), kv_export=got.append)
        pre.executor.wait_idle(10)
        outs = []
        dec.executor.submit_imported([5, 6, 7], SamplingParams(max_tokens=4), got[0].meta(),
                                     lambda rid, _: dec.executor.land(rid, TimeoutError("peer gone")),
                                     request_id="x", callback=outs.append)
        dec.executor.wait_idle(10)
        assert outs[-1].finish_reason == "abort" and "KV transfer failed" in outs[-1].error
        assert dec.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))[0].finish_reason == "length"
        assert_no_leak(dec)


# ---- worker processes ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(llama_engine):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with DisaggLLM(llama_engine.directory, prefill_workers=2, decode_workers=2, worker_threads=1) as llm:
        yield llm


def test_greedy_outputs_equal_colocated_and_counters_count_blocks(cluster, prompts, colocated, llama_engine):
    """16 concurrent mixed-length requests: the same tokens as the colocated LLM; every prompt's blocks moved
    once, bytes = blocks x bytes per block."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = cluster.stats()["disagg"]["kv_transfer"]
    outs = cluster.generate(prompts, params)
    assert [o.token_ids for o in outs] == colocated
    assert [o.text for o in outs] == [cluster.decode(t) for t in colocated]
    after = cluster.stats()["disagg"]["kv_transfer"]
    bs = llama_engine.config.bounds.tokens_per_block
    blocks = sum(cdiv(len(p), bs) for p in prompts)
    assert after["blocks"] - before["blocks"] == blocks
    assert after["transfers"] - before["transfers"] == len(prompts)
    per_block = llama_engine.kv_bytes_per_token * bs
    assert cluster.stats()["disagg"]["bytes_per_block"] == per_block
    assert after["bytes"] - before["bytes"] == blocks * per_block
    s = cluster.stats()
    assert s["histograms"]["ttft_prefill"]["count"] >= len(prompts)
    assert s["histograms"]["ttft_transfer"]["count"] >= len(prompts)
    assert s["outcomes"]["length"] >= len(prompts)


def test_refused_requests_name_the_problem(cluster):
    with pytest.raises(InvalidRequestError, match="max_seq_len"):
        cluster.generate([5, 6, 7], SamplingParams(max_tokens=1000))
    with pytest.raises(InvalidRequestError, match="structured output"):
        cluster.generate([5, 6, 7], SamplingParams(max_tokens=4, structured_output={"json": {"type": "object"}}))


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s"
        time.sleep(0.02)


def fresh_stats(workers) -> None:
    """Wait for two stats reports from each worker: the second was taken after this call began."""
    for w in workers:
        for _ in range(2):
            seen = w.stats
            wait_until(lambda w=w, seen=seen: w.stats is not seen, 10, f"no stats from {w.name}")


def test_prompts_sharing_a_prefix_go_to_the_prefill_worker_that_holds_it(cluster, llama_engine):
    """Two 48-token prefixes, one prefilled on each prefill worker (the second goes to the other one: the first
    is queued on its worker); then a burst of 8 requests, the two prefixes in the order a a b b a a b b: each
    goes to the worker that holds its prefix (least-loaded routing would mix them) and finds it cached there
    (each worker's prefix-hit counter rises by 4 x 48 tokens); the outputs equal the colocated LLM's."""
    ex = cluster.executor
    bs = llama_engine.config.bounds.tokens_per_block
    a, b = random_prompts(2, VOCAB, 6 * bs, 6 * bs, seed=50)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs: dict[str, object] = {}
    cb = lambda out: out.finished and outs.__setitem__(out.request_id, out)   # noqa: E731
    warm = [ex.submit(p + [3], params, callback=cb) for p in (a, b)]
    holder = {0: ex._flights[warm[0]].prefill, 1: ex._flights[warm[1]].prefill}
    assert holder[0] != holder[1]
    wait_until(lambda: all(r in outs for r in warm), 60, "the warm-up requests did not end")
    prefill = [w for w in ex.workers if w.role == "prefill"]
    fresh_stats(prefill)
    hits = {w.uid: w.stats["kv_cache"]["prefix_hits"] for w in prefill}
    routed = ex.stats()["disagg"]["routing"]["prefix_routed"]

    which = [0, 0, 1, 1, 0, 0, 1, 1]
    burst = [(a, b)[k] + s for k, s in zip(which, random_prompts(8, VOCAB, 2, 7, seed=51))]
    rids, routes = [], []
    for p in burst:
        rids.append(ex.submit(p, params, callback=cb))
        routes.append(ex._flights[rids[-1]].prefill)
    assert routes == [holder[k] for k in which]
    wait_until(lambda: all(r in outs for r in rids), 60, "the burst did not end")
    assert ex.stats()["disagg"]["routing"]["prefix_routed"] - routed == len(burst)
    fresh_stats(prefill)
    for w in prefill:
        assert w.stats["kv_cache"]["prefix_hits"] - hits[w.uid] == 4 * 6 * bs, w.name
    with LLM(llama_engine) as llm:
        assert [outs[r].token_ids for r in rids] == [o.token_ids for o in llm.generate(burst, params)]


def test_sigkill_of_a_decode_worker_fails_its_streams_and_the_rest_serve(cluster, prompts):
    """Kill the decode worker that streams: its requests end with an error naming it within seconds, health is
    degraded (not failed), and new requests run on the other decode worker."""
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    outs: dict[str, list] = {}
    ended = threading.Event()
    rids = []

    def cb(out):
        outs.setdefault(out.request_id, []).append(out)
        if out.finished and all(outs.get(r) and outs[r][-1].finished for r in rids):
            ended.set()

    for p in prompts[:4]:
        rids.append(cluster.submit(p[:20], params, callback=cb))
    deadline = time.monotonic() + 30
    while not all(len(outs.get(r, [])) >= 2 for r in rids):
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.01)
    # on a loaded machine the first stream may have ended while the last was still in prefill: kill the decode
    # worker of the running stream with the most tokens still to come. Every worker is frozen (SIGSTOP) while it
    # is chosen and killed: the tiny model decodes its 100 tokens in a fraction of a second, so a stream could
    # otherwise end between the choice and the kill (and no stream would be left to fail)
    pids = {w.uid: w.pid for w in cluster.executor.workers}
    for p in pids.values():
        os.kill(p, signal.SIGSTOP)
    try:
        where = {r: f.decode for r, f in list(cluster.executor._flights.items()) if r in rids}
        assert where, "every stream ended before one could be killed"
        victim = where[min(where, key=lambda r: len(outs[r]))]
        on_victim = [r for r, uid in where.items() if uid == victim]
        t0 = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
    finally:
        for p in pids.values():
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert ended.wait(60)
    killed = 0
    for r in rids:
        last = outs[r][-1]
        if last.finish_reason == "length":   # ended before the kill
            assert not last.error and len(last.token_ids) == 100
        else:
            assert r in on_victim and last.finish_reason == "abort", (r, last)
            assert "decode worker" in last.error and "SIGKILL" in last.error
            killed += 1
    assert killed >= 1
    assert time.monotonic() - t0 < 10
    assert cluster.executor.failure is None
    health = cluster.executor.health()
    assert health["status"] == "degraded"
    assert [w["alive"] for w in health["workers"] if w["role"] == "decode"].count(False) == 1
    again = cluster.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(o.finish_reason == "length" and not o.error for o in again)
