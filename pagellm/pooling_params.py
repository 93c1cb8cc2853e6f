"""Embedding requests (``runner="pooling"``): vLLM's ``PoolingParams``, the runner's resolved setup
(``PoolingInfo``, which crosses process bounds as plain data), and Matryoshka ``dimensions``."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolingInfo:
    """A pooling runner's setup, resolved at start-up (``weights/pooling_setup.py``)."""

    pooling_type: str  # LAST, MEAN or CLS
    normalize: bool
    hidden_size: int
    # Matryoshka embeddings (a request's ``dimensions`` may cut them): the sizes the checkpoint
    # lists, True for any size, False for none.
    matryoshka: list[int] | bool = False
    # A classification head's outputs (a cross-encoder's: one score), else None: an embedding.
    num_labels: int | None = None


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """``dimensions``: keep the first this many values (a Matryoshka model's), normalized again."""

    dimensions: int | None = None

    def check(self, info: PoolingInfo) -> None:
        """A ``ValueError`` naming ``dimensions`` where this model's vectors cannot be cut there."""
        n, size = self.dimensions, info.hidden_size
        if n is None or n == size:
            return
        if not info.matryoshka:
            raise ValueError("dimensions: this model does not support Matryoshka representation (its config "
                             "declares no matryoshka_dimensions)")
        allowed = info.matryoshka if isinstance(info.matryoshka, list) else None
        if not isinstance(n, int) or n < 1 or n > size or (allowed is not None and n not in allowed):
            raise ValueError(f"dimensions must be {'one of ' + str(allowed) if allowed else f'in [1, {size}]'}, "
                             f"got {n!r}")

    def apply(self, vector: list[float], info: PoolingInfo) -> list[float]:
        """``vector`` cut to ``dimensions`` (``check`` first)."""
        self.check(info)
        n = self.dimensions
        if n is None or n == len(vector):
            return vector
        cut = vector[:n]
        if not info.normalize:
            return cut
        norm = math.sqrt(math.fsum(x * x for x in cut)) or 1.0
        return [x / norm for x in cut]
