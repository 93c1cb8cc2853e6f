"""The in-process executor: one ``Worker`` in the engine's own process (the default)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.executor.base import Executor, PendingOutput
from pagellm.worker.worker import Worker


class UniProcExecutor(Executor):
    """Calls the single worker directly (no copies, no encoding of the scheduler output). With a
    batch queue (async scheduling) steps run on one thread of their own, in order, so the engine
    thread schedules the next step and applies outputs while the model computes (torch releases
    the GIL inside its ops)."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagellm-step") \
            if config.scheduler.max_concurrent_batches > 1 else None

    def submit_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        if self._thread is None:
            return super().submit_model(scheduler_output)
        future = self._thread.submit(self.worker.execute_model, scheduler_output)
        return PendingOutput(wait=future.result)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        self.worker.shutdown()
