"""What a front end (the HTTP server, a benchmark) talks to: the ``EngineClient`` protocol.

Two classes implement it: ``AsyncLLM`` (the engine on a thread of this process) and
``AsyncEngineClient`` (the engine core in its own process, over ZMQ). The serving modules depend on
this protocol only, and nothing here imports torch or model code, so a front end over an engine
core process stays small (vLLM's ``EngineClient``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagellm.lora_request import LoRARequest
    from pagellm.metrics import EngineStats
    from pagellm.outputs import RequestOutput
    from pagellm.pooling_params import PoolingInfo
    from pagellm.sampling_params import SamplingParams
    from pagellm.tokenizer import Tokenizer

# A prompt: text, token ids, or a dict (``prompt`` / ``prompt_token_ids``, ``multi_modal_data``, ...).
PromptType = str | list[int] | dict[str, Any]


class EngineDeadError(RuntimeError):
    """The engine failed (a worker died or raised) or was shut down; requests cannot be served."""


class EngineClient(Protocol):
    """An engine as a front end sees it: requests in, each one's outputs as an async stream."""

    dead_error: BaseException | None  # why the engine stopped serving (``None`` while it runs)

    @property
    def is_running(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def pooling(self) -> PoolingInfo | None:
        """A pooling runner's setup (``None``: the engine generates)."""

    def get_tokenizer(self) -> Tokenizer: ...

    def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0,
                 lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """The request's (cumulative) outputs until it finishes; invalid input raises before the
        first; a caller that stops reading aborts it."""

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` if the engine has failed."""

    async def get_stats(self) -> EngineStats: ...

    def get_stats_now(self) -> EngineStats:
        """The stats from any thread (waits for the current step)."""

    def get_trace_now(self) -> dict[str, Any] | None:
        """The step trace's buffer (``None`` when tracing is off)."""

    def lora(self, op: str, arg: Any = None) -> Any:
        """LoRA adapters: ``("add", LoRARequest)``, ``("remove", lora_int_id)``, ``("list", None)``."""

    def shutdown(self) -> None: ...


async def drain_stream(queue: asyncio.Queue, done: list[bool]) -> AsyncGenerator[RequestOutput, None]:
    """A request's outputs from its queue until it finishes. ``None`` in the queue ends it (aborted
    through ``abort``), an exception is raised (rejected, or the engine died). ``done[0]`` turns true
    once nothing is left to abort: the caller aborts in the engine when it stops reading early."""
    while True:
        item = await queue.get()
        if item is None or isinstance(item, BaseException):
            done[0] = True
            if item is None:
                return
            raise item
        done[0] = item.finished
        yield item
        if item.finished:
            return


def lora_op(engine: Any, op: str, arg: Any) -> Any:
    """``EngineClient.lora(op, arg)`` applied to an engine (an ``LLMEngine`` or ``DataParallelEngine``)."""
    if op == "add":
        return engine.add_lora(arg)
    if op == "remove":
        return engine.remove_lora(arg)
    if op == "list":
        return engine.list_loras()
    raise ValueError(f"unknown LoRA operation {op!r}")
