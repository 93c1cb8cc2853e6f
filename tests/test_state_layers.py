"""Models with state layers (LFM2's short convolutions) in the engine: samples that share a state
until each writes its own give the same tokens under memory pressure as without it, and what the
states cannot do yet is refused at start-up, naming it. (HF parity: test_hf_parity; scheduling
invariance, beams: test_scheduling_invariance, test_beam_search.)"""

from __future__ import annotations

import pytest

from pagellm import EngineArgs, LLMEngine, SamplingParams
from pagellm.utils import cdiv

from conftest import build_tiny_checkpoint, run_to_completion
from test_hf_parity import random_prompts


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = run_to_completion(engine)  # (invariants after every step)
    return [[o.token_ids for o in done[str(i)].outputs] for i in range(len(prompts))]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_parallel_samples_sharing_states_do_not_change_under_memory_pressure(ckpt_root, mode):
    path = build_tiny_checkpoint(ckpt_root, "lfm2")
    prompts = random_prompts(4, seed=3, lo=10, hi=50)
    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, n=3, seed=5)
    ref = _run(LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="16MiB")),
               prompts, params)
    bs = 8
    # The largest request alone, barely: three samples' blocks and the states of its two groups each.
    need = max(3 * cdiv(len(p) + 16, bs) + 3 * 2 for p in prompts)
    tight = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", num_gpu_blocks_override=need,
                                                  block_size=bs, preemption_mode=mode))
    assert _run(tight, prompts, params) == ref
    assert tight.scheduler.num_preemptions > 0
    assert mode != "swap" or tight.scheduler.num_swap_outs > 0
    kv = tight.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("kwargs,named", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8'"),
    (dict(disable_hybrid_kv_cache_manager=True), "disable_hybrid_kv_cache_manager"),
])
def test_what_states_cannot_do_yet_is_refused_at_start_up(ckpt_root, kwargs, named):
    path = build_tiny_checkpoint(ckpt_root, "lfm2")
    with pytest.raises(ValueError, match=f"state layers.*{named}"):
        LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="16MiB", **kwargs))
