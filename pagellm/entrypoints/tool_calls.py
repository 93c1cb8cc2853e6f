"""Tool calling for ``/v1/chat/completions``: ``tools`` + ``tool_choice`` as the OpenAI API has them.

- ``"required"`` and a named function (``{"type": "function", "function": {"name": ...}}``) are
  *constrained*: the reply is grammar-bound JSON, so it always parses and validates. Required: a
  list of ``{"name", "arguments"}`` objects (one if ``parallel_tool_calls`` is false), each
  ``arguments`` under its tool's ``parameters`` schema; named: that tool's arguments object alone.
- ``"auto"`` (the default when tools are given) lets the model choose: the tools are shown to it
  and its reply is parsed for calls in its family's format, the server's ``--tool-call-parser``
  (vLLM's names, :data:`PARSERS`): ``hermes`` (Qwen 2.5/3, Hermes; the default)
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, ``llama3_json`` (Llama 3.x)
  ``{"name": ..., "parameters": {...}}`` with ``; `` between calls, ``mistral``
  ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, ``granite`` ``<|tool_call|>[...]``,
  ``qwen3_coder`` (Qwen3-Coder, Qwen3.5) XML, :class:`XmlToolCallParser`. A chat template that takes ``tools``
  gets them; one that does not (SmolLM2's) gets them in a system message,
  :func:`tools_system_prompt` (or, where the template refuses a system role, in the first user
  message). The reply is free text, but once it starts a call a structural tag constrains it (a
  given tool's name, then arguments under its schema, then the format's closing text), so a
  started call always parses (the JSON formats; ``qwen3_coder``'s XML is parsed only).
- ``"none"``: tools are not shown and no call is parsed.

Earlier turns carry calls as assistant ``tool_calls`` and results as ``tool`` messages; for a
template without tool support they are rendered into text in the parser's format.
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
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolCallParser:
    """How one model family writes calls in free text: ``open`` + a call object (or, ``in_list``, a
    JSON list of them) + ``close``; the object's arguments under ``key``; calls written one after
    another are joined by ``separator``. ``keeps_special``: ``open`` is a special token the
    detokenizer must keep (Mistral's ``[TOOL_CALLS]``), as vLLM's parser asks."""

    name: str
    open: str
    close: str
    key: str = "arguments"
    in_list: bool = False
    separator: str = ""
    keeps_special: bool = False

    @property
    def trigger(self) -> str:
        """The text that starts a call (a tag, or Llama's bare JSON object)."""
        return self.open or '{"name"'

    def structures(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The structural tag's entries: each tool's call up to its arguments, which its schema binds."""
        lb, rb = ("[", "]") if self.in_list else ("", "")
        return [{"begin": f'{self.open}{lb}{{"name": {json.dumps(t["function"]["name"])}, "{self.key}": ',
                 "schema": _parameters(t), "end": "}" + rb + self.close} for t in tools]

    def render(self, calls: list[tuple[str, Any]]) -> str:
        """``(name, arguments)`` calls as this family's model writes them."""
        objs = [json.dumps({"name": name, self.key: args}) for name, args in calls]
        if self.in_list:
            return self.open + "[" + ", ".join(objs) + "]" + self.close
        return self.separator.join(self.open + o + self.close for o in objs)

    def parse(self, text: str, names: set[str],
              schemas: dict[str, dict[str, Any]] | None = None) -> tuple[str | None, list[dict[str, Any]] | None]:
        """``(content, calls)`` of a finished reply: the calls from where the first starts, the text
        before it as content; the whole text and ``None`` when no call to a given tool parses.
        (``schemas``, each tool's parameters: the JSON formats carry their own types.)"""
        start = text.find(self.trigger)
        if start < 0:
            return text, None
        calls, pos, decoder = [], start, json.JSONDecoder()
        while True:
            pos = _skip_space(text, pos, ";,")
            if not text.startswith(self.open, pos):
                break
            try:
                obj, pos = decoder.raw_decode(text, _skip_space(text, pos + len(self.open)))
            except json.JSONDecodeError:
                break
            pos = _skip_space(text, pos)
            if text.startswith(self.close, pos):
                pos += len(self.close)
            for item in obj if isinstance(obj, list) else [obj]:
                if isinstance(item, dict) and item.get("name") in names:  # (Llama writes either key)
                    args = item.get(self.key, item.get("arguments", item.get("parameters", {})))
                    calls.append(_call(item["name"], args))
        if not calls:
            return text, None
        return text[:start].strip() or None, calls


class XmlToolCallParser(ToolCallParser):
    """Qwen3-Coder's and Qwen3.5's calls (vLLM's ``qwen3_coder``): each argument a tagged text, typed
    by its tool's schema (strings as written, other types as JSON)::

        <tool_call>
        <function=add>
        <parameter=a>
        1
        </parameter>
        </function>
        </tool_call>

    Parsed, not grammar-bound: its arguments are no JSON a schema could bind (vLLM binds none)."""

    _CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def structures(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return []

    def render(self, calls: list[tuple[str, Any]]) -> str:
        out = []
        for name, args in calls:
            params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                             for k, v in (args.items() if isinstance(args, dict) else []))
            out.append(f"{self.open}\n<function={name}>\n{params}</function>\n{self.close}")
        return "\n".join(out)

    def parse(self, text: str, names: set[str],
              schemas: dict[str, dict[str, Any]] | None = None) -> tuple[str | None, list[dict[str, Any]] | None]:
        start = text.find(self.open)
        if start < 0:
            return text, None
        calls = []
        for m in self._CALL.finditer(text, start):
            name = m.group(1).strip()
            if name not in names:
                continue
            props = ((schemas or {}).get(name) or {}).get("properties") or {}
            args = {k.strip(): _typed(v, props.get(k.strip())) for k, v in self._PARAM.findall(m.group(2))}
            calls.append(_call(name, args))
        if not calls:
            return text, None
        return text[:start].strip() or None, calls


def _typed(value: str, schema: Any) -> Any:
    """An XML argument's text as its schema's type: a string as written, anything else as JSON
    (the text itself where it does not parse)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _skip_space(text: str, pos: int, also: str = "") -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] in also):
        pos += 1
    return pos


PARSERS = {p.name: p for p in (
    ToolCallParser("hermes", CALL_OPEN, CALL_CLOSE),
    ToolCallParser("llama3_json", "", "", key="parameters", separator="; "),
    ToolCallParser("mistral", "[TOOL_CALLS]", "", in_list=True, keeps_special=True),
    # Granite 3.x/4's list after its special token.
    ToolCallParser("granite", "<|tool_call|>", "", in_list=True, keeps_special=True),
    XmlToolCallParser("qwen3_coder", CALL_OPEN, CALL_CLOSE),
)}


def get_parser(name: str | None) -> ToolCallParser:
    """``--tool-call-parser``'s parser (``None``: hermes), or a ``ValueError`` naming the choices."""
    if name is None:
        return PARSERS["hermes"]
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got {name!r}")
    return PARSERS[name]


@dataclass(frozen=True, slots=True)
class ToolMode:
    """What ``tool_choice`` resolved to: ``kind`` is ``auto``, ``required`` or ``named`` (``name`` set)."""

    kind: str
    tools: list[dict[str, Any]]
    name: str | None = None
    parallel: bool = True
    parser: ToolCallParser = PARSERS["hermes"]

    @property
    def constrained(self) -> bool:
        return self.kind in ("required", "named")


def resolve(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
            parser: ToolCallParser = PARSERS["hermes"]) -> ToolMode | None:
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
        return ToolMode("auto", tools, parallel=par, parser=parser)
    if tool_choice == "required":
        return ToolMode("required", tools, parallel=par, parser=parser)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise APIError(f"tool_choice names function {name!r}, which is not among tools ({names})",
                           param="tool_choice")
        return ToolMode("named", tools, name=name, parallel=par, parser=parser)
    raise APIError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                   f"{{'name': ...}}}}, got {tool_choice!r}", param="tool_choice")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _ANY_OBJECT


def constraint(mode: ToolMode) -> StructuredOutputsParams | None:
    """The grammar a mode decodes under (``auto``: free text with structurally tagged calls)."""
    if mode.kind == "auto":
        structures = mode.parser.structures(mode.tools)
        if not structures:
            return None  # (a format no schema binds: calls are parsed from free text)
        return StructuredOutputsParams(structural_tag={"structures": structures, "triggers": [mode.parser.trigger]})
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


def tools_system_prompt(tools: list[dict[str, Any]], parser: ToolCallParser = PARSERS["hermes"]) -> str:
    """How the tools are described to a model whose chat template has no place for them."""
    listing = "\n".join(json.dumps(t["function"], separators=(",", ":")) for t in tools)
    example = parser.render([("<function name>", "<arguments object>")]).replace('"<', "<").replace('>"', ">")
    return ("You can call these functions (JSON signatures):\n" + listing + "\n\nTo call one, reply with "
            f"{example} and nothing else.")


def history_as_text(msg: dict[str, Any], index: int = 0, parser: ToolCallParser = PARSERS["hermes"]) -> dict[str, Any]:
    """An earlier assistant call or tool result as plain text, for a template without tool support."""
    calls = msg.get("tool_calls")
    if msg.get("role") == "assistant" and calls:
        try:
            text = parser.render([(c["function"]["name"], _loads_or_text(c["function"].get("arguments", "{}")))
                                  for c in calls])
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
    return mode.parser.parse(text, names, {t["function"]["name"]: _parameters(t) for t in mode.tools})


def finished(mode: ToolMode | None, text: str,
             finish_reason: str | None) -> tuple[str | None, list[dict[str, Any]] | None]:
    """:func:`parse` of a reply that ended with ``finish_reason``: only a reply that stopped by
    itself (not cut by ``max_tokens``) is read for calls; the text and ``None`` otherwise."""
    if mode is None or finish_reason != "stop":
        return text, None
    return parse(mode, text)


def holdback(text: str, trigger: str = CALL_OPEN) -> int:
    """How much of streamed ``text`` may be sent as content in auto mode: everything before a call
    starts, keeping back a tail that could be the beginning of ``trigger`` (the parser's)."""
    i = text.find(trigger)
    if i >= 0:
        return i
    for k in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-k:]):
            return len(text) - k
    return len(text)
