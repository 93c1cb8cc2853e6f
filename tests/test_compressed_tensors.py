"""compressed-tensors checkpoints at their width (quantization/compressed_tensors.py): pack-quantized
W4A16 / W8A16, int-quantized W8A8 and float-quantized FP8 read as the int8 kernel's blocks;
float32 greedy equal to HF on the library's own decompression; the default numerics
logprob-close and batch invariant; start-up refusals naming what is not built.

Every checkpoint and tensor is written by the ``compressed-tensors`` package's own compressor
(tests/quant_writers.py), and its own decompression (scales widened to float32) is the oracle."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from quant_writers import compress_one, write_compressed
from test_group_quant import assert_close_and_batch_invariant, assert_float32_equals_hf, greedy_at_width

from pagellm.kernels import gemm_int8
from pagellm.quantization.compressed_tensors import Fp8Blocks, PackedIntBlocks
from pagellm.quantization.quant_config import quant_scheme

from conftest import build_tiny_checkpoint, require_int8_kernel

INT4 = dict(num_bits=4, type="int")
INT8 = dict(num_bits=8, type="int")
FP8 = dict(num_bits=8, type="float")
# name: (format, weights) as llm-compressor's presets write them (W4A16, W8A16, W8A8, FP8, FP8_BLOCK)
TENSORS = {
    "w4-g32-asym": ("pack-quantized", dict(INT4, symmetric=False, strategy="group", group_size=32)),
    "w4-g128-sym": ("pack-quantized", dict(INT4, symmetric=True, strategy="group", group_size=128)),
    "w4-channel-asym": ("pack-quantized", dict(INT4, symmetric=False, strategy="channel")),
    "w4-tensor-sym": ("pack-quantized", dict(INT4, symmetric=True, strategy="tensor")),
    "w8-packed-channel": ("pack-quantized", dict(INT8, symmetric=True, strategy="channel")),
    "w8a8-channel": ("int-quantized", dict(INT8, symmetric=True, strategy="channel")),
    "w8a8-g64": ("int-quantized", dict(INT8, symmetric=True, strategy="group", group_size=64)),
    "w8-asym": ("int-quantized", dict(INT8, symmetric=False, strategy="channel")),
    "fp8-tensor": ("float-quantized", dict(FP8, symmetric=True, strategy="tensor")),
    "fp8-channel": ("float-quantized", dict(FP8, symmetric=True, strategy="channel")),
    "fp8-block": ("float-quantized", dict(FP8, symmetric=True, strategy="block", block_structure=[32, 64])),
}


def scheme_of(fmt: str, weights: dict):
    group = {"format": fmt, "weights": weights, "targets": ["Linear"]}
    cfg = types.SimpleNamespace(quantization_config={"quant_method": "compressed-tensors", "format": fmt,
                                                     "config_groups": {"group_0": group}})
    return quant_scheme(cfg, "ckpt")


def blocks_of(name: str, n: int = 96, k: int = 512, seed: int = 0):
    """The library's compressed tensors of a random bfloat16 weight (rows of different scales) as
    pagellm reads them, and the library's float32 decompression of them."""
    fmt, weights = TENSORS[name]
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.exp(torch.rand(n, 1, generator=g) * 4 - 3)).bfloat16()
    parts, ref = compress_one(w, fmt, weights)
    scheme = scheme_of(fmt, weights)
    return (Fp8Blocks if scheme.type == "float" else PackedIntBlocks).of(scheme, "layer", parts), ref


@pytest.mark.parametrize("name", TENSORS)
def test_blocks_dequantize_to_the_librarys_values(name):
    """pagellm's float32 dequantization equals compressed-tensors' own, value for value, whole and
    for a slice of outputs that starts inside a packed word of zero points."""
    blocks, ref = blocks_of(name)
    assert torch.equal(blocks.dequantize(), ref)
    assert torch.equal(blocks.take(40, 72).dequantize(), ref[40:72])


