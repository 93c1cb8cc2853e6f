"""A request's images as the engine carries them (vLLM's ``MultiModalFeatureSpec``): plain data.

Each image is known by its content hash (``mm_hash``: two requests with the same image share its
encoder output, and the hash enters the prefix cache's keys), occupies ``length`` placeholder
tokens of the prompt from ``offset`` on, and carries what its processor made of it for the
encoder (``data``: pixel values, opaque above the worker).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, eq=False)
class MultiModalFeature:
    mm_hash: str
    offset: int  # the first placeholder token's position in the prompt
    length: int  # placeholder tokens: the encoder's output rows for this image
    data: Any = None
    modality: str = "image"
    # M-RoPE (Qwen2-VL): the image's (temporal, height, width) grid in text-model rows, else None.
    mrope_grid: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether tokens ``[start, end)`` include any of this image's placeholders."""
        return self.offset < end and start < self.end
