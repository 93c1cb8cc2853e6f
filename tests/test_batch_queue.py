"""The batch queue (``async_scheduling``; pipeline stages use it too): the engine schedules the
next step while one computes, a request is never in two steps at once, and every output equals
the synchronous engine's: greedy tokens under chunked prefill and a tight cache (recompute and
swap preemption), parallel sampling, beam search, speculative decoding, structured output, LoRA,
aborts; invariants after every step, every block free at the end."""

from __future__ import annotations

import json

import pytest

from pagellm import LLM, LLMEngine, LoRARequest, SamplingParams
from pagellm.config import EngineArgs
from pagellm.sampling_params import BeamSearchParams

from conftest import assert_cache_pressure, build_tiny_checkpoint, run_to_completion
from test_hf_parity import random_prompts

TIGHT = dict(max_num_batched_tokens=32, long_prefill_token_threshold=16, num_gpu_blocks_override=30, block_size=8,
             num_cpu_blocks_override=64)
VARIANTS = {
    "plain": {},
    "recompute": dict(TIGHT, preemption_mode="recompute"),
    "swap": dict(TIGHT, preemption_mode="swap"),
    "ngram_spec": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
}


def run(model: str, async_scheduling: bool, requests, **kw) -> dict:
    """Every request's completions (a tight-cache variant checked to have been under pressure)."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, dtype="float32", async_scheduling=async_scheduling,
                                                   **kw))
    try:
        for rid, prompt, params in requests:
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        done = run_to_completion(engine)
        assert not engine.scheduler.in_flight
        assert_cache_pressure(engine, kw.get("preemption_mode"))
        return {rid: [c.token_ids for c in out.outputs] for rid, out in done.items()}
    finally:
        engine.shutdown()


def mixed_requests() -> list:
    prompts = random_prompts(10, seed=21, hi=120)
    reqs = [(f"g{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)]
    reqs.append(("n2", prompts[0], SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=12, ignore_eos=True)))
    reqs.append(("stop", prompts[1], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[prompts[1][3]])))
    return reqs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_async_scheduling_equals_the_synchronous_engine(tiny_llama, variant):
    reqs = mixed_requests()
    assert run(tiny_llama, True, reqs, **VARIANTS[variant]) == run(tiny_llama, False, reqs, **VARIANTS[variant])


def test_beam_search_under_async_scheduling(tiny_llama):
    prompt = random_prompts(1, seed=3, lo=20, hi=40)[0]
    outs = []
    for flag in (False, True):
        engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", async_scheduling=flag))
        try:
            engine.add_request("b", {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=3, max_tokens=10))
            engine.add_request("g", {"prompt_token_ids": prompt[:9]}, SamplingParams(temperature=0, max_tokens=10))
            done = run_to_completion(engine)
            outs.append({rid: [c.token_ids for c in o.outputs] for rid, o in done.items()})
        finally:
            engine.shutdown()
    assert outs[0] == outs[1]


def test_aborts_while_steps_are_in_flight_free_everything(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, dtype="float32", async_scheduling=True))
    try:
        for i, p in enumerate(random_prompts(8, seed=4, hi=60)):
            engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        engine.step()
        assert engine.scheduler.in_flight, "nothing was in flight: the test tests nothing"
        for i in range(0, 8, 2):
            engine.abort_request(str(i))
        engine.scheduler.check_invariants()
        done = run_to_completion(engine)
        assert sorted(done) == ["1", "3", "5", "7"]
        assert all(len(o.outputs[0].token_ids) == 50 for o in done.values())
    finally:
        engine.shutdown()


def test_batch_queue_combinations_refused_clearly():
    with pytest.raises(ValueError, match="kv_transfer_config"):
        EngineArgs(async_scheduling=True, kv_transfer_config={"kv_connector_extra_config": {"path": "/tmp/x"}}) \
            .create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineArgs(async_scheduling=True, data_parallel_size=2).create_engine_config()


def test_structured_output_under_async_scheduling(tiny_llama):
    """The grammar's bitmask for a request's next token needs its last token: with steps in flight
    the request is never in two of them, so the masks and the greedy outputs are the synchronous
    engine's, also under a tight cache with recompute."""
    jsonschema = pytest.importorskip("jsonschema")
    from test_structured_output import PERSON, PROMPTS, _params

    def outputs(async_scheduling: bool, **kw) -> list[list[int]]:
        llm = LLM(tiny_llama, kv_cache_memory="16MiB", max_model_len=512, async_scheduling=async_scheduling, **kw)
        with llm:
            outs = llm.generate(PROMPTS, _params(json=PERSON), use_tqdm=False)
            eng = llm.llm_engine
            assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
            assert eng.structured_outputs.num_constrained == 0
            assert_cache_pressure(eng, kw.get("preemption_mode"))
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
        return [o.outputs[0].token_ids for o in outs]

    ref = outputs(False)
    assert outputs(True) == ref
    # 12 blocks of 4 tokens for 4 requests of about 22 tokens each (6 blocks at their end): preemptions.
    assert outputs(True, num_gpu_blocks_override=12, block_size=4, preemption_mode="recompute",
                   max_num_batched_tokens=13, long_prefill_token_threshold=0) == ref


