"""Executors drive workers; the engine talks only to this interface.

``uni``: one worker in the engine's process (the default). ``mp``: one process per tensor-parallel
rank on this machine. ``ray``: one Ray actor per rank, on any node of a Ray cluster.
"""

from pagellm.executor.base import Executor, PendingOutput, WorkerError
from pagellm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "PendingOutput", "UniProcExecutor", "WorkerError", "create_executor"]


def create_executor(config, workers_per_machine: int | None = None) -> Executor:
    """The executor ``config.parallel.distributed_executor_backend`` names (imported only when used).
    ``workers_per_machine``: how many workers share this machine's cores (data-parallel replicas)."""
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        return UniProcExecutor(config)
    if backend == "mp":
        from pagellm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, workers_per_machine)
    if backend == "ray":
        from pagellm.executor.ray_executor import RayExecutor

        return RayExecutor(config, workers_per_machine)
    raise ValueError(f"distributed_executor_backend {backend!r} is not one of 'uni', 'mp', 'ray'")
