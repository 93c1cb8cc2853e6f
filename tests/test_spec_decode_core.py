"""Speculative decoding's scheduler contract, in pure Python with a fake model.

The fake model is a pure function of the context (``next_token``), so a request's output is
known without any engine: drafts, rollbacks, preemption, chunking and aborts around it must
reproduce it exactly, and ``check_invariants()`` must hold after every step.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.scheduler_output import ModelRunnerOutput, SampledToken
from pagellm.sequence import SequenceStatus
from pagellm.spec_decode.cost_model import StepCostModel, choose_k, expected_tokens
from pagellm.utils import cdiv

from conftest_core import EOS, make_group, make_scheduler


def next_token(tokens: list[int]) -> int:
    """The fake target model's greedy token after ``tokens`` (EOS now and then)."""
    last, n = tokens[-1], len(tokens)
    return EOS if (last * 7 + n) % 23 == 0 else (last * 31 + n) % 40 + 3


def expected_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    out: list[int] = []
    while True:
        t = next_token(prompt + out)
        out.append(t)
        if t == EOS or len(out) >= max_tokens or len(prompt) + len(out) >= max_model_len:
            return out


def propose(sched, rng: random.Random, quality: float, max_k: int = 4) -> None:
    """Drafts for every decoding sequence: each right with probability ``quality``."""
    for group in sched.running:
        for seq in group.live_seqs():
            if seq.num_computed_tokens == seq.num_tokens - 1:
                ctx = seq.prompt_token_ids + seq.output_token_ids
                drafts: list[int] = []
                for _ in range(rng.randint(0, max_k)):
                    good = next_token(ctx + drafts)
                    drafts.append(good if rng.random() < quality else (good + 1) % 40 + 3)
                seq.spec_token_ids = drafts


def spec_step(sched, rng: random.Random, quality: float):
    """Propose, schedule, verify greedily with ``next_token``, update; check the contract."""
    propose(sched, rng, quality)
    out = sched.schedule()
    assert sum(s.num_scheduled_tokens for s in out.scheduled) <= sched.config.max_num_batched_tokens
    assert out.scheduled_spec_decode_tokens == {s.seq_id: s.spec_token_ids for s in out.scheduled
                                                if s.spec_token_ids}
    sampled, accepted = {}, {}
    for s in out.scheduled:
        group = sched.requests[s.request_id]
        if s.spec_token_ids:
            k = len(s.spec_token_ids)
            assert s.do_sample and s.token_ids == [s.output_token_ids[-1] if s.output_token_ids
                                                   else s.prompt_token_ids[-1]] + s.spec_token_ids
            n_tok = len(s.prompt_token_ids) + len(s.output_token_ids)
            assert n_tok + k <= sched.max_model_len, "a draft past max_model_len"
            assert len(s.output_token_ids) + k < group.sampling_params.max_tokens, "a draft past max_tokens"
        if not s.do_sample:
            continue
        ctx = s.prompt_token_ids + s.output_token_ids
        acc: list[SampledToken] = []
        for d in s.spec_token_ids or ():
            if next_token(ctx + [a.token_id for a in acc]) != d:
                break
            acc.append(SampledToken(d, -0.1))
        if s.spec_token_ids:
            accepted[s.seq_id] = acc
        for sid in s.sample_seq_ids or [s.seq_id]:
            sampled[sid] = SampledToken(next_token(ctx + [a.token_id for a in acc]), -0.1)
    _, finished = sched.update_from_output(out, ModelRunnerOutput(sampled, accepted))
    sched.check_invariants()
    kv = sched.kv_cache_manager
    for group in sched.running:
        for seq in group.live_seqs():
            table = kv.block_tables.get(seq.seq_id, [])
            # Blocks that held only rejected drafts went back; hashed blocks hold computed tokens only.
            assert len(table) <= cdiv(seq.num_tokens, kv.block_size), "a block of rejected drafts kept"
            assert kv._num_cached_blocks[0].get(seq.seq_id, 0) * kv.block_size <= seq.num_computed_tokens
            assert not seq.spec_token_ids or seq.num_computed_tokens == seq.num_tokens - 1
    return out, finished


