"""Shared fixtures: tiny random HF checkpoints written by the tests, and engine helpers."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (tests/test_triton_attention.py). Triton
# reads this when it is first imported, and some test module's dependencies import it at
# collection: it is set here, before any of them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagellm.config import bundled_model_path  # noqa: E402

ARCH_CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32),
    # A window far below the tests' prompt lengths (up to 200 tokens), so that it binds.
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=24),
    # Soft-capping set low enough to bind on these random weights (Gemma 2's own are 50 and 30).
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], head_dim=32, sliding_window=24,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    # Local and global rotary bases, the global one scaled as Gemma 3 4B's is.
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], head_dim=32, sliding_window=24,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0}}),
    # As llama.cpp's converter and loader assume them: the query scale is the head size, Gemma 3's
    # layers 5 sliding to 1 full (the GGUF tests convert these to GGUF files).
    "gemma2-llamacpp": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], head_dim=32, sliding_window=24,
                            query_pre_attn_scalar=32, attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    "gemma3-llamacpp": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], head_dim=32,
                            sliding_window=24, query_pre_attn_scalar=32, num_hidden_layers=6,
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                "rope_theta": 1000000.0}}),
    # LFM2: short-convolution layers (3 taps) around attention layers, as LFM2-350M's pattern starts.
    "lfm2": dict(model_type="lfm2", architectures=["Lfm2ForCausalLM"], num_hidden_layers=6, conv_L_cache=3,
                 layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"], norm_eps=1e-5,
                 block_auto_adjust_ff_dim=False),
    # Qwen3.5: three gated-DeltaNet layers to one gated attention layer (GQA 2:1 in the DeltaNet's
    # heads too), rotary on a quarter of each head; its zero-centred norms made random (below).
    "qwen3_5": dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], num_hidden_layers=4,
                    head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], num_hidden_layers=4,
                        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=48, shared_expert_intermediate_size=96,
                        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]),
    # Qwen3-Next: Qwen3.5-MoE's layers with one dense MLP (Qwen's mlp_only_layers), its DeltaNet
    # projections stored per key head.
    "qwen3_next": dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], num_hidden_layers=4,
                       head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=48, shared_expert_intermediate_size=96, mlp_only_layers=[1],
                       decoder_sparse_step=1,
                       layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]),
    # Granite 4: Mamba2 layers (4 heads of 32 features, 2 groups of B/C) around a NoPE attention
    # layer (heads of hidden / heads, as llama.cpp's granitehybrid reads them), a shared MLP beside
    # routed experts on every layer, muP multipliers that bind.
    "granite4": dict(model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"],
                     num_hidden_layers=4, head_dim=16, layer_types=["mamba", "mamba", "attention", "mamba"],
                     mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
                     mamba_expand=2, shared_intermediate_size=96, intermediate_size=48, num_local_experts=4,
                     num_experts_per_tok=2, embedding_multiplier=4.0, residual_multiplier=0.5,
                     attention_multiplier=0.3, logits_scaling=2.0),
    # Nemotron-H: Mamba2 (4 heads of 16, not an expansion of the hidden size; time_step_limit's floor
    # clamps dt; time_step_min, which only initialises dt_bias, does not), NoPE attention and relu^2
    # MLP layers, one mixer each; the MLP layers keep no cache.
    "nemotron_h": dict(model_type="nemotron_h", architectures=["NemotronHForCausalLM"], num_hidden_layers=6,
                       layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention",
                                          "mlp"],
                       head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2,
                       conv_kernel=4, layer_norm_epsilon=1e-5, time_step_min=0.01,
                       time_step_limit=[0.001, float("inf")]),
    # Phi-4-mini's partial rotary and Phi-3.5's longrope (trained length 512 here), a window that binds.
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], sliding_window=40, head_dim=16,
                 original_max_position_embeddings=512,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0, 1.3, 1.9, 2.6, 3.5, 4.0],
                                  "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0]}),
    # Mixture of experts: more experts than top-k, so routing decides; Qwen's with a dense layer and
    # (Qwen2-MoE) a shared expert.
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                      norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, head_dim=32,
                      decoder_sparse_step=1, mlp_only_layers=[0]),
}


def require_kernel(available: Callable[[], bool], what: str, isa: tuple[str, ...] = (),
                   switches: tuple[str, ...] = ()) -> None:
    """The suite's rule for a test that needs a compiled kernel: it skips only where the user turned
    the kernel off (``PAGELLM_CPU_KERNELS=0`` or one of ``switches``) or where this CPU lacks its
    ISA (``isa``: /proc/cpuinfo flags), saying which; where the ISA is here, a kernel that did not
    build or load fails the test."""
    for var in ("PAGELLM_CPU_KERNELS", *switches):
        if os.environ.get(var) == "0":
            pytest.skip(f"{what} turned off by {var}=0")
    if available():
        return
    from pagellm.kernels.machine import cpu_info

    flags = _cpu_flags()
    missing = [f for f in isa if f not in flags]
    if missing:
        pytest.skip(f"no {what} on this machine: it needs {' '.join(missing)} ({cpu_info().summary()})")
    pytest.fail(f"this machine has {' '.join(isa) or 'a C compiler'} but the {what} did not build or load "
                "(see the warning log)")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_has(*flags: str) -> bool:
    """Whether this CPU has every one of ``flags`` (/proc/cpuinfo names): the oracle for which kernel
    paths a machine takes, independent of the kernels' own checks."""
    return set(flags) <= _cpu_flags()


