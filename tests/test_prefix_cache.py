"""Prefix caching on tiny pools: exact block ids on hits, exact eviction order, salts, stats."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.block_pool import BlockPool, hash_block_tokens
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.sequence import Sequence

from conftest_core import drive, fake_step, make_group, make_scheduler, run_all


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def _computed_seq(mgr: KVCacheManager, seq_id: int, tokens: list[int], salt: str | None = None) -> Sequence:
    """A sequence whose tokens were all computed (blocks allocated and cached)."""
    seq = Sequence(seq_id, tokens)
    assert mgr.allocate_slots(seq, len(tokens)) is not None
    seq.num_computed_tokens = len(tokens)
    mgr.cache_full_blocks(seq, salt)
    return seq


def test_hash_chain_depends_on_parent_tokens_and_salt():
    h1 = hash_block_tokens(None, [1, 2])
    assert h1 == hash_block_tokens(None, [1, 2])
    assert h1 != hash_block_tokens(None, [1, 3])
    assert h1 != hash_block_tokens(None, [1, 2], "tenant-a")
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(hash_block_tokens(None, [9, 9]), [5, 6])


def test_hit_reuses_exact_blocks_and_caps_last_token():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a = _computed_seq(mgr, 0, [1, 2, 3, 4, 5])  # blocks 0, 1 full (cached), 2 partial
    assert mgr.get_block_ids(0) == [0, 1, 2]
    b = Sequence(1, [1, 2, 3, 4, 9, 9])
    hit = mgr.get_computed_blocks(b)
    assert [blk.block_id for blk in hit] == [0, 1]
    # A prompt equal to a cached prefix still recomputes its last token: [1, 2, 3, 4] -> 1 block.
    assert [blk.block_id for blk in mgr.get_computed_blocks(Sequence(2, [1, 2, 3, 4]))] == [0]
    b.num_computed_tokens = 4
    assert [blk.block_id for blk in mgr.allocate_slots(b, 2, hit)] == [3]
    assert mgr.get_block_ids(1) == [0, 1, 3]
    assert [blk.ref_cnt for blk in mgr.block_pool.blocks[:4]] == [2, 2, 1, 1]
    mgr.check_invariants({0, 1})
    mgr.free(a)
    mgr.free(b)
    mgr.check_invariants(set())


def test_freed_cached_blocks_are_hit_and_pulled_from_the_free_list():
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    a = _computed_seq(mgr, 0, [1, 2, 3, 4, 5])
    mgr.free(a)
    # Unhashed block 2 to the head; hashed ones to the tail, the sequence's tail (1) before its head (0).
    assert free_ids(mgr.block_pool) == [2, 3, 4, 5, 1, 0]
    b = Sequence(1, [1, 2, 3, 4, 7])
    hit = mgr.get_computed_blocks(b)
    b.num_computed_tokens = 4
    assert [blk.block_id for blk in mgr.allocate_slots(b, 1, hit)] == [2]
    assert free_ids(mgr.block_pool) == [3, 4, 5]
    mgr.check_invariants({1})


def test_eviction_order_unhashed_first_then_lru_tail_before_head():
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    a = _computed_seq(mgr, 0, [1, 2, 3, 4])  # blocks 0, 1 (cached)
    b = _computed_seq(mgr, 1, [5, 6, 7, 8, 9])  # blocks 2, 3 (cached), 4 (partial)
    mgr.free(a)  # freed first: least recently used
    mgr.free(b)
    assert free_ids(mgr.block_pool) == [4, 5, 1, 0, 3, 2]
    pool = mgr.block_pool
    got = pool.get_new_blocks(4)
    assert [blk.block_id for blk in got] == [4, 5, 1, 0]
    # Blocks 1 and 0 were evicted: a's prefix is gone, b's survives.
    assert mgr.get_computed_blocks(Sequence(2, [1, 2, 3, 4, 0])) == []
    assert [blk.block_id for blk in mgr.get_computed_blocks(Sequence(3, [5, 6, 7, 8, 0]))] == [2, 3]
    pool.free_blocks(got)
    mgr.check_invariants(set())


def test_allocation_with_hit_fails_cleanly_when_pool_is_short():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    a = _computed_seq(mgr, 0, [1, 2, 3, 4])
    mgr.free(a)  # blocks 0, 1 cached and free; block 2 free
    b = Sequence(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit = mgr.get_computed_blocks(b)
    b.num_computed_tokens = 4
    assert mgr.allocate_slots(b, 5, hit) is None  # needs 3 new blocks, only 1 left after the hit
    assert free_ids(mgr.block_pool) == [2, 1, 0] and 1 not in mgr.block_tables
    mgr.check_invariants(set())


def test_salt_separates_tenants():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    _computed_seq(mgr, 0, [1, 2, 3, 4, 5], salt="a")
    assert mgr.get_computed_blocks(Sequence(1, [1, 2, 3, 4, 5])) == []
    assert len(mgr.get_computed_blocks(Sequence(2, [1, 2, 3, 4, 5]), "b")) == 0
    assert len(mgr.get_computed_blocks(Sequence(3, [1, 2, 3, 4, 5]), "a")) == 2


def test_generated_tokens_become_cacheable():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    seq = _computed_seq(mgr, 0, [1, 2, 3])
    seq.output_token_ids.append(4)  # decoded token; its K/V computed next step
    mgr.allocate_slots(seq, 1)
    seq.num_computed_tokens = 4
    mgr.cache_full_blocks(seq)
    assert [b.block_id for b in mgr.get_computed_blocks(Sequence(1, [1, 2, 3, 4, 5]))] == [0, 1]


def test_reset_prefix_cache_only_when_idle():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = _computed_seq(mgr, 0, [1, 2, 3, 4])
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(Sequence(1, [1, 2, 3, 4, 5])) == []
    mgr.check_invariants(set())


def test_disabled_caching_never_hits():
    mgr = KVCacheManager(num_blocks=4, block_size=2, enable_caching=False)
    mgr.free(_computed_seq(mgr, 0, [1, 2, 3, 4]))
    assert mgr.get_computed_blocks(Sequence(1, [1, 2, 3, 4, 5])) == []


def test_scheduler_admits_with_cached_prefix_and_counts_stats():
    sched = make_scheduler(num_blocks=16, block_size=4)
    sched.add_request(make_group("a", 10, tokens=list(range(10))))
    run_all(sched)
    sched.add_request(make_group("b", 12, tokens=list(range(8)) + [50, 51, 52, 53]))
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_computed_tokens == 8 and s.token_ids == [50, 51, 52, 53]
    assert sched.requests["b"].num_cached_tokens == 8
    stats = sched.prefix_cache_stats
    assert (stats.queries, stats.hits) == (22, 8)


def test_request_waits_for_a_prefix_a_running_prefill_is_computing():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=100)
    sched.add_request(make_group("a", 10, tokens=list(range(10))))
    sched.add_request(make_group("b", 10, tokens=list(range(8)) + [50, 51]))  # a's first 2 blocks
    sched.add_request(make_group("c", 10, tokens=[60 + i for i in range(10)]))  # behind b: FCFS
    out, _ = fake_step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]  # b's first block is a's, not cached yet
    out, _ = fake_step(sched)
    b = next(s for s in out.scheduled if s.request_id == "b")
    assert b.num_computed_tokens == 8 and b.token_ids == [50, 51]  # now a hit: computed once
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"]
    sched.check_invariants()


def test_caching_off_admits_identical_prompts_together():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=100, enable_caching=False)
    sched.add_request(make_group("a", 10, tokens=list(range(10))))
    sched.add_request(make_group("b", 10, tokens=list(range(10))))
    out, _ = fake_step(sched)
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 10), ("b", 10)]


def test_preempted_request_resumes_from_its_own_cached_blocks():
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=100)
    sched.add_request(make_group("old", 4, max_tokens=6, tokens=[1, 2, 3, 4]))
    sched.add_request(make_group("new", 4, max_tokens=6, tokens=[9, 8, 7, 6]))
    preempted_seen = resumed = None
    while sched.has_unfinished_requests():
        out, _ = fake_step(sched)
        if "new" in out.preempted_request_ids:
            preempted_seen = True
        elif preempted_seen and resumed is None:
            resumed = next((s for s in out.scheduled if s.request_id == "new"), None)
    assert preempted_seen and resumed is not None
    assert resumed.num_computed_tokens > 0  # the recompute started after its cached full blocks
    assert sched.prefix_cache_stats.hits > 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=4),  # a few shared prefixes (token pattern ids)
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, 3), st.integers(0, 12), st.integers(1, 8), st.booleans()),
            st.tuples(st.just("step"), st.integers(1, 3), st.just(0), st.just(0), st.just(False)),
            st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0), st.just(False)),
        ),
        max_size=50,
    ),
    st.integers(3, 20),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 24),
)
def test_random_shared_prefix_traffic_keeps_invariants(prefix_kinds, ops, num_blocks, block_size, budget):
    capacity = num_blocks * block_size
    prefixes = [[100 + k] * (3 + 5 * k) + list(range(k, k + 4)) for k in range(4)]
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=capacity,
                           max_num_batched_tokens=budget, long_prefill_token_threshold=0)

    def build(rid, kind, suffix_len, max_tokens, salted):
        tokens = prefixes[prefix_kinds[kind % len(prefix_kinds)]] + list(range(500, 500 + suffix_len))
        if len(tokens) >= capacity:
            return None
        return make_group(rid, 0, max_tokens=max_tokens, tokens=tokens, cache_salt="s" if salted else None)

    drive(sched, ops, build)
    assert sched.reset_prefix_cache()
    sched.check_invariants()
