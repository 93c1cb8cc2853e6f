"""pagellm: a readable vLLM-style inference engine that runs well on a CPU.

The names below load on first use (PEP 562): ``import pagellm`` alone costs no torch, so the HTTP
front end, which needs only the package's torch-free modules, stays small.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagellm.entrypoints.llm",
    "EngineArgs": "pagellm.config",
    "LLMEngine": "pagellm.engine.llm_engine",
    "LoRARequest": "pagellm.lora_request",
    "PoolingParams": "pagellm.pooling_params",
    "BeamSearchParams": "pagellm.sampling_params",
    "SamplingParams": "pagellm.sampling_params",
    **{name: "pagellm.outputs" for name in (
        "BeamSearchOutput", "BeamSearchSequence", "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
        "Logprob", "RequestOutput", "ScoringOutput", "ScoringRequestOutput")},
}
__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "EngineArgs", "LLMEngine", "LoRARequest", "Logprob", "PoolingParams",
           "RequestOutput", "SamplingParams", "ScoringOutput", "ScoringRequestOutput"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from pagellm.config import EngineArgs
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.entrypoints.llm import LLM
    from pagellm.lora_request import LoRARequest
    from pagellm.outputs import (
        BeamSearchOutput,
        BeamSearchSequence,
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )
    from pagellm.pooling_params import PoolingParams
    from pagellm.sampling_params import BeamSearchParams, SamplingParams