def require_avx512_kernel(available: Callable[[], bool], what: str) -> None:
    """A kernel with only AVX-512 paths (the prefill attention kernel; the decode kernel over a 16-bit
    or int8 cache): an AVX2 machine runs the PyTorch path instead, tested on its own."""
    require_kernel(available, what, ("avx512f",))


def require_cpu_kernel(available: Callable[[], bool], what: str = "CPU kernel") -> None:
    """A portable kernel (plain C, any x86-64 or ARM CPU): it must build wherever the kernels are on."""
    require_kernel(available, what)


def require_bf16_kernel() -> None:
    from pagellm.kernels import gemm

    require_kernel(gemm.bf16_supported, "bfloat16 GEMM kernel", ("avx512f", "avx512_bf16"),
                   ("PAGELLM_CPU_GEMM", "PAGELLM_CPU_BF16"))


def require_amx_kernel() -> None:
    from pagellm.kernels import gemm

    require_bf16_kernel()
    require_kernel(gemm.amx_supported, "AMX bfloat16 GEMM kernel", ("amx_bf16", "amx_tile"), ("PAGELLM_CPU_AMX",))


def require_f32_gemm_kernel() -> None:
    """The packed float32 GEMM (AVX-512); without it the projections are MKL's, whose row results
    change with the batch."""
    from pagellm.kernels import gemm

    require_kernel(lambda: gemm.usable(torch.zeros(1, 1)), "packed float32 GEMM kernel", ("avx512f",),
                   ("PAGELLM_CPU_GEMM",))


def require_attention_kernels(head_dim: int, cache_dtype: torch.dtype) -> None:
    """The decode attention kernel over a cache of this head size and element type (its portable
    path on every CPU), and the prefill kernel where the CPU has AVX-512 (without it a chunk's
    tokens run as decodes, with the same bits)."""
    from pagellm.attention import cpu_kernel
    from pagellm.attention.kv_quant import cache_head_dim

    row = torch.empty(1, 1, cache_head_dim(head_dim, cache_dtype), dtype=cache_dtype)
    require_cpu_kernel(lambda: cpu_kernel.usable_for(row),
                       f"decode attention kernel for head size {head_dim} over a {cache_dtype} cache")
    if cpu_has("avx512f"):
        require_avx512_kernel(lambda: cpu_kernel.prefill_usable_for(row),
                              f"prefill attention kernel for head size {head_dim} over a {cache_dtype} cache")


def require_int8_kernel() -> None:
    from pagellm.kernels import gemm_int8

    # AVX512-VNNI, AVX2 or plain C: it builds on every CPU
    require_kernel(gemm_int8.supported, "int8 GEMM kernel", (), ("PAGELLM_CPU_GEMM", "PAGELLM_CPU_INT8"))


def _tokenizer_dir(tmp_root: str) -> str:
    """The SmolLM2 tokenizer (from the bundled GGUF) saved as a plain HF tokenizer directory; or the one
    ``PAGELLM_TEST_TOKENIZER`` names (the GPU machine has no bundled model: gpu_prepare.sh saves it)."""
    if os.environ.get("PAGELLM_TEST_TOKENIZER"):
        return os.environ["PAGELLM_TEST_TOKENIZER"]
    from pagellm.config import resolve_model_source
    from pagellm.tokenizer import Tokenizer

    path = os.path.join(tmp_root, "tokenizer")
    if not os.path.exists(path):
        Tokenizer(resolve_model_source(None)).hf.save_pretrained(path)
    return path


