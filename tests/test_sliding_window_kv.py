"""Sliding-window layers give back the K/V their window can no longer read, in the engine: Gemma 3's
five windowed layers to one global layer at a 32k-token context hold a fraction of the KV blocks
one block table for every layer holds (``disable_hybrid_kv_cache_manager``, the layout before
groups), with the same greedy tokens. Short contexts are checked against HF in test_hf_parity."""

from __future__ import annotations

import random

from pagellm import EngineArgs, LLMEngine, SamplingParams

from conftest import build_tiny_checkpoint

WINDOW = 512  # Gemma 3 270M's own
CONTEXT = 32 * 1024


def _peak_kv(path: str, prompt: list[int], **kwargs) -> tuple[list[int], int, int]:
    """Greedy tokens, and the most blocks in use at once times the layers a block holds (so that
    both layouts count one layer's K/V of ``block_size`` tokens as one unit), and that unit count."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", kv_cache_memory="160MiB",
                                                   max_num_batched_tokens=4096, **kwargs))
    kv = engine.kv_cache_manager
    layers = engine.model_info.kv_cache_config.layers_per_page
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    peak, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
        engine.scheduler.check_invariants()
    assert out is not None
    return out.outputs[0].token_ids, peak * layers, len(kv.specs)


def test_gemma3_at_32k_holds_a_quarter_of_the_blocks_with_the_same_tokens(ckpt_root):
    path = build_tiny_checkpoint(ckpt_root, "gemma3-llamacpp", sliding_window=WINDOW,
                                 max_position_embeddings=CONTEXT + 64)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 49152) for _ in range(CONTEXT)]
    hybrid, held, groups = _peak_kv(path, prompt)
    one_table, held_before, one = _peak_kv(path, prompt, disable_hybrid_kv_cache_manager=True)
    assert (groups, one) == (6, 1)
    assert hybrid == one_table
    # One table: every token of all six layers. Groups: the global layer's every token, each
    # windowed layer's window plus the step's chunk (4096 tokens here) at most.
    assert held_before >= 6 * CONTEXT // 16
    assert held <= 0.25 * held_before, (held, held_before)
