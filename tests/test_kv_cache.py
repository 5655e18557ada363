"""KVCacheManager: ref-counted blocks, hash-chained prefix reuse, LRU eviction, sizing."""

from __future__ import annotations

import pytest

from kiln.contract import ConfigError
from kiln.runtime.kv_cache import KVCacheManager, hash_block, plan_num_blocks
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams


def req(tokens, rid="r"):
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4)


def run_prefill(kv: KVCacheManager, r: Request) -> None:
    hits = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - len(hits) * kv.block_size, hits)
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r)


def blocks(kv: KVCacheManager, r: Request) -> list[int]:
    return kv.block_table(r.request_id)


def test_allocate_free_accounting():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_reuse=False)
    a, b = req(list(range(10)), "a"), req(list(range(5)), "b")
    assert kv.allocate_slots(a, 10) and len(blocks(kv, a)) == 3
    assert kv.allocate_slots(b, 5) and len(blocks(kv, b)) == 2
    assert kv.num_used_blocks == 5 and kv.num_free_blocks == 3
    assert not kv.allocate_slots(req(list(range(20)), "c"), 20)   # 5 blocks > 3 free: nothing taken
    assert kv.num_free_blocks == 3
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) and kv.num_free_blocks == 3       # 12 tokens fit the 3 blocks
    assert not kv.allocate_slots(a, 3, keep_free=3)                  # the 4th block would break a promise
    assert kv.allocate_slots(a, 3) and kv.num_free_blocks == 2
    kv.free(a)
    kv.free(b)
    assert kv.num_used_blocks == 0
    kv.check_consistency()


def test_hash_chain_depends_on_prefix():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == h1
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 5]) != h1


def test_prefix_reuse_shares_blocks_and_counts_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    shared = list(range(100, 112))                       # 3 full blocks
    a = req(shared + [1, 2], "a")
    run_prefill(kv, a)
    assert kv.stats().cached_blocks == 3                 # the partial 4th block is not cached
    b = req(shared + [7, 8, 9], "b")
    hits = kv.get_computed_blocks(b)
    assert hits == blocks(kv, a)[:3]
    assert kv.allocate_slots(b, 3, hits)                   # 12 tokens computed, 3 to go: one new block
    assert blocks(kv, b)[:3] == hits and len(blocks(kv, b)) == 4
    assert all(kv.ref_cnt[x] == 2 for x in hits)         # shared, not copied
    st = kv.stats()
    assert st.prefix_hits == 12 and st.prefix_queries == 14 + 15
    kv.free(a)
    assert all(kv.ref_cnt[x] == 1 for x in hits)
    kv.free(b)
    assert kv.num_used_blocks == 0 and kv.stats().cached_blocks == 3
    kv.check_consistency()


def test_last_token_is_never_served_from_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req(list(range(8)), "a")
    run_prefill(kv, a)
    kv.free(a)
    b = req(list(range(8)), "b")                          # identical prompt of exactly 2 blocks
    assert len(kv.get_computed_blocks(b)) == 1            # the 2nd block holds the token that must be computed


def test_lru_eviction_order_and_stats():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b = req([1, 2, 3, 4, 5], "a"), req([9, 8, 7, 6, 5], "b")
    run_prefill(kv, a)
    run_prefill(kv, b)
    a_blocks, b_blocks = list(blocks(kv, a)), list(blocks(kv, b))
    kv.free(a)    # a's uncached tail block goes to the front; its cached blocks to the back
    kv.free(b)
    assert kv.stats().cached_blocks == 4 and kv.num_free_blocks == 6
    # uncached tail blocks go first; then 'a' (freed first, so older) before b's
    c = req([42, 43, 44, 45, 46, 47, 48], "c")
    assert kv.allocate_slots(c, 7)
    assert kv.stats().evictions == 2
    assert blocks(kv, c) == [b_blocks[2], a_blocks[2], a_blocks[1], a_blocks[0]]
    assert kv.get_computed_blocks(req([9, 8, 7, 6, 5], "b2")) == b_blocks[:2]
    assert kv.get_computed_blocks(req([1, 2, 3, 4, 5], "a2")) == []
    kv.check_consistency()


