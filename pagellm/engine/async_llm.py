"""``AsyncLLM``: the engine loop on a background thread, one asyncio stream per request.

The thread owns ``LLMEngine``: it steps while requests are unfinished and sleeps on an event
otherwise. Callers never touch the engine: they post what they want done to the thread's inbox
(vLLM's engine-core input queue), which it runs between steps in the order posted, so the event
loop never blocks on a model step and a request's abort never overtakes its add. Each request's
``RequestOutput``s (cumulative, like vLLM's default) are pushed into its ``asyncio.Queue`` with
``call_soon_threadsafe``. A stream the caller stops reading (client gone) aborts its request,
which frees its blocks before the next step. If a step raises, the engine is marked dead, every
in-flight stream ends with ``EngineDeadError`` and new requests are refused.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from pagellm.config import EngineArgs
from pagellm.engine.data_parallel import DataParallelEngine, create_engine
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.protocol import EngineDeadError, PromptType, drain_stream, lora_op
from pagellm.lora_request import LoRARequest
from pagellm.metrics import EngineStats
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingInfo
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _per_position(now: list[int], before: list[int], drafts: int) -> str:
    """Acceptance rate at each draft position over an interval, vLLM's log format."""
    if not drafts:
        return "-"
    return ", ".join(f"{(n - (before[i] if i < len(before) else 0)) / drafts:.2f}" for i, n in enumerate(now))


