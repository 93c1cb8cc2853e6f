"""``POST /v1/chat/completions``."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request

from pagellm.engine.protocol import EngineClient
from pagellm.entrypoints import tool_calls
from pagellm.entrypoints.chat_utils import MediaConnector
from pagellm.entrypoints.openai_protocol import APIError, ChatCompletionRequest
from pagellm.entrypoints.server_metrics import ServerMetrics
from pagellm.entrypoints.serving_engine import OpenAIServing
from pagellm.entrypoints.serving_models import OpenAIServingModels
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.reasoning import ReasoningParser, get_reasoning_parser
from pagellm.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    """``POST /v1/chat/completions``: the chat template, tool calls, a reasoning model's think block."""

    def __init__(self, engine: EngineClient, models: OpenAIServingModels, metrics: ServerMetrics,
                 chat_template_content_format: str = "auto", media: MediaConnector | None = None,
                 reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> None:
        super().__init__(engine, models, metrics, chat_template_content_format, media,
                         tool_calls.get_parser(tool_call_parser))
        # --reasoning-parser: chat replies' think block as reasoning_content, apart from the answer.
        self.reasoning = None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request):
        self.models.check_model(body.model)
        self._check_generates()
        mode = tool_calls.resolve(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_parser)
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
            if params.structured_outputs is not None and mode.constrained:
                raise APIError("tool_choice 'required' or a named function already constrains the reply; "
                               "drop response_format / structured_outputs", param="tool_choice")
            bound = tool_calls.constraint(mode)  # (None: auto mode in a format no schema binds)
            if params.structured_outputs is None and bound is not None:
                params = params.clone(structured_outputs=bound)
            # (auto with a response_format: the format wins; calls are still parsed from the text)
            if mode.kind == "auto" and mode.parser.keeps_special:
                params = params.clone(skip_special_tokens=False)  # (the call's tag is a special token)
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
            upto = done if mode.constrained else max(done, tool_calls.holdback(text, mode.parser.trigger))
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