@pytest.mark.parametrize("name", [n for n in TENSORS if not n.startswith("fp8") and n != "w8-asym"])
def test_int8_kernel_takes_integer_formats_at_width(name):
    """The integer formats' fields are the kernel's blocks, exactly the library's values; the
    kernel's product is within the activations' rounding bound of float64's, and batch invariant."""
    require_int8_kernel()
    from test_gguf_quant import error_bound

    blocks, ref = blocks_of(name)
    fmt = blocks.kernel_format()
    group = {"w4-g32-asym": 32, "w4-g128-sym": 128}.get(name, 512)
    assert fmt == (gemm_int8.Q8_BLOCKS if "w8" in name else gemm_int8.Q4_BLOCKS if group == 32
                   else gemm_int8.q4_format(group // 32))
    d, m, q = blocks.int8_fields()
    assert torch.equal(torch.from_numpy(d.repeat(32, axis=1) * q + m.repeat(32, axis=1)), ref)
    w = gemm_int8.BoundWeight(gemm_int8.pack_blocks(d, m, q, fmt), fmt, *ref.shape)
    x = torch.randn(7, ref.shape[1])
    x[3] *= 1000.0
    y = w(x)
    err = (y.double() - x.double() @ ref.double().T).abs()
    # (float32 rounds d q and m apart: a row that is all zero points still rounds their difference)
    parts = np.abs(d.repeat(32, axis=1) * q) + np.abs(m.repeat(32, axis=1))
    bound = error_bound(x, ref.double().numpy(), 32) + 1e-5 * x.double().abs() @ torch.from_numpy(parts).double().T
    assert bool((err <= bound).all()) and float((err / bound).max()) > 0.01
    assert all(torch.equal(w(x[i:i + 1]), y[i:i + 1]) for i in (0, 3, 6))


def test_act_order_groups_dequantize_by_g_idx_and_pack_in_their_input_order():
    """An act-order checkpoint (``actorder: group``, written by llm-compressor before 0.20 removed
    it): each input's group from ``weight_g_idx``, scattered. The tensors are written here, packed by
    the library's own ``pack_to_int32``; the oracle is the float64 formula ``(q - z[g_idx]) s[g_idx]``.
    No kernel block holds a scattered group: in its input order (sorted by group) the int8 kernel's
    product, on activations permuted alike, equals the float64 product within its rounding bound."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from test_gguf_quant import error_bound

    n, k, gs = 64, 256, 32
    rng = np.random.default_rng(3)
    g_idx = rng.permutation(k) // gs  # (each group 32 inputs, scattered over all of them)
    q = rng.integers(0, 16, (n, k))
    z = rng.integers(0, 16, (n, k // gs))
    s = torch.from_numpy(rng.uniform(0.01, 0.2, (n, k // gs))).bfloat16()
    parts = {"weight_packed": pack_to_int32(torch.from_numpy(q - 8).to(torch.int8), 4),
             "weight_shape": torch.tensor([n, k]), "weight_scale": s,
             "weight_zero_point": pack_to_int32(torch.from_numpy(z - 8).to(torch.int8), 4, packed_dim=0),
             "weight_g_idx": torch.from_numpy(g_idx).to(torch.int32)}
    scheme = scheme_of("pack-quantized", dict(INT4, symmetric=False, strategy="group", group_size=gs,
                                              actorder="group"))
    assert scheme.act_order and "weight_g_idx" in scheme.required()
    blocks = PackedIntBlocks.of(scheme, "layer", parts)
    sd = s.double().numpy()
    ref = torch.from_numpy((q - z[:, g_idx]) * sd[:, g_idx])
    assert torch.equal(blocks.dequantize().double(), ref)
    assert torch.equal(blocks.take(16, 48).dequantize().double(), ref[16:48])
    assert blocks.kernel_format() is None  # (scattered groups: no block of 32 inputs shares one)
    require_int8_kernel()
    order = blocks.input_order()
    assert order is not None and np.array_equal(np.sort(g_idx[order]), g_idx[order])
    ordered = blocks.in_input_order(order)
    fmt = ordered.kernel_format()
    w = gemm_int8.BoundWeight(gemm_int8.pack_blocks(*ordered.int8_fields(), fmt), fmt, n, k)
    x = torch.randn(5, k)
    xo = x[:, torch.from_numpy(order)]
    err = (w(xo).double() - x.double() @ ref.T).abs()
    bound = error_bound(xo, ref[:, order].numpy(), 32) + 1e-5 * (x.double().abs() @ ref.abs().T)
    assert bool((err <= bound).all()) and float((err / bound).max()) > 0.01, float((err / bound).max())


def test_asymmetric_int8_has_no_kernel_block():
    """An 8-bit zero point other than the middle has no 8-bit kernel block: dequantized instead."""
    blocks, _ = blocks_of("w8-asym")
    with pytest.raises(ValueError, match="zero point other than 128"):
        blocks.int8_fields()


@pytest.mark.parametrize("name", ["fp8-tensor", "fp8-channel", "fp8-block"])
def test_fp8_is_requantized_to_q8_0_of_the_librarys_values(name):
    """No kernel block holds e4m3 values: the int8 kernel gets GGUF Q8_0 blocks of the library's
    float32 values (``gguf``'s own quantizer and dequantizer are the oracle)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    blocks, ref = blocks_of(name)
    assert blocks.kernel_format() == gemm_int8.Q8_BLOCKS
    assert blocks.packed_name.endswith("(requantized to Q8_0 for the int8 kernel)")
    d, m, q = blocks.take(32, 96).int8_fields()
    want = dequantize(quantize(ref[32:96].numpy(), T.Q8_0), T.Q8_0)
    assert not m.any() and np.array_equal(d.repeat(32, axis=1) * q, want)


@pytest.fixture(scope="module")
def compressed(ckpt_root, tmp_path_factory):
    """The tiny Llama's Linear layers (not its LM head) as llm-compressor's presets store them, each
    beside the library's decompression of it as a plain checkpoint."""
    root = tmp_path_factory.mktemp("compressed-tensors")
    src = build_tiny_checkpoint(ckpt_root, "llama")
    dynamic = dict(symmetric=True, strategy="token", dynamic=True)
    presets = {
        "w4a16": ("pack-quantized", dict(INT4, symmetric=False, strategy="group", group_size=32), None),
        "w8a8": ("int-quantized", dict(INT8, symmetric=True, strategy="channel"), dict(INT8, **dynamic)),
        "w8a8-static": ("int-quantized", dict(INT8, symmetric=True, strategy="channel"),
                        dict(INT8, symmetric=True, strategy="tensor")),
        "fp8": ("float-quantized", dict(FP8, symmetric=True, strategy="channel"), dict(FP8, **dynamic)),
        "fp8-block": ("float-quantized", dict(FP8, symmetric=True, strategy="block", block_structure=[32, 32]), None),
    }
    out = {}
    for name, (fmt, weights, acts) in presets.items():
        out[name] = (str(root / name), str(root / f"{name}-dequantized"))
        write_compressed(src, *out[name], fmt, weights, acts)
    return out


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.mark.parametrize("name", ["w4a16", "w8a8-static", "fp8-block"])
def test_float32_greedy_equals_hf_on_the_librarys_decompression(compressed, name):
    assert_float32_equals_hf(*compressed[name], PROMPTS)


KINDS = {"w4a16": "compressed-tensors W4A16 int4 g32 asymmetric x14: int8 GEMMs (4-bit blocks)",
         "w8a8": "compressed-tensors W8A8 int8 per channel x14: int8 GEMMs (8-bit blocks)",
         "fp8": "compressed-tensors W8A8 FP8 e4m3 per channel (requantized to Q8_0 for the int8 kernel) x14: "
                "int8 GEMMs (8-bit blocks)"}


@pytest.mark.parametrize("name", KINDS)
def test_default_numerics_keep_them_at_width(compressed, name, caplog):
    """dtype auto: every projection packed from the checkpoint's tensors, the numerics line naming
    the format (and, for W8A8, that the kernel quantizes activations its own way); tokens
    logprob-close to float32; a prompt alone gives the tokens it gives in the batch."""
    require_int8_kernel()
    path, _ = compressed[name]
    got, prompts, _, lines = greedy_at_width(path, PROMPTS, caplog)
    assert any(KINDS[name] in line for line in lines), lines
    assert any("activation scheme" in line for line in lines) == (name != "w4a16"), lines
    assert_close_and_batch_invariant(path, prompts, got)


REFUSED = {
    "sparsity": ({"sparsity_config": {"format": "sparse-24-bitmask"}}, r"sparsity \(sparsity_config\)"),
    "kv cache": ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, r"a quantized KV cache"),
    "transforms": ({"transform_config": {"config_groups": {"u": {}}}}, r"transforms \(transform_config\)"),
    "format": ({"format": "nvfp4-pack-quantized"}, r"the format \(pack-quantized, int-quantized"),
    "int4 activations": ({"acts": dict(INT4, strategy="token")}, "activations other than 8-bit"),
    "int3": ({"weights": dict(INT4, num_bits=3, strategy="group", group_size=128)}, "pack-quantized weights other"),
    "group 48": ({"weights": dict(INT4, strategy="group", group_size=48)}, r"group_size \(multiples of 32"),
    "mixed": ({"second": dict(INT8, strategy="channel")}, "config_groups with different schemes"),
    "frozen": ({"quantization_status": "frozen"}, "quantization_status other than compressed"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refusals_name_what_is_not_built(case):
    change, match = dict(REFUSED[case][0]), REFUSED[case][1]
    fmt = change.pop("format", "pack-quantized")
    group = {"format": fmt, "targets": ["Linear"], "input_activations": change.pop("acts", None),
             "weights": change.pop("weights", dict(INT4, strategy="group", group_size=128))}
    groups = {"group_0": group}
    if "second" in change:
        groups["group_1"] = {**group, "weights": change.pop("second"), "format": "int-quantized"}
    qc = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": groups, **change}
    with pytest.raises(ValueError, match=f"quant_method='compressed-tensors' .* is not supported yet .*{match}"):
        quant_scheme(types.SimpleNamespace(quantization_config=qc), "ckpt")


def test_quantization_argument_is_checked_against_the_checkpoint(compressed):
    from pagellm import LLM

    path, deq = compressed["w4a16"]
    with pytest.raises(ValueError, match="quantization='awq', but .* holds COMPRESSED-TENSORS weights"):
        LLM(path, quantization="awq", num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="quantization='compressed-tensors', but .* holds no AWQ / GPTQ / "
                       "compressed-tensors weights"):
        LLM(deq, quantization="compressed-tensors", num_gpu_blocks_override=16)