def test_lora_under_async_scheduling(ckpt_root):
    """Adapters' rows in a step are that step's: with two steps in flight each request keeps its
    adapter, and every output equals the synchronous engine's (tight cache with swap too)."""
    pytest.importorskip("peft")
    from test_lora import ALL, make_adapter

    path = build_tiny_checkpoint(ckpt_root, "llama")
    adapters = [LoRARequest("qv", 1, make_adapter(path, f"{path}-lora-qv", 1, ["q_proj", "v_proj"])),
                LoRARequest("all", 2, make_adapter(path, f"{path}-lora-all", 2, ALL, r=4, rslora=True)), None]
    prompts = random_prompts(9, seed=13, hi=70)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def outputs(async_scheduling: bool, **kw) -> dict:
        engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", enable_lora=True, max_loras=2,
                                                       async_scheduling=async_scheduling, **kw))
        try:
            for i, p in enumerate(prompts):
                engine.add_request(str(i), {"prompt_token_ids": p}, params, lora_request=adapters[i % 3])
            done = run_to_completion(engine)
            assert not engine.scheduler.in_flight
            assert_cache_pressure(engine, kw.get("preemption_mode"))
            return {rid: o.outputs[0].token_ids for rid, o in done.items()}
        finally:
            engine.shutdown()

    ref = outputs(False)
    assert outputs(True) == ref
    assert outputs(True, **dict(TIGHT, preemption_mode="swap")) == ref


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_scheduling_on_smollm2_under_a_tight_cache(smollm2_path, mode):
    """The real model in its default numerics (chosen per machine; every kernel batch invariant),
    chunked prefill and a cache too small for every sequence at once: async equals synchronous."""
    prompts = random_prompts(6, seed=9, hi=100)
    reqs = [(str(i), p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for i, p in enumerate(prompts)]
    tight = dict(max_num_batched_tokens=48, long_prefill_token_threshold=32, num_gpu_blocks_override=24,
                 block_size=16, preemption_mode=mode, num_cpu_blocks_override=64)

    def outputs(async_scheduling: bool) -> dict:
        engine = LLMEngine.from_engine_args(EngineArgs(model=smollm2_path, async_scheduling=async_scheduling, **tight))
        try:
            for rid, prompt, params in reqs:
                engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            done = run_to_completion(engine)
            assert engine.get_stats()["num_preemptions"] > 0, "the cache was not tight: the test tests less"
            return {rid: o.outputs[0].token_ids for rid, o in done.items()}
        finally:
            engine.shutdown()

    assert outputs(True) == outputs(False)
