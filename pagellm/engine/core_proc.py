"""The engine core in its own process, and ``AsyncEngineClient``: ``AsyncLLM``'s interface over it.

The core process's main thread owns the ``LLMEngine`` (scheduler, KV cache manager, executor; the
only thread there that runs the kernels' OpenMP regions) and runs a busy loop: take every message
waiting on its input socket (add, abort, stats, health, shutdown), step while requests are
unfinished, send each step's ``RequestOutput``s to the client that sent the request, by
``client_index`` (vLLM V1's ``dict[client_index, EngineCoreOutputs]``). A front end (the HTTP
server) holds an ``AsyncEngineClient``: it sends requests over ZMQ (a PUSH socket into the core's
PULL) and a receiver thread reads its own PULL socket and feeds each request's asyncio queue.

Messages are pickled Python tuples (protocol 5): ``RequestOutput`` and ``SamplingParams`` are plain
dataclasses, and one message per step per client carries every request's output of that step, a
plain request's as an ``OutputDelta`` between its first and last (``output_delta``).
Detokenization and stop strings stay in the core (``engine/output_processor.py``): a stop string
ends its sequence in the step that completes it, so its blocks are free before the next schedule,
and only new text crosses the socket. If the core dies (a crash, a kill), the receiver sees the process gone within its
poll interval, every open stream ends with ``EngineDeadError`` and ``is_running`` turns false
(``/health`` answers 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
from collections import defaultdict
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from pagellm.config import EngineArgs
from pagellm.engine.async_llm import drain_stream
from pagellm.engine.llm_engine import EngineDeadError, PromptType, lora_op
from pagellm.engine.output_delta import OutputDelta, OutputDeltaDecoder, OutputDeltaEncoder
from pagellm.lora_request import LoRARequest
from pagellm.metrics import EngineStats
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingInfo
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

POLL_MS = 200  # how often an idle receiver checks that the core process is alive
CONTROL_TIMEOUT_S = 60.0  # stats and health answers wait for the current step, which can be long


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What a client needs to know about the engine in the core process (sent once, when ready)."""

    vocab_size: int
    max_model_len: int
    tokenizer: Tokenizer
    pooling: PoolingInfo | None = None  # runner="pooling"


def _send(sock: Any, msg: tuple) -> None:
    sock.send(pickle.dumps(msg, protocol=5), copy=False)


def _picklable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (ValueError and friends do), else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return RuntimeError(f"{type(e).__name__}: {e}")


def run_engine_core(engine_args: EngineArgs, chat_template: str | None, input_addr: str,
                    output_addrs: list[str]) -> None:
    """The core process's main: build the engine, then serve the clients until told to stop."""
    import zmq

    from pagellm.engine.data_parallel import create_engine

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Ctrl-C in a terminal reaches the whole process group: the front end stops this core in
    # order (a "shutdown" message; the step in progress finishes), SIGTERM or its exit otherwise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    outs = []
    for addr in output_addrs:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(addr)
        outs.append(sock)
    inp = ctx.socket(zmq.PULL)
    inp.bind(input_addr)
    try:
        engine = create_engine(engine_args, chat_template)
    except BaseException as e:  # noqa: BLE001 - every client learns why, then the process ends
        for sock in outs:
            _send(sock, ("failed", _picklable(e)))
        return
    info = CoreInfo(engine.model_info.vocab_size, engine.max_model_len, engine.get_tokenizer(),
                    engine.model_info.pooling)
    for sock in outs:
        _send(sock, ("ready", info))
    core = _CoreServer(engine, outs)
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    parent = os.getppid()
    running = True
    while running:
        if os.getppid() != parent:  # the process that started this core is gone: nobody can reach it
            logger.warning("the engine core's parent process exited; stopping")
            break
        # Idle: wait for a message. Busy: take what is there and step.
        timeout = 0 if engine.has_unfinished_requests() else POLL_MS
        while running and poller.poll(timeout):
            timeout = 0
            running = core.handle(pickle.loads(inp.recv()))
        if not running or not engine.has_unfinished_requests():
            continue
        try:
            outputs = engine.step()
        except BaseException as e:  # noqa: BLE001 - a failed step kills the core, loudly
            logger.exception("engine step failed; the engine core is dead")
            for sock in outs:
                _send(sock, ("dead", repr(e)))
            break
        core.publish(outputs)
    engine.shutdown()