def test_drafts_are_scheduled_verified_and_rolled_back():
    sched = make_scheduler(num_blocks=32, block_size=4)
    group = make_group("a", 6, max_tokens=40, tokens=[5, 9, 11, 3, 8, 20])
    sched.add_request(group)
    rng = random.Random(0)
    out, _ = spec_step(sched, rng, 1.0)  # the prompt: nothing to draft yet
    assert not out.scheduled_spec_decode_tokens
    seq = group.seqs[0]
    seq.spec_token_ids = [next_token(seq.prompt_token_ids + seq.output_token_ids), 99, 98]  # one right
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.spec_token_ids == seq.spec_token_ids and s.num_scheduled_tokens == 4
    assert len(sched.kv_cache_manager.block_tables[seq.seq_id]) == cdiv(7 + 3, 4)  # slots for the drafts
    before = seq.num_computed_tokens
    sampled = {seq.seq_id: SampledToken(7, -0.1)}
    sched.update_from_output(out, ModelRunnerOutput(sampled, {seq.seq_id: [SampledToken(s.spec_token_ids[0], -0.1)]}))
    sched.check_invariants()
    # Advanced by all 4, rolled back by the 2 rejected: the last token and the accepted draft are computed.
    assert seq.num_computed_tokens == before + 2 and seq.num_tokens == before + 3
    assert seq.output_token_ids[-2:] == [s.spec_token_ids[0], 7]
    assert len(sched.kv_cache_manager.block_tables[seq.seq_id]) == cdiv(seq.num_tokens, 4)


def _decoding(prompt_len: int, max_tokens: int, **cfg):
    """A scheduler with one request whose prompt is computed (in as many steps as the budget needs)."""
    sched = make_scheduler(num_blocks=64, block_size=4, **cfg)
    group = make_group("a", prompt_len, max_tokens=max_tokens)
    sched.add_request(group)
    while group.seqs[0].num_output_tokens == 0:
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(
            {s.seq_id: SampledToken(5, 0.0) for s in out.scheduled if s.do_sample}))
    return sched, group.seqs[0]


def test_drafts_trimmed_by_budget_max_model_len_and_max_tokens():
    for (prompt_len, max_tokens, cfg), allowed in (
            ((8, 100, dict(max_model_len=30, max_num_batched_tokens=3)), [1, 2]),  # the last token + 2
            ((9, 100, dict(max_model_len=11)), [1]),  # 10 tokens known: one more position
            ((4, 3, {}), [1])):  # 1 token out of 3: one draft and the token after it
        sched, seq = _decoding(prompt_len, max_tokens, **cfg)
        seq.spec_token_ids = [1, 2, 3, 4, 5]
        (s,) = sched.schedule().scheduled
        assert s.spec_token_ids == allowed, (prompt_len, max_tokens, cfg)


