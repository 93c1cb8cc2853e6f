"""How one step's results change one scheduled sequence: ``Scheduler.update_from_output`` runs these
in turn, per sequence it scheduled (computed tokens first, then a pooled result, beams, or samples).

Each applier is a function of the scheduler's bookkeeping (``StepBookkeeping``: free a finished
sequence's blocks, release a finished request, fork a sample), so what a step's outcome does to
the queues and the pool reads in one place and each kind of outcome is a short function.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

from pagellm.core.beam_search import advance_beams
from pagellm.core.encoder_cache_manager import EncoderCacheManager
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler_output import ModelRunnerOutput, SampledToken, ScheduledSequence
from pagellm.core.stop_check import check_stop
from pagellm.sequence import Sequence, SequenceGroup, SequenceStatus


class StepBookkeeping(Protocol):
    """What the appliers need of the scheduler."""

    kv_cache_manager: KVCacheManager
    encoder: EncoderCacheManager | None
    max_model_len: int
    num_lookahead_tokens: int

    def free_seq(self, seq: Sequence) -> None: ...

    def release(self, group: SequenceGroup) -> None: ...

    def fork(self, group: SequenceGroup, parent: Sequence, child_id: int | None = None) -> Sequence: ...


def apply_computed(book: StepBookkeeping, group: SequenceGroup, seq: Sequence, sched: ScheduledSequence,
                   out: ModelRunnerOutput) -> list[SampledToken]:
    """Advance ``num_computed_tokens`` by the scheduled tokens less the rejected drafts (plus a
    multi-step's earlier passes), cache the blocks that are now full, record prompt logprobs;
    returns the accepted drafts (or the earlier passes' tokens)."""
    seq.num_computed_tokens += sched.num_scheduled_tokens
    accepted = out.spec_accepted.get(seq.seq_id, []) if sched.spec_token_ids else []
    if sched.spec_token_ids:
        seq.num_computed_tokens -= len(sched.spec_token_ids) - len(accepted)  # the rejected drafts
        seq.spec_token_ids = []
    elif out.earlier_sampled:  # multi-step: each earlier pass computed one more token
        accepted = out.earlier_sampled.get(seq.seq_id, [])
        seq.num_computed_tokens += len(accepted)
    book.kv_cache_manager.cache_full_blocks(seq, group.hash_key)
    if book.encoder is not None:
        book.encoder.release_computed(group)
    if seq.seq_id in out.prompt_logprobs:
        group.record_prompt_logprobs(*out.prompt_logprobs[seq.seq_id])
    return accepted


def apply_pooled(book: StepBookkeeping, group: SequenceGroup, seq: Sequence, out: ModelRunnerOutput) -> None:
    """A pooling request's prompt is done: so is the request."""
    group.pooled = out.pooled[seq.seq_id]
    seq.status = SequenceStatus.FINISHED_STOPPED
    book.free_seq(seq)
    book.release(group)


def apply_beams(book: StepBookkeeping, group: SequenceGroup, seq: Sequence, out: ModelRunnerOutput) -> None:
    """A beam's candidates: the group keeps its best beams (forking and freeing as they move)."""
    advance_beams(group, seq, out.sampled[seq.seq_id].top_logprobs or {},
                  fork=partial(book.fork, group), free=book.free_seq)
    if group.is_finished():
        book.release(group)


def apply_samples(book: StepBookkeeping, group: SequenceGroup, seq: Sequence, sched: ScheduledSequence,
                  accepted: list[SampledToken], out: ModelRunnerOutput) -> None:
    """Append each sampled token (the accepted drafts first; a request's first sample forks its
    ``n`` sequences), checking stops token by token, so a stop inside an accepted run ends the
    sequence where it would have ended without speculation; a finished sequence frees its blocks,
    a live one gives back the blocks only rejected drafts or lookahead slots held. Stop strings
    need the text: a run of a request that has them records its cumulative logprobs, so the
    output processor can cut it where one ends (``Sequence.truncate_output``)."""
    targets = [seq]
    if sched.sample_seq_ids is not None and not group.forked:
        targets += [book.fork(group, seq, child_id) for child_id in sched.sample_seq_ids[1:]]
        group.forked = True
    for target in targets:
        tokens = [*accepted, out.sampled[target.seq_id]] if target is seq else [out.sampled[target.seq_id]]
        run: list[float] | None = [] if len(tokens) > 1 and group.sampling_params.stop else None
        if run is not None:  # (the output processor reads and clears it after this step)
            target.run_start, target.run_cumulative = target.num_output_tokens, run
        for sampled in tokens:
            if run is not None:
                run.append(target.cumulative_logprob)
            target.append_token(sampled.token_id, sampled.logprob, sampled.top_logprobs)
            check_stop(target, group.sampling_params, book.max_model_len)
            if target.status.is_finished:
                break
        if target.status.is_finished:
            book.free_seq(target)
        elif sched.spec_token_ids or book.num_lookahead_tokens or out.earlier_sampled:
            book.kv_cache_manager.cache_full_blocks(target, group.hash_key)
            book.kv_cache_manager.trim(target, target.num_tokens)  # rejected drafts' and lookahead blocks
    if group.is_finished():
        book.release(group)
