"""Structured output: every constrained output parses and validates, constraints do not leak into
other requests, survive preemption, forks and beams, and a bad constraint is a clear error.

The tiny random model writes noise, so any valid output here is the grammar's doing; greedy
outputs are compared across scheduling configurations (the mask must not depend on them)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import BeamSearchParams, StructuredOutputsParams

pytest.importorskip("llguidance")

BACKENDS = ["guidance"] + (["xgrammar"] if __import__("importlib").util.find_spec("xgrammar") else [])
PROMPTS = ["Give me a JSON object:", "Data:", "{", "The answer is"]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
}, "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module", params=BACKENDS)
def llm(tiny_llama, request):
    engine = LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=512,
                 structured_outputs_config={"backend": request.param})
    yield engine
    engine.llm_engine.shutdown()


def _params(max_tokens: int = 160, **so) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**so))


def _idle(llm: LLM) -> None:
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
    assert eng.structured_outputs.num_constrained == 0 and eng.structured_outputs.num_waiting_for_fsm == 0


def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a+", choice=["x"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="json"):
        StructuredOutputsParams(json=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown structured_outputs"):
        SamplingParams(structured_outputs={"regexp": "a"})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputsParams(regex="a+")


def test_json_schema_output_validates(llm):
    outs = llm.generate(PROMPTS, _params(json=PERSON), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), PERSON)
    _idle(llm)


def test_properties_come_out_in_schema_order(llm):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    (out,) = llm.generate(["x"], _params(json=schema), use_tqdm=False)
    assert list(json.loads(out.outputs[0].text)) == ["zeta", "alpha"]


def test_regex_choice_and_json_object(llm):
    regex = r"(yes|no) [0-9]{2,4}!"
    outs = llm.generate(PROMPTS, _params(regex=regex), use_tqdm=False)
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs), [o.outputs[0].text for o in outs]
    choices = ["red", "green", "blue sky"]
    outs = llm.generate(PROMPTS, _params(choice=choices), use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs)
    outs = llm.generate(PROMPTS, _params(max_tokens=200, json_object=True), use_tqdm=False)
    for o in outs:
        if o.outputs[0].finish_reason == "stop":  # an open-ended object may run out of tokens
            assert isinstance(json.loads(o.outputs[0].text), dict)
    _idle(llm)


def test_unconstrained_neighbour_is_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[:2], [plain, plain, _params(json=PERSON), _params(regex="[a-z]{3,9}")],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    _idle(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_constrained_under_preemption_gives_the_same_valid_output(tiny_llama, preemption_mode):
    ref_llm = LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=512)
    ref_outs = ref_llm.generate(PROMPTS, _params(json=PERSON), use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in ref_outs]
    ref_llm.llm_engine.shutdown()
    # Room for the largest request alone: the others are preempted again and again.
    blocks = max(-(-(len(o.prompt_token_ids) + len(o.outputs[0].token_ids)) // 16) for o in ref_outs) + 1
    tight = LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=512, num_gpu_blocks_override=blocks,
                preemption_mode=preemption_mode, block_size=16, max_num_batched_tokens=13,
                long_prefill_token_threshold=0)
    outs = tight.generate(PROMPTS, _params(json=PERSON), use_tqdm=False)
    assert tight.llm_engine.get_stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    _idle(tight)
    tight.llm_engine.shutdown()


def test_parallel_samples_and_beams_stay_valid(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=160, structured_outputs=StructuredOutputsParams(
        json=PERSON))
    (out,) = llm.generate(PROMPTS[:1], p, use_tqdm=False)
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), PERSON)
    choices = ["alpha", "beta", "gamma delta"]
    beams = llm.beam_search([{"prompt": PROMPTS[0]}], BeamSearchParams(
        beam_width=2, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)), use_tqdm=False)
    for seq in beams[0].sequences:
        assert llm.get_tokenizer().decode(seq.output_token_ids, skip_special_tokens=True) in choices
    _idle(llm)


def test_bad_constraint_is_a_clear_error_and_the_engine_keeps_serving(llm):
    eng = llm.llm_engine
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate(["x"], _params(regex="(unclosed"), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.json"):
        llm.generate(["x"], _params(json='{"type": "object", "properties": '), use_tqdm=False)
    if eng.structured_outputs.backend.name == "guidance":  # an unsupported construct is named
        with pytest.raises(ValueError, match="unevaluatedProperties"):
            llm.generate(["x"], _params(json={"type": "object", "unevaluatedProperties": False}), use_tqdm=False)
    # Through the engine directly (no front-end check): the request ends with the error.
    eng.add_request("bad", "x", _params(regex="[z-a]"))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].finished and "structured_outputs.regex" in (outs[-1].error or "")
    ok = llm.generate(["x"], _params(choice=["fine"]), use_tqdm=False)
    assert ok[0].outputs[0].text == "fine"
    _idle(llm)


# ---- random JSON schemas (hypothesis) -------------------------------------------------------
_leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.just({"type": "string", "pattern": "^[a-z]{1,4}$"}),
    st.just({"type": "boolean"}),
    st.builds(lambda vals: {"enum": vals}, st.lists(st.sampled_from(["x", "y", 1, 2, True, None]), min_size=1,
                                                     max_size=3, unique=True)),
)


def _extend(children):
    obj = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})
    arr = st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 3))
    return st.one_of(obj, arr)


SCHEMAS = st.recursive(_leaf, _extend, max_leaves=6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(schema=SCHEMAS)
def test_random_schemas_always_validate(llm, schema):
    outs = llm.generate(PROMPTS[:2], _params(max_tokens=300, json=schema), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


# ---- the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["thread", "core-process"])
def server(tiny_llama, request):
    import openai
    from test_server import KEY, _Server

    from pagellm.config import EngineArgs
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.engine.core_client import AsyncEngineClient

    args = EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", max_model_len=512)
    engine = AsyncLLM.from_engine_args(args) if request.param == "thread" else AsyncEngineClient.start(args)
    srv = _Server(engine, KEY)  # type: ignore[arg-type]
    yield srv, openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    srv.stop()
    engine.shutdown()


def test_response_format_through_the_openai_client(server):
    import openai
    from test_server import NAME

    _, client = server
    msgs = [{"role": "user", "content": "Describe a person."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=160, temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    chunks = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=160, temperature=0,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=300, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(model=NAME, prompt="Pick:", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert c.choices[0].text in ("left", "right")
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, response_format=bad,
                                           stream=stream)
        assert "structured_outputs.json" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="regexp"):
        client.completions.create(model=NAME, prompt="x", max_tokens=5, extra_body={"structured_outputs": {
            "regexp": "a"}})


# ---- tool calls ----------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
SCHEMAS_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS_BY_NAME[call.function.name])


def assert_next_turn_reads_the_result(client, model: str, messages: list, call_message, tools: list) -> None:
    """The call goes back as history with its result and the next turn is served, greedy to its
    token limit; the result reached the prompt (a longer result, a longer prompt)."""
    def turn(result: str):
        history = messages + [call_message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": call_message.tool_calls[0].id, "content": result}]
        return client.chat.completions.create(model=model, messages=history, tools=tools, max_tokens=4,
                                              temperature=0)
    short, long = turn("5"), turn("5, the sum of the two numbers asked for")
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 4
    assert long.usage.prompt_tokens > short.usage.prompt_tokens


def _streamed_calls(chunks):
    """Tool calls put together from streamed deltas, as a client does, and the last finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for c in chunks:
        for ch in c.choices:
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
    return [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_constrained_tool_calls_through_the_openai_client(server, choice):
    from test_server import NAME

    _, client = server
    kw = dict(model=NAME, messages=[{"role": "user", "content": "What is 2 + 3?"}], tools=[WEATHER, ADD],
              tool_choice=choice, max_tokens=120, temperature=0)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    _check_calls(ch.message.tool_calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in ch.message.tool_calls] == ["add"]
    streamed, finish = _streamed_calls(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in ch.message.tool_calls]
    assert_next_turn_reads_the_result(client, NAME, kw["messages"], ch.message, [WEATHER, ADD])


def test_tool_choice_errors_name_the_field(server):
    import openai
    from test_server import NAME

    _, client = server
    msgs = [{"role": "user", "content": "hi"}]
    cases = [(dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
             (dict(tool_choice="required"), "tool_choice"),
             (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools[0]"),
             (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
             (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, **extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None


def test_auto_mode_parses_calls_and_streams_only_what_cannot_be_one():
    from pagellm.entrypoints import tool_calls

    mode = tool_calls.resolve([WEATHER, ADD], "auto", None)
    reply = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, calls = tool_calls.parse(mode, reply)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert tool_calls.parse(mode, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')[1] is None
    assert tool_calls.parse(mode, "<tool_call>{not json</tool_call>")[1] is None
    assert tool_calls.parse(mode, "no call here") == ("no call here", None)
    assert tool_calls.holdback("Hello <tool") == len("Hello ")
    assert tool_calls.holdback("Hello <tool_call>{") == len("Hello ")
    assert tool_calls.holdback("Hello world") == len("Hello world")
    prompt = tool_calls.tools_system_prompt([WEATHER])
    assert "get_weather" in prompt and tool_calls.CALL_OPEN in prompt


def test_slow_compile_times_out_without_holding_up_others(tiny_llama, monkeypatch):
    """A request waits for its grammar outside the scheduler (vLLM's WAITING_FOR_FSM): the others
    run meanwhile; past ``compile_timeout_s`` it ends with an error naming the limit."""
    import time

    llm = LLM(tiny_llama, kv_cache_memory="16MiB",
              structured_outputs_config={"backend": "guidance", "compile_timeout_s": 0.3})
    eng = llm.llm_engine
    backend = eng.structured_outputs.backend
    real = backend.compile

    def slow(params):
        if params.regex == "slow":
            time.sleep(1.5)
        return real(params)

    monkeypatch.setattr(backend, "compile", slow)
    eng.add_request("slow", "x", _params(regex="slow"))
    eng.add_request("plain", "x", SamplingParams(max_tokens=3, ignore_eos=True))
    assert eng.get_stats()["num_waiting_for_fsm"] == 1
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    assert "did not compile within 0.3 s" in outs["slow"].error and outs["slow"].finished
    assert len(outs["plain"].outputs[0].token_ids) == 3 and outs["plain"].error is None
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
    eng.shutdown()


def test_oversized_constraint_is_refused():
    with pytest.raises(ValueError, match="limit"):
        StructuredOutputsParams(regex="a" * 300_000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_structural_tag_leaves_text_free_and_constrains_tagged_calls(tiny_llama, backend):
    """``tool_choice="auto"``'s constraint: any text, but after ``<tool_call>`` only a given tool's
    name and arguments under its schema, closed by ``}</tool_call>``."""
    from pagellm.config import resolve_model_source
    from pagellm.entrypoints import tool_calls
    from pagellm.structured_output.manager import create_backend
    from pagellm.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_source(tiny_llama))
    params = tool_calls.constraint(tool_calls.resolve([WEATHER, ADD], "auto", None))
    grammar = create_backend(backend, tok.hf, len(tok.hf), tok.eos_token_id).compile(params)

    def accepts(text: str) -> bool:
        m = grammar.new_matcher()
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])

    assert accepts("Just some text, no call at all.")
    assert accepts('Let me add. <tool_call>{"name": "add", "arguments": {"a":1,"b":2}}</tool_call>')
    assert not accepts('<tool_call>{"name": "sub", "arguments": {}}</tool_call>')  # no such tool
    assert not accepts('<tool_call>{"name": "add", "arguments": {"a":100,"b":2}}</tool_call>')  # a > 99
    assert not accepts('<tool_call>{"name": "add", "arguments": {"a":1')  # a started call must end
    with pytest.raises(ValueError, match="triggers"):
        StructuredOutputsParams(structural_tag={"structures": [{"begin": "<x>", "schema": {}, "end": "</x>"}],
                                                "triggers": ["<y>"]})


def test_auto_tool_choice_serves_text_with_a_tagged_grammar(server):
    from test_server import NAME

    _, client = server
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello"}],
                                       tools=[WEATHER, ADD], max_tokens=12, temperature=0)
    ch = r.choices[0]
    if ch.finish_reason == "tool_calls":  # a random model may write a call; it must then be valid
        _check_calls(ch.message.tool_calls)
    else:
        assert ch.message.tool_calls is None and isinstance(ch.message.content, str)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(data_parallel_size=2)])
def test_constrained_through_worker_processes_and_replicas(tiny_llama, parallel):
    """The bitmask travels to mp workers in the step's diff (tensor parallel: rank 0 samples) and
    each data-parallel replica compiles its own requests: the same greedy outputs as one worker."""
    # float32: tensor parallel splits reductions, and where ``auto`` picks bfloat16 GEMMs (per
    # machine) their rounding magnifies the new order enough to flip a random model's near-ties.
    kw = dict(kv_cache_memory="16MiB", max_model_len=512, dtype="float32")
    ref_llm = LLM(tiny_llama, **kw)
    ref = [o.outputs[0].token_ids for o in ref_llm.generate(PROMPTS, _params(json=PERSON), use_tqdm=False)]
    ref_llm.llm_engine.shutdown()
    llm = LLM(tiny_llama, distributed_executor_backend="mp", **kw, **parallel)
    with llm:
        outs = llm.generate(PROMPTS, _params(json=PERSON), use_tqdm=False)
        with pytest.raises(ValueError, match="structured_outputs.regex"):
            llm.generate(["x"], _params(regex="(unclosed"), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


def test_malformed_tool_history_is_a_400(server):
    import openai
    from test_server import NAME

    _, client = server
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [1, 2]}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=bad, max_tokens=4)
    assert e.value.body["param"] == "messages[1].tool_calls"


@pytest.mark.parametrize("backend", BACKENDS)
def test_length_bounded_strings_reject_raw_control_characters(tiny_llama, backend):
    """JSON strings may not hold raw U+0000-U+001F (RFC 8259); xgrammar 0.2.8's rule for a string
    with maxLength let them through, and a random model wrote one: json.loads rejected the text."""
    from pagellm.config import resolve_model_source
    from pagellm.structured_output.manager import create_backend
    from pagellm.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_source(tiny_llama))
    schema = {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}
    backend_ = create_backend(backend, tok.hf, len(tok.hf), tok.eos_token_id)
    grammar = backend_.compile(StructuredOutputsParams(json=schema))

    def accepts(text: str) -> bool:
        m = grammar.new_matcher()
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])

    assert accepts('["ab","c"]')
    assert not accepts('["a\x0eb"]')
    assert not accepts('["a\x01"]')
