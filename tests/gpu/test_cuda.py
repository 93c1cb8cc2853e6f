"""The GPU subset (``benchmarks/gpu_check.sh`` runs it on the lent H100; skipped without CUDA):
the Triton kernel compiled, bfloat16 included; the engine on CUDA equal to HF in float32 and
logprob-close in bfloat16; scheduling (chunks, prefix hits, recompute and swap to pinned memory)
never changes greedy outputs; beams and structured output on the GPU."""

from __future__ import annotations

import pytest
import torch
from paged_cases import BLOCK, NUM_BLOCKS, SHAPES, run_backend, sequences

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import BeamSearchParams, StructuredOutputsParams

from conftest import build_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 5, 9, 200, 31, 7], list(range(40, 140)), [3] * 33, list(range(500, 517))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, 2.0)])
def test_the_compiled_kernel_equals_the_reference(dtype, window, softcap):
    from pagellm.attention.cuda_paged import CudaPagedAttention
    from pagellm.attention.torch_paged import TorchPagedAttention

    hq, hkv, d = 8, 2, 64
    seqs = sequences(SHAPES, hq, hkv, d, seed=11)
    caches = [torch.zeros(NUM_BLOCKS * BLOCK, hkv, d, dtype=dtype) for _ in range(2)]
    ref = run_backend(TorchPagedAttention(), seqs, caches, hq, hkv, d, torch.float32, window, softcap, "cuda")
    got = run_backend(CudaPagedAttention(), seqs, caches, hq, hkv, d, dtype, window, softcap, "cuda")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_a_row_gets_the_same_bits_decoded_or_prefilled_alone_or_in_a_batch():
    from pagellm.attention.cuda_paged import CudaPagedAttention

    hq, hkv, d = 8, 2, 64
    for dtype in (torch.float32, torch.bfloat16):
        seqs = sequences([(53, 1), (37, 1), (70, 1), (53, 20)], hq, hkv, d, seed=5)
        seqs[3] = (53, 20, seqs[0][2], torch.cat([seqs[3][3][:19], seqs[0][3]]), seqs[0][4], seqs[0][5])
        caches = [torch.zeros(NUM_BLOCKS * BLOCK, hkv, d, dtype=dtype) for _ in range(2)]
        backend = CudaPagedAttention()
        alone = run_backend(backend, seqs[:1], caches, hq, hkv, d, dtype, device="cuda")[0]
        batched = run_backend(backend, seqs[:3], caches, hq, hkv, d, dtype, device="cuda")[0]
        prefilled = run_backend(backend, seqs[3:], caches, hq, hkv, d, dtype, device="cuda")[0][-1:]
        assert torch.equal(alone, batched) and torch.equal(alone, prefilled), dtype


def _greedy(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


def test_float32_greedy_equals_hf_on_the_gpu(ckpt_root):
    import transformers

    path = build_tiny_checkpoint(ckpt_root, "llama")
    llm = LLM(path, device="cuda", dtype="float32")
    assert llm.llm_engine.executor.worker.model_runner.attn_backend.name == "cuda"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for prompt, got in zip(PROMPTS, _greedy(llm), strict=True):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert got == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_scheduling_never_changes_greedy_outputs_on_the_gpu(ckpt_root, arch):
    """bfloat16 (CUDA's default): a tight cache preempting by recompute and by swap (pinned CPU
    memory), small chunks, prefix hits; a windowed, soft-capped family too."""
    path = build_tiny_checkpoint(ckpt_root, arch)
    ref = _greedy(LLM(path, device="cuda"))
    prompts = PROMPTS + [PROMPTS[1] + [9, 9]]  # (a prefix hit)
    ref.append(_greedy(LLM(path, device="cuda"), [prompts[-1]])[0])
    for mode in ("recompute", "swap"):
        llm = LLM(path, device="cuda", num_gpu_blocks_override=14, block_size=16, preemption_mode=mode,
                  max_num_batched_tokens=64, long_prefill_token_threshold=24, swap_space=0.01)
        assert _greedy(llm, prompts) == ref
        stats = llm.llm_engine.get_stats()
        assert stats["num_preemptions"] > 0 and (mode == "recompute" or stats["num_swap_outs"] > 0)


def test_beams_and_structured_output_on_the_gpu(ckpt_root):
    path = build_tiny_checkpoint(ckpt_root, "llama")
    llm = LLM(path, device="cuda", dtype="float32")
    cpu = LLM(path, device="cpu", dtype="float32")
    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    on_gpu = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], beams)[0].sequences
    on_cpu = cpu.beam_search([{"prompt_token_ids": PROMPTS[0]}], beams)[0].sequences
    assert [s.output_token_ids for s in on_gpu] == [s.output_token_ids for s in on_cpu]
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    out = llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0].text
    assert out in ("yes", "no", "maybe")