def test_stop_inside_an_accepted_run_ends_exactly_there():
    sched = make_scheduler(num_blocks=64, block_size=4)
    prompt = [5, 9, 11]
    want = expected_output(prompt, 50, 10_000)
    assert EOS in want, "pick a prompt whose output reaches EOS"
    group = make_group("a", 3, max_tokens=50, tokens=prompt)
    sched.add_request(group)
    rng = random.Random(1)
    while sched.has_unfinished_requests():
        spec_step(sched, rng, 1.0)  # every draft right: EOS arrives inside an accepted run
    seq = group.seqs[0]
    assert seq.output_token_ids == want and seq.status == SequenceStatus.FINISHED_STOPPED
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_beams_and_prefills_never_draft():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=4)
    group = make_group("a", 10, max_tokens=5)
    sched.add_request(group)
    group.seqs[0].spec_token_ids = [1, 2]  # a prefilling sequence's drafts are ignored
    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids is None and out.scheduled[0].num_scheduled_tokens == 4


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 14)),
            st.tuples(st.just("step"), st.integers(1, 4)),
            st.tuples(st.just("abort"), st.integers(0, 50)),
        ),
        max_size=50,
    ),
    st.integers(4, 24),
    st.sampled_from([1, 2, 4, 16]),
    st.integers(1, 40),
    st.sampled_from(["recompute", "swap"]),
    st.floats(0.0, 1.0),
    st.integers(0, 2**32 - 1),
)
def test_random_drafts_keep_invariants_and_outputs(ops, num_blocks, block_size, budget, mode, quality, seed):
    """Random adds, steps with random drafts (right with probability ``quality``), aborts, under
    preemption by recompute or swap: invariants after every step, every block back at the end,
    and every request that was not aborted produces exactly the fake model's greedy output."""
    capacity = num_blocks * block_size
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=capacity,
                           max_num_batched_tokens=budget, long_prefill_token_threshold=0,
                           preemption_mode=mode, num_cpu_blocks=num_blocks if mode == "swap" else 0)
    rng = random.Random(seed)
    groups, aborted = [], set()
    for op, *args in ops:
        if op == "add" and args[0] < capacity:
            prompt = [rng.randrange(3, 40) for _ in range(args[0])]
            group = make_group(f"r{len(groups)}", args[0], max_tokens=args[1], tokens=prompt)
            sched.add_request(group)
            groups.append(group)
        elif op == "step":
            for _ in range(args[0]):
                spec_step(sched, rng, quality)
        elif op == "abort" and groups:
            victim = groups[args[0] % len(groups)]
            aborted.add(victim.request_id)
            sched.finish_requests(victim.request_id, SequenceStatus.FINISHED_ABORTED)
            sched.check_invariants()
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            break
        spec_step(sched, rng, quality)
    assert not sched.has_unfinished_requests()
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_usable_blocks
    for group in groups:
        seq = group.seqs[0]
        if group.request_id in aborted or seq.status == SequenceStatus.FINISHED_IGNORED:
            continue
        want = expected_output(seq.prompt_token_ids, group.sampling_params.max_tokens, capacity)
        assert seq.output_token_ids == want


def test_cost_model_turns_speculation_off_where_it_does_not_pay():
    flat, linear = StepCostModel(), StepCostModel()
    for n in [*range(1, 600)] * 3:
        flat.observe(n, 0.010)  # weight-bound: more tokens cost nothing
        linear.observe(n, 0.001 * n)  # compute-bound: every token costs the same
    offers = [(5, 0.7)] * 4
    assert choose_k(flat, 4, 0, offers, 5) == 5
    assert choose_k(linear, 4, 0, offers, 5) == 0
    assert choose_k(flat, 4, 0, [], 5) == 0
    # Unmeasured sizes: interpolated; above the largest, extrapolated with the last slope, or as
    # if every row cost the same while only one size is known (never a guess that drafts are free).
    fresh = StepCostModel()
    assert fresh.estimate(8) is None and choose_k(fresh, 4, 0, offers, 5) == 0
    fresh.observe(64, 0.05)
    assert fresh.estimate(256) == pytest.approx(0.2) and fresh.estimate(8) == 0.05
    fresh.observe(128, 0.06)
    assert fresh.estimate(96) == pytest.approx(0.055, rel=0.01) and fresh.estimate(256) == pytest.approx(0.08, rel=0.01)
    assert expected_tokens(0.5, 3) == 1 + 0.5 + 0.25 + 0.125


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.lists(st.integers(0, 4), max_size=20),
       st.integers(1, 3), st.integers(0, 3), st.integers(1, 6))
def test_ngram_index_equals_a_brute_force_search(prompt, output, lo, extra, k):
    """The incremental n-gram index (grown in bulk, then token by token) proposes what a rescan
    of the whole context would: the tokens after the latest earlier match, longest n first."""
    from pagellm.config import SpeculativeConfig
    from pagellm.sequence import Sequence
    from pagellm.spec_decode.proposers import NgramProposer

    hi = lo + extra
    prop = NgramProposer(SpeculativeConfig(method="ngram", prompt_lookup_min=lo, prompt_lookup_max=hi))
    seq = Sequence(0, prompt, [])
    for t in [None, *output]:
        if t is not None:
            seq.output_token_ids.append(t)
        toks = seq.prompt_token_ids + seq.output_token_ids
        want: list[int] = []
        for n in range(hi, lo - 1, -1):
            ends = [e for e in range(n - 1, len(toks) - 1) if toks[e - n + 1:e + 1] == toks[len(toks) - n:]]
            if len(toks) > n and ends:
                want = toks[ends[-1] + 1:ends[-1] + 1 + k]
                break
        assert prop.propose(seq, k) == want