def build_tiny_checkpoint(root: str, arch: str, tie: bool = False, **overrides) -> str:
    """Write a tiny random model of ``arch`` (config.json + safetensors + tokenizer) under ``root``."""
    import transformers

    # (Overrides are in the name: a checkpoint built without them must not be returned for them.)
    named = "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
    path = os.path.join(root, f"tiny-{arch}{'-tied' if tie else ''}{named}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    base = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
    )
    base.update(ARCH_CONFIGS[arch])
    base.update(overrides)
    model_type = base.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **base)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "granitemoehybrid", "nemotron_h"):
        # (HF starts these at constants, its norms at identity: random ones, so that the tests see each)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith((".D", ".dt_bias")):
                    p.add_(torch.randn_like(p) * 0.3)
    tok = transformers.AutoTokenizer.from_pretrained(_tokenizer_dir(root))  # (first: config.json marks it done)
    tok.save_pretrained(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_llava(root: str, text_type: str = "llama", image_size: int = 56, tower: str = "clip") -> str:
    """A tiny random LLaVA-1.5 (a CLIP tower of 3 layers and 16 image tokens, or a SigLIP one with all
    its patches, as LLaVA-OneVision's; a two-layer text model) with SmolLM2's tokenizer plus
    ``<image>``, and its processor (the tower's image processor)."""
    import transformers

    path = os.path.join(root, f"tiny-llava-{text_type}-{image_size}-{tower}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = transformers.AutoTokenizer.from_pretrained(_tokenizer_dir(root))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                initializer_range=0.2, bos_token_id=1, eos_token_id=2, **ARCH_CONFIGS[text_type])
    clip = tower == "clip"
    vision = dict(model_type=f"{tower}_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, image_size=image_size, patch_size=14, initializer_range=0.2)
    strategy = "default" if clip else "full"  # (SigLIP has no class token to drop)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision,
                                      image_token_index=tok.convert_tokens_to_ids("<image>"),
                                      image_seq_length=(image_size // 14) ** 2, vision_feature_layer=-2,
                                      vision_feature_select_strategy=strategy, projector_hidden_act="gelu")
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(1234)
    transformers.LlavaForConditionalGeneration(config).float().save_pretrained(path)
    if clip:
        ip = transformers.CLIPImageProcessor(size={"shortest_edge": image_size},
                                             crop_size={"height": image_size, "width": image_size})
    else:
        ip = transformers.SiglipImageProcessor(size={"height": image_size, "width": image_size})
    transformers.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=14, num_additional_image_tokens=int(clip),
                                vision_feature_select_strategy=strategy,
                                chat_template=tok.chat_template).save_pretrained(path)
    return path


def build_tiny_qwen2_vl(root: str, v25: bool = False) -> str:
    """A tiny random Qwen2-VL (or Qwen2.5-VL: windows of 4x4 merged rows, the last layer full) with
    SmolLM2's tokenizer plus the vision tokens, and its image processor (at most 64 rows an image)."""
    import transformers

    path = os.path.join(root, f"tiny-qwen2{'_5' if v25 else ''}-vl")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = transformers.AutoTokenizer.from_pretrained(_tokenizer_dir(root))
    special = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": special})
    ids = {t: tok.convert_tokens_to_ids(t) for t in special}
    text = dict(model_type="qwen2_5_vl_text" if v25 else "qwen2_vl_text", vocab_size=len(tok), hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1,
                eos_token_id=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, num_heads=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                  initializer_range=0.2)
    vision.update(dict(hidden_size=32, intermediate_size=48, out_hidden_size=64, window_size=112,
                       fullatt_block_indexes=[1], hidden_act="silu") if v25 else
                  dict(embed_dim=32, hidden_size=64, mlp_ratio=2))
    cls = transformers.Qwen2_5_VLConfig if v25 else transformers.Qwen2VLConfig
    config = cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                 video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                 vision_end_token_id=ids["<|vision_end|>"])
    config.architectures = ["Qwen2_5_VLForConditionalGeneration" if v25 else "Qwen2VLForConditionalGeneration"]
    torch.manual_seed(1234)
    model_cls = transformers.Qwen2_5_VLForConditionalGeneration if v25 else transformers.Qwen2VLForConditionalGeneration
    model_cls(config).float().save_pretrained(path)
    # (transformers builds the Qwen2-VL processor with a video processor that needs torchvision:
    # the image processor and tokenizer are saved on their own, which AutoImageProcessor reads.)
    transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def round_to_gguf_blocks(w: torch.Tensor, bits: int) -> torch.Tensor:
    """``w [n, k]`` (k a multiple of 32) rounded to GGUF blocks as its reader dequantizes them (d in
    half precision): Q4_1 ``fl(fl(d * q) + m)`` (bits 4) or Q8_0 ``fl(d * q)`` (bits 8)."""
    n, k = w.shape
    w = w.float().reshape(n, k // 32, 32)
    if bits == 4:
        lo = w.min(-1, keepdim=True).values
        d = ((w.max(-1, keepdim=True).values - lo) / 15).half().float()
        return (d * ((w - lo) / d).round().clamp(0, 15) + lo).view(n, k)
    d = (w.abs().max(-1, keepdim=True).values / 127).half().float()
    return (d * (w / d).round().clamp(-128, 127)).view(n, k)


def build_tiny_gguf_valued_checkpoint(root: str, arch: str, **overrides) -> str:
    """The tiny random ``arch`` model with every projection rounded to Q4_1 blocks and the embedding
    and LM head to Q8_0, as a GGUF checkpoint's would be: what ``quantization="gguf"`` runs.
    ``overrides`` (config fields) need a ``root`` of their own: the directory is named by ``arch``."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = build_tiny_checkpoint(root, arch, **overrides)
    path = os.path.join(root, f"tiny-{arch}-gguf-valued")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    shutil.copytree(src, path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name, w in weights.items():
        if w.dim() == 2 and w.shape[1] % 32 == 0:
            weights[name] = round_to_gguf_blocks(w, 4 if "proj" in name else 8).contiguous()
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="session")
def tiny_llama(ckpt_root) -> str:
    return build_tiny_checkpoint(ckpt_root, "llama")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return bundled_model_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """``(tokenizer, model)``: Hugging Face's float32 SmolLM2 over the bundled GGUF (transformers'
    own dequantizer), loaded once for the oracles that only generate from it (each sets the
    generation config it needs)."""
    import transformers

    directory, name = os.path.split(smollm2_path)
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    return tok, hf


def assert_cache_pressure(engine, preemption_mode: str | None, what: str = "") -> None:
    """A tight-cache variant must have preempted (and in swap mode swapped out and back in): else
    it tests less than it says. ``preemption_mode`` None: no pressure expected, nothing checked."""
    stats = engine.get_stats()
    if preemption_mode is not None:
        assert stats["num_preemptions"] > 0, f"{what}: the cache was not tight: no preemption"
    if preemption_mode == "swap":
        assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] > 0, f"{what}: swap mode never swapped"


def run_to_completion(engine, check_invariants: bool = True, max_steps: int = 20_000) -> dict[str, object]:
    """Step the engine until idle, checking scheduler invariants after every step.

    A request that never finishes fails the test after ``max_steps`` instead of hanging it.
    """
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= max_steps, f"requests still unfinished after {max_steps} steps: the engine hangs"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if check_invariants:
            engine.scheduler.check_invariants()
    engine.scheduler.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    return finished


# ---- `slow`: every test that loads the bundled SmolLM2's weights, and nothing else ---------------
# A test asking for ``smollm2_path`` is marked here; any other test that loads the bundled weights
# (``LLM(None)``, ``model=None``) must carry ``@pytest.mark.slow`` itself, or it fails below, so
# ``make test-fast`` (``-m "not slow"``) stays fast by construction rather than by care.
_current_item: list[pytest.Item] = []


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if "smollm2_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current_item[:] = [item]
    try:
        return (yield)
    finally:
        _current_item.clear()


@pytest.fixture(autouse=True, scope="session")
def _bundled_weights_only_in_slow_tests():
    import pagellm.weights.gguf_file as gguf_file

    original = gguf_file.iter_gguf_weights
    try:
        bundled = os.path.realpath(bundled_model_path())
    except FileNotFoundError:  # (the GPU machine runs tests/gpu without the bundled package: nothing to guard)
        yield
        return

    def guarded(path, *args, **kwargs):
        item = _current_item[0] if _current_item else None
        if item is not None and os.path.realpath(path) == bundled and item.get_closest_marker("slow") is None:
            raise RuntimeError(f"{item.nodeid} loads the bundled SmolLM2 weights: mark it @pytest.mark.slow")
        yield from original(path, *args, **kwargs)

    gguf_file.iter_gguf_weights = guarded
    yield
    gguf_file.iter_gguf_weights = original


def mapped_kib(path: str) -> int:
    """This process's resident pages of its mappings of ``path``."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # (a mapping's first line)
                ours = len(fields) >= 6 and fields[5] == path
            elif ours and line.startswith("Rss:"):
                total += int(fields[1])
    return total
