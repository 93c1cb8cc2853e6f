"""The scheduler's token budget, admission limits, policy and preemption."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# The names of core/request_queue.py's SCHEDULING_POLICIES (the CLI's choices; a test holds them equal).
SchedulingPolicy = Literal["fcfs", "priority"]
PreemptionMode = Literal["recompute", "swap", "auto"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Token budget and admission limits of one engine step (vLLM V1's unified token rule)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 512
    scheduling_policy: SchedulingPolicy = "fcfs"
    # auto: recompute a request with one live sequence, swap one with several (see scheduler.py).
    preemption_mode: PreemptionMode = "auto"
    # Fraction of device blocks admissions and swap-ins leave free, so that running sequences
    # can grow for a while without preempting what was just admitted.
    watermark: float = 0.01
    # Priority policy: a queued request's effective priority improves by one for every this many
    # engine steps it has spent waiting or swapped out (0 = no aging).
    priority_aging_steps: int = 256
    # Steps in flight at once (vLLM's batch queue): the pipeline's stages, or 2 with
    # async_scheduling; a request is never in two of them (see scheduler.py).
    max_concurrent_batches: int = 1
    # Streaming (vLLM's stream_interval): a request's output goes out every this many new tokens
    # (and with every token until its first text, and when it finishes), so the front ends and
    # clients of a busy server handle fewer, larger chunks; 1 sends every token. None: grows with
    # load (engine/output_processor.py): every token below 16 requests streaming in a step.
    stream_interval: int | None = None
    # Multi-step decoding (core/multi_step.py): a decode-only step with nothing waiting runs up
    # to this many forward passes per schedule; 1 schedules every pass.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {self.max_concurrent_batches}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0 disables it), got {self.long_prefill_token_threshold}"
            )
        if self.scheduling_policy not in get_args(SchedulingPolicy):
            raise ValueError(f"scheduling_policy must be one of {', '.join(map(repr, get_args(SchedulingPolicy)))}, "
                             f"got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be 'recompute', 'swap' or 'auto', got {self.preemption_mode!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.priority_aging_steps < 0:
            raise ValueError(f"priority_aging_steps must be >= 0 (0 disables aging), got {self.priority_aging_steps}")

    @property
    def prefill_chunk_cap(self) -> int:
        """Most new tokens one sequence may take in a step (0 threshold means only the budget caps it).

        Without chunked prefill a prompt must run whole, so the threshold cannot apply.
        """
        if not self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        return self.long_prefill_token_threshold or self.max_num_batched_tokens
