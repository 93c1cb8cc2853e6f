"""A decode step's layers in one C call (``kernels/decode_graph.c``) give the layer-by-layer path's bits."""

from __future__ import annotations

import os

import pytest
import torch
from test_scheduling_invariance import DEFAULT_NUMERICS_MODELS

from pagellm.kernels import decode_graph

from conftest import (
    build_tiny_checkpoint,
    build_tiny_gguf_valued_checkpoint,
    require_bf16_kernel,
    require_f32_gemm_kernel,
    require_int8_kernel,
)
from test_hf_parity import random_prompts


def _graphs(llm):
    return llm.llm_engine.executor.worker.model_runner.decode_graphs


def _layer_by_layer(llm) -> None:
    """From now on this engine's model runs decode steps one op at a time, as prefill steps do."""
    _graphs(llm).disable()


def _require_graph(dtype: str = "auto") -> None:
    if os.environ.get("PAGELLM_DECODE_GRAPH") == "0":
        pytest.skip("PAGELLM_DECODE_GRAPH=0")
    require_f32_gemm_kernel()
    if dtype == "bfloat16":
        require_bf16_kernel()
    assert decode_graph.enabled(), "decode_graph.c should build wherever the GEMM kernels do"


def test_decode_graph_takes_only_layer_classes_that_declare_it():
    """The graph replays Llama's block op for op: a layer class is taken only where its own body
    declares ``DECODE_GRAPH`` (a subclass may change forward, as MoE's does: it inherits no claim)."""
    from pagellm.models.decoder import DecoderLayer
    from pagellm.models.gemma import Gemma2DecoderLayer
    from pagellm.models.moe import MoeDecoderLayer
    from pagellm.worker.decode_graph import graph_layer

    class NewBlock(DecoderLayer):  # a new family's block that forgot to say
        pass

    class DeclaredBlock(DecoderLayer):
        DECODE_GRAPH = True

    def layer(cls):
        return cls.__new__(cls)  # (the class is what is read; no weights needed)

    assert all(graph_layer(layer(c)) for c in (DecoderLayer, Gemma2DecoderLayer, DeclaredBlock))
    assert not graph_layer(layer(NewBlock)) and not graph_layer(layer(MoeDecoderLayer))
    assert not graph_layer(torch.nn.Linear(2, 2))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,kv", [("auto", "auto"), ("auto", "float32"), ("auto", "int8"), ("float32", "auto"),
                                      ("bfloat16", "auto")])
def test_smollm2_decode_graph_gives_the_layer_by_layer_logprobs(dtype, kv):
    """Every token and every logprob of a batch of greedy requests (prefill steps, mixed steps, then
    decode steps at shrinking batch sizes) is the same float with the graph as without it, over
    each GEMM kernel (int8, float32 with its 4-bit copy below 16 rows, bfloat16)."""
    from pagellm import LLM, SamplingParams

    _require_graph(dtype)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, seed=3, lo=5, hi=90)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (3, 9, 17, 24, 30)]
    with LLM(None, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory="64MiB", enable_prefix_caching=False) as llm:
        _assert_graph_gives_the_layer_by_layer_logprobs(llm, prompts, params)


def _assert_graph_gives_the_layer_by_layer_logprobs(llm, prompts, params) -> None:
    graphed = llm.generate(prompts, params, use_tqdm=False)
    assert _graphs(llm).graph is not None, "every op of these layers is a kernel: the graph applies"
    _layer_by_layer(llm)
    plain = llm.generate(prompts, params, use_tqdm=False)
    for g, p in zip(graphed, plain, strict=True):
        assert g.outputs[0].token_ids == p.outputs[0].token_ids
        assert g.outputs[0].logprobs == p.outputs[0].logprobs


@pytest.mark.slow
def test_smollm2_decode_graph_under_preemption_and_sampling():
    """Seeded sampling with recompute preemption in a tight cache: the same tokens either way."""
    from pagellm import LLM, SamplingParams

    _require_graph()
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, seed=5, lo=20, hi=60)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=40, ignore_eos=True) for i in range(6)]
    outs = []
    for graph in (True, False):
        with LLM(None, num_gpu_blocks_override=24, block_size=16, enable_prefix_caching=False) as llm:
            if not graph:
                _layer_by_layer(llm)
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            assert (_graphs(llm).graph is not None) == graph
            assert llm.llm_engine.scheduler.num_preemptions > 0, "the cache should be tight enough to preempt"
    assert outs[0] == outs[1]


