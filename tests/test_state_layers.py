"""Models with state layers (LFM2's short convolutions, Qwen3.5's gated DeltaNet) in the engine:
samples that share a state until each writes its own give the same tokens under memory pressure as
without it, a state larger than a block raises the block size, and what the states cannot do yet
is refused at start-up, naming it. (HF parity: test_hf_parity; scheduling
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


# (LFM2's two groups of convolution states; Qwen3.5's three of DeltaNet states, whose pages need 16 tokens;
# Granite 4's and Nemotron-H's Mamba2 states, at 32 and 16)
@pytest.mark.parametrize("arch,bs,state_groups", [("lfm2", 8, 2), ("qwen3_5", 16, 3), ("granite4", 32, 3),
                                                  ("nemotron_h", 16, 2)])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_parallel_samples_sharing_states_do_not_change_under_memory_pressure(ckpt_root, mode, arch, bs,
                                                                           state_groups):
    path = build_tiny_checkpoint(ckpt_root, arch)
    prompts = random_prompts(4, seed=3, lo=10, hi=50)
    params = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, n=3, seed=5)
    ref = _run(LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="16MiB")),
               prompts, params)
    # The largest request alone, barely: three samples' blocks and the states of each state group
    # (a step's three each, states kept for prefix hits), and the pool's null block.
    need = max(3 * cdiv(len(p) + 16, bs) + 3 * 3 * state_groups + 1 for p in prompts)
    tight = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", num_gpu_blocks_override=need,
                                                  block_size=bs, preemption_mode=mode))
    assert tight.block_size == bs
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


def test_a_state_larger_than_a_block_raises_the_block_size(ckpt_root):
    """Qwen3.5's DeltaNet states at 32 features per head (16 KiB a layer) need a page of 32 tokens of
    its attention K/V (512 bytes a token in float32): block_size goes from 16 to 32, saying so, and
    the tokens are still HF's."""
    import transformers

    from test_hf_parity import assert_equal_but_float32_ties, engine_greedy, hf_greedy

    path = build_tiny_checkpoint(ckpt_root, "qwen3_5", linear_key_head_dim=32, linear_value_head_dim=32)
    prompts = random_prompts(4, seed=8, lo=20, hi=90)
    got, engine = engine_greedy(path, prompts)
    assert engine.block_size == 32 and engine.executor.worker.spec.block_size == 32
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    assert_equal_but_float32_ties(hf, prompts, got, hf_greedy(hf, prompts))
