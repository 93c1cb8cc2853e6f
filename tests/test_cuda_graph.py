"""Decode steps through ``CudaGraphRunner``'s static buffers, on a CPU: the CUDA backend's Triton
kernel and the Triton ops (norms, activation, rotary fused with the K/V write) under the
interpreter, as a GPU runs them, and each "graph" an ``EagerReplay`` (it runs the captured forward
again over the same buffers, as a replay reads the same addresses). What this checks is the
plumbing a real graph depends on: padding rows that write only the scratch block, block-table
columns left from earlier steps, sizes chosen per step. tests/gpu replays real CUDA graphs."""

from __future__ import annotations

import os

import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.worker import cuda_graph
from pagellm.worker.cuda_graph import EagerReplay, default_capture_sizes

from conftest import build_tiny_checkpoint

PROMPTS = [[1, 5, 9, 200, 31, 7], list(range(40, 75)), [3] * 17]
MAX_TOKENS = [9, 4, 6]  # (requests end at different steps: batches of 3, 2 and 1 decodes)


def test_default_capture_sizes_are_vllms_up_to_max_num_seqs():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(3) == [1, 2, 4]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert default_capture_sizes(256)[-3:] == [240, 248, 256] and default_capture_sizes(1000)[-1] == 256
    args = EngineArgs(cudagraph_capture_sizes="1, 2,8").create_engine_config().device
    assert args.cudagraph_capture_sizes == (1, 2, 8)
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        EngineArgs(cudagraph_capture_sizes="1,x").create_engine_config()
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        EngineArgs(cudagraph_capture_sizes=[0, 4]).create_engine_config()


def test_parallelism_on_cuda_is_refused_by_name():
    with pytest.raises(ValueError, match="tensor_parallel_size.*not supported on CUDA"):
        EngineArgs(device="cuda", tensor_parallel_size=2).create_engine_config()


INTERPRETER_ONLY = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="a GPU replays real graphs (tests/gpu)")


def _run_as_a_gpu_would(monkeypatch) -> tuple[list[int], list[bool]]:
    """The CUDA backend, "graphs" (``EagerReplay``) and the Triton ops (not the CPU kernels; the
    rotary writes K/V in the same kernel) on this CPU. Returns the lists the run fills: each replayed
    step's rows, and per rotary call whether it wrote the K/V."""
    from pagellm.attention.cuda_paged import CudaPagedAttention
    from pagellm.kernels import triton_ops
    from pagellm.layers import custom_op
    from pagellm.worker import worker as worker_mod

    monkeypatch.setattr(worker_mod, "select_attention_backend", lambda cache, dtype, **kw: CudaPagedAttention())
    monkeypatch.setattr(worker_mod.Worker, "_cuda_graphs_apply", lambda self: True)
    monkeypatch.setattr(cuda_graph, "cuda_graph", EagerReplay.make)
    replayed: list[int] = []
    run = cuda_graph.CudaGraphRunner.run

    def counting_run(self, input_ids, positions, meta):
        out = run(self, input_ids, positions, meta)
        if out is not None:
            replayed.append(input_ids.shape[0])
        return out

    monkeypatch.setattr(cuda_graph.CudaGraphRunner, "run", counting_run)
    monkeypatch.setattr(custom_op, "cpu_kernels_apply", lambda device, dtype: False)
    monkeypatch.setattr(custom_op, "triton_kernels_apply", lambda device: True)
    fused: list[bool] = []
    rotary_and_write = triton_ops.rotary_and_write_kv

    def counting_rotary(q, k, v, cos, sin, key_cache=None, value_cache=None, slot_mapping=None):
        fused.append(key_cache is not None)
        rotary_and_write(q, k, v, cos, sin, key_cache, value_cache, slot_mapping)

    monkeypatch.setattr(triton_ops, "rotary_and_write_kv", counting_rotary)
    return replayed, fused


@pytest.mark.slow
@INTERPRETER_ONLY
def test_decode_steps_through_the_static_buffers_keep_greedy_outputs(ckpt_root, monkeypatch):
    from pagellm.layers import custom_op

    path = build_tiny_checkpoint(ckpt_root, "llama")
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kw = dict(dtype="float32", device="cpu", num_gpu_blocks_override=12, max_num_seqs=4)
    ref = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, params, use_tqdm=False)]

    replayed, fused = _run_as_a_gpu_would(monkeypatch)
    llm = LLM(path, cudagraph_capture_sizes=[1, 4], **kw)  # (2 decodes padded with a row used before)
    worker = llm.llm_engine.executor.worker
    ops = [m for m in worker.model_runner.model.modules() if isinstance(m, custom_op.CustomOp)]
    assert ops and all(m.use_triton and not m.use_kernel for m in ops)
    cache = worker.cache_engine
    scratch = cache.scratch_block
    assert scratch == 12 and cache.kv.shape[2] == 13 * 16  # one block past the pool's
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert fused and all(fused)  # (every layer's rotary wrote the K/V: none left to the backend)
    # Every decode step went through a "graph": 3 decodes padded to 4, then 2 padded to 4, then 1.
    assert sorted(set(replayed)) == [1, 2, 3] and worker.model_runner.cuda_graphs.num_replays == len(replayed)
    # The padding rows wrote the scratch block (3 -> 4), and no block the pool hands out holds
    # anything past what the requests wrote: total K rows written equal the tokens computed.
    k = cache.kv[:, 0]
    assert k[:, scratch * 16].abs().sum() > 0
    written = int((k[0, :scratch * 16].abs().sum(-1).sum(-1) > 0).sum())
    assert written == sum(len(p) + n - 1 for p, n in zip(PROMPTS, MAX_TOKENS, strict=True))


@pytest.mark.slow
@INTERPRETER_ONLY
def test_speculative_verification_steps_replay_graphs_too(ckpt_root, monkeypatch):
    """Issue 64 item 4: a step verifying drafts is decode rows (one per position, each attending up
    to itself), so it replays the graph of its row count: greedy outputs equal to the plain engine's,
    and steps with more rows than sequences went through a graph."""
    path = build_tiny_checkpoint(ckpt_root, "llama")
    prompts = [{"prompt_token_ids": [3, 4, 5] * 6}, {"prompt_token_ids": [7, 8] * 9}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", num_gpu_blocks_override=12, max_num_seqs=4)
    ref = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, params, use_tqdm=False)]
    replayed, _ = _run_as_a_gpu_would(monkeypatch)
    # (the model drafts for itself: its drafts are its own greedy tokens, so verification keeps them)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3, "cost_model": False}
    llm = LLM(path, cudagraph_capture_sizes=[1, 2, 4, 8], speculative_config=spec, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert llm.llm_engine.get_stats()["spec_num_accepted_tokens"] > 0  # (drafts were verified, some kept)
    assert max(replayed) > len(prompts)  # (a step of verification rows replayed its graph)
