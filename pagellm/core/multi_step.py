"""Multi-step decoding (vLLM V0's ``num_scheduler_steps``): one schedule, ``k`` forward passes.

In the steady state of generation a step changes little: every running sequence decodes one
token. Scheduling it, preparing its inputs and applying its outputs is host work paid per token,
and at batch 1 on a CPU it is paid with cold caches after each forward pass. With
``num_scheduler_steps = K`` the scheduler hands the worker a decode-only step with slots for ``k <=
K`` tokens per sequence; the worker runs ``k`` passes, feeding each row the token it just
sampled, and returns all ``k`` samples. The scheduler applies them token by token with the stop
checks, as it applies an accepted speculative run, so outputs equal ``k`` single steps.

A step is multi-step only when nothing else is waiting (an arrival waits at most ``k - 1``
passes) and every sequence's sampling reads nothing the ``k`` passes change on the engine side:
no penalties or ``min_tokens`` still in force (they read the output so far), no structured
output (the grammar advances on the engine), no beams, no first sample of a parallel request.
"""

from __future__ import annotations

from pagellm.core.kv_cache_manager import KVCacheManager, SlotRequest
from pagellm.sequence import Sequence, SequenceGroup


def history_free(group: SequenceGroup) -> bool:
    """Whether ``group``'s next samples depend only on the logits (not on its output so far or on
    engine-side state): the condition for sampling them in the worker's passes."""
    p = group.sampling_params
    if group.beam_state is not None or group.pooling is not None or p.structured_outputs is not None:
        return False
    if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
        return False
    if group.num_samples > 1 and not group.forked:
        return False
    return all(s.num_output_tokens >= p.min_tokens for s in group.live_seqs())


def steps_left(group: SequenceGroup, r: SlotRequest, max_model_len: int) -> int:
    """Tokens ``r.seq`` can still append before a length limit ends it."""
    left = max_model_len - r.seq.num_tokens
    if group.sampling_params.max_tokens is not None:
        left = min(left, group.sampling_params.max_tokens - r.seq.num_output_tokens)
    return left


def plan_num_steps(scheduled: list[tuple[SequenceGroup, list[SlotRequest]]], max_steps: int, any_waiting: bool,
                   kv: KVCacheManager, max_model_len: int) -> int:
    """How many passes this step runs (1: a plain step), with every sequence's slots for them
    allocated; a pool too short for them all leaves the step a plain one."""
    if max_steps <= 1 or any_waiting or not scheduled:
        return 1
    k = max_steps
    for group, plan in scheduled:
        if not history_free(group):
            return 1
        for r in plan:
            if r.num_new_tokens != 1 or not 0 < r.num_computed_tokens == r.seq.num_tokens - 1:  # not a decode
                return 1
            k = min(k, steps_left(group, r, max_model_len))
    if k <= 1:
        return 1
    grown: list[Sequence] = []
    for _, plan in scheduled:
        for r in plan:
            if kv.allocate_slots(r.seq, k) is None:
                for seq in grown:  # back to the one slot the plain step holds
                    kv.trim(seq, seq.num_tokens)
                return 1
            grown.append(r.seq)
    return k
