"""Pooling a prompt's final hidden states into one vector (``runner="pooling"``), chunk by chunk.

A prompt is prefilled in chunks, so the pooler keeps per sequence what its later chunks need:
``MEAN`` a float64 running sum (float64, so the sum's bits do not depend on where the chunks were
cut: batched or alone, the same vector), ``CLS`` the first position's row. ``LAST`` needs only the
last chunk's last row. The chunk that reaches the prompt's end returns the vector, normalized
(L2) where the config says so."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class Pooler:
    """``head``: what the pooled vector goes through last (a classifier's projection), if anything."""

    def __init__(self, pooling_type: str, normalize: bool,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.pooling_type = pooling_type
        self.normalize = normalize
        self.head = head
        self._partial: dict[int, torch.Tensor] = {}  # seq_id -> MEAN's running sum or CLS's row

    def chunk(self, seq_id: int, rows: torch.Tensor, start: int, prompt_len: int) -> torch.Tensor | None:
        """Take a chunk's hidden rows (positions ``start ...``); the pooled vector (float32) at the
        chunk that ends the prompt, else ``None``."""
        if start == 0:  # a prompt computed again after a preemption starts over
            self._partial.pop(seq_id, None)
        if self.pooling_type == "MEAN":
            total = rows.double().sum(0)
            if seq_id in self._partial:
                total += self._partial[seq_id]
            self._partial[seq_id] = total
        elif self.pooling_type == "CLS" and start == 0:
            self._partial[seq_id] = rows[0].float()
        if start + rows.shape[0] < prompt_len:
            return None
        if self.pooling_type == "LAST":
            vec = rows[-1].float()
        else:
            kept = self._partial.pop(seq_id)
            vec = (kept / prompt_len).float() if self.pooling_type == "MEAN" else kept
        if self.head is not None:
            vec = self.head(vec[None])[0].float()
        return F.normalize(vec.double(), dim=0).float() if self.normalize else vec

    def forget(self, seq_id: int) -> None:
        self._partial.pop(seq_id, None)
