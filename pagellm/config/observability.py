"""The step trace and the per-step log line."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    """The step trace (``trace``: a ring buffer of ``trace_max_events``; ``trace_out``: also
    written to this Chrome Trace JSON file) and the per-step log line (``log_step_details``)."""

    trace: bool = False
    trace_out: str | None = None
    trace_max_events: int = 500_000
    log_step_details: bool = False

    def __post_init__(self) -> None:
        if self.trace_max_events < 1000:
            raise ValueError(f"trace_max_events must be >= 1000, got {self.trace_max_events}")
        if self.trace_out is not None:
            parent = os.path.dirname(os.path.abspath(self.trace_out))
            if not os.path.isdir(parent):
                raise ValueError(f"trace_out {self.trace_out!r}: directory {parent!r} does not exist")

    @property
    def tracing(self) -> bool:
        return self.trace or self.trace_out is not None
