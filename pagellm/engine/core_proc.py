"""The engine core in its own process: its main loop and its side of the clients.

The core process's main thread owns the ``LLMEngine`` (scheduler, KV cache manager, executor; the
only thread there that runs the kernels' OpenMP regions) and runs a busy loop: take every message
waiting on its input socket (``core_messages``: add, abort, a control call, shutdown), step while
requests are unfinished, send each step's outputs to the client that sent the request, by
``client_index`` (vLLM V1's ``dict[client_index, EngineCoreOutputs]``). The clients are
``AsyncEngineClient``s (``core_client``).

Detokenization and stop strings stay in the core (``engine/output_processor.py``): a stop string
ends its sequence in the step that completes it, so its blocks are free before the next schedule,
and only new text crosses the socket. This module imports no torch at the top: a front end
imports it to spawn the core, which builds its engine in a fresh interpreter.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import tempfile
from collections import defaultdict
from typing import Any

from pagellm.config import EngineArgs
from pagellm.engine.core_messages import (
    AbortRequest,
    AddRequest,
    ClientMessage,
    ControlReply,
    ControlRequest,
    CoreDead,
    CoreFailed,
    CoreInfo,
    CoreMessage,
    RequestFailed,
    ShutdownCore,
    StepOutputs,
)
from pagellm.engine.output_delta import OutputDelta, OutputDeltaEncoder
from pagellm.engine.protocol import lora_op
from pagellm.outputs import RequestOutput

logger = logging.getLogger(__name__)

POLL_MS = 200  # how often an idle core, or a client's receiver, checks that the other side is alive


def send_message(sock: Any, msg: ClientMessage | CoreMessage) -> None:
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
            send_message(sock, CoreFailed(_picklable(e)))
        return
    info = CoreInfo(engine.model_info.vocab_size, engine.max_model_len, engine.get_tokenizer(),
                    engine.model_info.pooling)
    for sock in outs:
        send_message(sock, info)
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
                send_message(sock, CoreDead(repr(e)))
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

    def handle(self, msg: ClientMessage) -> bool:
        """Apply one client message; ``False`` once told to shut down."""
        engine = self.engine
        match msg:
            case AddRequest():
                try:
                    engine.add_request(msg.request_id, msg.prompt, msg.params, priority=msg.priority,
                                       lora_request=msg.lora_request)
                    self.owner[msg.request_id] = msg.client
                except Exception as e:  # invalid input: that request's stream raises it
                    send_message(self.outs[msg.client], RequestFailed(msg.request_id, _picklable(e)))
            case AbortRequest():
                engine.abort_request(msg.request_id)
                self.owner.pop(msg.request_id, None)
                self.deltas.forget(msg.request_id)
            case ControlRequest():
                try:
                    result: Any = (engine.get_stats() if msg.kind == "stats" else engine.get_trace()
                                   if msg.kind == "trace" else lora_op(engine, *msg.arg) if msg.kind == "lora"
                                   else engine.check_health())
                except Exception as e:  # noqa: BLE001 - the health answer is the exception
                    result = _picklable(e)
                send_message(self.outs[msg.client], ControlReply(msg.token, result))
            case ShutdownCore():
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
            send_message(self.outs[client], StepOutputs(items))


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
