"""Prefix caching through the real engine: identical greedy outputs with caching on and off."""

from __future__ import annotations

import random

import pytest

from pagellm import LLMEngine, SamplingParams
from pagellm.config import EngineArgs
from pagellm.utils import cdiv

from conftest import build_tiny_checkpoint, run_to_completion

MAX_TOKENS = 16


def shared_prefix_prompts(n: int, prefix_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 49152) for _ in range(prefix_len)] for _ in range(2)]
    return [prefixes[i % 2][: prefix_len - 7 * (i % 3)] + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 40))]
            for i in range(n)]


def run(path, prompts, **kw):
    kw.setdefault("kv_cache_memory", "16MiB")
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, **kw))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Two waves: the second finds the first's blocks in the cache (freed, not yet evicted).
    half = len(prompts) // 2
    outs = {}
    for wave in (range(half), range(half, len(prompts))):
        for i in wave:
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
        outs.update(run_to_completion(engine))
    return [outs[str(i)] for i in range(len(prompts))], engine


@pytest.fixture(scope="module")
def setup(ckpt_root):
    path = build_tiny_checkpoint(ckpt_root, "llama")
    prompts = shared_prefix_prompts(12, prefix_len=90, seed=5)
    ref, _ = run(path, prompts, enable_prefix_caching=False)
    return path, prompts, [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 9, "long_prefill_token_threshold": 0},
    {"block_size": 1},
    {"block_size": 32},
    {"tight": True},
    {"tight": True, "max_num_batched_tokens": 13, "long_prefill_token_threshold": 0},
], ids=["default", "chunked", "bs1", "bs32", "tight", "tight_chunked"])
def test_caching_on_equals_off(setup, kw):
    path, prompts, ref = setup
    kw = dict(kw)
    if kw.pop("tight", False):
        # Room for a few requests at once, not for their growth: forces preemption.
        kw["num_gpu_blocks_override"] = max(cdiv(len(p) + MAX_TOKENS, 16) for p in prompts) + 6
    outs, engine = run(path, prompts, **kw)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = engine.get_stats()
    assert stats["prefix_cache_hits"] > 0 and 0 < stats["prefix_cache_hit_rate"] < 1
    assert any(o.num_cached_tokens > 0 for o in outs)
    if "num_gpu_blocks_override" in kw:
        assert stats["num_preemptions"] > 0


def test_multi_turn_reuses_generated_tokens(setup):
    path, prompts, _ = setup
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, kv_cache_memory="16MiB"))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("t1", {"prompt_token_ids": prompts[0]}, params)
    first = run_to_completion(engine)["t1"].outputs[0].token_ids
    turn2 = prompts[0] + first + [11, 12, 13]
    engine.add_request("t2", {"prompt_token_ids": turn2}, params)
    out = run_to_completion(engine)["t2"]
    # Everything but the partial last block of turn one (and never the last token) was cached.
    assert out.num_cached_tokens >= (len(prompts[0]) + len(first) - 1) // 16 * 16 - 16


def test_cache_salt_and_reset(setup):
    path, prompts, _ = setup
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, kv_cache_memory="16MiB"))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, params, cache_salt="tenant-a")
    run_to_completion(engine)
    engine.add_request("b", {"prompt_token_ids": prompts[0], "cache_salt": "tenant-b"}, params)
    assert run_to_completion(engine)["b"].num_cached_tokens == 0
    engine.add_request("c", {"prompt_token_ids": prompts[0]}, params, cache_salt="tenant-a")
    assert run_to_completion(engine)["c"].num_cached_tokens > 0
    assert engine.reset_prefix_cache()
    engine.add_request("d", {"prompt_token_ids": prompts[0]}, params, cache_salt="tenant-a")
    assert run_to_completion(engine)["d"].num_cached_tokens == 0
