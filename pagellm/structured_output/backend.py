"""One small interface over the grammar libraries: compile a constraint, then per sequence a
matcher that fills bitmask rows and accepts tokens.

Bitmasks are numpy ``int32 [rows, ceil(vocab_size / 32)]``, bit ``t % 32`` of word ``t // 32`` set
when token ``t`` is allowed: the layout both llguidance and xgrammar fill, and the one
``pagellm.sampling.sampler.apply_token_bitmask`` reads.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from pagellm.sampling_params import StructuredOutputsParams

BACKENDS = ("auto", "guidance", "xgrammar")


class GrammarCompileError(ValueError):
    """The constraint does not compile (a bad schema, regex or grammar, or one the backend does not support)."""


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """Every token allowed (all bits set) until a matcher fills its row."""
    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


class Matcher(abc.ABC):
    """The grammar state of one sequence: which tokens may come next, and the tokens taken so far."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; ``False`` if the grammar forbids it (the state is unchanged)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and took its end (EOS): nothing more may be generated."""


class CompiledGrammar(abc.ABC):
    """A compiled constraint; thread-safe to share, one ``Matcher`` per sequence."""

    @abc.abstractmethod
    def new_matcher(self) -> Matcher: ...


class StructuredOutputBackend(abc.ABC):
    """Compiles ``StructuredOutputsParams`` for one tokenizer and vocabulary size (the model's logits
    width, which may exceed the tokenizer's: padded ids are never allowed)."""

    name: str

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    @abc.abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Raises ``GrammarCompileError`` naming the problem."""

