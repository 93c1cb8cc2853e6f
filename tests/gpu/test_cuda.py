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

# (fewer graph sizes than max_num_seqs' default: each engine captures at start-up)
GPU = dict(device="cuda", cudagraph_capture_sizes=[1, 2, 4, 8])
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 5, 9, 200, 31, 7], list(range(40, 140)), [3] * 33, list(range(500, 517))]


@pytest.fixture(params=[BLOCK, 128], ids=lambda p: f"partition{p}")
def partition(request, monkeypatch):
    """Decodes' keys split into one-block partitions (several programs and the reduce, compiled),
    and the default (one partition at these contexts)."""
    from pagellm.attention import triton_attention

    monkeypatch.setattr(triton_attention, "PARTITION_SIZE", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,softcap", [(None, None), (24, 2.0)])
def test_the_compiled_kernel_equals_the_reference(dtype, window, softcap, partition):
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


@pytest.mark.parametrize("window", [None, 20])
def test_a_row_gets_the_same_bits_decoded_or_prefilled_alone_or_in_a_batch(partition, window):
    """(Split decodes against chunks that combine partitions in one program: the same two functions
    in the same order, compiled into two kernels.)"""
    from pagellm.attention.cuda_paged import CudaPagedAttention

    hq, hkv, d = 8, 2, 64
    for dtype in (torch.float32, torch.bfloat16):
        seqs = sequences([(53, 1), (37, 1), (70, 1), (53, 20)], hq, hkv, d, seed=5)
        seqs[3] = (53, 20, seqs[0][2], torch.cat([seqs[3][3][:19], seqs[0][3]]), seqs[0][4], seqs[0][5])
        caches = [torch.zeros(NUM_BLOCKS * BLOCK, hkv, d, dtype=dtype) for _ in range(2)]
        backend = CudaPagedAttention()
        alone = run_backend(backend, seqs[:1], caches, hq, hkv, d, dtype, window, device="cuda")[0]
        batched = run_backend(backend, seqs[:3], caches, hq, hkv, d, dtype, window, device="cuda")[0]
        prefilled = run_backend(backend, seqs[3:], caches, hq, hkv, d, dtype, window, device="cuda")[0][-1:]
        assert torch.equal(alone, batched) and torch.equal(alone, prefilled), dtype


def _greedy(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


def test_float32_greedy_equals_hf_on_the_gpu(ckpt_root):
    import transformers

    path = build_tiny_checkpoint(ckpt_root, "llama")
    llm = LLM(path, **GPU, dtype="float32")
    assert llm.llm_engine.executor.worker.model_runner.attn_backend.name == "cuda"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for prompt, got in zip(PROMPTS, _greedy(llm), strict=True):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert got == ref[0, len(prompt):].tolist()


def _with_top(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp[t].logprob for t in sorted(lp, key=lambda t: lp[t].rank)[:5]}
                                      for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scheduling_on_the_gpu(ckpt_root, arch, dtype):
    """A tight cache preempting by recompute and by swap (pinned CPU memory), small chunks, prefix
    hits; a windowed, soft-capped family too. float32: the same greedy tokens. bfloat16 (CUDA's
    default): the attention kernel is batch-invariant, but cuBLAS picks GEMM kernels by the number
    of rows, so a row's bits can change with the batch: logprob-close (each side's token in the
    other's top 5 where they diverge) at near ties (``MAX_GAP["bfloat16"]``), printed with their margins."""
    from test_numerics import MAX_GAP, check_logprobs_close

    path = build_tiny_checkpoint(ckpt_root, arch)
    prompts = PROMPTS + [PROMPTS[1] + [9, 9]]  # (a prefix hit)
    ref = _with_top(LLM(path, **GPU, dtype=dtype), prompts[:-1])
    ref += _with_top(LLM(path, **GPU, dtype=dtype), prompts[-1:])
    for mode in ("recompute", "swap"):
        llm = LLM(path, **GPU, dtype=dtype, num_gpu_blocks_override=14, block_size=16, preemption_mode=mode,
                  max_num_batched_tokens=64, long_prefill_token_threshold=24, swap_space=0.01)
        got = _with_top(llm, prompts)
        stats = llm.llm_engine.get_stats()
        assert stats["num_preemptions"] > 0 and (mode == "recompute" or stats["num_swap_outs"] > 0)
        if dtype == "float32":
            assert [t for t, _ in got] == [t for t, _ in ref]
        else:
            gaps = check_logprobs_close(got, ref)
            print(f"{arch} bfloat16 {mode}: {len(gaps)} of {len(prompts)} diverged, margins {gaps}")
            assert all(g <= MAX_GAP["bfloat16"] for g in gaps), f"{arch} {mode}: divergences at gaps {gaps}"


def test_beams_and_structured_output_on_the_gpu(ckpt_root):
    path = build_tiny_checkpoint(ckpt_root, "llama")
    llm = LLM(path, **GPU, dtype="float32")
    cpu = LLM(path, device="cpu", dtype="float32")
    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    on_gpu = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], beams)[0].sequences
    on_cpu = cpu.beam_search([{"prompt_token_ids": PROMPTS[0]}], beams)[0].sequences
    assert [s.output_token_ids for s in on_gpu] == [s.output_token_ids for s in on_cpu]
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    out = llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0].text
    assert out in ("yes", "no", "maybe")


