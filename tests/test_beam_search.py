"""In-engine beam search equals Hugging Face ``generate(num_beams=k, do_sample=False)`` token for
token, with every finished beam in the same rank order; memory pressure does not change it."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagellm import LLM, BeamSearchParams
from pagellm.core.beam_search import BeamSearchState
from pagellm.utils import cdiv

from conftest import build_tiny_checkpoint
from test_hf_parity import SMOL_PROMPTS, random_prompts


def hf_beams(model, prompt: list[int], k: int, new_tokens: int, length_penalty: float, early_stopping,
             eos: int | None, use_cache: bool = True) -> list[list[int]]:
    """HF's k returned beams (best first), each cut after its EOS. ``use_cache=False``: every step
    a forward over the whole sequence, the model's definition without HF's cache reordering."""
    config = transformers.GenerationConfig(
        do_sample=False, num_beams=k, num_return_sequences=k, max_new_tokens=new_tokens, use_cache=use_cache,
        length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0, bos_token_id=None)
    model.generation_config.eos_token_id = eos
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    outs = []
    for row in gen[:, len(prompt):].tolist():
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]
        outs.append(row)
    return outs


def engine_beams(llm: LLM, prompts: list[list[int]], k: int, new_tokens: int, length_penalty: float, early_stopping,
                 ignore_eos: bool) -> list[list[list[int]]]:
    params = BeamSearchParams(beam_width=k, max_tokens=new_tokens, ignore_eos=ignore_eos,
                              length_penalty=length_penalty, early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_usable_blocks
    return [[s.output_token_ids for s in o.sequences] for o in outs]


# Mistral's and Gemma 2's windows (24 positions) bind within these prompts; Gemma 2 also soft-caps.
# The state families' beams share their states until each writes its own (copy-on-write). Nemotron-H's
# oracle is HF without its cache: with it (transformers 5.24) HF's k = 4 beams differ from HF's own
# uncached ones, which are ours.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2", "lfm2", "qwen3_5", "granite4", "nemotron_h"])
@pytest.mark.parametrize("k,length_penalty,early_stopping", [(2, 1.0, False), (4, 0.5, True), (4, 1.0, "never")])
def test_tiny_models_match_hf_beam_search(ckpt_root, arch, k, length_penalty, early_stopping):
    path = build_tiny_checkpoint(ckpt_root, arch)
    prompts = random_prompts(4, seed=21, lo=3, hi=60)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = [hf_beams(hf, p, k, 12, length_penalty, early_stopping, None, use_cache=arch != "nemotron_h")
           for p in prompts]
    llm = LLM(path, kv_cache_memory="16MiB", block_size=4, dtype="float32")  # the HF-exact oracle
    assert engine_beams(llm, prompts, k, 12, length_penalty, early_stopping, ignore_eos=True) == ref
    assert all(len(beams) == k for beams in ref)


def test_smollm2_matches_hf_beam_search_with_eos(smollm2_hf):
    tok, hf = smollm2_hf
    chat = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in ("What is 2+2? Answer with one number.", "Say hi.")]
    prompts = [tok.encode(p) for p in SMOL_PROMPTS[:3]] + [tok.encode(c, add_special_tokens=False) for c in chat]
    llm = LLM(None, kv_cache_memory="256MiB", dtype="float32")  # the HF-exact oracle
    eos = llm.llm_engine.tokenizer.eos_token_id
    saw_eos = False
    for k in (2, 4):
        ref = [hf_beams(hf, p, k, 16, 1.0, False, eos) for p in prompts]
        assert engine_beams(llm, prompts, k, 16, 1.0, False, ignore_eos=False) == ref
        saw_eos |= any(b and b[-1] == eos for beams in ref for b in beams)
    assert saw_eos, "no beam ended with EOS: the finished-hypothesis path went untested"


@pytest.mark.parametrize("mode", ["auto", "swap", "recompute"])
def test_beam_search_does_not_change_under_memory_pressure(tiny_llama, mode):
    prompts = random_prompts(3, seed=5, lo=10, hi=50)
    k, new = 4, 14
    ref = engine_beams(LLM(tiny_llama, kv_cache_memory="16MiB", block_size=4), prompts, k, new, 1.0, False, True)
    # The largest search alone, barely: its prompt once, plus each beam's own blocks.
    need = max(cdiv(len(p), 4) + k * (cdiv(new, 4) + 1) for p in prompts) + 1
    tight = LLM(tiny_llama, num_gpu_blocks_override=need, block_size=4, preemption_mode=mode,
                max_num_batched_tokens=32, long_prefill_token_threshold=0)
    assert engine_beams(tight, prompts, k, new, 1.0, False, True) == ref
    sched = tight.llm_engine.scheduler
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swap_outs > 0


def test_beams_share_blocks(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_memory="16MiB", block_size=4)
    eng = llm.llm_engine
    prompt = list(range(10, 90))  # 20 full blocks
    eng.add_request("b", {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        eng.scheduler.check_invariants()
        peak = max(peak, eng.kv_cache_manager.num_blocks - eng.kv_cache_manager.num_free_blocks)
    assert peak <= 20 + 4 * 2  # the prompt once, plus at most two private blocks per beam


def test_beam_state_rejects_bad_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    assert BeamSearchState(3, 5, eos_token_id=None).num_candidates == 6
