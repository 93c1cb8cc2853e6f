"""Helpers for pure-Python scheduler tests: a fake model that samples a fixed token."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from pagellm.config import SchedulerConfig
from pagellm.core.beam_search import BeamSearchState
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler
from pagellm.core.scheduler_output import ModelRunnerOutput, SampledToken
from pagellm.sampling_params import SamplingParams
from pagellm.sequence import Sequence, SequenceGroup, SequenceStatus

EOS = 2
_seq_ids = itertools.count(10**9)  # far from the ids a scheduler hands its forks


def make_scheduler(num_blocks=64, block_size=4, max_model_len=10_000, enable_caching=True, num_cpu_blocks=0,
                   watermark=0.0, max_loras=0, kv_cache_config=None, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching, num_cpu_blocks, watermark, kv_cache_config)
    return Scheduler(SchedulerConfig(watermark=watermark, **cfg), kv, max_model_len=max_model_len, max_loras=max_loras)


def make_group(rid: str, prompt_len: int, max_tokens: int = 4, tokens: list[int] | None = None,
               cache_salt: str | None = None, priority: int = 0, beam_width: int = 0, lora_id: int = 0,
               **params) -> SequenceGroup:
    """A request; ``beam_width > 0`` makes it a beam search (as ``LLMEngine.add_request`` would)."""
    if beam_width:
        params = dict(params, n=beam_width, logprobs=2 * beam_width, ignore_eos=True)
    sp = SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, "eos_token_id": EOS, **params})
    prompt = list(tokens) if tokens is not None else [7] * prompt_len
    group = SequenceGroup(rid, [Sequence(next(_seq_ids), prompt)], sp, arrival_time=0.0, cache_salt=cache_salt,
                          priority=priority)
    if beam_width:
        group.beam_state = BeamSearchState(beam_width, max_tokens, eos_token_id=EOS)
    if lora_id:
        group.lora_id, group.lora_fingerprint = lora_id, f"adapter-{lora_id}"
    return group


def _candidates(seq_id: int, n_out: int, k: int) -> dict[int, tuple[float, int]]:
    """Deterministic, distinct top-k "logprobs" for a beam (EOS among them now and then)."""
    return {EOS if (seq_id + n_out + j) % 7 == 0 else 10 + j: (-0.1 * (j + 1) - 0.01 * ((seq_id + j) % 5), j + 1)
            for j in range(k)}


def fake_step(sched: Scheduler, token: int = 5, eos_every: int = 0):
    """One step with a fake model: every sample is ``token`` (EOS at output positions ``i`` with
    ``(seq_id + i) % eos_every == 0``, where set); a multi-step step samples at each of its passes."""
    out = sched.schedule()
    sampled = {}
    earlier = {}
    pooled = {}

    def sample(sid: int, n_out: int, k: int | None) -> SampledToken:
        tok = EOS if eos_every and (sid + n_out) % eos_every == 0 else token
        return SampledToken(tok, -0.5, _candidates(sid, n_out, k) if k else None)

    for s in out.scheduled:
        group = sched.requests.get(s.request_id)
        if group is not None and group.pooling is not None:  # a pooling request: a vector at its prompt's end
            assert not s.do_sample
            if s.num_computed_tokens + s.num_scheduled_tokens >= len(s.prompt_token_ids):
                pooled[s.seq_id] = [float(s.seq_id)]
        if not s.do_sample:
            continue
        for sid in s.sample_seq_ids or [s.seq_id]:
            n_out, k = len(s.output_token_ids), s.sampling_params.logprobs
            if out.num_steps > 1:
                earlier[sid] = [sample(sid, n_out + j, k) for j in range(out.num_steps - 1)]
            sampled[sid] = sample(sid, n_out + out.num_steps - 1, k)
    _, finished = sched.update_from_output(out, ModelRunnerOutput(sampled, pooled=pooled, earlier_sampled=earlier))
    sched.check_invariants()
    return out, finished


def run_all(sched: Scheduler, max_steps: int = 10_000, eos_every: int = 0) -> list[SequenceGroup]:
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        finished += fake_step(sched, eos_every=eos_every)[1]
    assert not sched.has_unfinished_requests(), "requests left unfinished"
    return finished


def drive(sched: Scheduler, ops, build_group, eos_every: int = 0) -> None:
    """Apply random ``("add", *args) / ("step", n, ...) / ("abort", i, ...)`` ops, checking invariants,
    then run everything left to completion (no request may hang) and check the pool is all free.

    ``build_group(rid, *args)`` returns the group to add, or ``None`` for one the engine would reject.
    """
    added: list[str] = []
    for op, *args in ops:
        if op == "add":
            group = build_group(f"r{len(added)}", *args)
            if group is not None:
                sched.add_request(group)
                added.append(group.request_id)
        elif op == "step":
            for _ in range(args[0]):
                fake_step(sched, eos_every=eos_every)
        elif added:
            sched.finish_requests(added[args[0] % len(added)], SequenceStatus.FINISHED_ABORTED)
            sched.check_invariants()
    run_all(sched, eos_every=eos_every)
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks


# Random request traffic for ``drive``: adds (prompt length, max_tokens), runs of steps, aborts.
TRAFFIC = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
    ),
    max_size=60,
)
