"""The in-process executor: one ``Worker`` in the engine's own process (the default)."""

from __future__ import annotations

from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagellm.worker.worker import ModelInfo, Worker


class Executor:
    """Interface: ``collective_rpc`` to every worker plus the calls the engine makes each step."""

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        raise NotImplementedError

    def load_model(self) -> ModelInfo:
        return self.collective_rpc("load_model")[0]

    def determine_num_blocks(self) -> tuple[int, int]:
        """``(device blocks, CPU swap blocks)``: the smallest any worker can hold."""
        counts = self.collective_rpc("determine_num_blocks")
        return min(c[0] for c in counts), min(c[1] for c in counts)

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.collective_rpc("initialize_cache", (num_blocks, num_cpu_blocks))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    """Calls the single worker directly."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]