class _CoreServer:
    """The core's side of its clients: their messages applied to the engine, each step's outputs
    sent as deltas to the client that owns each request."""

    def __init__(self, engine: Any, outs: list[Any]) -> None:
        self.engine = engine
        self.outs = outs
        self.owner: dict[str, int] = {}  # request id -> client index
        self.deltas = OutputDeltaEncoder()

    def handle(self, msg: tuple) -> bool:
        """Apply one client message; ``False`` once told to shut down."""
        engine, kind = self.engine, msg[0]
        if kind == "add":
            _, client, rid, prompt, params, priority, lora_request = msg
            try:
                engine.add_request(rid, prompt, params, priority=priority, lora_request=lora_request)
                self.owner[rid] = client
            except Exception as e:  # invalid input: that request's stream raises it
                _send(self.outs[client], ("error", rid, _picklable(e)))
        elif kind == "abort":
            engine.abort_request(msg[1])
            self.owner.pop(msg[1], None)
            self.deltas.forget(msg[1])
        elif kind in ("stats", "health", "trace", "lora"):
            _, client, token, *arg = msg
            try:
                result: Any = (engine.get_stats() if kind == "stats" else engine.get_trace() if kind == "trace"
                               else lora_op(engine, *arg[0]) if kind == "lora" else engine.check_health())
            except Exception as e:  # noqa: BLE001 - the health answer is the exception
                result = _picklable(e)
            _send(self.outs[client], ("reply", token, result))
        elif kind == "shutdown":
            return False
        return True

    def publish(self, outputs: list[RequestOutput]) -> None:
        """One message per client with its requests' outputs of this step."""
        by_client: dict[int, list[RequestOutput | OutputDelta]] = defaultdict(list)
        for out in outputs:
            client = self.owner.get(out.request_id)
            if client is None:
                continue
            by_client[client].append(self.deltas.encode(out))
            if out.finished:
                del self.owner[out.request_id]
        for client, items in by_client.items():
            _send(self.outs[client], ("outputs", items))


def core_addresses(num_clients: int) -> tuple[str, str, list[str]]:
    """A private temporary directory and the IPC addresses in it: the core's input, one output per client."""
    tmp = tempfile.mkdtemp(prefix="pagellm-core-")
    return tmp, f"ipc://{tmp}/input", [f"ipc://{tmp}/output{i}" for i in range(num_clients)]


