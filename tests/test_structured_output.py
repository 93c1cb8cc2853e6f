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
    from pagellm.engine.core_proc import AsyncEngineClient

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