def test_decode_graphs_keep_float32_greedy_and_replay_the_eager_bits(ckpt_root):
    """Graphs on (the default) and off give the same float32 tokens; a replay equals an eager pass
    over the same padded batch bit for bit, in bfloat16 too (the same kernels, same shapes)."""
    path = build_tiny_checkpoint(ckpt_root, "llama")
    graphed = LLM(path, **GPU, dtype="float32", max_num_seqs=8)
    eager = LLM(path, **GPU, dtype="float32", enforce_eager=True)
    runner = graphed.llm_engine.executor.worker.model_runner
    assert runner.cuda_graphs is not None and eager.llm_engine.executor.worker.model_runner.cuda_graphs is None
    assert _greedy(graphed) == _greedy(eager)
    assert runner.cuda_graphs.num_replays > 0
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, **GPU, dtype=dtype, max_num_seqs=8)
        _greedy(llm, PROMPTS[:3])  # (the static buffers now hold a step of decodes padded to 4)
        graphs = llm.llm_engine.executor.worker.model_runner.cuda_graphs
        kv_caches = llm.llm_engine.executor.worker.cache_engine.kv_caches
        graph, out = graphs.graphs[4]
        graph.replay()
        replayed = out.clone()
        with torch.inference_mode():
            direct = graphs.model(graphs.input_ids[:4], graphs.positions[:4], kv_caches, graphs.metadata(4))
        assert torch.equal(replayed, direct), dtype


def test_lora_and_speculative_decoding_on_the_gpu(ckpt_root, tmp_path):
    """The LoRA torch path in the model's dtype, and n-gram speculation, equal the CPU's tokens."""
    peft = pytest.importorskip("peft")
    import transformers

    from pagellm.lora_request import LoRARequest

    path = build_tiny_checkpoint(ckpt_root, "llama")
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                          init_lora_weights=False)
    peft.get_peft_model(base, cfg).save_pretrained(str(tmp_path / "adapter"))
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(path, device=device, dtype="float32", enable_lora=True, max_lora_rank=8)
        outs[device] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False, lora_request=lora)]
    assert outs["cuda"] == outs["cpu"]
    spec = LLM(path, **GPU, dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert _greedy(spec, PROMPTS + [[7, 8, 9] * 12]) == _greedy(LLM(path, **GPU, dtype="float32"),
                                                                PROMPTS + [[7, 8, 9] * 12])


def test_what_cuda_lacks_is_refused_by_name(ckpt_root):
    path = build_tiny_checkpoint(ckpt_root, "llama")
    for kw, match in (({"kv_cache_dtype": "int8"}, "int8 is not supported on CUDA"),
                      ({"quantization": "gguf"}, "quantization='gguf'"),
                      ({"quantization": "q8_0"}, "q8_0"),
                      ({"tensor_parallel_size": 2}, "not supported on CUDA")):
        with pytest.raises(ValueError, match=match):
            LLM(path, **GPU, **kw)
