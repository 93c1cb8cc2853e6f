"""What runs inside an out-of-process worker (a ``mp`` process or a Ray actor): the ``Worker`` plus
the decoder that turns each step's diff back into a ``SchedulerOutput``."""

from __future__ import annotations

import os
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.scheduler_output import ModelRunnerOutput
from pagellm.executor.step_delta import SchedulerOutputDelta, StepDecoder
from pagellm.worker.worker import Worker


class WorkerWrapper:
    """``execute_method(name, args)``: a method of this wrapper if it has one, else of the ``Worker``."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str | None,
                 device_index: int | None = None) -> None:
        self.worker = Worker(config, rank, init_method, device_index)
        self.decoder = StepDecoder()

    def execute_method(self, method: str, args: tuple = ()) -> Any:
        target = getattr(self, method) if method in _OWN_METHODS else getattr(self.worker, method)
        return target(*args)

    def execute_model_delta(self, delta: SchedulerOutputDelta) -> ModelRunnerOutput | None:
        return self.worker.execute_model(self.decoder.decode(delta))

    def getpid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.worker.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


_OWN_METHODS = {"execute_model_delta", "getpid", "shutdown"}
