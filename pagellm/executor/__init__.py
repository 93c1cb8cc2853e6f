"""Executors drive workers; the engine talks only to this interface."""

from pagellm.executor.uniproc import Executor, UniProcExecutor

__all__ = ["Executor", "UniProcExecutor", "create_executor"]


def create_executor(config) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        return UniProcExecutor(config)
    raise ValueError(f"distributed_executor_backend {backend!r} is not supported yet")
