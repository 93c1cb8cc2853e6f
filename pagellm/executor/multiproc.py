"""The ``mp`` executor: one worker process per tensor-parallel rank on this machine.

Workers are started with ``python -m pagellm.executor.multiproc`` (not ``multiprocessing``'s
spawn, which would re-import the user's ``__main__``) and connect back over an authenticated
local socket. Each step the driver pickles the step's diff once and sends it to every rank; rank 0
answers with the sampled tokens, the others with ``None`` once their share is done. A rank that
raises, dies or closes its connection fails the step at once (the driver waits on every rank's
connection, so it never blocks on a rank stuck in a collective with a dead peer).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import replace
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any

from pagellm.config import EngineConfig, default_num_threads
from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.executor.base import Executor, PendingOutput, WorkerError
from pagellm.executor.step_delta import StepEncoder

_STARTUP_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_config(config: EngineConfig, workers_per_machine: int) -> EngineConfig:
    """The config a worker gets: the machine's cores shared out between its workers (unless the user
    set ``num_threads``), so two ranks on two cores do not each start two threads."""
    if config.device.num_threads is not None:
        return config
    threads = max(1, default_num_threads() // workers_per_machine)
    return replace(config, device=replace(config.device, num_threads=threads))


class MultiprocExecutor(Executor):
    """``tensor_parallel_size x pipeline_parallel_size`` worker processes on this machine, driven over
    local sockets."""

    backend_name = "mp"

    def __init__(self, config: EngineConfig, workers_per_machine: int | None = None) -> None:
        self.world_size = config.parallel.workers_per_engine
        self.driver_rank = config.parallel.driver_rank
        wconfig = worker_config(config, workers_per_machine or self.world_size)
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        init_method = f"tcp://127.0.0.1:{_free_port()}" if self.world_size > 1 else None
        env = {**os.environ, "PAGELLM_WORKER_ADDR": f"{self._listener.address[0]}:{self._listener.address[1]}",
               "PAGELLM_WORKER_AUTHKEY": authkey.hex(), "OMP_NUM_THREADS": str(wconfig.device.num_threads)}
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection | None] = [None] * self.world_size
        self._encoder = StepEncoder()
        self._closed = False
        try:
            self.procs = [subprocess.Popen([sys.executable, "-m", "pagellm.executor.multiproc"], env=env,
                                           stdin=subprocess.DEVNULL) for _ in range(self.world_size)]
            # An executor dropped without shutdown() (an LLM garbage-collected) still stops its workers.
            self._finalizer = weakref.finalize(self, _kill, self.procs)
            self._accept(wconfig, init_method)
        except BaseException:
            self.shutdown()
            raise

    def _accept(self, config: EngineConfig, init_method: str | None) -> None:
        """Hand each connecting worker its rank and config, then wait until every ``Worker`` is built."""
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        accepted: list[Connection] = []

        def accept() -> None:
            with contextlib.suppress(OSError):  # the listener closed: start-up failed
                accepted.extend(self._listener.accept() for _ in range(self.world_size))

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        while acceptor.is_alive():
            acceptor.join(0.1)
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                raise WorkerError(f"worker process {dead[0].pid} exited with code {dead[0].returncode} at start-up")
            if time.monotonic() > deadline:
                raise WorkerError(f"workers did not connect within {_STARTUP_TIMEOUT_S:.0f} s")
        for conn in accepted:  # the connection order is arbitrary: each worker says its pid
            pid = conn.recv()
            rank = next(i for i, p in enumerate(self.procs) if p.pid == pid)
            self.conns[rank] = conn
            conn.send((config, rank, init_method, rank))  # rank r uses cuda:r on a CUDA machine
        self._wait_all(deadline)  # each worker answers once its Worker (and process group) exists

    # ------------------------------------------------------------------ rpc
    def _send_all(self, method: str, args: tuple) -> None:
        self.check_health()
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)  # type: ignore[union-attr]
        except OSError as e:
            self._fail(f"lost the connection to a worker: {e}")

    def _wait_all(self, deadline: float | None = None) -> list[Any]:
        """Every rank's answer; the first error, death or hang-up fails the executor."""
        results: list[Any] = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self.conns) if conn is not None}
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending), timeout)
            if not ready:
                self._fail(f"workers {sorted(pending.values())} did not answer in time")
            for conn in ready:
                assert isinstance(conn, Connection)
                rank = pending.pop(conn)
                try:
                    ok, value = conn.recv()
                except (EOFError, OSError):
                    code = self.procs[rank].poll()
                    self._fail(f"worker rank {rank} (pid {self.procs[rank].pid}) died"
                               + ("" if code is None else f" with exit code {code}"))
                if not ok:
                    self._fail(self._root_cause() + f"worker rank {rank} raised: {value}")
                results[rank] = value
        return results

    def _root_cause(self, grace_s: float = 1.0) -> str:
        """A rank's error is often the echo of a peer's death (gloo: connection closed by peer):
        name the dead rank first when there is one."""
        deadline = time.monotonic() + grace_s
        while True:
            # A rank that exits cleanly after reporting its own error is not a death.
            dead = [(rank, p) for rank, p in enumerate(self.procs) if p.poll() not in (None, 0)]
            if dead or time.monotonic() >= deadline:
                return "".join(f"worker rank {r} (pid {p.pid}) died with exit code {p.returncode}; " for r, p in dead)
            time.sleep(0.05)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self._send_all(method, args)
        return self._wait_all()

    def submit_model(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        self._send_all("execute_model_delta", (self._encoder.encode(scheduler_output),))
        return PendingOutput(wait=lambda: self._wait_all()[self.driver_rank])

    def check_health(self) -> None:
        """Also notices a worker that died while the engine was idle."""
        if self.failure is None and not self._closed:
            dead = [(rank, p) for rank, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                rank, p = dead[0]
                self.failure = WorkerError(f"worker rank {rank} (pid {p.pid}) died with exit code {p.returncode}")
        super().check_health()

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self) -> None:
        """Ask every worker to exit, then kill whatever is left; no process outlives this call."""
        if self._closed:
            return
        self._closed = True
        # After a failure the survivors may be stuck in a collective with the dead rank: kill them.
        for conn in self.conns if self.failure is None else []:
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send_bytes(pickle.dumps(("shutdown", ())))
        deadline = time.monotonic() + (5.0 if self.failure is None else 0.0)
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self._listener.close()
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


# ---------------------------------------------------------------------- the worker process
def _watch_parent(parent: int) -> None:
    """Exit when the driver is gone, even while blocked in a collective with a dead peer."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _worker_main() -> None:
    from pagellm.executor.worker_wrapper import WorkerWrapper

    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    host, port = os.environ["PAGELLM_WORKER_ADDR"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["PAGELLM_WORKER_AUTHKEY"]))
    conn.send(os.getpid())
    config, rank, init_method, device_index = conn.recv()
    try:
        wrapper = WorkerWrapper(config, rank, init_method, device_index)
    except BaseException:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, None))
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if method == "shutdown":
            break
        try:
            reply = (True, wrapper.execute_method(method, args))
        except BaseException:  # noqa: BLE001
            reply = (False, traceback.format_exc())
        try:
            conn.send(reply)
        except (OSError, ValueError):
            break
    wrapper.shutdown()


if __name__ == "__main__":
    _worker_main()
