"""The base of the OpenAI endpoints' serving classes: request checks, sampling parameters, the
engine's outputs as a final response or a stream."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagellm.config import as_cli_message
from pagellm.engine.protocol import EngineClient, EngineDeadError
from pagellm.entrypoints import tool_calls
from pagellm.entrypoints.chat_utils import MediaConnector, MediaError, extract_images, template_renders_images
from pagellm.entrypoints.openai_protocol import APIError, ChatMessage, SamplingBody, normalize_message
from pagellm.lora_request import LoRARequest
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.tokenizer import check_token_ids
from pagellm.utils import reject_unknown

if TYPE_CHECKING:
    from pagellm.entrypoints.server_metrics import ServerMetrics
    from pagellm.entrypoints.serving_models import OpenAIServingModels

logger = logging.getLogger(__name__)


# Request limits beyond what the engine checks (each a 400 naming the field): a request could
# otherwise make every step scan a huge stop list, or fork a huge number of sequences.
MAX_STOP_STRINGS = 64
MAX_N = 128
DISCONNECT_POLL_S = 1.0  # a stream's fallback disconnect check (``OpenAIServing._stream``)


@dataclass(frozen=True, slots=True)
class Delta:
    """What one completion of a streamed request has new since its last chunk."""

    output: RequestOutput
    completion: CompletionOutput
    text: str  # the new text
    logprobs: CompletionOutput | None  # only the new tokens, with their logprobs (if asked for)
    first: bool  # this completion's first chunk
    text_offset: int  # where ``text`` starts in the completion's whole text


def _error_param(message: str) -> str | None:
    """The request field an engine-side error names (``structured_outputs.json ...`` -> ``response_format``
    for OpenAI clients, who sent it there or in ``structured_outputs``)."""
    return "structured_outputs" if message.startswith("structured_outputs") else None


def _tools_in_messages(msgs: list[dict[str, Any]], text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The conversation with the tools described in a system message (added, or the one it has
    extended), and the same with them led into its first user message instead."""
    if msgs[0]["role"] == "system" and isinstance(msgs[0].get("content"), str):
        system = [{**msgs[0], "content": msgs[0]["content"] + "\n\n" + text}] + msgs[1:]
    else:
        system = [{"role": "system", "content": text}] + msgs
    told = list(msgs)
    for i, m in enumerate(told):
        if m["role"] == "user" and isinstance(m.get("content"), str):
            told[i] = {**m, "content": text + "\n\n" + m["content"]}
            break
    return system, told


def _error_of(out: RequestOutput | None) -> str | None:
    return None if out is None else out.error


class OpenAIServing:
    """What every endpoint shares (vLLM's ``OpenAIServing``): the engine, the served names, request
    checks, sampling parameters from a request body, the chat template, and the engine's outputs as
    a final response or as per-completion deltas for SSE."""

    def __init__(self, engine: EngineClient, models: OpenAIServingModels, metrics: ServerMetrics,
                 chat_template_content_format: str = "auto", media: MediaConnector | None = None,
                 tool_parser: tool_calls.ToolCallParser = tool_calls.PARSERS["hermes"]) -> None:
        self.engine = engine
        self.tool_parser = tool_parser  # --tool-call-parser: how the model writes calls
        self.models = models
        self.model_name = models.model_name
        self.metrics = metrics
        self.content_format = chat_template_content_format
        self.media = media or MediaConnector()  # image URLs' rules (--allowed-local-media-path, ...)
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len

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
        told = None  # the conversation with the tools told in its first user message instead
        if not self.tokenizer.template_takes_tools:
            msgs = [tool_calls.history_as_text(m, i, self.tool_parser) for i, m in enumerate(msgs)]
            if tools:
                msgs, told = _tools_in_messages(msgs, tool_calls.tools_system_prompt(tools, self.tool_parser))
                tools = None
        try:
            try:
                prompt = self.tokenizer.chat_prompt(msgs, add_generation_prompt, tools, template_kwargs)
            except Exception:
                if told is None:
                    raise
                # a template that refuses the system role (Mistral's first ones): the user turn says it
                prompt = self.tokenizer.chat_prompt(told, add_generation_prompt, None, template_kwargs)
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
                    self.metrics.record(out)
                yield out
        finally:
            await outputs.aclose()

    async def _final(self, prompt: Any, params: SamplingParams, rid: str, priority: int,
                     request: Request, lora: LoRARequest | None = None) -> RequestOutput | None:
        """Non-streaming: the final output, or ``None`` (request aborted) if the client went away."""
        outs = await self._final_many([(prompt, params, rid)], priority, request, lora)
        return None if outs is None else outs[0]

    async def _final_many(self, jobs: list[tuple[Any, SamplingParams, str]], priority: int, request: Request,
                          lora: LoRARequest | None = None, label: str | None = "prompt") -> list[RequestOutput] | None:
        """Non-streaming, several engine requests admitted together (a batched completion, an
        embedding's inputs): their final outputs in order, or ``None`` if the client went away. An
        error in one aborts the others and is a 400, naming its index (``label i: ``) where there are
        several and ``label`` is given."""
        async def collect(prompt: Any, params: SamplingParams, rid: str) -> RequestOutput | None:
            last = None
            async for out in self.engine.generate(prompt, params, rid, priority, lora):
                last = out
                if out.error is not None:
                    break  # (the request is over; the others are aborted below)
            if last is not None and last.error is None:
                self.metrics.record(last)
            return last

        tasks = [asyncio.ensure_future(collect(*job)) for job in jobs]
        try:
            while not all(t.done() for t in tasks):
                if await request.is_disconnected():
                    logger.info("client of %s disconnected: aborting", jobs[0][2])
                    return None  # (the finally cancels the streams, which aborts the requests)
                failed = [t for t in tasks if t.done() and (t.exception() is not None or _error_of(t.result()))]
                if failed:
                    break
                await asyncio.wait([t for t in tasks if not t.done()], timeout=0.2,
                                   return_when=asyncio.FIRST_COMPLETED)
            outs: list[RequestOutput] = []
            for i, t in enumerate(tasks):
                if not t.done():
                    continue
                where = f"{label} {i}: " if label and len(jobs) > 1 else ""
                try:
                    out = t.result()
                except ValueError as e:
                    raise APIError(where + as_cli_message(str(e))) from e
                if out is not None and out.error is not None:
                    raise APIError(where + out.error, param=_error_param(out.error))
                if out is None:
                    return None
                outs.append(out)
            return outs
        finally:
            for t in tasks:
                t.cancel()  # ends an unfinished engine stream, which aborts its request

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

    def _check_generates(self) -> None:
        if self.engine.pooling is not None:
            raise APIError("this server embeds (--runner pooling): use POST /v1/embeddings", param="model")

    async def _respond(self, prompt: Any, params: SamplingParams, rid: str, body: SamplingBody, request: Request,
                       whole: Any, chunks: Any) -> Any:
        """Stream ``chunks(outputs)`` as SSE, or wait for the final output and return ``whole(output)``."""
        lora = self.models.check_model(body.model)
        if body.stream:
            return self._sse(chunks(await self._start(prompt, params, rid, body.priority, lora)))
        out = await self._final(prompt, params, rid, body.priority, request, lora)
        if out is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        return whole(out)

    @staticmethod
    def _usage(out: RequestOutput) -> dict[str, int]:
        p = len(out.prompt_token_ids)
        g = sum(len(c.token_ids) for c in out.outputs)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

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
