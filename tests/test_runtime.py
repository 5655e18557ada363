"""End-to-end runtime: many concurrent requests through a built engine, checked token-for-token against
transformers' greedy ``generate`` of each prompt alone; preemption, chunked prefill, prefix reuse,
seeded sampling, stop strings, abort, invalid requests."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from kiln.runtime import LLM, InvalidRequestError, RequestOutput, SamplingParams

from runtime_support import assert_no_leak, get_engine, hf_greedy, random_prompts

# one worker builds the engines once
pytestmark = [pytest.mark.xdist_group("runtime"), pytest.mark.usefixtures("hang_watchdog")]

VOCAB = 512


def workload(n=48, seed=0, min_len=1, max_len=90):
    rng = random.Random(seed)
    prompts = random_prompts(n, VOCAB, min_len, max_len, seed=seed)
    max_tokens = [rng.randint(1, 24) for _ in range(n)]
    # a burst of n/4 requests at once (so steps must batch them whatever the machine's speed), then
    # staggered arrivals that join while others run
    delays = [0.0] * (n // 4) + sorted(rng.uniform(0, 0.4) for _ in range(n - n // 4))
    return prompts, max_tokens, delays


def run_async(llm: LLM, prompts, params, delays) -> list[RequestOutput]:
    """Submit each prompt after its delay through generate_async; check the stream adds up."""

    async def one(p, sp, d):
        await asyncio.sleep(d)
        tokens, text, last = [], "", None
        async for out in llm.generate_async(p, sp):
            tokens += out.delta_token_ids
            text += out.delta_text
            last = out
        assert tokens == last.token_ids and text == last.text
        return last

    async def main():
        return await asyncio.gather(*(one(p, sp, d) for p, sp, d in zip(prompts, params, delays)))

    return asyncio.run(main())


def assert_matches_hf(ckpt, prompts, max_tokens, outs, ignore_eos=False):
    bad = []
    for i, (p, m, o) in enumerate(zip(prompts, max_tokens, outs)):
        ref = hf_greedy(ckpt, p, m, ignore_eos=ignore_eos)
        if o.token_ids != ref:
            bad.append(f"request {i} (prompt {len(p)} tokens, max_tokens {m}): kiln {o.token_ids} != hf {ref}")
        stops = not ignore_eos and ref and ref[-1] == 2 and len(ref) <= m
        assert o.finish_reason == ("stop" if stops else "length") or o.token_ids != ref
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    out = {}
    for fam in ("llama", "qwen2"):
        ckpt = checkpoint_dir(fam)
        out[fam] = (ckpt, get_engine(ckpt))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_48_concurrent_requests_match_transformers(engines, family):
    ckpt, engine = engines[family]
    prompts, max_tokens, delays = workload(seed=1 if family == "llama" else 2)
    with LLM(engine) as llm:
        outs = run_async(llm, prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens], delays)
        assert_matches_hf(ckpt, prompts, max_tokens, outs)
        assert_no_leak(llm)
        stats = llm.stats()
        assert stats["counters"]["requests_finished"] == 48 and stats["counters"]["preemptions"] == 0
        biggest = max(s.batch_size for s in llm.executor.metrics.steps)
        print(f"\n{family}: largest step batched {biggest} sequences")
        assert biggest >= 6, "requests were not batched"
        for o in outs:
            m = o.metrics
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
            assert m.ttft >= m.queue_time >= 0
            assert (m.mean_tpot is None) == (len(o.token_ids) < 2)


def test_preemption_with_a_tiny_pool_keeps_outputs(engines):
    ckpt, engine = engines["llama"]
    prompts, max_tokens, delays = workload(seed=3)
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    with LLM(engine, capacity_policy="max_utilization", max_kv_cache_tokens=longest + 16) as llm:
        assert llm.executor.kv.num_blocks * 8 < 3 * longest
        outs = run_async(llm, prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens], delays)
        assert_matches_hf(ckpt, prompts, max_tokens, outs)
        assert_no_leak(llm)
        assert llm.stats()["counters"]["preemptions"] > 0
        assert sum(o.metrics.num_preemptions for o in outs) == llm.stats()["counters"]["preemptions"]


def test_chunked_prefill_keeps_outputs(engines):
    ckpt, engine = engines["qwen2"]
    prompts, max_tokens, delays = workload(seed=4, min_len=30, max_len=90)
    with LLM(engine, max_num_tokens=16, enable_prefix_reuse=False) as llm:
        chunks = []
        schedule = llm.executor.scheduler.schedule

        def spy():
            out = schedule()
            chunks.extend((s.num_new_tokens, s.samples) for s in out.scheduled)
            assert out.num_tokens <= 16
            return out

        llm.executor.scheduler.schedule = spy
        outs = run_async(llm, prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens], delays)
        assert_matches_hf(ckpt, prompts, max_tokens, outs)
        assert_no_leak(llm)
        assert max(len(p) for p in prompts) > 16
        assert any(not samples for _, samples in chunks), "no prompt was split"
        assert llm.stats()["counters"]["prefill_tokens_computed"] == sum(len(p) for p in prompts)


def test_decoding_budget_and_short_prompt_lead_keep_outputs(engines):
    """Both scheduling knobs on the real step loop: every step that carries a decode holds at most the decoding
    budget, a step without one may hold more, and the outputs are transformers' whatever the order."""
    ckpt, engine = engines["llama"]
    bounds = engine.config.bounds
    budget = bounds.max_batch_size - 1 + bounds.tokens_per_block
    prompts, max_tokens, delays = workload(seed=6, min_len=10, max_len=90)
    with LLM(engine, decoding_max_num_tokens=budget, short_prompt_lead_s=5.0, enable_prefix_reuse=False) as llm:
        assert llm.executor.scheduler.config.decoding_max_num_tokens == budget
        steps = []
        schedule = llm.executor.scheduler.schedule

        def spy():
            out = schedule()
            steps.append((out.num_tokens, out.num_decode_tokens > 0))
            return out

        llm.executor.scheduler.schedule = spy
        outs = run_async(llm, prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens], delays)
        # whether the burst's steps ran without decodes depends on the machine's speed: a long prompt alone on
        # the idle engine is a step without one for certain
        alone = [max(prompts, key=len)]
        assert len(alone[0]) > budget
        outs += llm.generate(alone, SamplingParams(temperature=0, max_tokens=3))
        assert_matches_hf(ckpt, prompts + alone, max_tokens + [3], outs)
        assert_no_leak(llm)
    assert all(n <= budget for n, decodes in steps if decodes)
    assert any(decodes for _, decodes in steps) and max(n for n, decodes in steps if not decodes) > budget


