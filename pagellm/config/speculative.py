"""Speculative decoding: the proposer and how many tokens it guesses."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.config.parse import config_dict

SPEC_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: a proposer guesses up to ``num_speculative_tokens`` next
    tokens per sequence, the target model verifies them in one step (docs/spec_decode.md).

    ``ngram``: the latest earlier occurrence of the context's last ``prompt_lookup_max`` ..
    ``prompt_lookup_min`` tokens in the prompt and output; ``suffix``: a suffix tree over the
    request's tokens and the last ``suffix_cache_requests`` finished outputs (SuffixDecoding),
    proposing while a continuation's frequency is at least ``suffix_min_probability``.
    ``draft_model``: a smaller ``model`` with the same tokenizer, run by the same worker with its
    own paged K/V (same block tables), proposes greedily; it writes ``num_speculative_tokens``
    slots ahead (``num_lookahead_tokens``).
    ``cost_model``: choose k per step from measured step times and acceptance (``False``: always
    the full ``num_speculative_tokens``); ``disable_by_batch_size``: no drafts at this many running
    sequences or more (vLLM's ``disable_by_batch_size``; ``None`` = the cost model decides)."""

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_max_depth: int = 24
    suffix_min_probability: float = 0.1
    suffix_cache_requests: int = 256
    cost_model: bool = True
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPEC_METHODS}, got {self.method!r} "
                             "(EAGLE and MTP heads are not built: docs/spec_decode.md)")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config model (the draft model's path) is required with method "
                             f"'draft_model' and only there; got method {self.method!r}, model {self.model!r}")
        if not (isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16):
            raise ValueError(f"speculative_config num_speculative_tokens must be 1..16, "
                             f"got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.suffix_max_depth < 2:
            raise ValueError(f"speculative_config suffix_max_depth must be >= 2, got {self.suffix_max_depth}")
        if not 0.0 <= self.suffix_min_probability <= 1.0:
            raise ValueError(f"speculative_config suffix_min_probability must be in [0, 1], "
                             f"got {self.suffix_min_probability}")
        if self.suffix_cache_requests < 0:
            raise ValueError(f"speculative_config suffix_cache_requests must be >= 0, "
                             f"got {self.suffix_cache_requests}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config disable_by_batch_size must be >= 1, "
                             f"got {self.disable_by_batch_size}")

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots a sampling sequence gets past its scheduled tokens: where a draft model writes
        the K/V of the drafts it proposes."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict (``LLM(speculative_config={...})``) or its JSON text; ``None``: no speculation."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**config_dict(value, "speculative_config", '{"method": "ngram", "num_speculative_tokens": 3}',
                                  cls))
