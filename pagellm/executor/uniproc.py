"""The in-process executor: one ``Worker`` in the engine's own process (the default)."""

from __future__ import annotations

from typing import Any

from pagellm.config import EngineConfig
from pagellm.executor.base import Executor
from pagellm.worker.worker import Worker


class UniProcExecutor(Executor):
    """Calls the single worker directly (no copies, no encoding of the scheduler output)."""

    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        self.worker.shutdown()