def test_prefix_reuse_hits_and_outputs(engines):
    ckpt, engine = engines["llama"]
    rng = random.Random(5)
    prefix = [rng.randrange(3, VOCAB) for _ in range(64)]
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(8)]
    with LLM(engine) as llm:
        first = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=6))
        rest = llm.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=6))
        outs = first + rest
        assert_matches_hf(ckpt, prompts, [6] * 8, outs)
        assert outs[0].metrics.num_cached_tokens == 0
        assert all(o.metrics.num_cached_tokens == 64 for o in rest)
        kv = llm.stats()["kv_cache"]
        assert kv["prefix_hits"] == 7 * 64 and kv["hit_rate"] > 0.5
        assert llm.stats()["counters"]["prefill_tokens_computed"] == sum(len(p) for p in prompts) - 7 * 64
        assert_no_leak(llm)
        # the same prompt again, the bare block-aligned prefix, and a prompt extending a finished conversation:
        # the last token is always recomputed, and cached blocks hold generated tokens too
        again = [prompts[3], prefix, prompts[0] + outs[0].token_ids[:5] + [7, 8, 9]]
        outs2 = llm.generate(again, SamplingParams(temperature=0, max_tokens=6))
        assert_matches_hf(ckpt, again, [6] * 3, outs2)
        assert [o.metrics.num_cached_tokens for o in outs2] == [len(prompts[3]) // 8 * 8, 56,
                                                               (len(prompts[0]) + 5) // 8 * 8]
        assert_no_leak(llm)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_8bit_kv_outputs_survive_preemption_chunking_and_prefix_reuse(engines, kv):
    """A token's 8-bit row depends on its own keys only: with a pool small enough to preempt, prompts cut into
    16-token chunks and a shared prefix reused, an 8-bit KV engine generates what it generates for each prompt
    alone. (Its accuracy against the fp32 pool is measured on a trained checkpoint: scripts/kv_quant_agreement.py.)"""
    ckpt, _ = engines["llama"]
    engine = get_engine(ckpt, kv_cache_dtype=kv)
    assert engine.kv_dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    rng = random.Random(9)
    prefix = [rng.randrange(3, VOCAB) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(engine, enable_prefix_reuse=False) as llm:
        alone = [llm.generate([p], greedy)[0].token_ids for p in prompts]
    longest = max(len(p) for p in prompts) + 20
    with LLM(engine, capacity_policy="max_utilization", max_kv_cache_tokens=longest + 24, max_num_tokens=16) as llm:
        outs = llm.generate(prompts[:1], greedy) + llm.generate(prompts[1:], greedy)
        stats = llm.stats()
        assert_no_leak(llm)
    assert [o.token_ids for o in outs] == alone
    assert stats["counters"]["preemptions"] > 0 and stats["kv_cache"]["prefix_hits"] > 0


def test_multi_turn_replay_ttft_with_and_without_reuse(engines, capsys):
    ckpt, engine = engines["llama"]
    rng = random.Random(6)
    results = {}
    for reuse in (True, False):
        with LLM(engine, enable_prefix_reuse=reuse) as llm:
            history = [rng.randrange(3, VOCAB) for _ in range(24)] if reuse else results["first_turn"]
            results.setdefault("first_turn", list(history))
            ttfts, computed = [], []
            user = random.Random(7)
            for _turn in range(4):
                before = llm.stats()["counters"]["prefill_tokens_computed"]
                (out,) = llm.generate([history], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                ref = hf_greedy(ckpt, history, 8)
                assert out.token_ids[:len(ref)] == ref if ref[-1:] == [2] else out.token_ids == ref
                ttfts.append(out.metrics.ttft)
                computed.append(llm.stats()["counters"]["prefill_tokens_computed"] - before)
                history = history + out.token_ids + [user.randrange(3, VOCAB) for _ in range(12)]
            results[reuse] = (ttfts, computed)
    with capsys.disabled():
        for reuse in (True, False):
            ttfts, computed = results[reuse]
            print(f"\n  multi-turn replay, prefix reuse {'on ' if reuse else 'off'}: TTFT per turn "
                  f"{[f'{t * 1e3:.1f} ms' for t in ttfts]}, prompt tokens computed {computed}")
    on, off = results[True][1], results[False][1]
    assert on[0] == off[0] and all(a < b for a, b in zip(on[1:], off[1:]))


def test_seeded_sampling_reproducible_alone_and_batched(engines):
    _, engine = engines["qwen2"]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = random_prompts(1, VOCAB, 20, 20, seed=8)[0]
    with LLM(engine) as llm:
        (alone,) = llm.generate([prompt], params)
        (again,) = llm.generate([prompt], params)
        others = random_prompts(12, VOCAB, 1, 60, seed=9)
        mixed = llm.generate(others[:6] + [prompt] + others[6:],
                             [SamplingParams(temperature=1.0, max_tokens=12)] * 6 + [params]
                             + [SamplingParams(temperature=0.7, max_tokens=20, seed=5)] * 6)
        (other_seed,) = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=16,
                                                              ignore_eos=True))
    assert again.token_ids == alone.token_ids
    assert mixed[6].token_ids == alone.token_ids
    assert other_seed.token_ids != alone.token_ids


def test_stop_strings_are_trimmed(engines):
    _, engine = engines["llama"]
    with LLM(engine) as llm:
        prompts = random_prompts(6, VOCAB, 5, 30, seed=10)
        full = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        checked = 0
        for p, f in zip(prompts, full):
            text = f.text
            if len(text) < 12:
                continue
            stop = text[6:9]
            if "\ufffd" in stop:
                continue
            k = text.index(stop)
            (cut,) = llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      stop=[stop, "\x00"]))
            assert cut.finish_reason == "stop" and cut.stop_reason == stop
            assert cut.text == text[:k] and stop not in cut.text
            assert len(cut.token_ids) < len(f.token_ids)
            (kept,) = llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
                                                       include_stop_str_in_output=True))
            assert kept.text == text[:k + len(stop)]
            streamed = run_async(llm, [p], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop)],
                                 [0])[0]
            assert streamed.text == text[:k]
            checked += 1
        assert checked >= 3


