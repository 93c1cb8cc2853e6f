"""Images in prompts: limits, the processor's cache, media sources, the encoder's budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagellm.config.parse import config_dict
from pagellm.utils import reject_unknown


@dataclass(frozen=True, slots=True)
class MultiModalConfig:
    """Images in prompts (a vision-language model; ignored by a text model): how many per prompt,
    the processor's output cache, where local files may come from, the encoder's per-step budget
    and cache, in placeholder tokens (``None``: ``max_num_batched_tokens``, as vLLM)."""

    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 16})
    # Processed images kept by content hash; 0 turns every cross-request reuse of an image off (the
    # processor's output and the encoder's: each request then encodes its own images).
    mm_processor_cache_gb: float = 4.0
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = True  # http(s) image URLs (fetched with a timeout and a size limit)
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None

    def __post_init__(self) -> None:
        reject_unknown("limit_mm_per_prompt modality", self.limit_mm_per_prompt, {"image"})
        for k, v in self.limit_mm_per_prompt.items():
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"limit_mm_per_prompt[{k!r}] must be an int >= 0, got {v!r}")
        if self.mm_processor_cache_gb < 0:
            raise ValueError(f"mm_processor_cache_gb must be >= 0, got {self.mm_processor_cache_gb}")
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")

    @classmethod
    def from_any(cls, limit: dict | str | None, **kwargs: Any) -> MultiModalConfig:
        if limit is None:
            return cls(**kwargs)
        return cls(limit_mm_per_prompt=config_dict(limit, "limit_mm_per_prompt", '{"image": 4}', None), **kwargs)
