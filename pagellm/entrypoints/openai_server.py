"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncLLM``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as SSE),
``GET /v1/models``, ``GET /health``, ``GET /version``, ``POST /tokenize``, ``POST /detokenize``,
``GET /metrics`` (Prometheus). Errors use OpenAI's body ``{"error": {message, type, param, code}}``.
A client that disconnects aborts its request (its blocks are freed before the next step).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import os
import struct
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, fields, replace
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

import pagellm
from pagellm.config import as_cli_message
from pagellm.engine.async_llm import AsyncLLM, EngineDeadError
from pagellm.engine.core_proc import AsyncEngineClient
from pagellm.engine.lora_manager import LoRAInUse
from pagellm.entrypoints import tool_calls
from pagellm.entrypoints.chat_utils import MediaConnector, MediaError, extract_images, template_renders_images
from pagellm.entrypoints.openai_protocol import (
    CONTENT_FORMATS,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    SamplingBody,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    error_responses,
    normalize_message,
)
from pagellm.lora_request import LoRARequest
from pagellm.metrics import GAUGE, STAT_FIELDS
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.reasoning import ReasoningParser, get_reasoning_parser
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.tokenizer import check_token_ids
from pagellm.utils import reject_unknown

logger = logging.getLogger(__name__)

# Request limits beyond what the engine checks (each a 400 naming the field): a request could
# otherwise make every step scan a huge stop list, or fork a huge number of sequences.
MAX_STOP_STRINGS = 64
MAX_N = 128
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit per request
# What an embedding request runs with (the engine pools the prompt and samples nothing).
EMBED_PARAMS = SamplingParams(max_tokens=1, temperature=0)
MAX_BODY_BYTES = 16 * 2**20  # far above any prompt max_model_len allows; a 413 before the body is read
DISCONNECT_POLL_S = 1.0  # a stream's fallback disconnect check (``OpenAIServer._stream``)


class _BodyLimit:
    """Pure ASGI (Starlette's BaseHTTPMiddleware would hide client disconnects): a request whose
    Content-Length exceeds the limit gets an OpenAI-shaped 413 without its body being read."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            length = dict(scope.get("headers") or []).get(b"content-length", b"0")
            if length.isdigit() and int(length) > self.limit:
                await _error(f"The request body of {int(length)} bytes exceeds the limit of {self.limit} bytes.",
                             413, "BadRequestError")(scope, receive, send)
                return
        await self.app(scope, receive, send)


# The engine in this process (a loop thread) or in an engine-core process: the same interface.
EngineClient = AsyncLLM | AsyncEngineClient


@dataclass(frozen=True, slots=True)
class Delta:
    """What one completion of a streamed request has new since its last chunk."""

    output: RequestOutput
    completion: CompletionOutput
    text: str  # the new text
    logprobs: CompletionOutput | None  # only the new tokens, with their logprobs (if asked for)
    first: bool  # this completion's first chunk
    text_offset: int  # where ``text`` starts in the completion's whole text


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """``max_tokens=0``: the output without the one token the engine sampled."""
    return replace(out, outputs=[CompletionOutput(c.index, "", [], 0.0, None if c.logprobs is None else [],
                                                  "length" if c.finish_reason else None) for c in out.outputs])


async def _map_outputs(outputs: AsyncGenerator[RequestOutput, None], fn: Any) -> AsyncGenerator[RequestOutput, None]:
    async for out in outputs:
        yield fn(out)


def _prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token, token id -> logprob, rank, decoded token."""
    if out.prompt_logprobs is None:
        return None
    return [None if d is None else {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
                                    for t, v in d.items()} for d in out.prompt_logprobs]


def _error(message: str, status: int, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)


