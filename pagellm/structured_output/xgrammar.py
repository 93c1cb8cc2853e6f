"""The xgrammar backend (vLLM's default): C++, compiles a grammar ahead of time into per-state
token masks. Optional: ``pip install 'pagellm[xgrammar]'`` (it requires torch and, on x86 Linux,
triton; docs/structured_output.md compares the two backends on this project's model)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend import (
    CompiledGrammar,
    GrammarCompileError,
    Matcher,
    StructuredOutputBackend,
)


class _XgrammarMatcher(Matcher):
    __slots__ = ("m",)

    def __init__(self, m: xgr.GrammarMatcher) -> None:
        self.m = m

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.m.fill_next_token_bitmask(torch.from_numpy(bitmask), row)  # shares the numpy memory

    def accept_token(self, token_id: int) -> bool:
        return bool(self.m.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())


class _XgrammarGrammar(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def new_matcher(self) -> Matcher:
        return _XgrammarMatcher(xgr.GrammarMatcher(self.compiled))


# xgrammar 0.2.8 writes a string with minLength / maxLength as a count of `[^"\\\r\n]`, which lets
# raw control characters through (invalid JSON: a random model wrote "\x0e" there); its unbounded
# string rule excludes them, as RFC 8259 does. Same class, control characters excluded.
_BOUNDED_STRING_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _escape_controls_in_bounded_strings(ebnf: str) -> str:
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        super().__init__(hf_tokenizer, vocab_size, eos_token_id)
        stop = [eos_token_id] if eos_token_id is not None else None
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        # One compile thread: the engine's compile pool already runs beside the step loop on 2 cores.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        kind, spec, flexible = params.key()
        try:
            # Compact JSON unless whitespace_flexible, as llguidance writes it (xgrammar's own default
            # without whitespace is ", " and ": ").
            seps = None if flexible else (",", ":")
            if kind == "json":
                grammar = xgr.Grammar.from_json_schema(spec, any_whitespace=flexible, separators=seps)
                compiled = self.compiler.compile_grammar(_escape_controls_in_bounded_strings(str(grammar)))
            elif kind == "json_object":
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=flexible,
                                                             separators=seps)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(spec)
            elif kind == "structural_tag":
                tag = json.loads(spec)
                items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                         for s in tag["structures"]]
                compiled = self.compiler.compile_structural_tag(items, tag["triggers"])
            elif kind == "choice":
                compiled = self.compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in json.loads(spec)))
            else:
                compiled = self.compiler.compile_grammar(spec)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its message
            raise GrammarCompileError(f"structured_outputs.{kind} does not compile: {e}") from e
        return _XgrammarGrammar(compiled)
