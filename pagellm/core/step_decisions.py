"""What one ``schedule()`` decided, for the step trace and the per-step log line: admissions,
preemptions, swap-ins, and why each waiting request that stayed waiting was left out. Recorded
only when asked for (``Scheduler.record_decisions``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StepDecisions:
    """What one ``schedule()`` decided, for the step trace (recorded only when asked for):
    admissions with their prefix-cache hits in tokens, preemptions by mode, swap-ins, and why
    each waiting request that stayed waiting was left out."""

    admitted: list[tuple[str, int]] = field(default_factory=list)
    preempted: list[tuple[str, str]] = field(default_factory=list)  # (request id, "recompute" | "swap")
    swapped_in: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)  # request id -> LeftOut reason
    token_budget: int = 0
    token_budget_used: int = 0


class LeftOut:
    """Why a waiting request was not admitted this step (the first reason that stopped admissions;
    under the priority policy the requests behind a blocked better one get ``PRIORITY``)."""

    TOKEN_BUDGET = "token_budget"
    MAX_NUM_SEQS = "max_num_seqs"
    NO_FREE_BLOCKS = "no_free_blocks"
    WATERMARK = "watermark"
    OLDER_SWAPPED_FIRST = "older_swapped_first"
    NO_ROOM_AFTER_PREEMPTION = "no_room_after_preemption"  # this step had to preempt: no admissions
    PUSHED_OUT_THIS_STEP = "pushed_out_this_step"
    PREFIX_BEING_COMPUTED = "prefix_being_computed"  # its next block is a running prefill's
    WHOLE_PROMPT = "whole_prompt_needs_budget"  # chunked prefill off
    PRIORITY = "priority"
    MAX_LORAS = "max_loras"  # its adapter would be one more than max_loras in the step
    ENCODER_BUDGET = "encoder_budget"  # its first image fits neither this step's encoder budget nor the cache
