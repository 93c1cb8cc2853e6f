"""Preemption by swap (CPU block pool, exact swap pairs, OK / LATER / NEVER, watermark, fallback)
and the priority policy (victim choice, preempting arrivals, aging), on tiny pools."""

from __future__ import annotations

from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.config import SchedulerConfig, SchedulingPolicy
from pagellm.core.kv_cache_manager import AllocStatus, KVCacheManager
from pagellm.core.request_queue import (
    SCHEDULING_POLICIES,
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestOrder,
    create_request_queue,
)
from pagellm.sequence import Sequence, SequenceStatus

from conftest_core import fake_step, make_group, make_scheduler, run_all


def _computed(mgr: KVCacheManager, seq_id: int, tokens: list[int]) -> Sequence:
    seq = Sequence(seq_id, tokens)
    assert mgr.allocate_slots(seq, len(tokens)) is not None
    seq.num_computed_tokens = len(tokens)
    mgr.cache_full_blocks(seq)
    return seq


# ---------------------------------------------------------------- KV cache manager
def test_swap_out_and_in_give_exact_pairs_and_free_the_source():
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False, num_cpu_blocks=4)
    other = _computed(mgr, 0, list(range(5)))  # device blocks 0, 1
    seq = _computed(mgr, 1, list(range(10, 20)))  # device blocks 2, 3, 4
    assert mgr.get_block_ids(1) == [2, 3, 4]
    assert mgr.can_swap_out([seq]) == AllocStatus.OK
    assert mgr.swap_out([seq]) == [(2, 0), (3, 1), (4, 2)]
    assert 1 not in mgr.block_tables and [b.block_id for b in mgr.cpu_block_tables[1]] == [0, 1, 2]
    assert mgr.num_free_blocks == 6 and mgr.cpu_pool.num_free_blocks == 1
    mgr.check_invariants(live_seq_ids={0}, swapped_seq_ids={1})
    # The swap-out freed 4, 3, 2 to the head of the free list, so 2, 3, 4 come back first.
    assert mgr.can_swap_in([seq], num_new_tokens=1) == AllocStatus.OK
    assert mgr.swap_in([seq]) == [(0, 2), (1, 3), (2, 4)]
    assert mgr.cpu_pool.num_free_blocks == 4 and 1 not in mgr.cpu_block_tables
    mgr.free(seq)
    mgr.free(other)
    mgr.check_invariants(live_seq_ids=set(), swapped_seq_ids=set())
    assert mgr.num_free_blocks == 8


def test_can_swap_out_answers_never_and_later():
    mgr = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False, num_cpu_blocks=4)
    big = _computed(mgr, 0, list(range(17)))  # 5 blocks > 4 CPU blocks in all
    assert mgr.can_swap_out([big]) == AllocStatus.NEVER
    small = _computed(mgr, 1, list(range(12)))  # 3 blocks
    assert mgr.can_swap_out([small]) == AllocStatus.OK
    mgr.swap_out([small])
    two = _computed(mgr, 2, list(range(8)))  # 2 blocks, 1 CPU block free
    assert mgr.can_swap_out([two]) == AllocStatus.LATER


def test_can_swap_in_answers_ok_later_never_with_watermark():
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False, num_cpu_blocks=10, watermark=0.2)
    assert mgr.watermark_blocks == 2
    seq = _computed(mgr, 0, list(range(16)))  # 4 full blocks
    mgr.swap_out([seq])
    filler = _computed(mgr, 1, list(range(16)))  # 4 device blocks used, 6 free
    # 4 blocks back + 1 for the next token = 5; with the 2-block watermark that needs 7 > 6 free.
    assert mgr.can_swap_in([seq], 1, running=True) == AllocStatus.LATER
    assert mgr.can_swap_in([seq], 1, running=False) == AllocStatus.OK  # nobody running: no watermark
    mgr.free(filler)
    assert mgr.can_swap_in([seq], 1, running=True) == AllocStatus.OK
    assert mgr.can_swap_in([seq], 40, running=True) == AllocStatus.NEVER  # 4 + 10 blocks > the 10 there are


