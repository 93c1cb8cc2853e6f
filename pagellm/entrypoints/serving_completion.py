"""``POST /v1/completions``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request

from pagellm.entrypoints.openai_protocol import APIError, CompletionRequest
from pagellm.entrypoints.serving_engine import OpenAIServing
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams


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


class OpenAIServingCompletion(OpenAIServing):
    """``POST /v1/completions``: one prompt (text or token ids), echo, legacy logprobs, prompt scoring."""

    async def create_completion(self, body: CompletionRequest, request: Request):
        self.models.check_model(body.model)
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
