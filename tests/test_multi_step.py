"""Multi-step decoding (``num_scheduler_steps``): when a step runs several passes, what the scheduler
allocates and applies, and that outputs equal single steps token for token."""

from __future__ import annotations

import pytest

from pagellm.config import EngineArgs, SchedulerConfig
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.sequence import SequenceStatus

from conftest_core import EOS, fake_step, make_group, make_scheduler


def test_decode_steps_run_up_to_k_passes_and_stop_at_max_tokens():
    sched = make_scheduler(num_scheduler_steps=4, block_size=4)
    group = make_group("a", 6, max_tokens=10)
    sched.add_request(group)
    seq = group.seqs[0]
    out, _ = fake_step(sched)
    assert out.num_steps == 1  # a prefill
    assert seq.num_output_tokens == 1
    out = sched.schedule()
    # Slots for 4 passes: positions 6..9 (block_size 4: blocks 0-2).
    assert out.num_steps == 4 and len(out.scheduled[0].block_ids) == 3
    sched.update_from_output(out, _outputs(out, [11, 12, 13, 14]))
    sched.check_invariants()
    assert seq.output_token_ids == [5, 11, 12, 13, 14]
    assert seq.num_computed_tokens == seq.num_tokens - 1 == 10
    out, _ = fake_step(sched)
    assert out.num_steps == 4
    out, finished = fake_step(sched)
    assert out.num_steps == 1 and seq.num_output_tokens == 10  # one token left: a plain step
    assert finished == [group] and seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks


def _outputs(out, tokens):
    from pagellm.core.scheduler_output import ModelRunnerOutput, SampledToken

    sid = out.scheduled[0].seq_id
    toks = [SampledToken(t, -0.5) for t in tokens]
    return ModelRunnerOutput({sid: toks[-1]}, earlier_sampled={sid: toks[:-1]})


def test_eos_inside_a_run_ends_there_and_frees_the_blocks():
    sched = make_scheduler(num_scheduler_steps=8, block_size=2)
    group = make_group("a", 3, max_tokens=20)
    sched.add_request(group)
    fake_step(sched)
    out = sched.schedule()
    assert out.num_steps == 8
    sched.update_from_output(out, _outputs(out, [11, 12, EOS, 14, 15, 16, 17, 18]))
    sched.check_invariants()
    seq = group.seqs[0]
    assert seq.output_token_ids == [5, 11, 12, EOS] and seq.status == SequenceStatus.FINISHED_STOPPED
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks


def test_a_waiting_request_or_history_dependent_sampling_makes_a_plain_step():
    sched = make_scheduler(num_scheduler_steps=4, max_num_seqs=1)
    sched.add_request(make_group("a", 4, max_tokens=20))
    fake_step(sched)
    sched.add_request(make_group("b", 4, max_tokens=20))  # no seat: it waits
    assert fake_step(sched)[0].num_steps == 1
    for params in ({"repetition_penalty": 1.2}, {"frequency_penalty": 0.5}, {"presence_penalty": 0.5},
                   {"structured_outputs": StructuredOutputsParams(regex="a+")}):
        sched = make_scheduler(num_scheduler_steps=4)
        sched.add_request(make_group("a", 4, max_tokens=20, **params))
        steps = [fake_step(sched)[0].num_steps for _ in range(4)]
        assert steps == [1, 1, 1, 1], params
    sched = make_scheduler(num_scheduler_steps=4)  # n=2: the first sample forks, then every sequence runs on
    group = make_group("a", 4, max_tokens=20, n=2, temperature=1.0)
    sched.add_request(group)
    assert [fake_step(sched)[0].num_steps for _ in range(3)] == [1, 4, 4]
    assert [s.num_output_tokens for s in group.seqs] == [9, 9]
    sched = make_scheduler(num_scheduler_steps=4)  # min_tokens: plain until it is reached
    sched.add_request(make_group("a", 4, max_tokens=20, min_tokens=3))
    assert [fake_step(sched)[0].num_steps for _ in range(4)] == [1, 1, 1, 4]


def test_a_pool_too_short_for_every_pass_leaves_a_plain_step():
    sched = make_scheduler(num_scheduler_steps=8, num_blocks=4, block_size=2)
    for rid in "ab":
        sched.add_request(make_group(rid, 3, max_tokens=20, tokens=[ord(rid)] * 3))
    fake_step(sched)
    free = sched.kv_cache_manager.num_free_blocks
    out, _ = fake_step(sched)
    assert free < 14 and out.num_steps == 1  # 8 passes would take 7 more blocks than a plain step
    assert sched.kv_cache_manager.num_free_blocks == free  # nothing left over from the failed try


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="num_scheduler_steps must be >= 1"):
        SchedulerConfig(num_scheduler_steps=0)
    for other in ({"tensor_parallel_size": 2}, {"async_scheduling": True},
                  {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}):
        with pytest.raises(ValueError, match=f"num_scheduler_steps=4 does not combine with {next(iter(other))}"):
            EngineArgs(num_scheduler_steps=4, **other).create_engine_config()


MIX = [  # (prompt, params): each kind of sampling and stop a multi-step run applies token by token
    ("The capital of France is", dict(temperature=0, max_tokens=40)),
    ("Write a poem about the sea.", dict(temperature=0.8, seed=3, max_tokens=33, logprobs=2)),
    ("1, 2, 3,", dict(temperature=0, max_tokens=30, stop=[" 9"])),
    ("Tell me a story", dict(temperature=1.0, seed=7, max_tokens=50, top_k=20, top_p=0.9, n=2)),
    ("List three colors:", dict(temperature=0, max_tokens=25, stop_token_ids=[28])),
    ("Why is the sky blue?", dict(temperature=0.7, seed=1, max_tokens=20, repetition_penalty=1.3, min_tokens=5)),
]


def _run_mix(llm):
    from pagellm import SamplingParams

    outs = llm.generate([p for p, _ in MIX], [SamplingParams(**kw) for _, kw in MIX], use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
             for c in o.outputs] for o in outs]


@pytest.mark.slow
def test_outputs_equal_single_steps_token_for_token():
    """Greedy, seeded sampling with n=2, logprobs, stop strings and ids, penalties: the same tokens,
    texts, logprobs and finish reasons as one pass per schedule, through the in-place advance and
    through ``prepare_inputs`` each pass (the path off a CPU, or with LoRA or images)."""
    from pagellm import LLM

    ref = _run_mix(LLM(kv_cache_memory="64MiB"))
    llm = LLM(kv_cache_memory="64MiB", num_scheduler_steps=5)
    engine, runner = llm.llm_engine, llm.llm_engine.executor.worker.model_runner
    schedules = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: schedules.append(schedule()) or schedules[-1]
    for path in ("in place", "prepared"):
        if path == "prepared":
            runner._plain_decodes = lambda seqs: False
        schedules.clear()
        assert _run_mix(llm) == ref, path
        assert sum(so.num_steps > 1 for so in schedules) >= 5, f"{path}: multi-step never ran"
        assert {so.num_steps for so in schedules} >= {1, 5}
        engine.scheduler.check_invariants()
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
