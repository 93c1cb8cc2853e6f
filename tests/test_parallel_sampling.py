"""Parallel sampling (n, best_of): the prompt is computed once, its blocks shared by the forks,
a shared partial block copied on first write; outputs do not depend on memory pressure."""

from __future__ import annotations

import pytest

from pagellm import LLMEngine, SamplingParams
from pagellm.config import EngineArgs
from pagellm.core.scheduler_output import ModelRunnerOutput, SampledToken
from pagellm.sequence import SequenceStatus
from pagellm.utils import cdiv

from conftest import run_to_completion
from conftest_core import EOS, make_group, make_scheduler


def _step(sched, token_of=lambda seq_id: 5):
    out = sched.schedule()
    sampled = {}
    for s in out.scheduled:
        if s.do_sample:
            for sid in s.sample_seq_ids or [s.seq_id]:
                sampled[sid] = SampledToken(token_of(sid), -0.5)
    sched.update_from_output(out, ModelRunnerOutput(sampled))
    sched.check_invariants()
    return out


def test_forks_share_the_prompt_blocks_and_copy_the_partial_one_on_write():
    bs, prompt_len, n = 4, 30, 8  # 7 full blocks + a partial one holding 2 tokens
    sched = make_scheduler(num_blocks=64, block_size=bs, enable_caching=False)
    group = make_group("g", 0, max_tokens=6, tokens=list(range(100, 100 + prompt_len)), n=n)
    sched.add_request(group)
    kv = sched.kv_cache_manager
    out = _step(sched)  # the prompt, once, then n samples from its last row
    assert len(out.scheduled) == 1 and len(out.scheduled[0].sample_seq_ids) == n
    assert len(group.seqs) == n and group.forked
    prompt_blocks = cdiv(prompt_len, bs)
    assert kv.num_blocks - kv.num_free_blocks == prompt_blocks  # shared, not n x
    parent_table = kv.get_block_ids(group.seqs[0].seq_id)
    assert all(kv.get_block_ids(s.seq_id) == parent_table for s in group.seqs)
    out = _step(sched)  # every fork writes position 30, in the shared partial block
    assert len(out.scheduled) == n and sum(s.num_scheduled_tokens for s in out.scheduled) == n
    copies = out.cache_ops.copy
    assert len(copies) == n - 1 and all(src == parent_table[-1] for src, _ in copies)  # the last writer keeps it
    assert kv.num_blocks - kv.num_free_blocks == (prompt_blocks - 1) + n
    tables = [kv.get_block_ids(s.seq_id) for s in group.seqs]
    assert all(t[:-1] == parent_table[:-1] for t in tables) and len({t[-1] for t in tables}) == n
    while sched.has_unfinished_requests():
        _step(sched)
    assert kv.num_free_blocks == kv.num_blocks


def test_fork_counts_against_max_num_seqs_and_budget():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, enable_caching=False)
    sched.add_request(make_group("a", 5, max_tokens=3, n=3))
    sched.add_request(make_group("b", 5, max_tokens=3, n=2))  # 3 + 2 > 4: waits for "a"
    out = _step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]
    while any(g.request_id == "a" for g in sched.running):
        out = _step(sched)
    while sched.has_unfinished_requests():
        _step(sched)


def test_finished_fork_frees_its_blocks_while_siblings_go_on():
    sched = make_scheduler(num_blocks=64, block_size=4, enable_caching=False)
    group = make_group("g", 6, max_tokens=8, n=3)
    sched.add_request(group)
    kv = sched.kv_cache_manager
    _step(sched)  # prompt + fork
    stopper = group.seqs[1]
    used = kv.num_blocks - kv.num_free_blocks
    out = _step(sched, lambda sid: EOS if sid == stopper.seq_id else 5)
    assert stopper.status == SequenceStatus.FINISHED_STOPPED and len(out.scheduled) == 3
    assert stopper.seq_id not in kv.block_tables and not group.is_finished()
    assert kv.num_blocks - kv.num_free_blocks == used + 1  # 3 private last blocks, the stopper's returned
    while sched.has_unfinished_requests():
        _step(sched)
    assert len(group.seqs[0].output_token_ids) == 8 and len(stopper.output_token_ids) == 2


# ---------------------------------------------------------------- engine, tiny model
@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", block_size=8))


def _run(engine, prompts, params, **kw):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params, **kw)
    done = run_to_completion(engine)
    return [[c.token_ids for c in done[str(i)].outputs] for i in range(len(prompts))]


PROMPTS = [[5 + i for i in range(n)] for n in (13, 40, 7)]


def test_greedy_n_gives_identical_completions_equal_to_n1(engine):
    one = _run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    four = _run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=4))
    assert [len(c) for c in four] == [4, 4, 4]
    assert all(c == [ref[0]] * 4 for c, ref in zip(four, one, strict=True))


def test_seeded_parallel_samples_are_reproducible_and_differ(engine):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=3, seed=11)
    a = _run(engine, PROMPTS, params)
    b = _run(engine, PROMPTS[:1], params)  # alone instead of in a batch
    assert a[0] == b[0]
    assert len({tuple(t) for t in a[0]}) > 1, "the forks must not all sample the same tokens"


def test_best_of_returns_the_n_best_by_cumulative_logprob(engine):
    engine.add_request("b", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=2, best_of=5, seed=3))
    out = run_to_completion(engine)["b"]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    engine.add_request("all", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=5, seed=3))
    every = run_to_completion(engine)["all"]
    best = sorted((c.cumulative_logprob for c in every.outputs), reverse=True)[:2]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(best)


@pytest.mark.parametrize("mode", ["auto", "swap", "recompute"])
def test_parallel_samples_do_not_change_under_memory_pressure(tiny_llama, engine, mode):
    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, n=3, seed=5)
    ref = _run(engine, PROMPTS, params)
    bs = 8
    need = max(3 * cdiv(len(p) + 16, bs) for p in PROMPTS) + 1  # the largest request alone, barely
    tight = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, num_gpu_blocks_override=need, block_size=bs,
                                                  preemption_mode=mode))
    got = _run(tight, PROMPTS, params)
    assert got == ref
    sched = tight.scheduler
    assert sched.num_preemptions > 0
    if mode in ("auto", "swap"):
        assert sched.num_swap_outs > 0  # auto swaps multi-sequence requests
    kv = tight.kv_cache_manager
    assert kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_usable_blocks
