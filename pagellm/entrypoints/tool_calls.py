"""Tool calling for ``/v1/chat/completions``: ``tools`` + ``tool_choice`` as the OpenAI API has them.

- ``"required"`` and a named function (``{"type": "function", "function": {"name": ...}}``) are
  *constrained*: the reply is grammar-bound JSON, so it always parses and validates. Required: a
  list of ``{"name", "arguments"}`` objects (one if ``parallel_tool_calls`` is false), each
  ``arguments`` under its tool's ``parameters`` schema; named: that tool's arguments object alone.
- ``"auto"`` (the default when tools are given) lets the model choose: the tools are shown to it
  and its reply is parsed for calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (the Hermes / Qwen format). A chat template that takes ``tools`` gets them; one that does not
  (SmolLM2's) gets them in a system message, :func:`tools_system_prompt`. The reply is free text,
  but once it writes ``<tool_call>`` a structural tag constrains the call (a given tool's name,
  then arguments under its schema, then ``}</tool_call>``), so a started call always parses.
- ``"none"``: tools are not shown and no call is parsed.

Earlier turns carry calls as assistant ``tool_calls`` and results as ``tool`` messages; for a
template without tool support they are rendered into text in the same ``<tool_call>`` format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai_protocol import APIError
from pagellm.sampling_params import StructuredOutputsParams

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolMode:
    """What ``tool_choice`` resolved to: ``kind`` is ``auto``, ``required`` or ``named`` (``name`` set)."""

    kind: str
    tools: list[dict[str, Any]]
    name: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.kind in ("required", "named")


def resolve(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None) -> ToolMode | None:
    """Validate ``tools`` / ``tool_choice`` (400s naming the field) and return the mode, or ``None``
    when no tool may be called."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise APIError("tool_choice needs tools", param="tool_choice")
    if not tools or tool_choice == "none":
        return None
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                           "{...}}}}}", param=f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise APIError("tools: function names must be unique", param="tools")
    par = True if parallel is None else bool(parallel)
    if tool_choice in (None, "auto"):
        return ToolMode("auto", tools, parallel=par)
    if tool_choice == "required":
        return ToolMode("required", tools, parallel=par)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise APIError(f"tool_choice names function {name!r}, which is not among tools ({names})",
                           param="tool_choice")
        return ToolMode("named", tools, name=name, parallel=par)
    raise APIError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                   f"{{'name': ...}}}}, got {tool_choice!r}", param="tool_choice")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _ANY_OBJECT


def constraint(mode: ToolMode) -> StructuredOutputsParams:
    """The grammar a mode decodes under (``auto``: free text with structurally tagged calls)."""
    if mode.kind == "auto":
        return StructuredOutputsParams(structural_tag={
            "structures": [{"begin": f'{CALL_OPEN}{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
                            "schema": _parameters(t), "end": "}" + CALL_CLOSE} for t in mode.tools],
            "triggers": [CALL_OPEN]})
    if mode.kind == "named":
        tool = next(t for t in mode.tools if t["function"]["name"] == mode.name)
        return StructuredOutputsParams(json=_parameters(tool))
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in mode.tools]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": item, "minItems": 1}
    if not mode.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """How the tools are described to a model whose chat template has no place for them."""
    listing = "\n".join(json.dumps(t["function"], separators=(",", ":")) for t in tools)
    return ("You can call these functions (JSON signatures):\n" + listing + "\n\nTo call one, reply with "
            f'{CALL_OPEN}{{"name": <function name>, "arguments": <arguments object>}}{CALL_CLOSE} '
            "and nothing else.")


def history_as_text(msg: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """An earlier assistant call or tool result as plain text, for a template without tool support."""
    calls = msg.get("tool_calls")
    if msg.get("role") == "assistant" and calls:
        try:
            text = "".join(CALL_OPEN + json.dumps({"name": c["function"]["name"],
                                                  "arguments": _loads_or_text(c["function"].get("arguments", "{}"))})
                           + CALL_CLOSE for c in calls)
        except (TypeError, KeyError, AttributeError) as e:
            raise APIError(f"messages[{index}].tool_calls must be a list of {{'function': {{'name': ..., "
                           "'arguments': ...}}}}", param=f"messages[{index}].tool_calls") from e
        content = msg["content"] if isinstance(msg.get("content"), str) else ""
        return {"role": "assistant", "content": content + text}
    if msg.get("role") == "tool":
        return {"role": "user",
                "content": f"Result of the call {msg.get('tool_call_id', '')}: {msg.get('content', '')}"}
    return msg


def _loads_or_text(s: Any) -> Any:
    try:
        return json.loads(s) if isinstance(s, str) else s
    except json.JSONDecodeError:
        return s


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def parse(mode: ToolMode, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """``(content, tool_calls)`` of a finished reply: calls when the reply holds valid ones, else
    the text as content and ``None``."""
    if mode.kind == "named":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return text, None  # cut short by max_tokens: the partial arguments stay visible as text
        assert mode.name is not None
        return None, [_call(mode.name, text)]
    names = {t["function"]["name"] for t in mode.tools}
    if mode.kind == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, None
        calls = [_call(c["name"], c["arguments"]) for c in items if isinstance(c, dict) and c.get("name") in names]
        return (None, calls) if calls else (text, None)
    calls = []
    for m in _CALL_RE.finditer(text):
        obj = _loads_or_text(m.group(1))
        if isinstance(obj, dict) and obj.get("name") in names:
            calls.append(_call(obj["name"], obj.get("arguments", {})))
    if not calls:
        return text, None
    before = text[:text.find(CALL_OPEN)].strip()
    return before or None, calls


def finished(mode: ToolMode | None, text: str,
             finish_reason: str | None) -> tuple[str | None, list[dict[str, Any]] | None]:
    """:func:`parse` of a reply that ended with ``finish_reason``: only a reply that stopped by
    itself (not cut by ``max_tokens``) is read for calls; the text and ``None`` otherwise."""
    if mode is None or finish_reason != "stop":
        return text, None
    return parse(mode, text)


def holdback(text: str) -> int:
    """How much of streamed ``text`` may be sent as content in auto mode: everything before a call
    starts, keeping back a tail that could be the beginning of ``<tool_call>``."""
    i = text.find(CALL_OPEN)
    if i >= 0:
        return i
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
