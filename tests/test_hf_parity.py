"""Greedy outputs equal Hugging Face transformers token for token (float32, same weights)."""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch
import transformers

from pagellm import LLMEngine, SamplingParams
from pagellm.config import EngineArgs

from conftest import build_tiny_checkpoint, run_to_completion

NEW_TOKENS = 32


def hf_greedy(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """One prompt at a time (no padding), greedy, EOS ignored (generated but not a stop, like ignore_eos)."""
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                           pad_token_id=0, bos_token_id=None)
    model.generation_config.eos_token_id = None  # else generate() merges the model's EOS back in
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            assert gen.shape[1] == len(p) + new_tokens
            outs.append(gen[0, len(p):].tolist())
    return outs


def engine_greedy(model_path: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS, **engine_kwargs):
    """All prompts submitted together; invariants checked after every step; returns token ids.

    A small KV budget by default: the per-step invariant check walks every block. float32 unless
    asked otherwise: the token-exact oracle (``auto`` may choose bfloat16 GEMMs on this machine).
    """
    engine_kwargs.setdefault("kv_cache_memory", "64MiB")
    engine_kwargs.setdefault("dtype", "float32")
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_path, **engine_kwargs))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = run_to_completion(engine)
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))], engine


# Two float32 implementations of the same model (pagellm's kernels, HF's MKL) round differently in
# the last bits of a logit; where HF's two best tokens are closer than that, either may win. Seen
# once in CI (qwen2, one step, on another machine); not reproduced here over 640 prompt seeds.
FLOAT32_TIE = 1e-4


def assert_equal_but_float32_ties(hf, prompts: list[list[int]], got: list[list[int]], ref: list[list[int]]) -> None:
    """Greedy tokens equal HF's, except where HF's own logits hold a float32 tie at the first
    divergence: there the gap between HF's token and ours (teacher-forced along the common
    prefix, in float64 from HF's float32 logits) must be below ``FLOAT32_TIE`` nats."""
    for i, (p, g, r) in enumerate(zip(prompts, got, ref, strict=True)):
        if g == r:
            continue
        pos = next(j for j, (x, y) in enumerate(zip(g, r, strict=True)) if x != y)
        with torch.no_grad():
            logits = hf(torch.tensor([p + r[:pos]])).logits[0, -1].double()
        lp = torch.log_softmax(logits, -1)
        gap = float(lp[r[pos]] - lp[g[pos]])
        assert gap < FLOAT32_TIE, f"prompt {i} left HF's greedy tokens at step {pos} where HF's logprob gap " \
                                  f"was {gap:.3g} nats: not a float32 tie"


