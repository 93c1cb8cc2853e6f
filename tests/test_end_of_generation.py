"""Generation ends on every end-of-generation id a checkpoint names, with no client-side stop: what
llama.cpp derives from a GGUF file, and vLLM's rule for ``generation_config.json``'s ``eos_token_id``
list (an instruction-tuned model's end of turn is often not its tokenizer's EOS)."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import openai
import pytest
from test_server import _Server

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.weights.gguf_file import _reader, gguf_end_of_generation_ids

from conftest import build_tiny_checkpoint
from test_hf_parity import random_prompts, write_gemma_gguf


def test_gguf_end_of_generation_ids_are_llama_cpps(tmp_path):
    """The ids llama.cpp's vocabulary loader ends generation on: the file's EOS, EOT and EOM ids and
    every token spelled as an end-of-turn marker (the list in the test, not the module's)."""
    tokens = [f"tok{i}" for i in range(40)]
    named = {3: "<end_of_turn>", 7: "<|im_end|>", 11: "<|eot_id|>", 12: "<|eom_id|>", 20: "<|endoftext|>",
             21: "<|end|>"}
    for i, text in named.items():
        tokens[i] = text
    tokens[30] = "<start_of_turn>"  # a marker that does not end a turn
    path = str(tmp_path / "eog.gguf")
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_eos_token_id(1)
    w.add_eot_token_id(25)
    w.add_uint32("tokenizer.ggml.eom_token_id", 26)
    w.add_bos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _reader.cache_clear()
    assert gguf_end_of_generation_ids(path) == sorted({1, 25, 26, *named})


def test_a_gguf_files_end_of_turn_id_ends_an_engine_run(ckpt_root, smollm2_path):
    """A GGUF file's EOT id (``tokenizer.ggml.eot_token_id``, not its tokenizer's EOS) ends a run,
    with no client-side stop: the same weights without the key run to ``max_tokens``, with it the
    reply ends on the id (the token the tiny model's greedy reply starts with)."""
    path = build_tiny_checkpoint(ckpt_root, "gemma3-llamacpp", tie=True)
    plain, eot = os.path.join(ckpt_root, "eog-plain.gguf"), os.path.join(ckpt_root, "eog-eot.gguf")
    write_gemma_gguf(path, plain, smollm2_path)
    prompt = {"prompt_token_ids": random_prompts(1, seed=5, lo=40, hi=41)[0]}
    greedy = SamplingParams(temperature=0, max_tokens=16)
    with LLM(plain, kv_cache_memory="16MiB") as llm:
        out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
        first = out.token_ids[0]
        assert first not in llm.llm_engine.model_info.end_of_generation_ids
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    write_gemma_gguf(path, eot, smollm2_path, eot_token_id=first)
    with LLM(eot, kv_cache_memory="16MiB") as llm:
        assert first in llm.llm_engine.model_info.end_of_generation_ids
        assert llm.llm_engine.tokenizer.eos_token_id != first
        out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop" and out.stop_reason == first


@pytest.fixture(scope="module")
def end_of_turn_model(tiny_llama, tmp_path_factory):
    """The tiny model with one more end-of-generation id in generation_config.json: the token its
    greedy chat reply reaches first at step ``k`` (a token it has not produced before), so the reply
    must now end there, reason "stop", with no client-side stop."""
    messages = [{"role": "user", "content": "Say hello."}]
    with LLM(tiny_llama, kv_cache_memory="16MiB") as llm:
        reply = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
        eos = llm.llm_engine.tokenizer.eos_token_id
    k = next(i for i in range(3, len(reply)) if reply[i] not in reply[:i] and reply[i] != eos)
    path = str(tmp_path_factory.mktemp("eot") / "tiny-llama-eot")
    shutil.copytree(tiny_llama, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [eos, reply[k]]}, f)
    return path, messages, reply, k


def test_generation_config_end_of_turn_stops_offline(end_of_turn_model):
    path, messages, reply, k = end_of_turn_model
    with LLM(path, kv_cache_memory="16MiB") as llm:
        assert reply[k] in llm.llm_engine.model_info.end_of_generation_ids
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == reply[:k + 1] and out.finish_reason == "stop" and out.stop_reason == reply[k]
        # ignore_eos keeps its meaning: every end-of-generation id is an ordinary token then.
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
        assert out.token_ids == reply and out.finish_reason == "length"
        # min_tokens holds it back, as it holds back EOS, and a client's own stop ids still stop.
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24, min_tokens=k + 2), use_tqdm=False)
        assert reply[k] not in out[0].outputs[0].token_ids[:k + 2]
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[reply[1]]),
                       use_tqdm=False)[0].outputs[0]
        assert out.token_ids == reply[:2] and out.stop_reason == reply[1]


def test_generation_config_end_of_turn_stops_through_the_server(end_of_turn_model):
    """The checkpoint's chat template through the server and the ``openai`` client: the reply ends
    at the end of its turn."""
    path, messages, reply, k = end_of_turn_model
    engine = AsyncLLM.from_engine_args(EngineArgs(model=path, kv_cache_memory="16MiB"))
    srv = _Server(engine, None)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1
        with LLM(path, kv_cache_memory="16MiB") as llm:
            assert r.choices[0].message.content == llm.llm_engine.tokenizer.decode(reply[:k + 1])
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 24
    finally:
        srv.stop()
        engine.shutdown()


def test_a_model_without_a_chat_template_names_the_flag_to_each_caller(tiny_llama, tmp_path):
    """Offline, the ``chat_template`` keyword; through the server, its ``--chat-template`` flag."""
    path = str(tmp_path / "no-template")
    shutil.copytree(tiny_llama, path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    for extra in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(path, extra)):
            os.remove(os.path.join(path, extra))
    messages = [{"role": "user", "content": "Hi"}]
    with LLM(path, kv_cache_memory="16MiB") as llm, pytest.raises(ValueError, match="chat_template="):
        llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=path, kv_cache_memory="16MiB"))
    srv = _Server(engine, None)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        assert "--chat-template FILE" in e.value.message and "chat_template=" not in e.value.message
    finally:
        srv.stop()
        engine.shutdown()
