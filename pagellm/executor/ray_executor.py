"""The ``ray`` executor: one Ray actor per tensor-parallel rank, placed with a placement group.

Works against a local ``ray.init()`` and against an existing cluster: if Ray is not initialised
yet, ``ray.init()`` connects to ``RAY_ADDRESS`` or the cluster ``ray start`` made on this machine,
and only starts a private local instance when there is none (that one is stopped again on
shutdown). Ray places the actors (``PACK``: one node when it fits); ``torch.distributed`` (gloo on
CPU, nccl on CUDA) does the collectives, rendezvousing at rank 0's node. Each step's diff is put
in the object store once and read by every rank; an actor that dies or raises fails the step at
once.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.executor.base import Executor, PendingOutput, WorkerError
from pagellm.executor.multiproc import worker_config
from pagellm.executor.step_delta import StepEncoder

_PLACEMENT_TIMEOUT_S = float(os.environ.get("PAGELLM_RAY_PLACEMENT_TIMEOUT_S", "120"))


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("distributed_executor_backend='ray' needs Ray: pip install 'pagellm[ray]' "
                          "(or pip install ray)") from None
    return ray


class RayWorker:
    """The actor: builds a ``WorkerWrapper`` once every rank knows the rendezvous address."""

    def __init__(self) -> None:
        self.wrapper: Any = None

    def node_ip_and_free_port(self) -> tuple[str, int]:
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def init_worker(self, config: EngineConfig, rank: int, init_method: str | None) -> int:
        from pagellm.executor.worker_wrapper import WorkerWrapper

        # Ray exposes the actor's GPU as device 0 (CUDA_VISIBLE_DEVICES); on CPU there is no index.
        self.wrapper = WorkerWrapper(config, rank, init_method, 0 if config.device.device == "cuda" else None)
        return os.getpid()

    def execute_method(self, method: str, args: tuple = ()) -> Any:
        return self.wrapper.execute_method(method, args)

    def execute_model_delta(self, delta: Any) -> Any:
        # A separate method: Ray resolves an ObjectRef only when it is a top-level argument.
        return self.wrapper.execute_model_delta(delta)


class RayExecutor(Executor):
    """``tensor_parallel_size`` Ray actors in one placement group."""

    backend_name = "ray"

    def __init__(self, config: EngineConfig, workers_per_machine: int | None = None) -> None:
        ray = self._ray = import_ray()
        from ray.util import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = config.parallel.workers_per_engine
        self.driver_rank = config.parallel.driver_rank
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init()
        # Each rank's bundle reserves its threads' CPUs (data-parallel replicas share them out too).
        wconfig = worker_config(config, workers_per_machine or self.world_size)
        threads = wconfig.device.num_threads
        gpu = config.device.device == "cuda"
        bundle = {"CPU": threads, **({"GPU": 1} if gpu else {})}
        self._pg = placement_group([bundle] * self.world_size, strategy="PACK")
        self.actors: list[Any] = []
        self._encoder = StepEncoder()
        self._closed = False
        try:
            ready, _ = ray.wait([self._pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
            if not ready:
                raise WorkerError(f"the Ray cluster cannot place {self.world_size} worker(s) of {bundle} within "
                                  f"{_PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()})")
            actor_cls = ray.remote(RayWorker)
            self.actors = [
                actor_cls.options(num_cpus=threads, num_gpus=1 if gpu else 0,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(
                                      placement_group=self._pg, placement_group_bundle_index=rank),
                                  runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}}).remote()
                for rank in range(self.world_size)
            ]
            init_method = None
            if self.world_size > 1:
                ip, port = self._get([self.actors[0].node_ip_and_free_port.remote()])[0]
                init_method = f"tcp://{ip}:{port}"
            self.pids = self._get([a.init_worker.remote(wconfig, rank, init_method)
                                   for rank, a in enumerate(self.actors)])
        except BaseException:
            self.shutdown()
            raise

    def _get(self, refs: list[Any]) -> list[Any]:
        """Every result in rank order; the first actor death or exception fails the executor."""
        ray = self._ray
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    results[index[ref]] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(f"Ray worker rank {index[ref]} died: {e}")
                except ray.exceptions.RayError as e:
                    self._fail(self._dead_peers(pending, index) + f"Ray worker rank {index[ref]} raised: {e}")
        return results

    def _dead_peers(self, pending: list[Any], index: dict[Any, int], grace_s: float = 1.0) -> str:
        """A rank's error is often the echo of a peer's death (gloo: connection closed by peer):
        name the dead ranks first when there are any."""
        ray = self._ray
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s) if pending else ([], [])
        dead = []
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(index[ref])
            except ray.exceptions.RayError:
                pass
        return "".join(f"Ray worker rank {r} died; " for r in dead)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.check_health()
        return self._get([a.execute_method.remote(method, args) for a in self.actors])

    def submit_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        self.check_health()
        delta = self._ray.put(self._encoder.encode(scheduler_output))  # serialised once for all ranks
        refs = [a.execute_model_delta.remote(delta) for a in self.actors]
        return PendingOutput(wait=lambda: self._get(refs)[self.driver_rank])

    def check_health(self) -> None:
        """Also notices an actor that died while the engine was idle (a cheap call to every actor)."""
        if self.failure is None and not self._closed:
            self._get([a.execute_method.remote("getpid") for a in self.actors])
        super().check_health()

    def worker_pids(self) -> list[int]:
        return list(getattr(self, "pids", []))

    def shutdown(self) -> None:
        """Kill the actors, free the placement group, stop Ray if this executor started it."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        from ray.util import remove_placement_group

        for actor in self.actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(actor)
        with contextlib.suppress(Exception):
            remove_placement_group(self._pg)
        if self._owns_ray:
            ray.shutdown()
