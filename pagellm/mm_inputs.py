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


@dataclass(frozen=True, slots=True)
class BlockKeys:
    """What a request's prefix-cache block hashes include besides tokens (vLLM's extra keys):
    ``first`` (the cache salt, the adapter) in block 0's, and each image's hash in the hash of every
    block its placeholders overlap. Hashes chain, so every block after an image is keyed by it,
    while blocks before the first image stay shareable with requests that show other images."""

    first: str | None
    images: tuple[tuple[int, int, str], ...]  # (offset, end, mm_hash)

    def key(self, i: int, block_size: int) -> str | None:
        lo, hi = i * block_size, (i + 1) * block_size
        hashes = [h for offset, end, h in self.images if offset < hi and lo < end]
        first = self.first if i == 0 else None
        if not hashes:
            return first
        return f"{first or ''}\x00mm:" + ",".join(hashes)
