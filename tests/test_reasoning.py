"""Reasoning output (``--reasoning-parser qwen3 | deepseek_r1``): the think block apart from the
answer, whole and streamed (tags split across chunks, no block, a block cut short), the grammar
constraining only the answer, ``chat_template_kwargs`` reaching the template, and the server's
``reasoning_content`` through the ``openai`` client, streamed and not."""

from __future__ import annotations

import json
import re

import numpy as np
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.reasoning import REASONING_PARSERS, ThinkTokens, get_reasoning_parser
from pagellm.sampling_params import StructuredOutputsParams

from conftest import build_tiny_checkpoint

TEXTS = ["<think>two plus two</think>\n\nFour.", "\n<think>a<b</think>c</think>d", "Just the answer.",
         "<think>cut short by max_tok", "<thi", "</think>after", "<think></think>", "", "<think>x</thin"]
PROMPTS = ["", "<|im_start|>assistant\n<think>\n", "<think>\n\n</think>\n\n"]


def oracle(name: str, text: str, prompt: str) -> tuple[str | None, str | None]:
    """The split by regular expressions, written apart from the parser."""
    opened = prompt.rfind("<think>") > prompt.rfind("</think>")
    if prompt.rfind("</think>") > prompt.rfind("<think>"):
        return None, text or None  # thinking turned off by the template
    m = re.match(r"\s*<think>", text)
    if not opened and m:
        text, opened = text[m.end():], True
    if not opened and name == "qwen3":
        return None, text or None
    head, sep, tail = text.partition("</think>")
    return head or None, (tail or None) if sep else None


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_whole_texts_split_as_the_oracle_says(name):
    parser = get_reasoning_parser(name)
    for prompt in PROMPTS:
        for text in TEXTS:
            assert parser.split(text, prompt) == oracle(name, text, prompt), (text, prompt)
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        get_reasoning_parser("granite")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(REASONING_PARSERS)), st.sampled_from(TEXTS), st.sampled_from(PROMPTS),
       st.lists(st.integers(0, 40), max_size=6))
def test_any_chunking_streams_the_same_split(name, text, prompt, cuts):
    """A stream cut anywhere (inside a tag too) gives the whole text's split, delta by delta."""
    parser = get_reasoning_parser(name)(prompt)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    reasoning = content = ""
    for a, b in zip(bounds, bounds[1:], strict=False):
        r, c = parser.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    assert ((reasoning + r) or None, (content + c) or None) == oracle(name, text, prompt)


THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                  "{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    """A tiny Llama whose tokenizer has <think> and </think> as tokens (49152, 49153) and a
    Qwen3-Thinking-style template: ``enable_thinking: false`` writes an empty block, else the
    template opens one."""
    import transformers

    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("think")), "llama", vocab_size=49160)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if "</think>" not in tok.get_vocab():
        tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
        tok.chat_template = THINK_TEMPLATE
        tok.save_pretrained(path)
    return path


def test_the_grammar_waits_for_the_answer(think_model):
    import transformers

    from pagellm.sequence import Sequence
    from pagellm.structured_output.manager import StructuredOutputManager

    tok = transformers.AutoTokenizer.from_pretrained(think_model)
    think = ThinkTokens.of(tok.get_vocab(), "qwen3")
    assert (think.start, think.end) == (49152, 49153)
    so = StructuredOutputManager(tok, 49160, tok.eos_token_id, think=think)
    so._grammars["r"] = so._compile_timed(StructuredOutputsParams(choice=["yes", "no"]))
    opened, closed = [5, think.start, 9], [5, think.start, 9, think.end]
    seq = Sequence(1, opened, [300, 301])  # thinking: free
    assert so._answer(seq) is None and so.advance("r", seq) is None
    seq.output_token_ids += [think.end]  # the block closed: the grammar starts at the answer
    row = so.fill_bitmask([("r", seq)])[0]
    free = np.unpackbits(row.view(np.uint8), bitorder="little")
    allowed = np.flatnonzero(free[:49160])
    assert 0 < len(allowed) < 50 and free[300] == 0 and free[think.end] == 0
    for t in allowed:  # each a first piece of "yes" or "no"
        piece = tok.decode([int(t)])
        assert piece and ("yes".startswith(piece) or "no".startswith(piece)), piece
    assert so._answer(Sequence(2, closed, [])) == []  # a prompt that closed its block: the answer from the start


def test_the_engine_constrains_only_the_answer(think_model):
    llm = LLM(think_model, dtype="float32", reasoning_parser="qwen3")
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    closed = llm.chat([{"role": "user", "content": "Is it?"}], params, use_tqdm=False,
                      chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
    assert closed.text in ("yes", "no")
    masks = llm.llm_engine.structured_outputs.stats.masks_filled
    opened = llm.chat([{"role": "user", "content": "Is it?"}], params, use_tqdm=False)[0].outputs[0]
    assert len(opened.token_ids) == 12 and 49153 not in opened.token_ids  # (random weights never close it)
    assert llm.llm_engine.structured_outputs.stats.masks_filled == masks  # no mask while it thinks
    with pytest.raises(ValueError, match="no single <think> / </think> token"):
        LLM(build_tiny_checkpoint(str(think_model) + "-plain", "llama"), reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        EngineArgs(reasoning_parser="granite").create_engine_config()


@pytest.fixture(scope="module")
def client(think_model):
    from test_server import KEY, _Server

    from pagellm.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(model=think_model, dtype="float32", kv_cache_memory="16MiB",
                                                  max_model_len=256, reasoning_parser="deepseek_r1"))
    srv = _Server(engine, KEY, reasoning_parser="deepseek_r1")  # type: ignore[arg-type]
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    srv.stop()
    engine.shutdown()


def test_reasoning_content_through_the_server(client):
    messages = [{"role": "user", "content": "Think, then answer."}]
    kw = dict(model="tiny", messages=messages, max_tokens=10, temperature=0)
    thinking = client.chat.completions.create(**kw).choices[0].message
    # The template opened the block and the random model never closes it: all reasoning.
    assert thinking.content is None and len(thinking.model_extra["reasoning_content"]) > 0
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks if c.choices]
    assert "".join(s for s in streamed if s) == thinking.model_extra["reasoning_content"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    no_think = dict(kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    answer = client.chat.completions.create(**no_think).choices[0].message
    assert answer.model_extra["reasoning_content"] is None and answer.content
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    shaped = client.chat.completions.create(**dict(no_think, max_tokens=40, response_format=fmt))
    assert set(json.loads(shaped.choices[0].message.content)) == {"a"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**dict(kw, extra_body={"chat_template_kwargs": {"tokenize": True}}))
    assert e.value.body["param"] == "chat_template_kwargs"