def test_cache_hit_touch_removes_from_free_queue():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = req([1, 2, 3], "a")
    run_prefill(kv, a)
    kv.free(a)
    b = req([1, 2, 5, 6, 7], "b")
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 1 and kv.ref_cnt[hits[0]] == 0    # cached but free: taking it shrinks the free pool
    assert not kv.allocate_slots(b, 3, hits, keep_free=1)  # 2 new blocks + the cached one = all 3
    assert kv.num_free_blocks == 3
    assert kv.allocate_slots(b, 3, hits)  # needs 2 more blocks: the free ones, not the shared one
    assert kv.num_free_blocks == 0
    assert hits[0] in blocks(kv, b) and len(set(blocks(kv, b))) == 3
    kv.check_consistency()


def test_duplicate_prefix_computed_twice_stays_consistent():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a, b = req([1, 2, 3, 4, 5], "a"), req([1, 2, 3, 4, 5], "b")
    for r in (a, b):   # both admitted before either is cached: two private copies of the same prefix
        assert kv.get_computed_blocks(r) == []
        assert kv.allocate_slots(r, 5)
    for r in (a, b):
        r.num_computed_tokens = 5
        kv.cache_blocks(r)
    assert kv.stats().cached_blocks == 2
    kv.free(a)
    kv.free(b)
    kv.check_consistency()
    assert kv.num_used_blocks == 0


def test_plan_num_blocks_smallest_limit_wins():
    n, why = plan_num_blocks(1024, 16, memory_fraction=0.5, max_kv_cache_tokens=None, available_bytes=1 << 30)
    assert n == (1 << 29) // (1024 * 16) and "kv_cache_memory_fraction" in why
    n, why = plan_num_blocks(1024, 16, memory_fraction=0.5, max_kv_cache_tokens=160, available_bytes=1 << 30)
    assert n == 10 and "max_kv_cache_tokens" in why
    n, why = plan_num_blocks(1024, 16, memory_fraction=0.9, max_kv_cache_tokens=None, useful_tokens=100,
                             available_bytes=1 << 30)
    assert n == 7
    with pytest.raises(ConfigError, match="smaller than one block"):
        plan_num_blocks(1 << 20, 16, memory_fraction=0.1, max_kv_cache_tokens=None, available_bytes=1 << 20)
    with pytest.raises(ValueError, match="below one block"):
        plan_num_blocks(1024, 16, memory_fraction=None, max_kv_cache_tokens=8)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        plan_num_blocks(1024, 16, memory_fraction=1.5, max_kv_cache_tokens=None)


def test_sliding_window_releases_blocks_behind_the_window():
    """Window 8, blocks of 4: the next token at position p attends to p-7..p, so at most 3 blocks are held
    however long the request grows; the table keeps its positions and never names a released block."""
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=8)
    r = req(list(range(100, 110)), "r")
    assert kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    kv.cache_blocks(r)
    most = 0
    for t in range(40):                              # 40 decode steps: 50 tokens = 13 blocks without the window
        r.append_token(200 + t)
        assert kv.allocate_slots(r, 1)
        table, held = kv.block_table(r.request_id), kv.held_blocks(r.request_id)
        first_needed = (r.num_computed_tokens - 8 + 1) // 4
        assert len(table) == -(-(r.num_computed_tokens + 1) // 4)          # positional
        assert table[first_needed:] == held[len(held) - len(table) + first_needed:] or first_needed <= 0
        assert set(table) <= set(held)
        most = max(most, len(held))
        r.num_computed_tokens += 1
        kv.cache_blocks(r)
        kv.check_consistency()
    assert most <= 3 and kv.num_used_blocks <= 3
    # released blocks that were full stay in the prefix cache: the same prompt finds them
    again = req(list(range(100, 110)), "again")
    assert len(kv.get_computed_blocks(again)) == 2
    kv.free(r)
    kv.check_consistency()
    assert kv.num_used_blocks == 0
