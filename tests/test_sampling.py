"""Sampler behaviour: seeded reproducibility, filters, penalties, logprobs, parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import LLMEngine, SamplingParams
from pagellm.config import EngineArgs
from pagellm.sampling.sampler import SamplingRow, apply_penalties, sample

from conftest import run_to_completion


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB"))


def _run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    return run_to_completion(engine)


PROMPT = [11, 222, 3333, 4444, 555]


def test_seeded_sampling_is_reproducible_across_batches(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=200, seed=42, max_tokens=20, ignore_eos=True)
    alone = _run(engine, [("x", PROMPT, params)])["x"].outputs[0].token_ids
    others = [(f"o{i}", [7 + i] * (3 + 17 * i), SamplingParams(temperature=0.7, max_tokens=5 + 7 * i,
                                                                 seed=i if i % 2 else None)) for i in range(5)]
    crowded = _run(engine, others[:2] + [("x", PROMPT, params)] + others[2:])["x"].outputs[0].token_ids
    assert alone == crowded
    other_seed = _run(engine, [("y", PROMPT, params.clone(seed=43))])["y"].outputs[0].token_ids
    assert other_seed != alone


def test_top_k_1_equals_greedy(engine):
    greedy = _run(engine, [("g", PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))])
    topk1 = _run(engine, [("k", PROMPT, SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True))])
    assert greedy["g"].outputs[0].token_ids == topk1["k"].outputs[0].token_ids


def test_logprobs_are_the_models_log_softmax(tiny_llama):
    import transformers

    # float32, the oracle's numerics: ``auto`` may pick bfloat16 GEMMs on this machine.
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", dtype="float32"))
    try:
        out = _run(engine, [("l", PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=4, ignore_eos=True))])
    finally:
        engine.shutdown()
    comp = out["l"].outputs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1].log_softmax(-1)
    first = comp.logprobs[0]
    top = ref.topk(4)
    assert list(first)[:4] == top.indices.tolist()
    for tok, val in zip(top.indices.tolist(), top.values.tolist(), strict=True):
        assert math.isclose(first[tok].logprob, val, abs_tol=1e-4)
    assert first[comp.token_ids[0]].rank == 1
    assert math.isclose(comp.cumulative_logprob, sum(lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids,
                                                                                     strict=True)), abs_tol=1e-5)


def _rows(params, outputs=None, prompt=None):
    return [SamplingRow(params, prompt or [], outputs or [], None)]


def test_top_p_min_p_and_top_k_filter_the_right_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    torch.manual_seed(0)
    for params, allowed in [
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),
        (SamplingParams(temperature=1.0, min_p=0.5), {0, 1}),
        (SamplingParams(temperature=1.0, top_k=3), {0, 1, 2}),
        (SamplingParams(temperature=1.0, top_p=0.1), {0}),
    ]:
        seen = {sample(logits.clone(), _rows(params)).token_ids[0] for _ in range(300)}
        assert seen == allowed, params


def test_unfiltered_sampling_follows_the_distribution():
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    gen = torch.Generator().manual_seed(0)
    counts = [0, 0, 0]
    row = [SamplingRow(SamplingParams(temperature=1.0), [], [], gen)]
    for _ in range(3000):
        counts[sample(probs.log(), row).token_ids[0]] += 1
    for c, p in zip(counts, probs[0].tolist(), strict=True):
        assert abs(c / 3000 - p) < 0.04


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = logits.clone()
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(out, [SamplingRow(params, [0], [1, 1, 2], None)])
    expected = torch.tensor([[2.0 / 2, -1.0 * 2 - 2 * 0.5 - 0.25, 0.5 / 2 - 0.5 - 0.25, 3.0]])
    torch.testing.assert_close(out, expected)


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3], eos_token_id=2)
    assert sample(logits, _rows(params, outputs=[4])).token_ids == [4]
    assert sample(logits, _rows(params, outputs=[4, 4])).token_ids == [2]


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0), ("n", 0), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("min_tokens", -1),
    ("logprobs", -1), ("best_of", 0), ("stop", [""]),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_sampling_keyword_raises_value_error_naming_it():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams(temprature=0.5)