def random_prompts(n: int, seed: int, vocab: int = 49152, lo: int = 1, hi: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [lo, hi] + [rng.randint(lo, hi) for _ in range(n - 2)]
    return [[rng.randrange(3, vocab) for _ in range(n_tok)] for n_tok in lengths]


@pytest.mark.parametrize("arch,tie,shard", [
    ("llama", False, False), ("llama", True, True), ("qwen2", False, False), ("qwen3", False, False),
    ("mistral", False, False), ("gemma2", True, False), ("gemma3", True, False),
    ("mixtral", False, False), ("qwen2_moe", False, False), ("qwen3_moe", True, True),
    ("lfm2", False, False), ("lfm2", True, False), ("qwen3_5", False, False), ("qwen3_5", True, False),
    ("qwen3_5_moe", False, False), ("qwen3_next", False, False), ("granite4", False, False),
    ("nemotron_h", False, False),
])
def test_tiny_random_models_match_hf(ckpt_root, arch, tie, shard):
    path = build_tiny_checkpoint(ckpt_root, arch, tie=tie)
    if shard:
        sharded = path + "-sharded"
        if not os.path.exists(sharded):
            m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            m.save_pretrained(sharded, max_shard_size="1MB")
            transformers.AutoTokenizer.from_pretrained(path).save_pretrained(sharded)
        assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
        path = sharded
    # (crc32, not hash(): str hashes change with every process, so the prompts would too)
    prompts = random_prompts(10, seed=zlib.crc32(arch.encode()) % 1000)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf_greedy(hf, prompts)
    got, _ = engine_greedy(path, prompts)
    assert_equal_but_float32_ties(hf, prompts, got, ref)
    # The checkpoint is not degenerate: greedy continuations differ between prompts.
    assert len({tuple(r) for r in ref}) > 5


# GQA ratios 4 and 1 beside the suite's 2, head sizes that are not powers of two (the decode
# kernel's generic path), windows and soft-caps in force.
@pytest.mark.parametrize("arch,overrides", [
    ("mistral", dict(num_key_value_heads=1, head_dim=20)),
    ("gemma2", dict(num_key_value_heads=4, head_dim=24, query_pre_attn_scalar=24)),
    ("gemma3", dict(num_key_value_heads=1, head_dim=40, query_pre_attn_scalar=40)),
    ("qwen3_moe", dict(num_key_value_heads=4, head_dim=48)),
    ("granite4", dict(num_key_value_heads=1, num_local_experts=0)),  # (and Granite 4's dense hybrids)
])
def test_gqa_ratios_and_odd_head_sizes_match_hf(ckpt_root, arch, overrides):
    path = build_tiny_checkpoint(os.path.join(ckpt_root, "gqa-odd"), arch, **overrides)
    prompts = random_prompts(6, seed=zlib.crc32(arch.encode()) % 1000 + 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf_greedy(hf, prompts)
    got, _ = engine_greedy(path, prompts)
    assert_equal_but_float32_ties(hf, prompts, got, ref)
    assert len({tuple(r) for r in ref}) > 4


def test_the_tie_rule_refuses_a_divergence_that_is_not_a_tie(ckpt_root):
    """A greedy token replaced by HF's second best where the two are far apart fails the check."""
    path = build_tiny_checkpoint(ckpt_root, "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(2, seed=7, lo=5, hi=20)
    ref = hf_greedy(hf, prompts, new_tokens=4)
    with torch.no_grad():
        top2 = hf(torch.tensor([prompts[0] + ref[0][:2]])).logits[0, -1].double().log_softmax(-1).topk(2)
    assert float(top2.values[0] - top2.values[1]) > FLOAT32_TIE  # (not itself a tie)
    wrong = [ref[0][:2] + [int(top2.indices[1])] + ref[0][3:], ref[1]]
    assert_equal_but_float32_ties(hf, prompts, ref, ref)
    with pytest.raises(AssertionError, match="not a float32 tie"):
        assert_equal_but_float32_ties(hf, prompts, wrong, ref)


def test_llama3_rope_scaling_matches_hf(ckpt_root):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    path = build_tiny_checkpoint(os.path.join(ckpt_root, "l3"), "llama", rope_parameters={
        "rope_theta": 500000.0, **scaling}, max_position_embeddings=1024)
    prompts = random_prompts(8, seed=3, lo=60, hi=300)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    got, _ = engine_greedy(path, prompts)
    assert_equal_but_float32_ties(hf, prompts, got, hf_greedy(hf, prompts))


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Photosynthesis is the process by which green plants",
    "1, 2, 3, 4, 5,",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter "
    "and his three children. Every morning he walked into the trees with his axe, and every evening he",
    "Hi",
]


def test_smollm2_gguf_matches_hf(smollm2_hf):
    tok, hf = smollm2_hf
    prompts = [tok.encode(p) for p in SMOL_PROMPTS]
    assert len({len(p) for p in prompts}) >= 8
    ref = hf_greedy(hf, prompts)
    got, _ = engine_greedy(None, prompts)
    assert_equal_but_float32_ties(hf, prompts, got, ref)


def test_gemma2_logprobs_equal_hf_with_its_final_soft_cap(ckpt_root):
    """The head's soft-cap is monotonic, so greedy tokens cannot show it: logprobs do. Every sampled
    token's logprob equals HF's log-softmax of its (capped) logits, teacher-forced, in float32."""
    path = build_tiny_checkpoint(ckpt_root, "gemma2", tie=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(3, seed=11, lo=5, hi=40)
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, kv_cache_memory="64MiB", dtype="float32"))
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = run_to_completion(engine)
    capped = 0
    for i, p in enumerate(prompts):
        out = done[str(i)].outputs[0]
        with torch.no_grad():
            logits = hf(torch.tensor([p + out.token_ids])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert abs(entry[tok].logprob - float(lp[len(p) - 1 + j, tok])) < 1e-4
        capped += int((logits.abs() > 0.9 * hf.config.final_logit_softcapping).sum())
    assert capped > 0, "no logit came near the cap: the test would not see it"


def test_phi3_fused_weights_partial_longrope_match_hf(ckpt_root):
    """Phi-3's checkpoint stores qkv_proj and gate_up_proj fused; rotary covers 3/4 of each head with
    longrope's short factors (the served length, 512, is within the trained one, as HF picks for
    these lengths), and a 40-token window binds."""
    path = build_tiny_checkpoint(ckpt_root, "phi3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    names = {n for n, _ in hf.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    prompts = random_prompts(8, seed=3)
    ref = hf_greedy(hf, prompts)
    got, _ = engine_greedy(path, prompts, max_model_len=512)
    assert_equal_but_float32_ties(hf, prompts, got, ref)
    assert len({tuple(r) for r in ref}) > 5


def test_odd_partial_rotary_width_matches_hf(ckpt_root):
    """head_dim x partial_rotary_factor odd (20 x 0.75 = 15): HF's table has ceil(15 / 2) frequencies,
    so the first 16 features rotate; the rotary op must take that width, not 15 or the head's 20."""
    path = build_tiny_checkpoint(os.path.join(ckpt_root, "head20"), "phi3", hidden_size=80, head_dim=20,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.75})
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.model.rotary_emb.inv_freq.numel() == 8
    prompts = random_prompts(4, seed=5)
    ref = hf_greedy(hf, prompts)
    got, _ = engine_greedy(path, prompts, max_model_len=512)
    assert_equal_but_float32_ties(hf, prompts, got, ref)


# HF name (after "model.layers.{i}." for layer tensors) -> llama.cpp's, for Gemma.
_GEMMA_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_gemma_gguf(hf_dir: str, path: str, tokenizer_from: str, eot_token_id: int | None = None) -> None:
    """The HF checkpoint as llama.cpp's converter writes it: its names, norms stored as 1 + w, the
    metadata llama.cpp reads (float32 tensors, so the weights are the same numbers); optionally an
    end-of-turn id (``tokenizer.ggml.eot_token_id``)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from pagellm.weights.gguf_write import _copy_tokenizer, add_decoder_metadata

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    arch = "gemma2" if cfg.model_type == "gemma2" else "gemma3"
    w = gguf.GGUFWriter(path, arch)
    add_decoder_metadata(w, cfg.max_position_embeddings, cfg.hidden_size, cfg.num_hidden_layers,
                         cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps,
                         cfg.vocab_size)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    else:
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    _copy_tokenizer(w, tokenizer_from)
    if eot_token_id is not None:
        w.add_eot_token_id(eot_token_id)
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_GEMMA_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
        arr = t.float().numpy()
        w.add_tensor(gname, (arr + np.float32(1.0)) if name.endswith("norm.weight") else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


@pytest.mark.parametrize("arch", ["gemma2-llamacpp", "gemma3-llamacpp"])
def test_gemma_gguf_matches_hf(ckpt_root, arch, smollm2_path):
    """A Gemma GGUF (llama.cpp's names, 1 + w norms, its metadata) runs as HF runs the checkpoint it
    was converted from."""
    path = build_tiny_checkpoint(ckpt_root, arch, tie=True)
    gguf_path = os.path.join(ckpt_root, f"{arch}.gguf")
    write_gemma_gguf(path, gguf_path, smollm2_path)
    assert_gguf_runs_as_hf(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), gguf_path,
                           seed=5)


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5", "qwen3_5_moe", "granite4"])
def test_state_layer_families_gguf_match_hf(ckpt_root, arch, smollm2_path):
    """llama.cpp's ``lfm2``, ``qwen35``, ``qwen35moe`` and ``granitehybrid`` files (written as its
    converter writes them, ``gguf_state_writers``): HF's greedy tokens in float32."""
    from gguf_state_writers import write_state_gguf

    path = build_tiny_checkpoint(ckpt_root, arch)
    gguf_path = os.path.join(ckpt_root, f"{arch}-state.gguf")
    write_state_gguf(path, gguf_path, smollm2_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert_gguf_runs_as_hf(hf, gguf_path, seed=3, max_model_len=512)


def test_qwen3_5_gguf_q8_0_keeps_its_tiled_value_heads_in_blocks(ckpt_root, smollm2_path, tmp_path):
    """Every Qwen3.5 matrix in Q8_0, the DeltaNet's in llama.cpp's tiled order of value heads (its
    ``ssm_out`` columns too, which blocks cannot be permuted back across): in float32 the model runs
    as HF runs the values the file holds, put back in HF's order by this test; on the int8 kernel
    (``quantization="gguf"``) the projections are packed from the file's blocks."""
    import json
    import shutil

    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf_state_writers import _NAMES, _tile_rows, write_state_gguf
    from safetensors.numpy import save_file


    path = build_tiny_checkpoint(ckpt_root, "qwen3_5")
    gguf_path = str(tmp_path / "qwen3_5-q8_0.gguf")
    held = write_state_gguf(path, gguf_path, smollm2_path,
                            quantize=lambda n: T.Q8_0 if n.startswith("blk.") and "conv1d" not in n else None)
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    hk, hv, kd, vd = (c[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                     "linear_value_head_dim"))
    def untile(x, head, axis=0):  # tiled -> grouped: the writer's reorder with the factors swapped
        return _tile_rows(x, hv // hk, hv, head, axis)
    kinds = {v: k for k, v in _NAMES["qwen35"].items()}
    oracle = {"model.embed_tokens.weight": held["token_embd.weight"], "lm_head.weight": held["output.weight"],
              "model.norm.weight": held["output_norm.weight"] - np.float32(1)}
    for name, x in held.items():
        if not name.startswith("blk."):
            continue
        _, layer, kind = name.split(".", 2)
        stem, _, suffix = kind.rpartition(".")
        if kind == "ssm_a":
            oracle[f"model.layers.{layer}.linear_attn.A_log"] = np.log(-untile(x[:, None], 1)[:, 0])
            continue
        rel = "linear_attn.dt_bias" if kind == "ssm_dt.bias" else f"{kinds[stem]}.{suffix}"
        hf_name = f"model.layers.{layer}.{rel}"
        if stem in ("attn_qkv", "ssm_conv1d"):
            x = np.concatenate([x[:2 * hk * kd], untile(x[2 * hk * kd:], vd)])
            x = x[:, None, :] if stem == "ssm_conv1d" else x
        elif stem == "attn_gate":
            x = untile(x, vd)
        elif stem in ("ssm_beta", "ssm_alpha") or kind == "ssm_dt.bias":
            x = untile(x if x.ndim == 2 else x[:, None], 1).reshape(x.shape)
        elif stem == "ssm_out":
            x = untile(x, vd, axis=1)
        elif stem.endswith("norm") and stem != "ssm_norm":
            x = x - np.float32(1)
        oracle[hf_name] = np.ascontiguousarray(x, dtype=np.float32)
    oracle_dir = tmp_path / "oracle"
    oracle_dir.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(path, f), oracle_dir / f)
    save_file(oracle, str(oracle_dir / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(oracle_dir), dtype=torch.float32)
    prompts = assert_gguf_runs_as_hf(hf, gguf_path, seed=4, max_model_len=512)
    assert_runs_on_the_files_blocks(gguf_path, prompts, ("model.layers.0.linear_attn.in_proj",
                                                         "model.layers.0.linear_attn.out_proj"))


def assert_runs_on_the_files_blocks(gguf_path: str, prompts: list[list[int]], names: tuple[str, ...]) -> None:
    """On the int8 kernel (``quantization="gguf"``) the projections ``names`` are packed from the
    file's blocks, and the model generates."""
    from pagellm import LLM
    from pagellm.layers.linear import Linear

    llm = LLM(model=gguf_path, quantization="gguf", max_model_len=512, kv_cache_memory="16MiB")
    linears = {n: m for n, m in llm.llm_engine.executor.worker.model.named_modules() if isinstance(m, Linear)}
    for name in names:
        assert linears[name].bound_i8 is not None, name
    out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def assert_gguf_runs_as_hf(hf, gguf_path: str, seed: int, **engine_kwargs) -> list[list[int]]:
    """Greedy tokens of the engine on ``gguf_path`` against HF's ``hf`` on six random prompts (float32
    ties excepted), which must not all agree with each other; returns the prompts."""
    prompts = random_prompts(6, seed=seed)
    ref = hf_greedy(hf.eval(), prompts)
    got, _ = engine_greedy(gguf_path, prompts, **engine_kwargs)
    assert_equal_but_float32_ties(hf, prompts, got, ref)
    assert len({tuple(r) for r in ref}) > 4
    return prompts



# HF name (after "model.layers.{i}.") -> llama.cpp's, for Phi-3 (fused qkv; ffn_up holds gate and up).
_PHI3_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
                    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_phi3_gguf(hf_dir: str, path: str, tokenizer_from: str, q8_0: bool = False) -> str:
    """The HF Phi-3 checkpoint as llama.cpp's converter writes it: fused tensors under its names, the
    rotated features per head, the trained length, longrope's factors as two tensors, the window;
    with ``q8_0`` the layers' matrices quantized to Q8_0 by ``gguf``. Returns an HF checkpoint with
    the values the file holds (``gguf``'s dequantizer): the oracle's weights."""
    import shutil

    import gguf
    import numpy as np
    from safetensors.torch import load_file, save_file

    from pagellm.weights.gguf_write import _copy_tokenizer, add_decoder_metadata

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(path, "phi3")
    add_decoder_metadata(w, cfg.max_position_embeddings, cfg.hidden_size, cfg.num_hidden_layers,
                         cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps,
                         cfg.vocab_size)
    w.add_rope_dimension_count(int(cfg.head_dim * rope["partial_rotary_factor"]))
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    w.add_sliding_window(cfg.sliding_window)
    _copy_tokenizer(w, tokenizer_from)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    oracle = {}
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gname = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                     "lm_head.weight": "output"}[name] + ".weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_PHI3_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
        arr = t.float().numpy()
        oracle[name] = t
        if q8_0 and gname.startswith("blk.") and arr.ndim == 2:
            q = gguf.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            oracle[name] = torch.from_numpy(gguf.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(arr.shape))
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    oracle_dir = hf_dir + ("-q8" if q8_0 else "")
    if q8_0:
        shutil.copytree(hf_dir, oracle_dir, dirs_exist_ok=True)
        save_file(oracle, os.path.join(oracle_dir, "model.safetensors"))
    return oracle_dir


@pytest.mark.slow
@pytest.mark.parametrize("max_model_len", [512, 1024])
def test_phi3_gguf_matches_hf(ckpt_root, smollm2_path, max_model_len):
    """A Phi-3 GGUF (fused tensors, partial rotary, longrope's factors as tensors, the window) runs as
    HF runs its checkpoint: short factors within the trained 512 positions; served at 1024, the
    long ones, against HF's model whose checkpoint says so."""
    path = build_tiny_checkpoint(ckpt_root, "phi3")
    gguf_path = os.path.join(ckpt_root, "phi3.gguf")
    if not os.path.exists(gguf_path):
        write_phi3_gguf(path, gguf_path, smollm2_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if max_model_len > 512:  # HF's long factors for every call, as the engine takes them for this length
        rope = hf.config.rope_parameters
        hf.config.rope_parameters = {**rope, "short_factor": rope["long_factor"]}
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, config=hf.config, dtype=torch.float32).eval()
    assert_gguf_runs_as_hf(hf, gguf_path, seed=9, max_model_len=max_model_len)


@pytest.mark.slow
def test_phi3_gguf_fused_blocks_are_cut_into_their_parts(ckpt_root, smollm2_path):
    """Q8_0 fused qkv and gate_up kept at their width: each part takes its rows' blocks. In float32
    they are dequantized per part and the model runs as HF runs the dequantized checkpoint; on the
    int8 kernel (``quantization="gguf"``) the fused projections are packed from those blocks."""

    path = build_tiny_checkpoint(ckpt_root, "phi3")
    gguf_path = os.path.join(ckpt_root, "phi3-q8_0.gguf")
    oracle_dir = write_phi3_gguf(path, gguf_path, smollm2_path, q8_0=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32).eval()
    prompts = assert_gguf_runs_as_hf(hf, gguf_path, seed=9, max_model_len=512)
    assert_runs_on_the_files_blocks(gguf_path, prompts, ("model.layers.0.self_attn.qkv_proj",
                                                         "model.layers.1.mlp.gate_up_proj"))


# HF name (after "model.layers.{i}.", Mixtral's block_sparse_moe read as mlp) -> llama.cpp's, for MoE models.
_MOE_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_EXPERT_GGUF_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                      "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def write_moe_gguf(hf_dir: str, path: str, tokenizer_from: str) -> str:
    """The HF MoE checkpoint as llama.cpp's converter writes it (Mixtral as ``llama`` with q/k
    permuted, Qwen's as ``qwen2moe``/``qwen3moe``): each layer's experts stacked in one 3-D tensor
    and quantized to Q8_0 by ``gguf`` (float32 where the inputs are not whole blocks), everything
    else float32. Returns an HF checkpoint beside it
    with those experts' values as ``gguf`` dequantizes them: the oracle's weights."""
    import re
    import shutil

    import gguf
    import numpy as np
    from safetensors.torch import load_file, save_file

    from pagellm.weights.gguf_write import _copy_tokenizer, add_decoder_metadata

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[cfg.model_type]
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w = gguf.GGUFWriter(path, arch)
    add_decoder_metadata(w, cfg.max_position_embeddings, cfg.hidden_size, cfg.num_hidden_layers,
                         cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps,
                         cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    _copy_tokenizer(w, tokenizer_from)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    stacks: dict[tuple[str, str], list] = {}
    per_expert = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
    oracle = {}
    for name, t in tensors.items():
        hf_name = name.replace(".block_sparse_moe.", ".mlp.")
        arr = t.float().numpy()
        m = per_expert.fullmatch(hf_name)
        if m:
            stacks.setdefault((m.group(1), _EXPERT_GGUF_NAMES[m.group(3)]), []).append((int(m.group(2)), name))
            continue
        oracle[name] = t
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gname = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                     "lm_head.weight": "output"}[name] + ".weight"
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            base, _, suffix = rest.rpartition(".")
            gname = f"blk.{layer}.{_MOE_GGUF_NAMES[base]}.{suffix}"
            if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads
                arr = arr.reshape(heads, 2, arr.shape[0] // heads // 2, *arr.shape[1:]).swapaxes(1, 2) \
                    .reshape(arr.shape)
            if base == "mlp.shared_expert_gate":
                arr = arr.reshape(-1)
        w.add_tensor(gname, arr)
    for (layer, gname), members in stacks.items():
        names = [n for _, n in sorted(members)]
        assert len(names) == experts
        stack = np.stack([tensors[n].float().numpy() for n in names])
        if stack.shape[-1] % 32:  # (Qwen's down projections here: 48 inputs) float32, as llama.cpp falls back
            w.add_tensor(f"blk.{layer}.{gname}.weight", stack)
            oracle.update((n, tensors[n]) for n in names)
            continue
        q = gguf.quantize(stack, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(f"blk.{layer}.{gname}.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        back = gguf.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(stack.shape)
        for e, n in enumerate(names):
            oracle[n] = torch.from_numpy(np.ascontiguousarray(back[e]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    oracle_dir = hf_dir + "-q8-experts"
    shutil.copytree(hf_dir, oracle_dir, dirs_exist_ok=True)
    save_file(oracle, os.path.join(oracle_dir, "model.safetensors"))
    return oracle_dir


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_gguf_matches_hf(ckpt_root, arch, smollm2_path, monkeypatch):
    """An MoE GGUF (llama.cpp's names and stacked Q8_0 experts, its metadata; a Qwen model's dense
    layer found from its tensors) runs as HF runs the checkpoint with those experts' values."""
    path = build_tiny_checkpoint(ckpt_root, arch)
    gguf_path = os.path.join(ckpt_root, f"{arch}.gguf")
    oracle_dir = write_moe_gguf(path, gguf_path, smollm2_path)
    prompts = assert_gguf_runs_as_hf(
        transformers.AutoModelForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32), gguf_path, seed=7)
    # On the int8 kernel the Q8_0 experts are kept as the file's blocks (no expert's float weight is
    # ever written) and packed from them.
    from pagellm import LLM
    from pagellm.layers.linear import Linear
    from pagellm.layers.moe import FusedMoE

    def refuse(self, which, expert, part, loaded):
        if loaded.shape[-1] % 32 == 0:
            raise AssertionError(f"a Q8_0 expert ({which} {expert}) was loaded as floats")
        return original(self, which, expert, part, loaded)

    original = FusedMoE.weight_loader
    with monkeypatch.context() as m:
        m.setattr(FusedMoE, "weight_loader", refuse)
        llm = LLM(model=gguf_path, quantization="gguf", kv_cache_memory="16MiB")
    moes = [mod for mod in llm.llm_engine.executor.worker.model.modules() if isinstance(mod, FusedMoE)]
    experts = [e for mod in moes for e in (*mod.w13, *mod.w2) if isinstance(e, Linear)]
    quantized = [e for e in experts if e.in_features % 32 == 0]
    assert quantized and all(e.bound_i8 is not None for e in quantized)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def chat_checkpoint(ckpt_root: str, arch: str, template: str, tie: bool = False) -> str:
    """The tiny ``arch`` checkpoint with ``template`` as its tokenizer's chat template (a copy)."""
    import shutil

    src = build_tiny_checkpoint(ckpt_root, arch, tie=tie)
    path = src + "-chat"
    if not os.path.exists(path):
        shutil.copytree(src, path)
        tok = transformers.AutoTokenizer.from_pretrained(src)
        tok.chat_template = template
        tok.save_pretrained(path)
    return path


# Gemma's own chat template (as Gemma 2 checkpoints ship it): no system role, alternating turns.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")


def test_gemma_chat_uses_the_checkpoints_template_and_its_refusals(ckpt_root):
    """``LLM.chat`` renders the checkpoint's own template; a system message, which Gemma's template
    refuses, fails with the template's own words (as transformers does), and the engine keeps serving."""
    from pagellm import LLM

    llm = LLM(chat_checkpoint(ckpt_root, "gemma2", GEMMA_TEMPLATE, tie=True), kv_cache_memory="16MiB",
              max_model_len=256)
    with pytest.raises(Exception, match="System role not supported"):
        llm.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    tok = llm.llm_engine.get_tokenizer()
    text = tok.chat_prompt([{"role": "user", "content": "hi"}])["prompt"]
    assert text.endswith("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"), text
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


# The templates Phi-3-mini-instruct and Mistral / Mixtral-Instruct v0.1 ship with.
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("arch,template,system_ok,ending", [
    ("phi3", PHI3_TEMPLATE, True, "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"),
    ("mixtral", MISTRAL_TEMPLATE, False, "[INST] hi [/INST]"),
])
def test_phi3_and_mistral_chat_use_the_checkpoints_template(ckpt_root, arch, template, system_ok, ending):
    """``LLM.chat`` renders each family's own template: Phi-3's system turn, Mistral's [INST] turns
    and its refusal of a system role in the template's own words, the engine serving on."""
    from pagellm import LLM

    llm = LLM(chat_checkpoint(ckpt_root, arch, template), kv_cache_memory="16MiB", max_model_len=256)
    tok = llm.llm_engine.get_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    if system_ok:
        text = tok.chat_prompt(messages)["prompt"]
    else:
        with pytest.raises(Exception, match="Conversation roles must alternate"):  # (its first check)
            llm.chat(messages)
        text = tok.chat_prompt(messages[1:])["prompt"]
    assert text.endswith(ending), text
    out = llm.chat(messages if system_ok else messages[1:], SamplingParams(max_tokens=3, ignore_eos=True),
                   use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