def start_engine_core(engine_args: EngineArgs, chat_template: str | None, input_addr: str,
                      output_addrs: list[str]) -> multiprocessing.process.BaseProcess:
    """Spawn the engine core process (a fresh interpreter: no torch or OpenMP state copied)."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=run_engine_core, args=(engine_args, chat_template, input_addr, output_addrs),
                       name="pagellm-engine-core", daemon=True)
    proc.start()
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class AsyncEngineClient:
    """``AsyncLLM``'s interface (``generate``, ``abort``, ``check_health``, stats, tokenizer) for an
    engine core running in another process. ``start`` launches a core with one client (this one);
    several front-end processes would each hold a client with its own index."""

    def __init__(self, input_addr: str, output_addr: str, client_index: int = 0, core_pid: int | None = None) -> None:
        """Bind this client's output socket and start its receiver; ``wait_ready`` then waits for
        the core's ``CoreInfo``. ``core_pid``: the core process, watched for liveness when another
        process started it."""
        import zmq

        self.client_index = client_index
        self.core_pid = core_pid
        self.process: multiprocessing.process.BaseProcess | None = None  # when this client started the core
        self._tmpdir: str | None = None
        self.dead_error: BaseException | None = None
        self._stopped = False
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PULL)  # outputs from the core (bound before the core starts)
        self._in.bind(output_addr)
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.connect(input_addr)
        self._send_lock = threading.Lock()  # ZMQ sockets are not thread-safe
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._deltas = OutputDeltaDecoder()
        self._deltas_lock = threading.Lock()  # the receiver applies deltas; a closing stream forgets
        self._replies: dict[int, list[Any]] = {}
        self._tokens = itertools.count()
        self._ready = threading.Event()
        self._info: CoreInfo | None = None
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._receive, name="pagellm-core-client", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Wait for the core to have built its engine; raise its start-up error if it failed."""
        if not self._ready.wait(timeout) or self._info is None:
            error = self._start_error or self.dead_error or EngineDeadError("the engine core did not start")
            self.shutdown()
            raise error

    @classmethod
    def start(cls, engine_args: EngineArgs, chat_template: str | None = None) -> AsyncEngineClient:
        """Spawn an engine core process for ``engine_args`` with this one client and connect to it."""
        tmp, input_addr, output_addrs = core_addresses(1)
        client = cls(input_addr, output_addrs[0], 0)  # binds its output socket before the core connects
        client._tmpdir = tmp
        client.process = start_engine_core(engine_args, chat_template, input_addr, output_addrs)
        client.wait_ready()
        return client

    # ------------------------------------------------------------------ the receiver thread
    def _receive(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        while not self._stopped:
            if not poller.poll(POLL_MS):
                if not self._core_alive():
                    self._die(EngineDeadError("the engine core process exited"))
                    return
                continue
            msg = pickle.loads(self._in.recv())
            kind = msg[0]
            if kind == "outputs":
                self._push_step(msg[1])
            elif kind == "error":
                self._push(msg[1], msg[2])
            elif kind == "reply":
                slot = self._replies.get(msg[1])
                if slot is not None:
                    slot.append(msg[2])
                    slot[0].set()
            elif kind == "ready":
                self._info = msg[1]
                self._ready.set()
            elif kind == "failed":
                self._start_error = msg[1]
                self._ready.set()
                return
            elif kind == "dead":
                self._die(EngineDeadError(f"the engine died: {msg[1]}"))
                return

    def _core_alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self.core_pid is None or _pid_alive(self.core_pid)

    def _push(self, request_id: str, item: RequestOutput | BaseException | None) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream[0].call_soon_threadsafe(stream[1].put_nowait, item)

    def _push_step(self, items: list[RequestOutput | OutputDelta]) -> None:
        """One step's outputs (whole or as deltas) into their streams, with one wake-up per event
        loop, not one per request: a 64-request decode step otherwise writes the loop's self-pipe
        64 times."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._deltas_lock:
            for item in items:
                stream = self._streams.get(item.request_id)
                if stream is None:  # (its stream has closed: keep nothing for it)
                    self._deltas.forget(item.request_id)
                    continue
                out = self._deltas.decode(item)
                if out is not None:
                    by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _die(self, error: BaseException) -> None:
        self.dead_error = error
        self._ready.set()
        for rid in list(self._streams):
            self._push(rid, error)
        for slot in list(self._replies.values()):
            slot.append(error)
            slot[0].set()

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            _send(self._out, msg)

    def _call(self, kind: str, *arg: Any) -> Any:
        """A stats, health, trace or LoRA request, answered by the core between steps."""
        token = next(self._tokens)
        slot: list[Any] = [threading.Event()]
        self._replies[token] = slot
        try:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine is not running: {self.dead_error}")
            self._send((kind, self.client_index, token, *arg))
            if not slot[0].wait(CONTROL_TIMEOUT_S):
                raise EngineDeadError(f"the engine core did not answer {kind} in {CONTROL_TIMEOUT_S:.0f} s")
        finally:
            self._replies.pop(token, None)
        result = slot[1]
        if isinstance(result, BaseException):
            raise result
        return result

    # ------------------------------------------------------------------ AsyncLLM's interface
    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._stopped

    def get_tokenizer(self) -> Tokenizer:
        assert self._info is not None
        return self._info.tokenizer

    @property
    def max_model_len(self) -> int:
        assert self._info is not None
        return self._info.max_model_len

    @property
    def pooling(self) -> PoolingInfo | None:
        assert self._info is not None
        return self._info.pooling

    @property
    def vocab_size(self) -> int:
        assert self._info is not None
        return self._info.vocab_size

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """As ``AsyncLLM.generate``: outputs until finished; invalid input raises before any output;
        a caller that stops reading aborts the request in the core."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        done = [False]
        try:
            self._send(("add", self.client_index, request_id, prompt, sampling_params, priority, lora_request))
            async for item in drain_stream(queue, done):
                yield item
        finally:
            self._streams.pop(request_id, None)
            with self._deltas_lock:
                self._deltas.forget(request_id)
            if not done[0] and self.is_running:
                self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))
        self._push(request_id, None)

    async def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        if not self._core_alive():
            self._die(EngineDeadError("the engine core process exited"))
            raise self.dead_error  # type: ignore[misc]
        await asyncio.to_thread(self._call, "health")

    async def get_stats(self) -> EngineStats:
        return await asyncio.to_thread(self.get_stats_now)

    def get_stats_now(self) -> EngineStats:
        return self._call("stats")

    def get_trace_now(self) -> dict[str, Any] | None:
        return self._call("trace")

    def lora(self, op: str, arg: Any = None) -> Any:
        """As ``AsyncLLM.lora``, done by the core between steps."""
        return self._call("lora", (op, arg))

    def shutdown(self) -> None:
        """Stop the core (it finishes its step first) and the receiver; open streams end with
        ``EngineDeadError``."""
        if self._stopped:
            return
        if self.process is not None and self.process.is_alive():
            with contextlib.suppress(Exception):  # a broken socket: the join below still bounds it
                self._send(("shutdown",))
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=5)
        self._stopped = True
        self._thread.join(timeout=5)
        for rid in list(self._streams):
            self._push(rid, EngineDeadError("the engine was shut down"))
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
