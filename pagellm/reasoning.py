"""Reasoning output (vLLM's ``--reasoning-parser``): a model that thinks in ``<think> ... </think>``
before it answers gets the two apart, so a client shows only the answer.

Text side (the server): ``ReasoningParser`` turns the completion's text, whole or as stream deltas,
into ``(reasoning, content)``. A tag split across deltas is held back until it is whole, so the
stream and the whole text split the same way (the whole text is one delta)::

    "<think>" "two pl" "us two</thi" "nk>\\n\\nFour."  ->  reasoning "two plus two", content "\\n\\nFour."

- ``qwen3``: the think block is open when the output starts with ``<think>`` or the prompt opened it
  (a template that writes ``<think>`` after the generation prompt); otherwise the output is all
  answer (Qwen3 with ``enable_thinking: false``).
- ``deepseek_r1``: everything up to ``</think>`` is reasoning (R1's template opens the block in the
  prompt; an output ``<think>`` is dropped too).
- Whatever the parser, a prompt whose last tag closed a block (``enable_thinking: false`` writes an
  empty one) is answered without thinking: all content.
- A think block cut by ``max_tokens`` stays reasoning.

Token side (the engine): structured output constrains the answer only (vLLM's rule): the grammar
starts after the ``</think>`` token (``ThinkTokens.answer_start``).
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


class ReasoningParser:
    """One completion's split, fed its text delta by delta (``feed``, then ``finish``)."""

    name = ""
    thinks_by_default = False  # no start tag: reasoning (deepseek_r1) or answer (qwen3)

    def __init__(self, prompt: str = "") -> None:
        self._buf = ""
        # The prompt's last tag opened a block (the template opened it for the model) or closed one
        # (an empty block: thinking turned off), or there is none.
        opened, closed = prompt.rfind(START), prompt.rfind(END)
        self._state = "think" if opened > closed else "content" if closed > opened else "start"

    def feed(self, delta: str) -> tuple[str, str]:
        """``(reasoning, content)`` text this delta makes final."""
        self._buf += delta
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(START):
                self._buf, self._state = head[len(START):], "think"
            elif START.startswith(head):
                return "", ""  # (a tag may still be coming)
            else:
                self._state = "think" if self.thinks_by_default else "content"
        if self._state == "think":
            end = self._buf.find(END)
            if end < 0:
                keep = _partial_tag(self._buf, END)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf, self._state = self._buf[:end], self._buf[end + len(END):], "content"
        if self._state == "content":
            content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back once the completion ended: a cut think block stays reasoning."""
        rest, self._buf = self._buf, ""
        if self._state == "start":
            return (rest, "") if self.thinks_by_default else ("", rest)
        return (rest, "") if self._state == "think" else ("", rest)

    @classmethod
    def split(cls, text: str, prompt: str = "") -> tuple[str | None, str | None]:
        """A whole completion's ``(reasoning, content)``, ``None`` for an empty part."""
        parser = cls(prompt)
        r1, c1 = parser.feed(text)
        r2, c2 = parser.finish()
        return (r1 + r2) or None, (c1 + c2) or None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    thinks_by_default = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (Qwen3ReasoningParser,
                                                                           DeepSeekR1ReasoningParser)}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name]


def _partial_tag(text: str, tag: str) -> int:
    """The length of ``text``'s longest suffix that begins ``tag`` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    """The tokenizer's ids of the two tags (each one token in the models that think)."""

    start: int
    end: int

    @classmethod
    def of(cls, vocab: dict[str, int], parser: str) -> ThinkTokens:
        get_reasoning_parser(parser)
        if START not in vocab or END not in vocab:
            raise ValueError(f"reasoning_parser {parser!r}: the tokenizer has no single {START} / {END} token")
        return cls(vocab[START], vocab[END])

    def answer_start(self, prompt_ids: list[int], output_ids: list[int]) -> int | None:
        """Where the answer begins in ``output_ids``, ``None`` while the model may still be thinking:
        after its ``</think>``, or at once where the prompt's last tag closed a block (a template's
        empty think block: thinking turned off)."""
        if self.end in output_ids:
            return output_ids.index(self.end) + 1
        last_end = _rindex(prompt_ids, self.end)
        return 0 if last_end >= 0 and last_end > _rindex(prompt_ids, self.start) else None


def _rindex(ids: list[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
