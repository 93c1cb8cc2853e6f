"""The llguidance backend (``"guidance"``, the default): Rust, 3 MB, no dependencies.

llguidance compiles lazily (the lexer is built as tokens are asked for), so "compiling" a
constraint here means building its grammar and one template matcher, which catches every error a
constraint can have up front; each sequence then gets a ``deep_copy`` of the template.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend import (
    CompiledGrammar,
    GrammarCompileError,
    Matcher,
    StructuredOutputBackend,
)


class _GuidanceMatcher(Matcher):
    __slots__ = ("m",)

    def __init__(self, m: llguidance.LLMatcher) -> None:
        self.m = m

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self.m, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.m.consume_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.m.is_stopped())


class _GuidanceGrammar(CompiledGrammar):
    def __init__(self, template: llguidance.LLMatcher) -> None:
        self.template = template

    def new_matcher(self) -> Matcher:
        return _GuidanceMatcher(self.template.deep_copy())


def _lark_literal(text: str) -> str:
    return json.dumps(text)  # Lark string literals take JSON's escapes


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        super().__init__(hf_tokenizer, vocab_size, eos_token_id)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        # llguidance's default parser limits (lexer fuel per step, lexer states, grammar size) bound
        # what one grammar may cost: a pathological one fails with an error instead of stalling a step.
        self.limits = llguidance.LLParserLimits()

    @staticmethod
    def grammar_text(kind: str, spec: str, whitespace_flexible: bool) -> str:
        """The constraint (``StructuredOutputsParams.key()``) as an llguidance grammar (JSON schema,
        regex or Lark)."""
        defaults: Any = {"whitespace_flexible": whitespace_flexible}  # llguidance's JsonCompileOptions (a TypedDict)
        if kind == "json":
            try:
                schema = json.loads(spec)
            except json.JSONDecodeError as e:
                raise GrammarCompileError(f"structured_outputs.json is not valid JSON: {e}") from e
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=defaults)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "structural_tag":
            tag = json.loads(spec)
            tags = [llguidance.StructTag(trigger=next(t for t in tag["triggers"] if s["begin"].startswith(t)),
                                         begin=s["begin"], grammar=s["schema"], end=s["end"])
                    for s in tag["structures"]]
            # assume_special=False: a trigger like "<tool_call>" is text here, not a special token.
            return llguidance.StructTag.to_grammar(tags, assume_special=False)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(_lark_literal(c) for c in json.loads(spec)))
        return llguidance.LLMatcher.grammar_from_lark(spec)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        key = params.key()
        kind = key[0]
        try:
            grammar = self.grammar_text(*key)
        except GrammarCompileError:
            raise
        except Exception as e:  # llguidance raises ValueError / RuntimeError with its message
            raise GrammarCompileError(f"structured_outputs.{kind} does not compile: {e}") from e
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if m.is_error():
            raise GrammarCompileError(f"structured_outputs.{kind} does not compile: {m.get_error()}")
        return _GuidanceGrammar(m)
