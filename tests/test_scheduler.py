"""The scheduler in pure Python with a fake model: budget, chunking, preemption, stops, invariants."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.sequence import SequenceStatus

from conftest_core import EOS, TRAFFIC, drive, fake_step, make_group, make_scheduler


def test_core_does_not_import_torch():
    assert "pagellm.core.scheduler" in sys.modules
    import pagellm.core.scheduler as s

    assert "torch" not in s.__dict__


def test_token_budget_and_chunking():
    sched = make_scheduler(max_num_batched_tokens=10, long_prefill_token_threshold=0)
    sched.add_request(make_group("a", 8))
    sched.add_request(make_group("b", 8, tokens=[8] * 8))  # no prefix in common with a
    out, _ = fake_step(sched)
    assert [(s.request_id, s.num_scheduled_tokens, s.do_sample) for s in out.scheduled] == [
        ("a", 8, True), ("b", 2, False)]
    out, _ = fake_step(sched)
    # a decodes one token, b finishes its prompt with the remaining 6.
    assert [(s.request_id, s.num_scheduled_tokens, s.num_computed_tokens) for s in out.scheduled] == [
        ("a", 1, 8), ("b", 6, 2)]


def test_long_prefill_threshold_caps_one_request():
    sched = make_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=5)
    sched.add_request(make_group("a", 12))
    sched.add_request(make_group("b", 3))
    out, _ = fake_step(sched)
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 5), ("b", 3)]


def test_chunking_disabled_waits_for_full_prompt_budget():
    sched = make_scheduler(max_num_batched_tokens=10, long_prefill_token_threshold=0, enable_chunked_prefill=False)
    sched.add_request(make_group("a", 8))
    sched.add_request(make_group("b", 8))
    out, _ = fake_step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for r in "abc":
        sched.add_request(make_group(r, 3))
    out, _ = fake_step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]


def test_preempts_newest_by_recompute_and_resumes():
    # 4 blocks of 2 tokens; two requests of 3-token prompts each take 2 blocks, then both must grow.
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=100, enable_caching=False)
    sched.add_request(make_group("old", 3, max_tokens=3))
    sched.add_request(make_group("new", 3, max_tokens=3))
    fake_step(sched)  # prefill both; each sampled one token -> 4 tokens, 2 blocks each (pool full)
    fake_step(sched)  # position 3 still fits in block 2 of each; a second token each
    out, finished = fake_step(sched)  # old needs a 3rd block -> "new" is preempted, nobody admitted
    assert out.preempted_request_ids == ["new"]
    assert [s.request_id for s in out.scheduled] == ["old"]
    new = sched.requests["new"]
    assert new.seqs[0].status == SequenceStatus.PREEMPTED and new.seqs[0].num_computed_tokens == 0
    assert new.seqs[0].output_token_ids == [5, 5] and new.metrics.num_preemptions == 1
    assert sched.waiting.peek() is new
    while sched.has_unfinished_requests():
        finished += fake_step(sched)[1]
    assert [g.request_id for g in finished] == ["old", "new"]
    assert all(len(g.seqs[0].output_token_ids) == 3 for g in finished)
    assert sched.kv_cache_manager.num_free_blocks == 4


def test_recompute_resumes_with_output_tokens_as_prompt():
    sched = make_scheduler(num_blocks=4, block_size=2, enable_caching=False)
    sched.add_request(make_group("old", 3, max_tokens=3))
    sched.add_request(make_group("new", 3, max_tokens=3))
    for _ in range(3):
        fake_step(sched)  # "new" is preempted in the third step, after 2 output tokens
    # Later "new" is rescheduled for its 3 prompt tokens + 2 output tokens in one chunk, and samples.
    seen = None
    while sched.has_unfinished_requests() and seen is None:
        out, _ = fake_step(sched)
        seen = next((s for s in out.scheduled if s.request_id == "new"), None)
    assert seen is not None and seen.num_computed_tokens == 0 and seen.token_ids == [7, 7, 7, 5, 5] and seen.do_sample


def test_stops_eos_stop_ids_min_tokens_and_length():
    sched = make_scheduler()
    sched.add_request(make_group("eos", 2, max_tokens=10))
    sched.add_request(make_group("min", 2, max_tokens=10, min_tokens=2))
    sched.add_request(make_group("ign", 2, max_tokens=2, ignore_eos=True))
    sched.add_request(make_group("sid", 2, max_tokens=10, stop_token_ids=[EOS]))
    _, finished = fake_step(sched, token=EOS)
    assert {g.request_id for g in finished} == {"eos", "sid"}
    assert sched.requests["min"].seqs[0].status == SequenceStatus.RUNNING
    _, finished = fake_step(sched, token=EOS)
    assert {g.request_id: g.seqs[0].status.finish_reason for g in finished} == {"min": "stop", "ign": "length"}
    assert not sched.has_unfinished_requests()


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=5)
    sched.add_request(make_group("a", 3, max_tokens=100))
    finished = []
    while sched.has_unfinished_requests():
        finished += fake_step(sched)[1]
    seq = finished[0].seqs[0]
    assert seq.num_tokens == 5 and seq.status.finish_reason == "length"


def test_abort_frees_blocks_immediately():
    sched = make_scheduler(num_blocks=8, block_size=2)
    sched.add_request(make_group("a", 5))
    sched.add_request(make_group("b", 5, tokens=[8] * 5))  # no prefix in common with a
    fake_step(sched)
    done = sched.finish_requests("a", SequenceStatus.FINISHED_ABORTED)
    assert [g.seqs[0].status.finish_reason for g in done] == ["abort"]
    assert sched.kv_cache_manager.num_free_blocks == 8 - 3
    sched.check_invariants()
    out = sched.schedule()
    assert out.finished_seq_ids == [done[0].seqs[0].seq_id]


@settings(max_examples=150, deadline=None)
@given(
    TRAFFIC,
    st.integers(2, 24),
    st.sampled_from([1, 2, 4, 16]),
    st.integers(1, 40),
    st.integers(1, 6),
    st.sampled_from([1, 1, 2, 3, 8]),
    st.sampled_from([0, 0, 5, 11]),
)
def test_random_add_step_abort_keeps_invariants(ops, num_blocks, block_size, budget, max_seqs, steps, eos_every):
    """With multi-step decoding too (``steps`` passes at most), EOS now and then inside a run."""
    capacity = num_blocks * block_size
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=capacity,
                           max_num_batched_tokens=budget, max_num_seqs=max_seqs, long_prefill_token_threshold=0,
                           num_scheduler_steps=steps)
    # The engine rejects prompts that can never fit before they reach the scheduler.
    drive(sched, ops, lambda rid, n, max_tokens: make_group(rid, n, max_tokens=max_tokens) if n < capacity else None,
          eos_every=eos_every)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 30), st.sampled_from([None, "LAST", "MEAN"])),
            st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
            st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
        ),
        max_size=60,
    ),
    st.integers(2, 24),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 40),
)
def test_pooling_requests_mixed_with_generation_keep_invariants(ops, num_blocks, block_size, budget):
    """Pooling requests (runner="pooling" sets every request's; mixed here to stress the scheduler)
    finish with their prompt's last chunk, sample nothing, and free everything."""
    capacity = num_blocks * block_size
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=capacity,
                           max_num_batched_tokens=budget, max_num_seqs=4, long_prefill_token_threshold=0)
    pooled_groups = []

    def build(rid, n, pooling):
        if n >= capacity:
            return None
        group = make_group(rid, n, max_tokens=3)
        group.pooling = pooling
        if pooling is not None:
            pooled_groups.append(group)
        return group

    drive(sched, ops, build)
    for g in pooled_groups:
        seq = g.seqs[0]
        assert seq.output_token_ids == []
        assert seq.status == SequenceStatus.FINISHED_ABORTED or (
            g.pooled == [float(seq.seq_id)] and seq.num_computed_tokens == len(seq.prompt_token_ids))

