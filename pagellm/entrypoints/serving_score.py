"""``POST /v1/score`` and ``POST /rerank`` (vLLM's shapes) on a pooling runner: a cross-encoder
scores each pair as one prompt, an embedding model by the cosine of the two texts' vectors
(``pagellm/scoring.py``)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagellm import scoring
from pagellm.entrypoints.openai_protocol import APIError, RerankRequest, ScoreRequest
from pagellm.entrypoints.serving_embedding import EMBED_PARAMS
from pagellm.entrypoints.serving_engine import OpenAIServing

MAX_SCORE_PAIRS = 2048  # (as many as an embedding request's inputs)


class OpenAIServingScores(OpenAIServing):
    """``/v1/score`` (also ``/score``) and ``/rerank`` (also ``/v1/rerank``, ``/v2/rerank``)."""

    async def create_score(self, body: ScoreRequest, request: Request) -> Any:
        lora = self.models.check_model(body.model)
        try:
            pairs = scoring.score_pairs(body.text_1, body.text_2)
        except ValueError as e:
            raise APIError(str(e), param="text_1") from None
        result = await self._scores(pairs, request, lora, "text_2")
        if result is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        scores, tokens = result
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": body.model or self.model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def create_rerank(self, body: RerankRequest, request: Request) -> Any:
        lora = self.models.check_model(body.model)
        if not body.documents:
            raise APIError("documents must not be empty", param="documents")
        if body.top_n is not None and body.top_n < 0:
            raise APIError(f"top_n must be >= 0, got {body.top_n}", param="top_n")
        result = await self._scores([(body.query, d) for d in body.documents], request, lora, "documents")
        if result is None:
            return Response(status_code=499)
        scores, tokens = result
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or self.model_name,
                "usage": {"total_tokens": tokens},
                "results": [{"index": i, "relevance_score": scores[i]}
                            | ({"document": {"text": body.documents[i]}} if body.return_documents else {})
                            for i in order]}

    async def _scores(self, pairs: list[tuple[str, str]], request: Request, lora: Any,
                      param: str) -> tuple[list[float], int] | None:
        """Each pair's score and the prompt tokens read, or ``None`` if the client went away."""
        try:
            kind = scoring.score_kind(self.engine.pooling)
        except ValueError as e:
            raise APIError(str(e), param="model") from None
        if len(pairs) > MAX_SCORE_PAIRS:
            raise APIError(f"at most {MAX_SCORE_PAIRS} pairs, got {len(pairs)}", param=param)
        hf = self.tokenizer.hf
        texts = [scoring.pair_token_ids(hf, a, b) for a, b in pairs] if kind == "cross-encoder" else \
            [self.tokenizer.encode(t) for t in scoring.unique_texts(pairs)]
        for i, ids in enumerate(texts):
            if len(ids) >= self.max_model_len:
                raise APIError(f"text {i} has {len(ids)} tokens; this model reads at most {self.max_model_len - 1}",
                               param=param)
        rid = f"score-{uuid.uuid4().hex}"
        outs = await self._final_many([({"prompt_token_ids": ids}, EMBED_PARAMS, f"{rid}-{i}")
                                       for i, ids in enumerate(texts)], 0, request, lora)
        if outs is None:
            return None
        return scoring.scores_of(kind, pairs, [o.pooled or [] for o in outs]), sum(len(ids) for ids in texts)