def test_shared_blocks_are_swapped_once_and_stay_shared():
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, num_cpu_blocks=8)
    a = _computed(mgr, 0, list(range(9)))  # blocks 0, 1 full (cached), 2 partial
    b = Sequence(1, list(range(8)) + [99, 98])  # same two full blocks, its own third
    hit = mgr.get_computed_blocks(b)
    b.num_computed_tokens = 8
    assert mgr.allocate_slots(b, 2, hit) is not None
    b.num_computed_tokens = 10
    assert mgr.get_block_ids(1)[:2] == [0, 1]
    pairs = mgr.swap_out([a, b])
    assert sorted(src for src, _ in pairs) == [0, 1, 2, 3]  # blocks 0 and 1 copied once
    cpu_a, cpu_b = mgr.cpu_block_tables[0], mgr.cpu_block_tables[1]
    assert cpu_a[:2] == cpu_b[:2] and all(blk.ref_cnt == 2 for blk in cpu_a[:2])
    mgr.check_invariants(live_seq_ids=set(), swapped_seq_ids={0, 1})
    mgr.reset_prefix_cache()  # forget the device copies: swap-in must copy everything back
    back = mgr.swap_in([a, b])
    assert len(back) == 4
    assert mgr.get_block_ids(0)[:2] == mgr.get_block_ids(1)[:2]  # still shared on the device
    mgr.check_invariants(live_seq_ids={0, 1}, swapped_seq_ids=set())


def test_swap_in_takes_still_cached_device_blocks_without_copying():
    mgr = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, num_cpu_blocks=8)
    seq = _computed(mgr, 0, list(range(10)))  # blocks 0, 1 cached, 2 partial
    mgr.swap_out([seq])
    pairs = mgr.swap_in([seq])
    assert pairs == [(2, 2)]  # only the partial block is copied back: the full ones were still cached
    assert mgr.get_block_ids(0) == [0, 1, 2]
    mgr.check_invariants(live_seq_ids={0}, swapped_seq_ids=set())


