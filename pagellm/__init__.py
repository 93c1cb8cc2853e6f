"""pagellm: a readable vLLM-style inference engine that runs well on a CPU."""

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

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "EngineArgs", "LLMEngine", "LoRARequest", "Logprob", "PoolingParams",
           "RequestOutput", "SamplingParams", "ScoringOutput", "ScoringRequestOutput"]