def test_abort_mid_stream_frees_blocks(engines):
    _, engine = engines["llama"]
    with LLM(engine) as llm:
        prompt = random_prompts(1, VOCAB, 40, 40, seed=11)[0]
        seen = {}

        async def main():
            outs = []
            agen = llm.generate_async(prompt, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True),
                                      request_id="victim")
            async for out in agen:
                outs.append(out)
                if len(outs) == 3:
                    seen["used"] = llm.executor.kv.num_used_blocks
                    llm.abort("victim")
            return outs

        outs = asyncio.run(main())
        assert seen["used"] > 0
        assert outs[-1].finish_reason == "abort" and 3 <= len(outs[-1].token_ids) < 80
        assert_no_leak(llm)
        # no step follows the abort: the gauges must show the freed blocks anyway
        assert llm.stats()["gauges"]["kv_blocks_used"] == 0 and llm.stats()["gauges"]["running"] == 0

        async def early_exit():   # leaving the stream early aborts the request too
            async for _ in llm.generate_async(prompt, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)):
                break

        asyncio.run(early_exit())
        assert_no_leak(llm)
        for i, _ in enumerate(llm.stream(prompt, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))):
            if i == 2:
                break                      # the blocking stream aborts on exit too
        assert_no_leak(llm)
        assert llm.stats()["counters"]["requests_aborted"] == 3 and llm.stats()["outcomes"]["abort"] == 3
        assert llm.executor.failure is None
    assert llm.executor.failure == "the executor is closed"


