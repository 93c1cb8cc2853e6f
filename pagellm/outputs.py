"""What the engine returns: ``RequestOutput`` with one ``CompletionOutput`` per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token, with its rank in the distribution and its decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (``time.monotonic``) of a request's life, for TTFT / TPOT / queue time."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # by recompute or by swap
    num_swaps: int = 0  # preemptions by swap (each one swapped out, later back in)
    # Speculative decoding: steps that verified drafts, tokens drafted, drafts accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence: text, token ids, logprobs and why it ended."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step (cumulative, like vLLM's default)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # ``SamplingParams.prompt_logprobs``: ``None`` for the first prompt token, then per token the
    # token itself and the top-k (vLLM's shape); set once the whole prompt is computed.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # runner="pooling": the prompt's vector once computed.
    pooled: list[float] | None = None
    # Why the request ended without being served (e.g. its structured-output constraint did not
    # compile); ``None`` for every request that ran.
    error: str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class PoolingRequestOutput(Generic[T]):
    """vLLM's: a pooling runner's result for one prompt (or pair), ``outputs`` its vector or score."""

    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """``LLM.embed``'s result for one prompt."""

    __slots__ = ()


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """``LLM.score``'s result for one pair."""

    __slots__ = ()


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished beam (vLLM's shape): ``tokens`` and ``text`` cover prompt and completion."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty, the ranking key
    finish_reason: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""


@dataclass(slots=True)
class BeamSearchOutput:
    """Beam search result of one prompt: ``sequences`` ranked best first."""

    sequences: list[BeamSearchSequence]
