"""The executor interface the engine talks to, and the errors that mean a worker is gone."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from pagellm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.worker import ModelInfo

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker raised, died or stopped answering; the executor cannot run another step."""


class Executor:
    """``collective_rpc`` to every worker plus the calls the engine makes each step.

    A step is ``submit_model`` then ``PendingOutput.result``, so an engine that drives several
    executors (data-parallel replicas) can start them all before waiting for any.
    """

    #: Set once a worker failed; every later call raises it again instead of touching the workers.
    failure: WorkerError | None = None
    #: Names the backend in failure logs.
    backend_name = "uni"

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call ``method(*args)`` on every worker; one result per rank, in rank order."""
        raise NotImplementedError

    def load_model(self) -> ModelInfo:
        return self.collective_rpc("load_model")[0]

    def determine_num_blocks(self) -> tuple[int, int]:
        """``(device blocks, CPU swap blocks)``: the smallest any worker can hold."""
        counts = self.collective_rpc("determine_num_blocks")
        return min(c[0] for c in counts), min(c[1] for c in counts)

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.collective_rpc("initialize_cache", (num_blocks, num_cpu_blocks))

    def submit_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Start one step; the default runs it to completion at once."""
        return PendingOutput(self.collective_rpc("execute_model", (scheduler_output,))[0])

    def check_health(self) -> None:
        """Raise ``WorkerError`` if any worker has failed."""
        if self.failure is not None:
            raise self.failure

    def shutdown(self) -> None:
        """Stop the workers; idempotent."""

    def _fail(self, message: str) -> NoReturn:
        """Record the failure (every later call raises it too), log it, raise it."""
        self.failure = WorkerError(message)
        logger.error("%s executor failed: %s", self.backend_name, message)
        raise self.failure


class PendingOutput:
    """A step in flight; ``result()`` waits for rank 0's ``ModelRunnerOutput``."""

    def __init__(self, value: Any = None, wait: Any = None) -> None:
        self._value = value
        self._wait = wait

    def result(self) -> ModelRunnerOutput:
        if self._wait is not None:
            self._value, self._wait = self._wait(), None
        return self._value
