"""The one interface through which a feature adds to a step after the scheduler has decided it.

``Scheduler.schedule()`` decides what runs; features then attach what the worker needs for them
(the grammar bitmask, LoRA slots, a draft model's draft counts) to the ``SchedulerOutput``. Each
such feature is a ``StepDecorator``, registered with the engine, which calls every decorator in
one place, in registration order; a new feature is one implementation, not edits in the engine,
the scheduler and the runner.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.sequence import SequenceGroup


class StepDecorator(Protocol):
    def decorate_step(self, so: SchedulerOutput, requests: Mapping[str, SequenceGroup]) -> None:
        """Add this feature's part to ``so`` (``requests``: the scheduler's requests by id)."""