def test_invalid_requests_raise_while_others_finish(engines):
    ckpt, engine = engines["llama"]
    prompts, max_tokens, _ = workload(n=12, seed=12)
    with LLM(engine) as llm:
        result = {}
        t = threading.Thread(target=lambda: result.update(outs=llm.generate(
            prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])))
        t.start()
        time.sleep(0.05)
        cases = [
            (list(range(3, 100)), SamplingParams(max_tokens=4), "max_input_len"),
            (list(range(3, 90)), SamplingParams(max_tokens=60), "max_seq_len"),
            ([5, VOCAB + 3], SamplingParams(max_tokens=4), "vocabulary"),
            ([], SamplingParams(max_tokens=4), "empty"),
            ([5, 6], SamplingParams(max_tokens=4, stop_token_ids=[10**6]), "stop_token_ids"),
        ]
        for prompt, sp, msg in cases:
            with pytest.raises(InvalidRequestError, match=msg):
                llm.submit(prompt, sp)
        with pytest.raises(ValueError, match="invalid SamplingParams"):
            llm.submit([5, 6], SamplingParams(top_p=0))
        llm.submit([5, 6], SamplingParams(max_tokens=30, ignore_eos=True), request_id="dup")
        with pytest.raises(InvalidRequestError, match="already in use"):
            llm.submit([5, 6], SamplingParams(max_tokens=2), request_id="dup")
        with pytest.raises(InvalidRequestError, match="max_input_len"):   # a bad prompt in a batch: nothing runs
            llm.generate([[5, 6], list(range(3, 200))], SamplingParams(max_tokens=4))
        t.join(60)
        assert_matches_hf(ckpt, prompts, max_tokens, result["outs"])
        assert_no_leak(llm)
        assert llm.stats()["counters"]["requests_rejected"] >= 6


def test_llm_from_engine_dir_with_text_prompts(engines):
    _, engine = engines["qwen2"]
    with LLM(engine.directory, max_batch_size=4, seed=0) as llm:
        outs = llm.generate(["The kiln fires the clay", "Héllo wörld 🙂", "Tokens flow"],
                            SamplingParams(temperature=0, max_tokens=8, logprobs=3))
        assert [o.prompt for o in outs] == ["The kiln fires the clay", "Héllo wörld 🙂", "Tokens flow"]
        for o in outs:
            assert o.prompt_token_ids == llm.tokenizer.encode(o.prompt).ids
            assert o.text == llm.decode(o.token_ids)
            assert len(o.logprobs) == len(o.token_ids)
            for tok, lp in zip(o.token_ids, o.logprobs):
                assert next(iter(lp)) == tok and len(lp) >= 3 and lp[tok] == max(lp.values())
        with pytest.raises(ValueError, match="max_batch_size"):
            LLM(engine, max_batch_size=10**6)
        assert "TTFT" in llm.metrics_summary()