class AsyncLLM:
    """Async front of one ``LLMEngine``: ``generate`` yields outputs as they come; ``abort`` frees at once."""

    engine: LLMEngine | DataParallelEngine

    def __init__(self, engine: LLMEngine | DataParallelEngine | Callable[[], LLMEngine | DataParallelEngine],
                 log_stats_interval: float = 10.0) -> None:
        """``engine``, or a function that builds one: then the loop thread builds it, so that thread
        is the only one in the process that ever runs the kernels' OpenMP regions. (libgomp keeps
        a thread team per thread that starts parallel regions; once two teams exist, more threads
        than cores, it stops spinning between regions and every kernel call pays a futex wake-up:
        measured 15-20 % slower per GEMM, 22 % less W64 throughput, for a loop thread stepping an
        engine the main thread had built.) Errors while building are raised here."""
        # A lock around each step starved callers: the loop re-took it before a waiting thread woke,
        # so a client's abort waited out its whole request. Work goes through an inbox instead.
        self._inbox: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._inbox_open = True
        self._inbox_mu = threading.Lock()
        self._lock = threading.Lock()  # serializes callers once the loop has ended (run directly)
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._log_interval = log_stats_interval
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        factory: Callable[[], LLMEngine | DataParallelEngine] | None = None
        if callable(engine):
            factory = engine
        else:
            self.engine = engine
        self._thread = threading.Thread(target=self._loop, args=(factory,), name="pagellm-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    @classmethod
    def from_engine_args(cls, args: EngineArgs, chat_template: str | None = None, **kw: Any) -> AsyncLLM:
        return cls(lambda: create_engine(args, chat_template), **kw)

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._stopped

    # ------------------------------------------------------------------ what front ends may read
    def get_tokenizer(self) -> Tokenizer:
        return self.engine.get_tokenizer()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def pooling(self) -> PoolingInfo | None:
        """A pooling runner's setup (``None``: the engine generates)."""
        return self.engine.model_info.pooling

    @property
    def vocab_size(self) -> int:
        return self.engine.model_info.vocab_size

    # ------------------------------------------------------------------ the loop thread
    def _loop(self, factory: Callable[[], LLMEngine | DataParallelEngine] | None) -> None:
        if factory is not None:
            try:
                self.engine = factory()
            except BaseException as e:  # noqa: BLE001 - handed to the constructor, which raises it
                self._build_error = e
        self._built.set()
        if self._build_error is not None:
            return
        try:
            self._step_until_stopped()
        finally:
            with self._inbox_mu:
                self._inbox_open = False
            with self._lock:
                self._run_inbox()

    def _step_until_stopped(self) -> None:
        last_log = time.monotonic()
        last_stats = self.engine.get_stats()
        while not self._stopped:
            self._run_inbox()
            busy = self.engine.has_unfinished_requests()
            if busy:
                try:
                    outputs = self.engine.step()
                except BaseException as e:  # noqa: BLE001 - any failure kills the engine, loudly
                    logger.exception("engine step failed; the engine is dead")
                    self._die(e)
                    return
            else:
                outputs = []
            for out in outputs:
                self._push(out.request_id, out)
            if self._log_interval and time.monotonic() - last_log >= self._log_interval:
                last_log, last_stats = self._log_stats(last_log, last_stats)
            if not busy:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()

    def _run_inbox(self) -> None:
        while True:
            try:
                fut, fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - the caller's to raise
                    fut.set_exception(e)

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the loop thread before its next step (directly, once the loop has ended)."""
        fut: Future[T] = Future()
        with self._inbox_mu:
            if self._inbox_open:
                self._inbox.put((fut, fn))
                self._wakeup.set()
                return fut
        with self._lock:
            self._inbox.put((fut, fn))
            self._run_inbox()
        return fut

    def _call(self, fn: Callable[[], T]) -> T:
        """``fn()`` run by the loop thread, from any other thread (waits for the current step)."""
        if threading.current_thread() is self._thread:
            return fn()
        return self._submit(fn).result()

    def _log_stats(self, since: float, prev: EngineStats) -> tuple[float, EngineStats]:
        """vLLM-style periodic line: throughputs, queues, KV usage, prefix-cache hit rate."""
        now = time.monotonic()
        s = self.engine.get_stats()
        dt = max(now - since, 1e-9)
        it, prev_it, sch = s.iteration, prev.iteration, s.scheduler
        if it.steps != prev_it.steps:
            steps = it.steps - prev_it.steps
            ms = {k: 1000 * (getattr(it, k) - getattr(prev_it, k)) / steps
                  for k in ("schedule_seconds", "model_seconds", "output_seconds")}
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
                "Swapped: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
                "Steps: %d, per step: schedule %.2f ms, model %.1f ms, outputs %.2f ms",
                (it.prompt_tokens - prev_it.prompt_tokens) / dt,
                (it.generation_tokens - prev_it.generation_tokens) / dt,
                sch.num_running, sch.num_swapped, sch.num_waiting, 100 * sch.kv_cache_usage,
                100 * sch.prefix_cache_hit_rate, steps, ms["schedule_seconds"], ms["model_seconds"],
                ms["output_seconds"])
            drafts = it.spec_num_drafts - prev_it.spec_num_drafts
            if drafts or it.spec_steps_off != prev_it.spec_steps_off:
                drafted = it.spec_num_draft_tokens - prev_it.spec_num_draft_tokens
                accepted = it.spec_num_accepted_tokens - prev_it.spec_num_accepted_tokens
                logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, Drafted: %d "
                            "tokens, Acceptance rate: %.1f%%, Per-position acceptance: %s, Steps without drafts "
                            "(cost model): %d", 1 + accepted / drafts if drafts else 0.0, accepted, drafted,
                            100 * accepted / drafted if drafted else 0.0,
                            _per_position(it.spec_accepted_per_pos, prev_it.spec_accepted_per_pos, drafts),
                            it.spec_steps_off - prev_it.spec_steps_off)
        return now, s

    def _push(self, request_id: str, item: RequestOutput | BaseException | None) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _die(self, error: BaseException) -> None:
        self.dead_error = error
        for rid in list(self._streams):
            self._push(rid, EngineDeadError(f"the engine died: {type(error).__name__}: {error}"))

    # ------------------------------------------------------------------ public API
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Queue a request and yield its (cumulative) outputs until it finishes.

        Invalid requests raise ``ValueError`` here, before anything is yielded. Stopping the
        iteration early (a client that went away) aborts the request.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        self._streams[request_id] = stream
        done = [False]
        try:
            # Cancelled while still in the inbox, the add never runs; once running, the abort
            # below is queued after it.
            await asyncio.wrap_future(self._submit(lambda: self.engine.add_request(
                request_id, prompt, sampling_params, priority=priority, lora_request=lora_request)))
            async for item in drain_stream(stream.queue, done):
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not done[0] and self.is_running:
                await asyncio.shield(self.abort(request_id))

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._push(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Free the request's blocks before the next step; its stream ends (as an aborted output)."""
        await asyncio.wrap_future(self._submit(lambda: self._abort(request_id)))

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine or a worker has failed (checked now, not only at
        the next step: a worker can die while the engine is idle)."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        await asyncio.wrap_future(self._submit(self._check_health))

    def _check_health(self) -> None:
        try:
            self.engine.check_health()
        except EngineDeadError as e:
            self._die(e)
            raise

    async def get_stats(self) -> EngineStats:
        return await asyncio.to_thread(self.get_stats_now)

    def get_stats_now(self) -> EngineStats:
        """The engine's stats, from any thread (waits for the current step; a Prometheus scrape)."""
        return self._call(self.engine.get_stats)

    def lora(self, op: str, arg: Any = None) -> Any:
        """LoRA adapters: ``("add", LoRARequest)``, ``("remove", lora_int_id)``, ``("list", None)``."""
        return self._call(lambda: lora_op(self.engine, op, arg))

    def get_trace_now(self) -> dict[str, Any] | None:
        """The step trace's buffer (``None`` when tracing is off), from any thread."""
        return self._call(self.engine.get_trace)

    def shutdown(self) -> None:
        """Stop the loop; in-flight streams end with ``EngineDeadError``."""
        if self._stopped:
            return
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        for rid in list(self._streams):
            self._push(rid, EngineDeadError("the engine was shut down"))
        self.engine.shutdown()
