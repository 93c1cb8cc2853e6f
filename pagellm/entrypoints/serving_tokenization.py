"""``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

from typing import Any

from pagellm.entrypoints.openai_protocol import APIError, DetokenizeRequest, TokenizeRequest
from pagellm.entrypoints.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """``POST /tokenize`` (a prompt, or messages through the chat template) and ``POST /detokenize``."""

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.models.check_model(body.model)
        if body.messages is not None:
            ids = self._chat_prompt(body.messages)["prompt_token_ids"]
        elif body.prompt is not None:
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError("either prompt or messages is required", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        self.models.check_model(body.model)
        self._check_token_ids(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens, False)}
