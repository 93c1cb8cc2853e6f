"""``AsyncEngineClient``: the ``EngineClient`` protocol over an engine core in another process.

A front end (the HTTP server) holds one: it sends requests over ZMQ (a PUSH socket into the core's
PULL, ``core_messages``) and a receiver thread reads its own PULL socket and feeds each request's
asyncio queue. If the core dies (a crash, a kill), the receiver sees the process gone within its
poll interval, every open stream ends with ``EngineDeadError`` and ``is_running`` turns false
(``/health`` answers 503). Nothing here imports torch: the front end's process stays small.
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
import sys
import threading
from collections.abc import AsyncGenerator
from typing import Any

from pagellm.config import EngineArgs
from pagellm.engine.core_messages import (
    AbortRequest,
    AddRequest,
    ClientMessage,
    ControlKind,
    ControlReply,
    ControlRequest,
    CoreDead,
    CoreFailed,
    CoreInfo,
    RequestFailed,
    ShutdownCore,
    StepOutputs,
)
from pagellm.engine.core_proc import POLL_MS, core_addresses, send_message, start_engine_core
from pagellm.engine.output_delta import OutputDelta, OutputDeltaDecoder
from pagellm.engine.protocol import EngineDeadError, PromptType, drain_stream
from pagellm.lora_request import LoRARequest
from pagellm.metrics import EngineStats
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingInfo
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer

CONTROL_TIMEOUT_S = 60.0  # stats and health answers wait for the current step, which can be long


def _drop_torch_advice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("PyTorch was not found")


def keep_torch_out() -> None:
    """Make this process a front end that can never load torch (the engine core, another process,
    runs the model). transformers imports torch whenever torch can be found, even for a tokenizer;
    with ``import torch`` failing here it loads only its tokenizers and chat templates, its
    supported torch-free set: ~200 MiB less per front-end process. A no-op where torch is already
    loaded (a test process, an in-process engine)."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # Python's own "not importable" marker
        logging.getLogger("transformers").addFilter(_drop_torch_advice)  # (its notice that torch is absent)


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
    """The ``EngineClient`` protocol for an engine core running in another process. ``start``
    launches a core with one client (this one); several front-end processes each hold a client
    with its own index."""

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
            match msg:
                case StepOutputs():
                    self._push_step(msg.items)
                case RequestFailed():
                    self._push(msg.request_id, msg.error)
                case ControlReply():
                    slot = self._replies.get(msg.token)
                    if slot is not None:
                        slot.append(msg.result)
                        slot[0].set()
                case CoreInfo():
                    self._info = msg
                    self._ready.set()
                case CoreFailed():
                    self._start_error = msg.error
                    self._ready.set()
                    return
                case CoreDead():
                    self._die(EngineDeadError(f"the engine died: {msg.reason}"))
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

    def _send(self, msg: ClientMessage) -> None:
        with self._send_lock:
            send_message(self._out, msg)

    def _call(self, kind: ControlKind, arg: Any = None) -> Any:
        """A stats, health, trace or LoRA request, answered by the core between steps."""
        token = next(self._tokens)
        slot: list[Any] = [threading.Event()]
        self._replies[token] = slot
        try:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine is not running: {self.dead_error}")
            self._send(ControlRequest(self.client_index, token, kind, arg))
            if not slot[0].wait(CONTROL_TIMEOUT_S):
                raise EngineDeadError(f"the engine core did not answer {kind} in {CONTROL_TIMEOUT_S:.0f} s")
        finally:
            self._replies.pop(token, None)
        result = slot[1]
        if isinstance(result, BaseException):
            raise result
        return result

    # ------------------------------------------------------------------ the EngineClient protocol
    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._stopped

    @property
    def info(self) -> CoreInfo:
        """What the core said about its engine when it was ready (``wait_ready`` has returned)."""
        assert self._info is not None
        return self._info

    def get_tokenizer(self) -> Tokenizer:
        return self.info.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def pooling(self) -> PoolingInfo | None:
        return self.info.pooling

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

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
            self._send(AddRequest(self.client_index, request_id, prompt, sampling_params, priority, lora_request))
            async for item in drain_stream(queue, done):
                yield item
        finally:
            self._streams.pop(request_id, None)
            with self._deltas_lock:
                self._deltas.forget(request_id)
            if not done[0] and self.is_running:
                self._send(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))
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
                self._send(ShutdownCore())
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
