"""``POST /v1/completions``."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

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


@dataclass
class _Prompt:
    """One prompt of a completion request (a batched one has several), ready for the engine."""

    prompt: dict[str, Any]
    params: SamplingParams
    echo: str  # the prompt's text, put before each completion when asked
    prompt_only: bool  # max_tokens=0 with echo: score the prompt, drop the one sampled token
    first_index: int  # its choices are first_index ... first_index + n - 1 (prompt by prompt)


async def _merged(streams: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """The chunks of several streams as each comes; an error in one ends all (their requests abort)."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield chunk
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[dict]) -> None:
        try:
            async for chunk in stream:
                await queue.put(chunk)
            await queue.put(done)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put(e)
    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


def _of_prompt(e: APIError, i: int) -> APIError:
    """``e`` as the error of prompt ``i`` of a batched request (a 400 naming its index)."""
    return APIError(f"prompt {i}: {e.message}", e.status, e.type, e.param, e.code)


def _sum_usage(usages: list[dict[str, int]]) -> dict[str, int]:
    return {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


class OpenAIServingCompletion(OpenAIServing):
    """``POST /v1/completions``: prompts (text or token ids, one or a list), echo, legacy logprobs,
    prompt scoring. Each prompt of a list is its own engine request, all admitted together; prompt
    i's choices are indexed i * n ... i * n + n - 1, as in OpenAI's API and vLLM."""

    async def create_completion(self, body: CompletionRequest, request: Request):
        lora = self.models.check_model(body.model)
        self._check_generates()
        prompts = self._completion_prompts(body.prompt)
        if len(prompts) > 1 and body.kv_transfer_params is not None:
            raise APIError(f"kv_transfer_params takes one prompt, got {len(prompts)}", param="kv_transfer_params")
        jobs = [self._prepare(body, p, i, len(prompts)) for i, p in enumerate(prompts)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        rids = [rid] if len(jobs) == 1 else [f"{rid}-{i}" for i in range(len(jobs))]
        if body.stream:
            streams = await self._start_all(jobs, rids, body.priority, lora)
            return self._sse(self._batch_chunks(jobs, streams, rids, rid, created, body, request))
        outs = await self._final_many([(j.prompt, j.params, r) for j, r in zip(jobs, rids, strict=True)],
                                      body.priority, request, lora)
        if outs is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        outs = [_prompt_only(o) if j.prompt_only else o for j, o in zip(jobs, outs, strict=True)]
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [c for j, out in zip(jobs, outs, strict=True) for c in self._choices(j, out, body)],
                "usage": _sum_usage([self._usage(out) for out in outs])}

    def _prepare(self, body: CompletionRequest, prompt: dict[str, Any], i: int, count: int) -> _Prompt:
        """Prompt ``i``'s token ids and sampling parameters; an error is a 400 naming its index when
        the request has several."""
        try:
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
            params = self._params(body, len(ids), 1 if prompt_only else max_tokens, body.logprobs, body.best_of,
                                  scored)
            if body.stream and params.best_of and params.best_of > params.n:
                raise APIError("best_of > n cannot be streamed", param="best_of")
        except APIError as e:
            if count == 1:
                raise
            raise _of_prompt(e, i) from None
        echo = ""  # only when asked are the ids decoded
        if body.echo:
            echo = prompt["prompt"] if prompt["prompt"] is not None else self.tokenizer.decode(ids, False)
        return _Prompt(prompt, params, echo, prompt_only, i * body.n)

    def _choices(self, job: _Prompt, out: RequestOutput, body: CompletionRequest) -> list[dict[str, Any]]:
        choices: list[dict[str, Any]] = [{"index": job.first_index + c.index, "text": job.echo + c.text,
                                          "logprobs": self._logprobs_echoed(out, c, body.echo, len(job.echo)),
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                                         for c in out.outputs]
        if body.prompt_logprobs is not None:
            for choice in choices:
                choice["prompt_logprobs"] = _prompt_logprobs_json(out)
        return choices

    async def _start_all(self, jobs: list[_Prompt], rids: list[str], priority: int,
                         lora: Any) -> list[AsyncGenerator[RequestOutput, None]]:
        """Every prompt's stream, each past its first output; if one is refused, the others are
        closed (aborted) and the refusal is a 400 naming its index."""
        started = await asyncio.gather(*(self._start(j.prompt, j.params, r, priority, lora)
                                          for j, r in zip(jobs, rids, strict=True)), return_exceptions=True)
        failed = [(i, e) for i, e in enumerate(started) if isinstance(e, BaseException)]
        if not failed:
            return started  # type: ignore[return-value]
        for stream in started:
            if not isinstance(stream, BaseException):
                await stream.aclose()
        i, e = failed[0]
        if len(jobs) > 1 and isinstance(e, APIError):
            raise _of_prompt(e, i) from None
        raise e

    async def _batch_chunks(self, jobs: list[_Prompt], streams: list[AsyncGenerator[RequestOutput, None]],
                            rids: list[str], rid: str, created: int, body: CompletionRequest,
                            request: Request) -> AsyncIterator[dict]:
        lasts: list[RequestOutput | None] = [None] * len(jobs)
        parts = [self._completion_chunks(_map_outputs(s, _prompt_only) if j.prompt_only else s, r, rid, created,
                                         body, j, request, lasts, i)
                 for i, (j, s, r) in enumerate(zip(jobs, streams, rids, strict=True))]
        async for chunk in _merged(parts):
            yield chunk
        if all(last is not None for last in lasts) and (body.stream_options or {}).get("include_usage"):
            yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [], "usage": _sum_usage([self._usage(last) for last in lasts if last is not None])}

    def _completion_prompts(self, prompt: Any) -> list[dict[str, Any]]:
        """The prompts of a request: a string, token ids, or a list of either."""
        if isinstance(prompt, str):
            return [{"prompt": prompt}]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [{"prompt_token_ids": list(prompt)}]
        prompts = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]
        for i, p in enumerate(prompts):
            if not (p.get("prompt") or p.get("prompt_token_ids")):
                raise APIError(f"prompt {i}: must not be empty", param="prompt")
        return prompts

    async def _completion_chunks(self, outputs: AsyncGenerator[RequestOutput, None], engine_rid: str, rid: str,
                                 created: int, body: CompletionRequest, job: _Prompt, request: Request,
                                 lasts: list[RequestOutput | None], slot: int) -> AsyncIterator[dict]:
        """One prompt's chunks (its choices' indexes offset by ``job.first_index``); its last output
        goes to ``lasts[slot]`` for the usage."""
        echo = job.echo
        async for d in self._deltas(outputs, engine_rid, request, body.logprobs is not None, always_first=body.echo):
            lasts[slot], c = d.output, d.completion
            lp = self._logprobs_echoed(d.output, d.logprobs, bool(echo) and d.first, d.text_offset) \
                if d.logprobs is not None else None
            yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [{"index": job.first_index + c.index, "text": (echo if d.first else "") + d.text,
                                "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                   "usage": None}

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
