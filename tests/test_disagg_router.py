"""The disaggregated frontend's prefix-aware choice of a prefill worker (kiln.runtime.disagg.router), against the
KV manager's own hash chain and cache events; no processes (the end-to-end routing test is in test_disagg.py)."""

from __future__ import annotations

from kiln.runtime.disagg.router import PrefixRouter, prompt_hashes
from kiln.runtime.kv_cache import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams

BS = 4
PREFIX = list(range(100, 116))          # 4 full blocks
OTHER = list(range(200, 216))


def prefill(kv: KVCacheManager, tokens: list[int], rid: str) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=1), max_tokens=1)
    hits = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - len(hits) * kv.block_size, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r)
    return r


def test_events_name_the_hashes_the_frontend_computes():
    """What a worker's KV manager logs (cached, then evicted) is the chain prompt_hashes gives the frontend."""
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    kv.record_events()
    r = prefill(kv, PREFIX + [1, 2], "a")
    assert kv.drain_events() == [(True, h) for h in prompt_hashes(PREFIX + [1, 2], BS)]
    assert kv.drain_events() == []
    kv.free(r)
    prefill(kv, OTHER + [3], "b")   # 5 blocks of 6: 3 of the cached ones are evicted
    events = kv.drain_events()
    evicted = [h for cached, h in events if not cached]
    assert len(evicted) == 3 and set(evicted) <= set(prompt_hashes(PREFIX, BS))
    assert [h for cached, h in events if cached] == prompt_hashes(OTHER + [3], BS)


def test_no_prefix_anywhere_is_least_loaded():
    router = PrefixRouter(BS)
    assert router.route("a", PREFIX, [(0, 0), (1, 0)]).uid == 0      # a tie: the lower slot
    assert router.route("b", OTHER, [(0, 1), (1, 0)]).uid == 1       # 0 has a's 16 tokens queued
    assert router.route("c", [7] * 10, [(0, 1), (1, 1)]).uid == 0    # 16 tokens queued on each: 0 was chosen longer ago
    router.release("a")
    assert router.route("d", [7] * 10, [(0, 1), (1, 1)]).uid == 0    # 0 holds c's 10 now, 1 holds b's 16


def test_ties_go_to_the_worker_chosen_least_recently():
    """Prompts no worker holds, each routed after the last left prefill: they take turns, so new prefixes spread
    over the workers' caches."""
    router = PrefixRouter(BS)
    uids = []
    for i in range(4):
        uids.append(router.route(f"r{i}", [i] * 9, [(0, 0), (1, 0)]).uid)
        router.release(f"r{i}")
    assert uids == [0, 1, 0, 1]


def test_the_holder_of_a_prefix_wins_until_its_queue_costs_more():
    router = PrefixRouter(BS)
    router.on_events(1, [(True, h) for h in prompt_hashes(PREFIX, BS)])
    prompt = PREFIX + [9, 9]
    first = router.route("a", prompt, [(0, 0), (1, 0)])
    assert (first.uid, first.cached_tokens, first.cost) == (1, 16, 2)
    # each follower adds its 2 uncached tokens to worker 1's queue: cheaper there than 18 tokens on worker 0
    for i in range(7):
        assert router.route(f"f{i}", prompt, [(0, 0), (1, 1 + i)]).uid == 1
    # worker 1's queue is 16 tokens now: 16 + 2 = 18 ties with recomputing all 18 on worker 0, which has fewer
    # requests queued; past that the prefix is recomputed on the idle worker
    assert router.route("x", prompt, [(0, 0), (1, 8)]).uid == 0
    router.release("x")
    for rid in ["a"] + [f"f{i}" for i in range(7)]:
        router.release(rid)
    assert router.route("y", prompt, [(0, 0), (1, 0)]).uid == 1   # released: the holder is idle again


def test_an_evicted_prefix_no_longer_attracts():
    router = PrefixRouter(BS)
    hashes = prompt_hashes(PREFIX, BS)
    router.on_events(1, [(True, h) for h in hashes])
    router.on_events(1, [(False, hashes[1])])   # the chain breaks at block 1: only block 0 still matches
    route = router.route("a", PREFIX + [5], [(0, 0), (1, 0)])
    assert (route.uid, route.cached_tokens) == (1, BS)
    router.release("a")
    router.forget(1)
    assert router.route("b", PREFIX + [5], [(0, 0), (1, 0)]).cached_tokens == 0


def test_a_prompt_in_prefill_counts_as_held_and_one_token_is_left_to_compute():
    """A prompt still in prefill on a worker counts as that worker's (its blocks will be cached there), and the
    match stops a block short of a prompt that is all whole blocks (the worker computes its last token)."""
    router = PrefixRouter(BS)
    router.route("a", PREFIX, [(0, 0), (1, 0)])               # on 0, 16 tokens queued
    route = router.route("b", PREFIX, [(0, 1), (1, 5)])       # 16 + 4 on 0 against 16 on 1
    assert (route.uid, route.cost) == (1, 16)
    router.release("b")
    big = [7] * 40
    router.route("c", big, [(0, 1), (1, 0)])                  # 40 queued on 1
    route = router.route("d", PREFIX + [1], [(0, 1), (1, 1)])
    assert (route.uid, route.cached_tokens) == (0, 16)        # held by a's claim: 16 + 1 on 0, 17 + 40 on 1
    router.release("a")
    route = router.route("e", PREFIX + [1], [(0, 1), (1, 1)])
    assert route.uid == 0 and route.cached_tokens == 16       # d's own claim holds it now


def test_prefix_reuse_off_routes_by_load_alone():
    router = PrefixRouter(BS, enabled=False)
    router.on_events(1, [(True, h) for h in prompt_hashes(PREFIX, BS)])
    route = router.route("a", PREFIX + [1], [(0, 0), (1, 0)])
    assert (route.uid, route.cached_tokens) == (0, 0)
