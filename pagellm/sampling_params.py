"""Per-request sampling parameters, validated on construction (vLLM's field names)."""

from __future__ import annotations

import json as json_module  # (StructuredOutputsParams has a field named json)
from dataclasses import dataclass, field, fields
from typing import Any

from pagellm.utils import reject_unknown

_GREEDY_EPS = 1e-5
# Top log-probabilities a request may ask for per token (vLLM's default max_logprobs): each one is
# a top-k over the whole vocabulary in the sampler.
MAX_LOGPROBS = 20


# Largest constraint spec accepted (a JSON schema, regex, grammar or the choices together), in
# characters: a bigger one is refused before it reaches a grammar compiler.
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024


def _check_structural_tag(tag: str | dict) -> str:
    """vLLM's structural tag as canonical JSON text, or a ``ValueError`` naming what is wrong."""
    def bad(why: str) -> ValueError:
        return ValueError(f"structured_outputs.structural_tag {why}")

    if isinstance(tag, str):
        try:
            tag = json_module.loads(tag)
        except json_module.JSONDecodeError as e:
            raise bad(f"is not valid JSON: {e}") from e
    if not isinstance(tag, dict):
        raise bad("must be an object with 'structures' and 'triggers'")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise bad("needs a non-empty 'structures' list")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise bad("needs a non-empty 'triggers' list of strings")
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")) \
                or not isinstance(s.get("schema"), (dict, bool)):
            raise bad(f"structures[{i}] needs 'begin' and 'end' strings and a 'schema'")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise bad(f"structures[{i}].begin {s['begin']!r} starts with none of the triggers")
    return json_module.dumps({"structures": structures, "triggers": triggers})


@dataclass(slots=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's ``StructuredOutputsParams``): exactly one of ``json`` (a JSON
    schema, as a dict or its JSON text), ``regex``, ``choice`` (the output is one of these strings),
    ``grammar`` (a Lark grammar, llguidance's dialect; or GBNF/EBNF with the xgrammar backend),
    ``json_object=True`` (any JSON object) or ``structural_tag`` (free text in which each
    ``begin ... end`` segment, entered when a trigger appears, follows its JSON schema; vLLM's
    format as a dict or JSON text: ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``).
    ``whitespace_flexible``: allow any whitespace between JSON tokens (off: compact JSON)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar, json_object, "
                             f"structural_tag must be set, got {given or 'none'}")
        if self.structural_tag is not None:
            self.structural_tag = _check_structural_tag(self.structural_tag)
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or JSON text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
        size = len(self.key()[1])
        if size > MAX_STRUCTURED_SPEC_CHARS:
            raise ValueError(f"structured_outputs: the constraint is {size} characters, more than the limit "
                             f"of {MAX_STRUCTURED_SPEC_CHARS}")

    def key(self) -> tuple[str, str, bool]:
        """``(kind, spec text, whitespace_flexible)``: what a compiled grammar is cached under."""
        if self.json is not None:
            # Not sort_keys: the properties' order is the output's order.
            text = self.json if isinstance(self.json, str) else json_module.dumps(self.json)
            return "json", text, self.whitespace_flexible
        if self.regex is not None:
            return "regex", self.regex, self.whitespace_flexible
        if self.choice is not None:
            return "choice", json_module.dumps(self.choice), self.whitespace_flexible
        if self.grammar is not None:
            return "grammar", self.grammar, self.whitespace_flexible
        if self.structural_tag is not None:
            return "structural_tag", str(self.structural_tag), self.whitespace_flexible
        return "json_object", "", self.whitespace_flexible


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. Field names and defaults follow ``vllm.SamplingParams``.

    ``temperature == 0`` means greedy. ``logprobs=k`` returns the top-k log-probabilities per
    generated token plus the sampled token's own. Unknown keywords raise ``TypeError`` (dataclass).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (pagellm.structured_output): a dict is taken as StructuredOutputsParams' fields.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: the tokenizer's EOS id and every string form of ``stop``.
    eos_token_id: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            reject_unknown("structured_outputs field(s)", self.structured_outputs,
                           {f.name for f in fields(StructuredOutputsParams)})
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            raise bad("best_of", f"must be an integer >= n ({self.n})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be an integer; -1 or 0 disables it")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop or ()):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or ()):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be StructuredOutputsParams or a dict of its fields")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self, **changes: object) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


_FIELDS = {f.name for f in fields(SamplingParams)}
_dataclass_init = SamplingParams.__init__


def _checked_init(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    reject_unknown("sampling parameter(s)", kwargs, _FIELDS)
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _checked_init  # type: ignore[method-assign]


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``, run inside the engine with Hugging Face's beam search rules.

    ``early_stopping`` is HF's: ``False`` (default) stops by HF's heuristic, ``True`` as soon as
    ``beam_width`` hypotheses are finished, ``"never"`` only when no beam can improve.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    include_stop_str_in_output: bool = False
    # Every beam constrained by this (pagellm's addition; beams fork their parent's grammar state).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width: must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError(f"temperature: beam search uses unscaled log-probabilities (0.0), got {self.temperature}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping: must be True, False or 'never', got {self.early_stopping!r}")
