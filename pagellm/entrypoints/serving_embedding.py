"""``POST /v1/embeddings``."""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagellm.entrypoints.openai_protocol import APIError, EmbeddingRequest
from pagellm.entrypoints.serving_engine import OpenAIServing
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit per request
# What an embedding request runs with (the engine pools the prompt and samples nothing).
EMBED_PARAMS = SamplingParams(max_tokens=1, temperature=0)


class OpenAIServingEmbedding(OpenAIServing):
    """``POST /v1/embeddings`` on a pooling runner: each input pooled, as floats or base64."""

    async def create_embedding(self, body: EmbeddingRequest, request: Request) -> Any:
        lora = self.models.check_model(body.model)
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
        outs = await self._final_many([({"prompt_token_ids": ids}, EMBED_PARAMS, f"{rid}-{i}")
                                       for i, ids in enumerate(inputs)], 0, request, lora, label=None)
        if outs is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        data = []
        for i, out in enumerate(outs):
            assert out.pooled is not None
            vec = params.apply(out.pooled, info)
            emb: Any = vec if body.encoding_format == "float" else \
                base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        n = sum(len(ids) for ids in inputs)
        return {"object": "list", "data": data, "model": body.model or self.model_name,
                "usage": {"prompt_tokens": n, "total_tokens": n}}

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
