"""The grammar library for constrained decoding and the reasoning parser."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pagellm.config.parse import config_dict

ReasoningParserName = Literal["qwen3", "deepseek_r1"]


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """vLLM's ``structured_outputs_config``: the grammar library (``auto`` = llguidance, see
    docs/structured_output.md; ``guidance``; ``xgrammar``, an extra) and how long a constraint may
    take to compile before its request fails."""

    backend: str = "auto"
    compile_timeout_s: float = 30.0
    # vLLM's: a thinking model's grammar constrains only the answer after its ``</think>``.
    reasoning_parser: ReasoningParserName | None = None

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in get_args(ReasoningParserName):
            raise ValueError(f"reasoning_parser must be one of {get_args(ReasoningParserName)}, "
                             f"got {self.reasoning_parser!r}")
        if self.backend not in ("auto", "guidance", "xgrammar"):
            raise ValueError(f"structured_outputs_config backend must be 'auto', 'guidance' or 'xgrammar', "
                             f"got {self.backend!r}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"structured_outputs_config compile_timeout_s must be > 0, got {self.compile_timeout_s}")

    @classmethod
    def from_any(cls, value: StructuredOutputsConfig | dict | str | None) -> StructuredOutputsConfig:
        """From a dict (``LLM(structured_outputs_config={...})``) or its JSON text (the CLI flag)."""
        if value is None or isinstance(value, cls):
            return value or cls()
        return cls(**config_dict(value, "structured_outputs_config", '{"backend": "xgrammar"}', cls))