def test_decode_graph_checks_its_tables_and_inputs():
    _require_graph()
    fns = torch.ones(len(decode_graph.FNS), dtype=torch.int64)
    dims = torch.tensor([8, 2, 1, 4, 16, 16, 0, 1], dtype=torch.int64)  # (one rope table)
    layers = torch.zeros(1, len(decode_graph.LAYER_FIELDS), dtype=torch.int64)
    with pytest.raises(ValueError, match="wrong shape"):
        decode_graph.DecodeGraph(fns[:-1], dims, layers, 1e-6, 0.5, [])
    with pytest.raises(ValueError, match="int64"):
        decode_graph.DecodeGraph(fns.int(), dims, layers, 1e-6, 0.5, [])
    with pytest.raises(ValueError, match="address"):
        decode_graph.DecodeGraph(torch.zeros_like(fns), dims, layers, 1e-6, 0.5, [])
    bad_kind = layers.clone()
    bad_kind[0, decode_graph.LAYER_FIELDS.index("o_kind")] = 7
    with pytest.raises(ValueError, match="unknown GEMM kinds"):
        decode_graph.DecodeGraph(fns, dims, bad_kind, 1e-6, 0.5, [])
    bad_rope = layers.clone()
    bad_rope[0, decode_graph.LAYER_FIELDS.index("rope")] = 1
    with pytest.raises(ValueError, match="rope table"):
        decode_graph.DecodeGraph(fns, dims, bad_rope, 1e-6, 0.5, [])
    windowed = layers.clone()
    windowed[0, decode_graph.LAYER_FIELDS.index("window")] = 4
    no_windowed_kernel = fns.clone()
    no_windowed_kernel[decode_graph.FNS.index("decode_windowed")] = 0
    with pytest.raises(ValueError, match="address"):
        decode_graph.DecodeGraph(no_windowed_kernel, dims, windowed, 1e-6, 0.5, [])
    decode_graph.DecodeGraph(no_windowed_kernel, dims, layers, 1e-6, 0.5, [])  # (no layer calls it)
    g = decode_graph.DecodeGraph(fns, dims, layers, 1e-6, 0.5, [])
    assert (g.hidden, g.head_dim, g.block_size) == (8, 4, 16)
    with pytest.raises(ValueError, match="2 K/V caches for 1 layers"):
        g.bind_caches([(torch.zeros(1), torch.zeros(1))] * 2)
    t = 3
    args = dict(cos=torch.zeros(1, t, 4), sin=torch.zeros(1, t, 4), slot_mapping=torch.zeros(t, dtype=torch.int64),
                block_tables=torch.zeros(t, 2, dtype=torch.int64), seq_lens=torch.ones(t, dtype=torch.int64))
    with pytest.raises(ValueError, match="bind_caches"):
        g.run(torch.zeros(t, 8), **args)  # never reaches the kernels with dangling cache pointers
    g.bind_caches([(torch.zeros(1), torch.zeros(1))])
    with pytest.raises(ValueError, match="as when the graph was captured"):  # the kernels were chosen for float32
        g.bind_caches([(torch.zeros(1, dtype=torch.float16), torch.zeros(1, dtype=torch.float16))])
    with pytest.raises(ValueError, match="x must be"):
        g.run(torch.zeros(t, 7), **args)
    with pytest.raises(ValueError, match="seq_lens"):
        g.run(torch.zeros(t, 8), **{**args, "seq_lens": torch.ones(t, dtype=torch.int32)})
    with pytest.raises(ValueError, match="block_tables"):
        g.run(torch.zeros(t, 8), **{**args, "block_tables": torch.zeros(t + 1, 2, dtype=torch.int64)})


@pytest.mark.parametrize("model", ["gemma2-256", "gemma3-256", "qwen3-128", "mistral-128"])
def test_decode_graph_takes_gemma_qk_norms_and_windows_with_the_same_bits(ckpt_root, model):
    """Gemma 2 and 3's blocks (four norms, GeGLU, a window on the sliding layers, Gemma 2's soft-caps,
    Gemma 3's q/k norms and two rotary tables), Qwen3's q/k norms and Mistral's window in the default
    GGUF numerics: every token and logprob the same floats with the graph as layer by layer."""
    from pagellm import LLM, SamplingParams

    _require_graph()
    require_int8_kernel()
    arch, overrides = DEFAULT_NUMERICS_MODELS[model]
    path = build_tiny_gguf_valued_checkpoint(os.path.join(ckpt_root, model), arch, **overrides)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, seed=9, lo=20, hi=60)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (30, 12, 40, 25)]
    with LLM(path, quantization="gguf", kv_cache_memory="64MiB", enable_prefix_caching=False) as llm:
        _assert_graph_gives_the_layer_by_layer_logprobs(llm, prompts, params)


def test_decode_graph_gathers_act_order_inputs_with_the_same_bits(ckpt_root, tmp_path):
    """A GPTQ act-order checkpoint at width: each projection's activations are gathered into its
    blocks' input order before the int8 GEMM, in the graph as layer by layer (the same floats)."""
    from quant_writers import write_quantized

    from pagellm import LLM, SamplingParams

    _require_graph()
    require_int8_kernel()
    path = str(tmp_path / "gptq")
    write_quantized(build_tiny_checkpoint(ckpt_root, "llama"), path, str(tmp_path / "deq"), "gptq", group=32,
                    act_order=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, seed=5, lo=10, hi=50)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (20, 9, 30, 14)]
    with LLM(path, kv_cache_memory="64MiB", enable_prefix_caching=False) as llm:
        qkv = llm.llm_engine.executor.worker.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight_format.input_order is not None and qkv.gemm_descriptor()[4] != 0
        _assert_graph_gives_the_layer_by_layer_logprobs(llm, prompts, params)