def test_priority_arrival_preempts_lower_priority_requests(engines):
    """max_utilization: three low-priority requests fill most of the pool; a high-priority one arriving after
    their first token cannot fit, so the lowest-priority, latest one is preempted (then the next) until it
    does. Every output is still transformers' greedy one; the priority shows in each output's metrics."""
    ckpt, engine = engines["llama"]
    rng = random.Random(13)
    lows = [[rng.randrange(3, VOCAB) for _ in range(40)] for _ in range(3)]     # 5 blocks each, 8 at most
    high = [rng.randrange(3, VOCAB) for _ in range(90)]                         # 12 blocks
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(engine, capacity_policy="max_utilization", max_kv_cache_tokens=24 * 8) as llm:
        assert llm.executor.kv.num_blocks == 24
        finals, started = {}, set()
        steps = []
        schedule = llm.executor.scheduler.schedule

        def spy():
            out = schedule()
            steps.append(([r.request_id for r in out.preempted], [s.request.request_id for s in out.scheduled]))
            return out

        llm.executor.scheduler.schedule = spy

        def on_output(out: RequestOutput):
            if out.finished:
                finals[out.request_id] = out
            elif out.request_id != "high" and out.request_id not in started:
                started.add(out.request_id)
                if len(started) == 3:   # from the step loop: "high" arrives before the next step
                    llm.submit(high, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                               request_id="high", priority=5, callback=on_output)

        for rid, prompt, prio in (("a", lows[0], 0), ("b", lows[1], 1), ("c", lows[2], 0)):
            llm.submit(prompt, params, request_id=rid, priority=prio, callback=on_output)
        assert llm.executor.wait_idle(60)
        admitted = next(i for i, (_, ids) in enumerate(steps) if "high" in ids)
        assert steps[admitted][0] in (["c"], ["c", "a"])     # lowest priority, latest arrival first; never b
        assert finals["high"].metrics.priority == 5 and finals["b"].metrics.priority == 1
        assert finals["high"].metrics.num_preemptions == 0 and finals["c"].metrics.num_preemptions >= 1
        assert_matches_hf(ckpt, lows + [high], [24, 24, 24, 6], [finals[r] for r in ("a", "b", "c", "high")],
                          ignore_eos=True)
        assert_no_leak(llm)


def test_sliding_window_holds_a_bounded_number_of_blocks(checkpoint_dir):
    """Mistral with a window of 8 and blocks of 8: after its 17-token prompt (3 blocks), a 110-token generation
    holds at most 2 blocks at a time (16 without the window); outputs equal transformers', also for a second
    request whose prompt blocks come from the prefix cache after the first request released them."""
    ckpt = checkpoint_dir("mistral")
    engine = get_engine(ckpt)
    assert engine.config.model.sliding_window == 8 and engine.config.bounds.tokens_per_block == 8
    prompt = random_prompts(1, VOCAB, 17, 17, seed=14)[0]
    with LLM(engine) as llm:
        kv = llm.executor.kv
        held: dict[str, list[int]] = {}

        def watch(out: RequestOutput):
            if not out.finished:
                held.setdefault(out.request_id, []).append(len(kv.held_blocks(out.request_id)))
                kv.check_consistency()

        outs = []
        for rid in ("first", "again"):
            q = []
            llm.submit(prompt, SamplingParams(temperature=0, max_tokens=110, ignore_eos=True), request_id=rid,
                       callback=lambda out: (watch(out), q.append(out)))
            assert llm.executor.wait_idle(60)
            outs.append(q[-1])
        print(f"\nsliding window 8: blocks held after the prompt {held['first'][0]}, then at most "
              f"{max(held['first'][1:])} (110 tokens generated)")
        for h in held.values():
            assert h[0] == 3 and max(h[1:]) <= 2 and len(h) == 109
        assert outs[1].metrics.num_cached_tokens == 16
        assert_matches_hf(ckpt, [prompt, prompt], [110, 110], outs, ignore_eos=True)
        assert_no_leak(llm)
