"""Scoring text pairs (vLLM's ``LLM.score``, ``/v1/score``, ``/rerank``) on a pooling runner: a
cross-encoder (a one-label classification head) reads each pair as one prompt and its logit's
sigmoid is the score; an embedding model (a bi-encoder) embeds each text and the score is the
cosine similarity of the two vectors. Plain data and arithmetic (no torch): shared by the offline
``LLM`` and the server."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pagellm.pooling_params import PoolingInfo


def score_kind(info: PoolingInfo | None) -> str:
    """``"cross-encoder"`` or ``"bi-encoder"`` for a model that scores, else a ``ValueError``."""
    if info is None:
        raise ValueError("scoring needs a pooling runner (runner='pooling', --runner pooling)")
    if info.num_labels is None:
        return "bi-encoder"
    if info.num_labels == 1:
        return "cross-encoder"
    raise ValueError(f"scoring needs a classification head of one label (this model's has {info.num_labels}) "
                     "or an embedding model")


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one ``text_1`` against each ``text_2``, or two lists of one length zipped."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 must not be empty")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                         "as text_2")
    for field, texts in (("text_1", first), ("text_2", second)):
        for t in texts:
            if not isinstance(t, str):
                raise ValueError(f"{field} must hold strings, got {type(t).__name__}")
    return list(zip(first, second, strict=True))


def pair_token_ids(tokenizer: Any, a: str, b: str) -> list[int]:
    """A cross-encoder's prompt: the pair as its tokenizer joins two texts (``[CLS] a [SEP] b [SEP]``)."""
    return list(tokenizer(a, b)["input_ids"])


def unique_texts(pairs: list[tuple[str, str]]) -> list[str]:
    """A bi-encoder's prompts: each text of the pairs once, in first-seen order."""
    return list(dict.fromkeys(t for pair in pairs for t in pair))


def scores_of(kind: str, pairs: list[tuple[str, str]], vectors: Sequence[Sequence[float]]) -> list[float]:
    """Each pair's score from the pooled vectors of its prompts: a cross-encoder's, one per pair (its
    logit's sigmoid); a bi-encoder's, one per ``unique_texts`` entry (the two texts' cosine)."""
    if kind == "cross-encoder":
        return [sigmoid(v[0]) for v in vectors]
    by_text = dict(zip(unique_texts(pairs), vectors, strict=True))
    return [cosine(by_text[a], by_text[b]) for a, b in pairs]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def cosine(u: Sequence[float], v: Sequence[float]) -> float:
    dot = math.fsum(a * b for a, b in zip(u, v, strict=True))
    norm = math.sqrt(math.fsum(a * a for a in u)) * math.sqrt(math.fsum(b * b for b in v))
    return dot / norm if norm else 0.0
