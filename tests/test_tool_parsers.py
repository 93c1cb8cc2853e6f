"""Tool calls in each family's own format (``--tool-call-parser``, vLLM's names): replies written
here as each family's documentation shows them parse into OpenAI calls; the auto mode's grammar
holds a started call to the format; through the server, a forced reply in the format comes back as
calls, streamed and not, and tools reach a template that refuses the system role."""

from __future__ import annotations

import json

import pytest

from pagellm.entrypoints import tool_calls

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

# Two calls in each family's published format (Qwen 2.5's and Hermes' tags, each on its own
# lines; Llama 3.1's JSON with "parameters", "; " between calls; Mistral v0.3's list).
REPLIES = {
    "hermes": 'Let me see.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "note", "arguments": {"text": "hi; {x}"}}\n</tool_call>',
    "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                   '{"name": "note", "parameters": {"text": "hi; {x}"}}',
    "mistral": '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
               '{"name": "note", "arguments": {"text": "hi; {x}"}}]',
    # Granite 3.x/4's list after its special token; Qwen3-Coder's and Qwen3.5's XML (a string
    # argument as written, the integers typed by the tool's schema).
    "granite": '<|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
               '{"name": "note", "arguments": {"text": "hi; {x}"}}]',
    "qwen3_coder": 'Let me see.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n'
                   '</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=note>\n<parameter=text>\nhi; {x}\n'
                   '</parameter>\n</function>\n</tool_call>',
}
# (formats whose calls are parsed, not grammar-bound: no JSON schema binds XML arguments)
UNBOUND = {"qwen3_coder"}


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_each_family_format_parses_into_calls(name):
    mode = tool_calls.resolve([ADD, NOTE], "auto", None, tool_calls.get_parser(name))
    content, calls = tool_calls.parse(mode, REPLIES[name])
    assert content == ("Let me see." if name in ("hermes", "qwen3_coder") else None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("add", {"a": 1, "b": 2}), ("note", {"text": "hi; {x}"})]
    assert all(c["type"] == "function" and c["id"] for c in calls)
    assert tool_calls.parse(mode, "Just text.") == ("Just text.", None)
    unknown = REPLIES[name]
    for tool in ("add", "note"):  # (a JSON name, or an XML tag's)
        unknown = unknown.replace(f'"{tool}"', '"rm"').replace(f"={tool}>", "=rm>")
    assert tool_calls.parse(mode, unknown) == (unknown, None)  # calls to tools not given are text
    cut = REPLIES[name][:REPLIES[name].index('"b"' if name not in UNBOUND else "=b>")]
    assert tool_calls.parse(mode, cut) == (cut, None)  # a call cut short is text
    # What is written back as history is what the parser reads: one call, and several at once (an
    # assistant turn with two calls, through history_as_text as a template without tools gets it).
    parser = tool_calls.get_parser(name)
    rendered = parser.render([("add", {"a": 3, "b": 4})])
    assert [json.loads(c["function"]["arguments"]) for c in parser.parse(rendered, {"add"})[1]] == [{"a": 3, "b": 4}]
    two = [("add", {"a": 3, "b": 4}), ("note", {"text": "a; {b}"})]
    turn = {"role": "assistant", "content": "",
            "tool_calls": [{"id": f"c{i}", "type": "function",
                            "function": {"name": n, "arguments": json.dumps(a)}} for i, (n, a) in enumerate(two)]}
    text = tool_calls.history_as_text(turn, 0, parser)["content"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parser.parse(text, {"add", "note"})[1]] == two
    trigger = parser.trigger
    assert tool_calls.holdback("Hi " + trigger[:3], trigger) == 3 and tool_calls.holdback("Hi " + trigger, trigger) == 3


def test_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        tool_calls.get_parser("pythonic")


def test_an_xml_argument_keeps_its_text_where_its_schema_says_string():
    """``qwen3_coder``: a string parameter that looks like JSON stays the text written, an untyped
    one is read as JSON, and a parameter cut short leaves the reply as text."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string"}, "o": {}}}}}]
    mode = tool_calls.resolve(tools, "auto", None, tool_calls.get_parser("qwen3_coder"))
    reply = ('<tool_call>\n<function=f>\n<parameter=s>\n[1, 2]\n</parameter>\n'
             '<parameter=o>\n{"k": [1]}\n</parameter>\n</function>\n</tool_call>')
    _, calls = tool_calls.parse(mode, reply)
    assert json.loads(calls[0]["function"]["arguments"]) == {"s": "[1, 2]", "o": {"k": [1]}}
    assert tool_calls.constraint(mode) is None


@pytest.mark.parametrize("name", sorted(set(REPLIES) - UNBOUND))
def test_auto_grammar_binds_a_started_call_in_each_format(tiny_llama, name):
    from pagellm.config import resolve_model_source
    from pagellm.structured_output.manager import create_backend
    from pagellm.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_source(tiny_llama))
    parser = tool_calls.get_parser(name)
    params = tool_calls.constraint(tool_calls.resolve([ADD, NOTE], "auto", None, parser))
    grammar = create_backend("guidance", tok.hf, len(tok.hf), tok.eos_token_id).compile(params)

    def accepts(text: str) -> bool:
        m = grammar.new_matcher()
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])

    assert accepts("Plain words.")
    assert accepts(parser.render([("add", {"a": 1, "b": 2})]))
    assert not accepts(parser.render([("add", {"a": 100, "b": 2})]))  # a > 99
    assert not accepts(parser.render([("sub", {"a": 1, "b": 2})]))  # no such tool


# Mistral-7B-Instruct-v0.1's chat template (its tokenizer_config.json): no tools, roles that must
# alternate, and a system role refused.
NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def mistral_style_engine(tiny_llama):
    from pagellm.config import EngineArgs
    from pagellm.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", max_model_len=512),
                                       NO_SYSTEM_TEMPLATE)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("name", ["mistral", "llama3_json", "granite", "qwen3_coder"])
def test_a_forced_reply_in_the_format_comes_back_as_calls(mistral_style_engine, name):
    import openai
    from test_server import KEY, NAME, _Server
    from test_structured_output import _streamed_calls, assert_next_turn_reads_the_result

    srv = _Server(mistral_style_engine, KEY, tool_call_parser=name)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        reply = tool_calls.get_parser(name).render([("add", {"a": 1, "b": 2})])
        regex = "".join("\\" + ch if ch in "[]{}().*+?|\\^$" else ch for ch in reply)
        kw = dict(model=NAME, messages=[{"role": "user", "content": "What is 1 + 2?"}], tools=[ADD, NOTE],
                  max_tokens=60, temperature=0, extra_body={"structured_outputs": {"regex": regex}})
        r = client.chat.completions.create(**kw)  # (the tools went into the user turn: no system role here)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
        assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == \
            [("add", {"a": 1, "b": 2})]
        streamed, finish = _streamed_calls(client.chat.completions.create(stream=True, **kw))
        assert finish == "tool_calls" and streamed == [{"name": "add", "arguments": ch.message.tool_calls[0]
                                                        .function.arguments}]
        assert_next_turn_reads_the_result(client, NAME, kw["messages"], ch.message, [ADD])
    finally:
        srv.stop()