# ---------------------------------------------------------------- scheduler
def test_swap_mode_parks_the_victim_and_brings_it_back():
    # Two requests grow into an 8-block pool; the newer one is swapped out, then back in.
    # (No prefix caching: identical prompts would let the swap-in take a's cached blocks, copying nothing.)
    sched = make_scheduler(num_blocks=8, block_size=4, num_cpu_blocks=8, preemption_mode="swap",
                           enable_caching=False)
    a, b = make_group("a", 12, max_tokens=12), make_group("b", 12, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    saw_swap_out = saw_swap_in = False
    while sched.has_unfinished_requests():
        out, _ = fake_step(sched)
        if out.cache_ops.swap_out:
            saw_swap_out = True
            assert b in sched.swapped and b.seqs[0].status == SequenceStatus.SWAPPED
            assert out.preempted_request_ids == ["b"]
        if out.cache_ops.swap_in:
            saw_swap_in = True
            assert [s.request_id for s in out.scheduled][-1] == "b"
    assert saw_swap_out and saw_swap_in
    assert b.metrics.num_swaps == 1 and b.metrics.num_preemptions == 1 and sched.num_swap_ins == 1
    assert len(b.seqs[0].output_token_ids) == 12  # resumed, not recomputed from scratch
    assert sched.kv_cache_manager.cpu_pool.num_free_blocks == 8


def test_swap_falls_back_to_recompute_when_the_swap_pool_is_full():
    sched = make_scheduler(num_blocks=8, block_size=4, num_cpu_blocks=1, preemption_mode="swap")
    a, b = make_group("a", 12, max_tokens=12), make_group("b", 12, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    while not sched.num_preemptions:
        fake_step(sched)
    assert sched.num_swap_outs == 0 and sched.num_swap_fallbacks == 1
    assert b.seqs[0].status == SequenceStatus.PREEMPTED and b in sched.waiting
    run_all(sched)


def test_auto_mode_recomputes_single_sequence_requests():
    sched = make_scheduler(num_blocks=8, block_size=4, num_cpu_blocks=8, preemption_mode="auto")
    sched.add_request(make_group("a", 12, max_tokens=12))
    sched.add_request(make_group("b", 12, max_tokens=12))
    run_all(sched)
    assert sched.num_preemptions > 0 and sched.num_swap_outs == 0 and sched.num_swap_fallbacks == 0


def test_watermark_holds_back_admissions_while_others_run():
    # 10 blocks, "a" holds 4. "b" needs 5 of the 6 free: with 2 reserved (0.2) it must wait.
    for watermark, admitted in ((0.2, False), (0.0, True)):
        sched = make_scheduler(num_blocks=10, block_size=4, watermark=watermark, max_num_batched_tokens=64,
                               enable_caching=False)
        sched.add_request(make_group("a", 15, max_tokens=3))
        fake_step(sched)
        sched.add_request(make_group("b", 20, max_tokens=2))
        out, _ = fake_step(sched)
        assert ("b" in [s.request_id for s in out.scheduled]) is admitted
        run_all(sched)


def test_watermark_does_not_apply_to_an_empty_engine():
    sched = make_scheduler(num_blocks=10, block_size=4, watermark=0.2, max_num_batched_tokens=64)
    sched.add_request(make_group("big", 35, max_tokens=1))  # 9 of 10 blocks, only 1 left free
    out, _ = fake_step(sched)
    assert [s.request_id for s in out.scheduled] == ["big"]


def test_the_policy_registry_is_what_users_may_choose():
    """Every name the config (and the CLI) offers has a registry row, and no row is unreachable;
    each row's queue and priority ranking are what its name says; an unknown name is refused,
    naming the argument, by the config and by the factory."""
    assert set(get_args(SchedulingPolicy)) == set(SCHEDULING_POLICIES)
    order = RequestOrder(False, 0)
    assert type(create_request_queue("fcfs", order)) is FCFSRequestQueue
    assert type(create_request_queue("priority", order)) is PriorityRequestQueue
    assert [name for name, spec in SCHEDULING_POLICIES.items() if spec.by_priority] == ["priority"]
    for make in (lambda: SchedulerConfig(scheduling_policy="lifo"), lambda: create_request_queue("lifo", order)):
        with pytest.raises(ValueError, match="scheduling_policy must be one of 'fcfs', 'priority', got 'lifo'"):
            make()


# Prefix caching off below: make_group's prompts repeat one token, and hits would change the block counts.
def test_priority_victim_is_the_lowest_priority_running_request():
    sched = make_scheduler(num_blocks=12, block_size=4, scheduling_policy="priority", priority_aging_steps=0,
                           enable_caching=False)
    groups = [make_group(r, 8, max_tokens=20, priority=p) for r, p in (("p0", 0), ("p5", 5), ("p1", 1))]
    for g in groups:
        sched.add_request(g)
    while not sched.num_preemptions:
        fake_step(sched)
    assert groups[1].metrics.num_preemptions == 1
    assert groups[0].metrics.num_preemptions == groups[2].metrics.num_preemptions == 0
    run_all(sched)


def test_high_priority_arrival_preempts_lower_priority_running():
    sched = make_scheduler(num_blocks=8, block_size=4, scheduling_policy="priority", priority_aging_steps=0,
                           enable_caching=False)
    low = make_group("low", 28, max_tokens=4, priority=3)  # 7 of the 8 blocks, 8 after its first token
    sched.add_request(low)
    fake_step(sched)
    high = make_group("high", 8, max_tokens=2, priority=0)
    sched.add_request(high)
    out, _ = fake_step(sched)
    assert out.preempted_request_ids == ["low"] and [s.request_id for s in out.scheduled] == ["high"]
    finished = run_all(sched)
    assert [g.request_id for g in finished] == ["high", "low"]


def test_equal_priority_arrival_does_not_preempt():
    sched = make_scheduler(num_blocks=8, block_size=4, scheduling_policy="priority", priority_aging_steps=0,
                           enable_caching=False)
    sched.add_request(make_group("first", 28, max_tokens=4, priority=1))
    fake_step(sched)
    sched.add_request(make_group("second", 8, max_tokens=2, priority=1))
    out, _ = fake_step(sched)
    assert out.preempted_request_ids == [] and [s.request_id for s in out.scheduled] == ["first"]
    run_all(sched)


def _starvation(aging_steps: int) -> int | None:
    """One slot; a priority-5 request waits while priority-0 requests keep arriving. Returns the
    step at which it is first scheduled (None if never within 60 steps)."""
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=1, scheduling_policy="priority",
                           priority_aging_steps=aging_steps, enable_caching=False)
    low = make_group("low", 4, max_tokens=2, priority=5)
    sched.add_request(low)
    sched.add_request(make_group("h0", 4, max_tokens=2, priority=0))
    for step in range(60):
        out, finished = fake_step(sched)
        if any(s.request_id == "low" for s in out.scheduled):
            return step
        if finished:  # a fresh high-priority request replaces each one that finishes
            sched.add_request(make_group(f"h{step}", 4, max_tokens=2, priority=0))
    return None


def test_aging_bounds_starvation():
    assert _starvation(aging_steps=0) is None  # without aging, newer high-priority work always wins
    step = _starvation(aging_steps=2)
    assert step is not None and step <= 5 * 2 + 3  # 5 levels x 2 steps each, plus a request in flight


def test_effective_priority_improves_while_queued_and_freezes_while_running():
    sched = make_scheduler(scheduling_policy="priority", priority_aging_steps=3)
    g = make_group("g", 4, max_tokens=8, priority=4)
    sched.order.step = 10
    sched.add_request(g)
    sched.order.step = 17
    assert sched.order.effective_priority(g) == 4 - 7 // 3
    sched.order.dequeue(g)
    sched.order.step = 100
    assert sched.order.effective_priority(g) == 2  # running: no more aging


def test_request_that_can_never_fit_is_ignored_not_hung():
    sched = make_scheduler(num_blocks=4, block_size=4)
    g = make_group("big", 17, max_tokens=2)  # 5 blocks > 4 in the pool
    sched.add_request(g)
    out, _ = fake_step(sched)
    assert not out.scheduled and sched.take_ignored() == [g]
    assert g.seqs[0].status == SequenceStatus.FINISHED_IGNORED and g.seqs[0].status.finish_reason == "length"
    assert not sched.has_unfinished_requests()


def test_abort_while_swapped_frees_cpu_blocks():
    sched = make_scheduler(num_blocks=8, block_size=4, num_cpu_blocks=8, preemption_mode="swap")
    sched.add_request(make_group("a", 12, max_tokens=12))
    sched.add_request(make_group("b", 12, max_tokens=12))
    while not sched.swapped:
        fake_step(sched)
    sched.finish_requests("b", SequenceStatus.FINISHED_ABORTED)
    sched.check_invariants()
    assert sched.kv_cache_manager.cpu_pool.num_free_blocks == 8
    run_all(sched)


# ---------------------------------------------------------------- random traffic
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 10), st.integers(0, 3), st.integers(1, 4)),
            st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0), st.just(1)),
            st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0), st.just(1)),
        ),
        max_size=50,
    ),
    st.sampled_from(["recompute", "swap", "auto"]),
    st.sampled_from(["fcfs", "priority"]),
    st.integers(4, 16),
    st.integers(0, 12),
    st.sampled_from([0.0, 0.1, 0.3]),
    st.sampled_from([0, 1, 3]),
    st.booleans(),
)
def test_random_traffic_under_pressure_keeps_invariants(ops, mode, policy, num_blocks, num_cpu_blocks, watermark,
                                                       aging, caching):
    from conftest_core import drive

    bs = 4
    sched = make_scheduler(num_blocks=num_blocks, block_size=bs, max_model_len=num_blocks * bs,
                           num_cpu_blocks=num_cpu_blocks, watermark=watermark, enable_caching=caching,
                           preemption_mode=mode, scheduling_policy=policy, priority_aging_steps=aging,
                           max_num_batched_tokens=16, long_prefill_token_threshold=0)

    def build(rid, prompt_len, max_tokens, priority, n):
        if prompt_len >= num_blocks * bs:
            return None  # the engine rejects it in add_request
        tokens = [prompt_len % 3] * min(prompt_len, 8) + list(range(prompt_len - min(prompt_len, 8)))
        # n > 1: parallel samples share the prompt's blocks (and are swapped as a group in auto mode);
        # n == 4 stands for a beam search of width 2 (beams fork and die every step).
        beam = 2 if n == 4 else 0
        return make_group(rid, 0, max_tokens=max_tokens, tokens=tokens, n=1 if beam else n, beam_width=beam,
                          priority=priority if policy == "priority" else 0)

    drive(sched, ops, build)
    kv = sched.kv_cache_manager
    assert kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_usable_blocks
