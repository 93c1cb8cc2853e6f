"""Beam search over a request's sequences: :func:`advance_beams` applies the search's step rule
(``pagellm/beam_state.py``, HF ``generate``'s algorithm) to the live beams; the scheduler lends it
the fork (shared blocks) and free operations.
"""

from __future__ import annotations

from collections.abc import Callable

from pagellm.beam_state import BeamHypothesis, BeamSearchState, BeamStep
from pagellm.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = ["BeamHypothesis", "BeamSearchState", "BeamStep", "advance_beams"]


def advance_beams(group: SequenceGroup, seq: Sequence, top: dict[int, tuple[float, int]],
                  fork: Callable[[Sequence], Sequence], free: Callable[[Sequence], None]) -> None:
    """Record beam ``seq``'s candidates (``top``: token -> (logprob, rank)); once every running beam
    of ``group`` has reported, take the beam step: surviving parents extend in place, extra
    children are ``fork``-ed (sharing the parent's blocks), beams nobody continues are ``free``-d."""
    state = group.beam_state
    assert state is not None
    state.pending[seq.seq_id] = {tok: lp for tok, (lp, _) in top.items()}
    beams = group.live_seqs()
    if any(b.seq_id not in state.pending for b in beams):
        return
    step = state.step([b.output_token_ids for b in beams], [state.pending[b.seq_id] for b in beams])
    state.pending.clear()
    new_beams: list[Sequence] = []
    used: set[int] = set()
    if not step.done:
        # A parent's first continuation extends it in place; each further one is a fork taken
        # before any token is appended (so it starts from the parent's state of this step).
        for parent_idx, _, _ in step.running:
            parent = beams[parent_idx]
            if parent.seq_id in used:
                new_beams.append(fork(parent))
            else:
                used.add(parent.seq_id)
                new_beams.append(parent)
        for beam, (_, token, cum) in zip(new_beams, step.running, strict=True):
            beam.output_token_ids.append(token)
            beam.cumulative_logprob = cum
    for b in beams:  # beams no continuation chose, or all of them when the search is over
        if b.seq_id not in used:
            b.status = SequenceStatus.FINISHED_STOPPED
            free(b)
    # Running order follows the search's ranking (HF breaks ties by beam index).
    rank = {b.seq_id: i for i, b in enumerate(new_beams)}
    group.seqs.sort(key=lambda s: rank.get(s.seq_id, len(rank)))
