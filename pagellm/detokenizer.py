"""Incremental, UTF-8-safe detokenization and stop strings.

Decoding one token at a time breaks multi-byte characters and drops the leading spaces that
depend on the previous token, so each step decodes a short window ``[prefix_offset, end)`` and
emits only what extends the decoded ``[prefix_offset, read_offset)``; an incomplete character
(``U+FFFD`` at the end) is held back until the next token completes it.
"""

from __future__ import annotations

from pagellm.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tail used as left context so the first output token decodes right


class IncrementalDetokenizer:
    """Per-sequence text state; ``step(new_ids)`` returns the text delta."""

    __slots__ = ("tokenizer", "skip_special_tokens", "ids", "prefix_offset", "read_offset", "text", "num_output_tokens")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.num_output_tokens = 0  # generated tokens fed so far

    def step(self, new_token_ids: list[int]) -> str:
        if len(new_token_ids) > 1:  # (token by token: an incomplete last character holds back only itself)
            return "".join([self.step([t]) for t in new_token_ids])
        self.ids.extend(new_token_ids)
        self.num_output_tokens += len(new_token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop_string(text: str, delta_len: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """The earliest stop string that ends inside the last ``delta_len`` characters of ``text``.

    Returns ``(stop, cut)``: the text is truncated to ``text[:cut]`` (the stop string kept only
    when ``include``); ``None`` when no stop string appears.
    """
    hit: tuple[str, int] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
        if idx != -1 and (hit is None or idx < hit[1]):
            hit = (stop, idx)
    if hit is None:
        return None
    stop, idx = hit
    return stop, idx + len(stop) if include else idx