# ---------------------------------------------------------------------- metrics
class _EngineCollector:
    """Gauges and counters read from the engine's stats at scrape time."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    def collect(self):
        s = self.server.engine.get_stats_now()
        for f in STAT_FIELDS:  # every field pagellm.metrics exports, with its kind and help
            if f.prom is None:
                continue
            family = GaugeMetricFamily if f.kind == GAUGE else CounterMetricFamily
            value = getattr(getattr(s, f.group), f.name)
            if isinstance(value, list):  # one series per position
                m = family(f"pagellm:{f.prom}", f.doc, labels=["model_name", "position"])
                for i, v in enumerate(value):
                    m.add_metric([self.server.model_name, str(i)], v)
            else:
                m = family(f"pagellm:{f.prom}", f.doc, labels=["model_name"])
                m.add_metric([self.server.model_name], value)
            yield m


_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


# ---------------------------------------------------------------------- the server
class OpenAIServer:
    """Builds the FastAPI app for one ``AsyncLLM`` or ``AsyncEngineClient``."""

    def __init__(self, engine: EngineClient, model_name: str, api_key: str | None = None,
                 chat_template_content_format: str = "auto", media: MediaConnector | None = None,
                 reasoning_parser: str | None = None) -> None:
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, "
                             f"got {chat_template_content_format!r}")
        self.engine = engine
        self.model_name = model_name
        self.content_format = chat_template_content_format
        # --reasoning-parser: chat replies' think block as reasoning_content, apart from the answer.
        self.reasoning = None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
        self.media = media or MediaConnector()  # image URLs' rules (--allowed-local-media-path, ...)
        self.api_key = api_key
        # LoRA adapters served under their names (picked by a request's ``model``); the engine
        # holds the truth, this front end's view is refreshed from it on a miss.
        self.loras: dict[str, LoRARequest] = {r.lora_name: r for r in engine.lora("list") or []}
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(self))
        # With several API server processes (--api-server-count), each records its requests' latency
        # in prometheus_client's multiprocess files and any of them answers /metrics with the sum.
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        if self.multiprocess:
            MultiProcessCollector(self.registry)
        hist = {"time_to_first_token_seconds": "Time to first token",
                "time_per_output_token_seconds": "Time per output token after the first",
                "e2e_request_latency_seconds": "Arrival to finish",
                "request_queue_time_seconds": "Arrival to first scheduling"}
        hist_registry = None if self.multiprocess else self.registry  # (multiprocess: read back from the files)
        self.hist = {k: Histogram(f"pagellm:{k}", doc, ["model_name"], registry=hist_registry, buckets=_BUCKETS)
                     for k, doc in hist.items()}
        self.app = self._build()

    # ------------------------------------------------------------------ helpers
    def _check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (``None``: the base model); 404 for an unknown name."""
        if model is None or model == self.model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            registered = self.engine.lora("list")  # another front end may have loaded it (None: no LoRA)
            if registered is not None:
                self.loras = {r.lora_name: r for r in registered}
                lora = self.loras.get(model)
        if lora is None:
            raise APIError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model", "model_not_found")
        return lora

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Register an adapter under ``name`` (the next free id); ``APIError`` 400 if it cannot be served."""
        registered = await asyncio.to_thread(self.engine.lora, "list")  # None: the engine runs without LoRA
        if registered is None:
            raise APIError("this server runs without LoRA: start it with --enable-lora", 400, param="lora_name")
        if name == self.model_name or name in {r.lora_name for r in registered}:
            raise APIError(f"the name {name!r} is already in use", 400, param="lora_name")
        request = LoRARequest(name, max([r.lora_int_id for r in registered], default=0) + 1, path)
        try:
            await asyncio.to_thread(self.engine.lora, "add", request)
        except ValueError as e:
            raise APIError(str(e), 400, param="lora_path") from e
        self.loras[name] = request
        return {"status": "ok", "lora_name": name, "lora_int_id": request.lora_int_id}

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        """The engine's own check, here too: the front end decodes ids (echo, /detokenize) first."""
        try:
            check_token_ids(ids, self.engine.vocab_size, param)
        except ValueError as e:
            raise APIError(str(e), param=param) from e

    def _chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                     tools: list[dict[str, Any]] | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The conversation through the chat template, or a 400 naming what is wrong with it. Tools
        go to a template that takes them, else into a system message (``tool_calls``)."""
        if not messages:
            raise APIError("messages must not be empty", param="messages")
        msgs = [normalize_message(m, i, self.content_format) for i, m in enumerate(messages)]
        template = getattr(self.tokenizer.hf, "chat_template", None)
        auto = self.content_format == "auto"
        renders = self.content_format == "openai" or (auto and template_renders_images(template))
        try:
            msgs, images = extract_images(msgs, self.tokenizer.image_placeholder, renders, self.media)
        except MediaError as e:
            raise APIError(str(e), param=e.param) from None
        if not self.tokenizer.template_takes_tools:
            msgs = [tool_calls.history_as_text(m, i) for i, m in enumerate(msgs)]
            if tools:
                text = tool_calls.tools_system_prompt(tools)
                if msgs[0]["role"] == "system" and isinstance(msgs[0].get("content"), str):
                    msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + text}
                else:
                    msgs.insert(0, {"role": "system", "content": text})
                tools = None
        try:
            prompt = self.tokenizer.chat_prompt(msgs, add_generation_prompt, tools, template_kwargs)
        except ValueError as e:
            if "chat_template_kwargs" in str(e):
                raise APIError(str(e), param="chat_template_kwargs") from None
            raise APIError(f"cannot apply the chat template: {type(e).__name__}: {as_cli_message(str(e))}",
                           param="messages") from e
        except Exception as e:  # a template that rejects the conversation; the message only, no traceback
            raise APIError(f"cannot apply the chat template: {type(e).__name__}: {e}", param="messages") from e
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return prompt

    def _params(self, body: SamplingBody, prompt_len: int, max_tokens: int | None, logprobs: int | None,
                best_of: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
        if body.n > MAX_N or (best_of or 0) > MAX_N:
            raise APIError(f"n and best_of must be <= {MAX_N}", param="n")
        room = self.max_model_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} "
                           "in the completion). Please reduce the length of the messages or completion.",
                           param="max_tokens")
        if room < 1:
            raise APIError(f"The prompt has {prompt_len} tokens; this model's maximum context length is "
                           f"{self.max_model_len} tokens.", param="messages")
        kw: dict[str, Any] = dict(
            n=body.n, best_of=best_of, max_tokens=max_tokens if max_tokens is not None else room,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
            min_p=body.min_p or 0.0, seed=body.seed,
            stop=stops,
            stop_token_ids=body.stop_token_ids or [], presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens, include_stop_str_in_output=body.include_stop_str_in_output,
            structured_outputs=self._structured_outputs(body))
        try:
            return SamplingParams(**kw)
        except ValueError as e:  # SamplingParams' messages start with the field's name
            field = str(e).split(" ", 1)[0]
            raise APIError(str(e), param=field if field in kw else None) from e

    @staticmethod
    def _structured_outputs(body: SamplingBody) -> StructuredOutputsParams | None:
        """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM's extra field), not both."""
        fmt, so = body.response_format, body.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise APIError("give response_format or structured_outputs, not both", param="response_format")
        try:
            if so is not None:
                reject_unknown("structured_outputs field(s)", so, {f.name for f in fields(StructuredOutputsParams)})
                return StructuredOutputsParams(**so)
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise APIError("response_format json_schema needs json_schema.schema",
                               param="response_format.json_schema")
            return StructuredOutputsParams(json=fmt.json_schema.json_schema)
        except ValueError as e:
            raise APIError(str(e), param="structured_outputs" if so is not None else "response_format") from e

    def _record(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None or m.finished_time is None:
            return
        label = self.model_name
        if m.first_token_time is not None:
            self.hist["time_to_first_token_seconds"].labels(label).observe(m.first_token_time - m.arrival_time)
            n_out = max(len(c.token_ids) for c in out.outputs) if out.outputs else 0
            if n_out > 1 and m.last_token_time is not None:
                self.hist["time_per_output_token_seconds"].labels(label).observe(
                    (m.last_token_time - m.first_token_time) / (n_out - 1))
        self.hist["e2e_request_latency_seconds"].labels(label).observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.hist["request_queue_time_seconds"].labels(label).observe(m.first_scheduled_time - m.arrival_time)

    async def _start(self, prompt: Any, params: SamplingParams, rid: str, priority: int,
                     lora: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Queue the request and wait for its first output, so a rejected request becomes an
        HTTP 400 before a streaming response has started."""
        gen = self.engine.generate(prompt, params, rid, priority, lora)
        try:
            first = await gen.__anext__()
        except ValueError as e:  # (an engine argument it names is a server flag here)
            raise APIError(as_cli_message(str(e))) from e
        if first.error is not None:  # e.g. a constraint that did not compile: nothing was generated
            raise APIError(first.error, param=_error_param(first.error))

        async def chained() -> AsyncGenerator[RequestOutput, None]:
            try:
                yield first
                async for out in gen:
                    yield out
            finally:
                await gen.aclose()
        return chained()

    async def _stream(self, outputs: AsyncGenerator[RequestOutput, None], rid: str,
                      request: Request) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs; stops (which aborts the request) when the client disconnects.

        Starlette's ``StreamingResponse`` already cancels the stream the moment the client hangs up
        (under uvicorn, ASGI spec 2.3: it listens for the disconnect beside the stream; at spec 2.4
        the next send fails), and the cancellation aborts the request. Asking
        ``Request.is_disconnected`` as well costs an anyio cancel scope per call: after every
        output it was a quarter of the API server's CPU on W64, so it is only a fallback, asked at
        most once per ``DISCONNECT_POLL_S``."""
        next_poll = time.monotonic() + DISCONNECT_POLL_S
        try:
            async for out in outputs:
                if time.monotonic() >= next_poll:
                    if await request.is_disconnected():
                        logger.info("client of %s disconnected: aborting", rid)
                        return
                    next_poll = time.monotonic() + DISCONNECT_POLL_S
                if out.finished:
                    self._record(out)
                yield out
        finally:
            await outputs.aclose()

    async def _final(self, prompt: Any, params: SamplingParams, rid: str, priority: int,
                     request: Request, lora: LoRARequest | None = None) -> RequestOutput | None:
        """Non-streaming: the final output, or ``None`` (request aborted) if the client went away."""
        async def collect() -> RequestOutput | None:
            last = None
            async for out in self.engine.generate(prompt, params, rid, priority, lora):
                last = out
            if last is not None:
                self._record(last)
            return last

        task = asyncio.ensure_future(collect())
        while not task.done():
            if await request.is_disconnected():
                task.cancel()  # ends the engine stream, which aborts the request
                logger.info("client of %s disconnected: aborting", rid)
                return None
            await asyncio.wait({task}, timeout=0.2)
        try:
            out = task.result()
        except ValueError as e:
            raise APIError(as_cli_message(str(e))) from e
        if out is not None and out.error is not None:
            raise APIError(out.error, param=_error_param(out.error))
        return out

    async def _deltas(self, outputs: AsyncGenerator[RequestOutput, None], rid: str, request: Request, logprobs: bool,
                      always_first: bool = False) -> AsyncIterator[Delta]:
        """Per completion, what is new since the last chunk (see ``Delta``)."""
        sent_text: dict[int, int] = {}
        sent_tok: dict[int, int] = {}
        async for out in self._stream(outputs, rid, request):
            for c in out.outputs:
                start = sent_text.get(c.index, 0)
                first = c.index not in sent_text
                text = c.text[start:]
                if not text and c.finish_reason is None and not (first and always_first):
                    continue  # tokens that make no text yet (a split UTF-8 character): wait for them
                part = None
                if logprobs and c.logprobs is not None:
                    t0 = sent_tok.get(c.index, 0)
                    part = CompletionOutput(c.index, text, c.token_ids[t0:], None, c.logprobs[t0:])
                    sent_tok[c.index] = len(c.token_ids)
                sent_text[c.index] = len(c.text)
                yield Delta(out, c, text, part, first, start)

    def _logprobs_completion(self, c: Any, offset0: int) -> dict[str, Any] | None:
        return None if c.logprobs is None else self._legacy_logprobs(c.token_ids, c.logprobs, offset0)

    def _legacy_logprobs(self, token_ids: list[int], logprobs: list[Any], offset0: int) -> dict[str, Any]:
        """OpenAI's legacy ``logprobs`` of these tokens, their text starting at ``offset0``; an
        entry ``None`` (a prompt's first token) has no logprob and no top ones."""
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for tid, d in zip(token_ids, logprobs, strict=False):
            text = self.tokenizer.decode([tid], False)
            tokens.append(text)
            token_lps.append(d[tid].logprob if d is not None and tid in d else None)
            tops.append(None if d is None else {v.decoded_token or self.tokenizer.decode([t], False): v.logprob
                                                for t, v in d.items()})
            offsets.append(off)
            off += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _logprobs_echoed(self, out: RequestOutput, c: Any, echo: bool, offset0: int) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs, led by the prompt's tokens where it is echoed (``prompt_logprobs``)."""
        lp = self._logprobs_completion(c, offset0)
        if lp is None or not echo or out.prompt_logprobs is None:
            return lp
        prompt = self._legacy_logprobs(out.prompt_token_ids, out.prompt_logprobs, 0)
        return {key: prompt[key] + lp[key] for key in lp}

    def _logprobs_chat(self, c: Any, top: int) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        content = []
        for tid, d in zip(c.token_ids, c.logprobs, strict=False):
            text = self.tokenizer.decode([tid], False)
            ranked = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:top]
            content.append({"token": text, "logprob": d[tid].logprob if tid in d else -9999.0,
                            "bytes": list(text.encode()),
                            "top_logprobs": [{"token": self.tokenizer.decode([t], False), "logprob": v.logprob,
                                              "bytes": list(self.tokenizer.decode([t], False).encode())}
                                             for t, v in ranked]})
        return {"content": content}

    @staticmethod
    def _usage(out: RequestOutput) -> dict[str, int]:
        p = len(out.prompt_token_ids)
        g = sum(len(c.token_ids) for c in out.outputs)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    # ------------------------------------------------------------------ routes
    def _build(self) -> FastAPI:
        app = FastAPI(title="pagellm", version=pagellm.__version__)
        app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
        self._add_error_handlers(app)
        v1, keyed = self._guards()
        self._add_service_routes(app, v1, keyed)
        self._add_api_routes(app, v1, keyed)
        return app

    @staticmethod
    def _add_error_handlers(app: FastAPI) -> None:
        @app.exception_handler(APIError)
        async def _api_error(_: Request, e: APIError) -> JSONResponse:
            return _error(e.message, e.status, e.type, e.param, e.code)

        @app.exception_handler(RequestValidationError)
        async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
            first = e.errors()[0] if e.errors() else {}
            loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
            return _error(f"{loc}: {first.get('msg', 'invalid request')}" if loc else str(e), 400,
                          "BadRequestError", loc)

        @app.exception_handler(EngineDeadError)
        async def _dead(_: Request, e: EngineDeadError) -> JSONResponse:
            return _error(str(e), 503, "ServiceUnavailableError")

    def _guards(self) -> tuple[list[Any], list[Any]]:
        """``(v1, keyed)``: the dependencies of the API routes (the key, and a running engine) and
        of the service routes that need only the key. With --api-key everything but /health,
        /version and the OpenAPI document needs it."""
        server = self
        # A dependency, not HTTP middleware: Starlette's BaseHTTPMiddleware hides client
        # disconnects from ``Request.is_disconnected``, which abort-on-disconnect relies on.
        expected = f"Bearer {server.api_key}".encode() if server.api_key else None

        async def key_guard(request: Request) -> None:
            # Constant time: the comparison's duration must not tell how much of a guess was right.
            given = request.headers.get("authorization", "").encode()
            if expected is not None and not hmac.compare_digest(given, expected):
                raise APIError("Incorrect or missing API key.", 401, "AuthenticationError", code="invalid_api_key")

        async def guard(request: Request) -> None:
            await key_guard(request)
            if not server.engine.is_running:
                raise APIError("The engine is not running.", 503, "ServiceUnavailableError")

        return [Depends(guard)], [Depends(key_guard)]

    def _add_service_routes(self, app: FastAPI, v1: list[Any], keyed: list[Any]) -> None:
        """Health, version, models, LoRA adapters, metrics and the step trace."""
        server = self

        @app.get("/health", response_class=Response,
                 responses={200: {"description": "The engine is running (empty body)"}, **error_responses(503)})
        async def health() -> Response:
            try:
                await server.engine.check_health()
            except EngineDeadError as e:
                return _error(f"The engine is not running: {e}", 503, "ServiceUnavailableError")
            return Response(status_code=200)

        @app.get("/version")
        async def version() -> dict[str, str]:
            return {"version": pagellm.__version__}

        @app.get("/v1/models", dependencies=v1, responses=error_responses(401, 503))
        async def models() -> dict[str, Any]:
            now = int(time.time())
            loras = await asyncio.to_thread(server.engine.lora, "list") or []
            return {"object": "list", "data": [
                {"id": server.model_name, "object": "model", "created": now, "owned_by": "pagellm",
                 "root": server.model_name, "parent": None, "max_model_len": server.max_model_len},
                *({"id": r.lora_name, "object": "model", "created": now, "owned_by": "pagellm", "root": r.lora_path,
                   "parent": server.model_name, "max_model_len": server.max_model_len} for r in loras)]}

        @app.post("/v1/load_lora_adapter", dependencies=v1, responses=error_responses(400, 401))
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> dict[str, Any]:
            """Check and register an adapter (its files are read in a thread, not in the engine's step)."""
            return await server.load_lora(body.lora_name, body.lora_path)

        @app.post("/v1/unload_lora_adapter", dependencies=v1, responses=error_responses(400, 401, 404, 409))
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> dict[str, Any]:
            """Unregister an adapter; 409 while requests using it run (they are never cut short)."""
            lora = server._check_model(body.lora_name)  # 404 for an unknown name
            if lora is None:  # the base model's name
                raise APIError(f"{body.lora_name!r} is not a LoRA adapter", 404, "NotFoundError", "lora_name")
            try:
                await asyncio.to_thread(server.engine.lora, "remove", lora.lora_int_id)
            except LoRAInUse as e:
                raise APIError(str(e), 409, "ConflictError", "lora_name") from e
            server.loras.pop(lora.lora_name, None)
            return {"status": "ok", "lora_name": lora.lora_name}

        @app.get("/metrics", dependencies=keyed, responses=error_responses(401))
        async def metrics() -> Response:
            return Response(generate_latest(server.registry), media_type="text/plain; version=0.0.4")

        @app.get("/debug/trace", dependencies=keyed, responses=error_responses(401, 404))
        async def debug_trace() -> Response:
            """The step trace so far (Chrome Trace JSON; ``pagellm trace`` renders it); 404 unless
            the server was started with ``--trace`` or ``--trace-out FILE``."""
            trace = await asyncio.to_thread(server.engine.get_trace_now)
            if trace is None:
                return _error("the step trace is off: start the server with --trace or --trace-out FILE", 404,
                              "NotFoundError")
            return Response(json.dumps(trace, separators=(",", ":")), media_type="application/json")

    def _add_api_routes(self, app: FastAPI, v1: list[Any], keyed: list[Any]) -> None:
        """Tokenization and the OpenAI generation endpoints."""
        server = self

        @app.post("/tokenize", dependencies=keyed, responses=error_responses(400, 401, 404))
        async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
            server._check_model(body.model)
            if body.messages is not None:
                ids = server._chat_prompt(body.messages)["prompt_token_ids"]
            elif body.prompt is not None:
                ids = server.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                raise APIError("either prompt or messages is required", param="prompt")
            return {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}

        @app.post("/detokenize", dependencies=keyed, responses=error_responses(400, 401, 404))
        async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
            server._check_model(body.model)
            server._check_token_ids(body.tokens, "tokens")
            return {"prompt": server.tokenizer.decode(body.tokens, False)}

        @app.post("/v1/embeddings", dependencies=v1, responses=error_responses(400, 401, 404, 503))
        async def embeddings(body: EmbeddingRequest, request: Request):
            return await server._embeddings(body, request)

        @app.post("/v1/completions", dependencies=v1, responses=error_responses(400, 401, 404, 503))
        async def completions(body: CompletionRequest, request: Request):
            return await server._completions(body, request)

        @app.post("/v1/chat/completions", dependencies=v1, responses=error_responses(400, 401, 404, 503))
        async def chat(body: ChatCompletionRequest, request: Request):
            return await server._chat(body, request)

    # ------------------------------------------------------------------ /v1/embeddings
    def _embedding_inputs(self, value: Any) -> list[list[int]]:
        """Each input's token ids: a string, a list of strings, token ids, or lists of them."""
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        if not value or len(value) > MAX_EMBEDDING_INPUTS:
            raise APIError(f"input must hold 1 to {MAX_EMBEDDING_INPUTS} items, got {len(value)}", param="input")
        out = []
        for i, item in enumerate(value):
            ids = self.tokenizer.encode(item) if isinstance(item, str) else list(item)
            self._check_token_ids(ids, "input")
            if not ids or len(ids) >= self.max_model_len:
                raise APIError(f"input[{i}] has {len(ids)} tokens; this model embeds 1 to {self.max_model_len - 1}",
                               param="input")
            out.append(ids)
        return out

    async def _embeddings(self, body: EmbeddingRequest, request: Request) -> Any:
        lora = self._check_model(body.model)
        info = self.engine.pooling
        if info is None:
            raise APIError("this server generates text; embeddings need a server started with --runner pooling",
                           param="model")
        if body.encoding_format not in ("float", "base64"):
            raise APIError(f"encoding_format must be 'float' or 'base64', got {body.encoding_format!r}",
                           param="encoding_format")
        params = PoolingParams(body.dimensions)
        try:
            params.check(info)  # (refused before anything runs)
        except ValueError as e:
            raise APIError(str(e), param="dimensions") from None
        inputs = self._embedding_inputs(body.input)
        rid = f"embd-{uuid.uuid4().hex}"
        outs = await asyncio.gather(*(self._final({"prompt_token_ids": ids}, EMBED_PARAMS, f"{rid}-{i}", 0, request,
                                                  lora) for i, ids in enumerate(inputs)))
        if any(o is None for o in outs):
            return Response(status_code=499)  # the client went away; nobody reads this
        data = []
        for i, out in enumerate(outs):
            assert out is not None and out.pooled is not None
            vec = params.apply(out.pooled, info)
            emb: Any = vec if body.encoding_format == "float" else \
                base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(ids) for ids in inputs)
        return {"object": "list", "data": data, "model": body.model or self.model_name,
                "usage": {"prompt_tokens": n, "total_tokens": n}}

    # ------------------------------------------------------------------ /v1/completions
    def _completion_prompts(self, prompt: Any) -> list[dict[str, Any]]:
        if isinstance(prompt, str):
            return [{"prompt": prompt}]
        if prompt and isinstance(prompt[0], int):
            return [{"prompt_token_ids": list(prompt)}]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if len(prompt) > 1:
            raise APIError("batched prompts are not supported: send one prompt per request", param="prompt")
        return self._completion_prompts(prompt[0])

    def _check_generates(self) -> None:
        if self.engine.pooling is not None:
            raise APIError("this server embeds (--runner pooling): use POST /v1/embeddings", param="model")

    async def _completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        self._check_generates()
        (prompt,) = self._completion_prompts(body.prompt)
        ids = prompt.get("prompt_token_ids") or self.tokenizer.encode(prompt["prompt"])
        self._check_token_ids(ids, "prompt")
        prompt = {"prompt": prompt.get("prompt"), "prompt_token_ids": ids}
        if body.kv_transfer_params is not None:  # disaggregated prefill/decode (``pagellm proxy``)
            prompt["kv_transfer_params"] = body.kv_transfer_params
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default for completions
        # max_tokens=0 with echo scores the prompt alone (evaluation harnesses): the engine samples
        # one token, which the response drops.
        prompt_only = max_tokens == 0 and body.echo
        scored = body.prompt_logprobs if body.prompt_logprobs is not None else body.logprobs if body.echo else None
        params = self._params(body, len(ids), 1 if prompt_only else max_tokens, body.logprobs, body.best_of, scored)
        if body.stream and params.best_of and params.best_of > params.n:
            raise APIError("best_of > n cannot be streamed", param="best_of")
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        echo = ""  # the prompt's text, put before the completion when asked; only then are ids decoded
        if body.echo:
            echo = prompt["prompt"] if prompt["prompt"] is not None else self.tokenizer.decode(ids, False)

        def whole(out: RequestOutput) -> dict[str, Any]:
            out = _prompt_only(out) if prompt_only else out
            choices: list[dict[str, Any]] = [{"index": c.index, "text": echo + c.text,
                                              "logprobs": self._logprobs_echoed(out, c, body.echo, len(echo)),
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
            if body.prompt_logprobs is not None:
                for choice in choices:
                    choice["prompt_logprobs"] = _prompt_logprobs_json(out)
            return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": choices, "usage": self._usage(out)}

        def chunks(outputs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[dict]:
            return self._completion_chunks(_map_outputs(outputs, _prompt_only) if prompt_only else outputs, params,
                                           rid, created, body, echo, request)

        return await self._respond(prompt, params, rid, body, request, whole, chunks)

    async def _respond(self, prompt: Any, params: SamplingParams, rid: str, body: SamplingBody, request: Request,
                       whole: Any, chunks: Any) -> Any:
        """Stream ``chunks(outputs)`` as SSE, or wait for the final output and return ``whole(output)``."""
        lora = self._check_model(body.model)
        if body.stream:
            return self._sse(chunks(await self._start(prompt, params, rid, body.priority, lora)))
        out = await self._final(prompt, params, rid, body.priority, request, lora)
        if out is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        return whole(out)

    async def _completion_chunks(self, outputs: AsyncGenerator[RequestOutput, None], params: SamplingParams, rid: str,
                                 created: int, body: CompletionRequest, echo: str,
                                 request: Request) -> AsyncIterator[dict]:
        last = None
        async for d in self._deltas(outputs, rid, request, body.logprobs is not None, always_first=body.echo):
            last, c = d.output, d.completion
            lp = self._logprobs_echoed(last, d.logprobs, bool(echo) and d.first, d.text_offset) \
                if d.logprobs is not None else None
            yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [{"index": c.index, "text": (echo if d.first else "") + d.text,
                                "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                   "usage": None}
        if last is not None and (body.stream_options or {}).get("include_usage"):
            yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [], "usage": self._usage(last)}

    # ------------------------------------------------------------------ /v1/chat/completions
    async def _chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        self._check_generates()
        mode = tool_calls.resolve(body.tools, body.tool_choice, body.parallel_tool_calls)
        args = (body.messages, body.add_generation_prompt, mode.tools if mode else None, body.chat_template_kwargs)
        has_images = any(isinstance(m.content, list) and any(p.type == "image_url" for p in m.content)
                         for m in body.messages)
        # (in a thread where an image URL may be fetched; a text-only chat stays on the loop)
        prompt = await asyncio.to_thread(self._chat_prompt, *args) if has_images else self._chat_prompt(*args)
        ids = prompt["prompt_token_ids"]
        if body.kv_transfer_params is not None:
            prompt["kv_transfer_params"] = body.kv_transfer_params
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = body.top_logprobs or 0
        if top and not body.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        params = self._params(body, len(ids), max_tokens, top if body.logprobs else None)
        if mode is not None:
            if params.structured_outputs is None:
                params = params.clone(structured_outputs=tool_calls.constraint(mode))
            elif mode.constrained:
                raise APIError("tool_choice 'required' or a named function already constrains the reply; "
                               "drop response_format / structured_outputs", param="tool_choice")
            # (auto with a response_format: the format wins; calls are still parsed from the text)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        prompt_text = prompt.get("prompt") or ""

        def message(c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
            # (with a reasoning parser, tool calls are read from the answer after the think block)
            reasoning, text = (None, c.text) if self.reasoning is None else self.reasoning.split(c.text, prompt_text)
            content, calls = tool_calls.finished(mode, text or "", c.finish_reason)
            msg: dict[str, Any] = {"role": "assistant", "content": text if calls is None else content}
            if self.reasoning is not None:
                msg["reasoning_content"] = reasoning
            if calls is None:
                return msg, c.finish_reason
            return {**msg, "tool_calls": calls}, "tool_calls"

        def whole(out: RequestOutput) -> dict[str, Any]:
            choices = []
            for c in out.outputs:
                msg, finish = message(c)
                choices.append({"index": c.index, "message": msg,
                                "logprobs": self._logprobs_chat(c, top) if body.logprobs else None,
                                "finish_reason": finish, "stop_reason": c.stop_reason})
            return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": choices, "usage": self._usage(out)}

        return await self._respond(prompt, params, rid, body, request, whole,
                                   lambda outputs: self._chat_chunks(outputs, params, rid, created, body, top,
                                                                     request, mode, prompt_text))

    async def _chat_chunks(self, outputs: AsyncGenerator[RequestOutput, None], params: SamplingParams, rid: str,
                           created: int, body: ChatCompletionRequest, top: int,
                           request: Request, mode: tool_calls.ToolMode | None = None,
                           prompt_text: str = "") -> AsyncIterator[dict]:
        last = None
        sent: dict[int, int] = {}  # with tools: how much of each choice's text went out as content
        # With a reasoning parser: each choice's parser, and its answer so far (the text tools read).
        parsers: dict[int, ReasoningParser] = {}
        answers: dict[int, str] = {}

        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": choices, "usage": usage}

        for i in range(params.n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for d in self._deltas(outputs, rid, request, body.logprobs):
            last, c = d.output, d.completion
            lp = self._logprobs_chat(d.logprobs, top) if d.logprobs is not None else None
            new, text = d.text, c.text  # the answer's new text, and all of it so far
            if self.reasoning is not None:
                parser = parsers.setdefault(c.index, self.reasoning(prompt_text))
                reasoning, new = parser.feed(d.text)
                if c.finish_reason is not None:
                    rest = parser.finish()
                    reasoning, new = reasoning + rest[0], new + rest[1]
                if reasoning:  # (reasoning first: it came first)
                    yield chunk([{"index": c.index, "delta": {"reasoning_content": reasoning}, "logprobs": lp,
                                  "finish_reason": None}])
                    lp = None
                text = answers[c.index] = answers.get(c.index, "") + new
                if not new and c.finish_reason is None:
                    continue  # (a tag held back: nothing for the answer yet)
            if mode is None:
                yield chunk([{"index": c.index, "delta": {"content": new} if new else {}, "logprobs": lp,
                              "finish_reason": c.finish_reason}])
                continue
            # Tools: content goes out only where it cannot be (part of) a call; calls at the end.
            done = sent.get(c.index, 0)
            upto = done if mode.constrained else max(done, tool_calls.holdback(text))
            calls = None
            if c.finish_reason is not None:
                calls = tool_calls.finished(mode, text, c.finish_reason)[1]
                upto = len(text) if calls is None else done
            delta: dict[str, Any] = {"content": text[done:upto]} if upto > done else {}
            sent[c.index] = upto
            if calls is not None:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
            yield chunk([{"index": c.index, "delta": delta, "logprobs": lp,
                          "finish_reason": "tool_calls" if calls is not None else c.finish_reason}])
        if last is not None and (body.stream_options or {}).get("include_usage"):
            yield chunk([], self._usage(last))

    def _sse(self, chunks: AsyncIterator[dict]) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for c in chunks:
                    yield f"data: {json.dumps(c)}\n\n".encode()
            except (ValueError, APIError, EngineDeadError) as e:
                msg = e.message if isinstance(e, APIError) else str(e)
                kind = "ServiceUnavailableError" if isinstance(e, EngineDeadError) else "BadRequestError"
                yield f"data: {json.dumps({'error': {'message': msg, 'type': kind}})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")


def _error_param(message: str) -> str | None:
    """The request field an engine-side error names (``structured_outputs.json ...`` -> ``response_format``
    for OpenAI clients, who sent it there or in ``structured_outputs``)."""
    return "structured_outputs" if message.startswith("structured_outputs") else None


def build_app(engine: EngineClient, model_name: str, api_key: str | None = None,
              chat_template_content_format: str = "auto", media: MediaConnector | None = None,
              reasoning_parser: str | None = None) -> FastAPI:
    return OpenAIServer(engine, model_name, api_key, chat_template_content_format, media, reasoning_parser).app


def serve(engine: EngineClient, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, reuse_port: bool = False, chat_template_content_format: str = "auto",
          exit_on_engine_death: bool = False, media: MediaConnector | None = None,
          reasoning_parser: str | None = None) -> None:
    """Run the server until interrupted, then shut the engine (client) down. ``reuse_port``: bind
    with SO_REUSEPORT, so several server processes share one port (the kernel spreads connections).
    ``exit_on_engine_death``: stop serving and exit with status 1 once the engine has died, so a
    supervisor (systemd ``Restart=on-failure``, a Kubernetes pod) starts a fresh one."""
    import socket
    import threading

    import uvicorn

    app = build_app(engine, model_name, api_key, chat_template_content_format, media, reasoning_parser)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    died = threading.Event()

    def watch() -> None:
        while not server.should_exit:
            if engine.dead_error is not None:
                logger.error("the engine died (%s); exiting (--exit-on-engine-death)", engine.dead_error)
                died.set()
                server.should_exit = True
                return
            time.sleep(0.5)

    if exit_on_engine_death:
        threading.Thread(target=watch, name="pagellm-engine-watch", daemon=True).start()
    try:
        if not reuse_port:
            server.run()
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then re-raised the signal
        pass
    finally:
        engine.shutdown()
    if died.is_set():
        raise SystemExit(1)


def run_api_server(client_index: int, input_addr: str, output_addr: str, core_pid: int, model_name: str,
                   host: str, port: int, api_key: str | None, chat_template_content_format: str = "auto",
                   exit_on_engine_death: bool = False, media: MediaConnector | None = None,
                   reasoning_parser: str | None = None) -> None:
    """One of ``--api-server-count`` front-end processes: an engine-core client with its own index,
    serving HTTP on the shared port."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    client = AsyncEngineClient(input_addr, output_addr, client_index, core_pid)
    client.wait_ready()
    serve(client, model_name, host, port, api_key, reuse_port=True,
          chat_template_content_format=chat_template_content_format, exit_on_engine_death=exit_on_engine_death,
          media=media, reasoning_parser=reasoning_parser)
