"""The CUDA backend's Triton attention kernel, run on the CPU by Triton's interpreter
(``TRITON_INTERPRET=1``) against the torch reference backend: decodes and chunks (fresh, after a
prefix, several in a step), GQA, head sizes that need padding, every cache dtype, sliding windows
and soft-caps. Small shapes: the interpreter runs each program in numpy."""

from __future__ import annotations

import os

import pytest
import torch

# (conftest.py sets TRITON_INTERPRET=1 where there is no GPU, before anything imports triton; on a
# GPU the compiled kernel is tested in tests/gpu instead.)
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter's tests (a GPU runs tests/gpu, compiled)", allow_module_level=True)

from paged_cases import BLOCK, NUM_BLOCKS, SHAPES, run_backend, sequences  # noqa: E402

from pagellm.attention import triton_attention  # noqa: E402
from pagellm.attention.cuda_paged import CudaPagedAttention  # noqa: E402
from pagellm.attention.torch_paged import TorchPagedAttention  # noqa: E402

# Key partitions of one block (every block its own program), of two, and the default (128
# positions: one partition at these contexts, the kernel unsplit).
PARTITIONS = [BLOCK, 2 * BLOCK, triton_attention.PARTITION_SIZE]


@pytest.fixture(params=PARTITIONS, ids=lambda p: f"partition{p}")
def partition(request, monkeypatch):
    monkeypatch.setattr(triton_attention, "PARTITION_SIZE", request.param)
    return request.param


def decode_partitions(backend, seqs):
    """The partitions the backend gives this step's decodes (their group's kernel argument)."""
    decodes = [s for s in seqs if s[1] == 1 and s[0] > 1]
    meta = backend.build_metadata([s[0] for s in decodes], [s[2] for s in decodes], [], BLOCK, torch.device("cpu"))
    return meta.groups[0].kernel_args[4]


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (8, 2, 64), (6, 2, 80)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kernel_equals_the_reference(hq, hkv, d, cache_dtype, partition):
    seqs = sequences(SHAPES, hq, hkv, d, seed=hq * d)
    caches = [torch.zeros(NUM_BLOCKS * BLOCK, hkv, d, dtype=cache_dtype) for _ in range(2)]
    ref = run_backend(TorchPagedAttention(), seqs, caches, hq, hkv, d, torch.float32)
    backend = CudaPagedAttention.for_cache(caches[0], torch.float32)
    got = run_backend(backend, seqs, caches, hq, hkv, d, torch.float32)
    assert decode_partitions(backend, seqs) == -(-70 // partition)  # (the longest decode's context: 70)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"sequence {SHAPES[i]}: {m}")


@pytest.mark.parametrize("window,softcap", [(24, None), (None, 2.0), (9, 3.0)])
def test_windows_and_softcaps_equal_the_reference(window, softcap, partition):
    hq, hkv, d = 8, 2, 32
    seqs = sequences(SHAPES, hq, hkv, d, seed=7)
    caches = [torch.zeros(NUM_BLOCKS * BLOCK, hkv, d) for _ in range(2)]
    ref = run_backend(TorchPagedAttention(), seqs, caches, hq, hkv, d, torch.float32, window, softcap)
    got = run_backend(CudaPagedAttention(), seqs, caches, hq, hkv, d, torch.float32, window, softcap)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"sequence {SHAPES[i]}: {m}")


def test_16_bit_queries_stay_close_and_an_int8_cache_is_refused():
    """Float16 queries over a bfloat16 cache. (Bfloat16 queries run on the GPU only: Triton 3.9's
    interpreter multiplies bfloat16 tiles wrongly, ``tl.dot`` of two random 16x16 tiles off by 1e10.)"""
    hq, hkv, d = 8, 2, 64
    seqs = sequences(SHAPES, hq, hkv, d, seed=3)
    caches = [torch.zeros(NUM_BLOCKS * BLOCK, hkv, d, dtype=torch.bfloat16) for _ in range(2)]
    ref = run_backend(TorchPagedAttention(), seqs, caches, hq, hkv, d, torch.float32)
    got = run_backend(CudaPagedAttention(), seqs, caches, hq, hkv, d, torch.float16)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="int8 is not supported on CUDA"):
        CudaPagedAttention.for_cache(torch.zeros(4, 1, 8, dtype=torch.int8), torch.float32)


@pytest.fixture
def row_by_row_dot(monkeypatch):
    """The interpreter's ``tl.dot`` one output row at a time. It is numpy's matmul, whose BLAS may
    sum a row in another order when the tile has other rows beside it (OpenBLAS's AVX2 kernels do;
    its AVX-512 ones did not): a property of the host's BLAS, not of the kernel, which on a GPU
    keeps a row's bits by its fixed tile height (the GPU subset runs this case compiled)."""
    import numpy as np
    from triton.runtime import interpreter

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        assert a.data.ndim == 2 and a.data.dtype == np.float32, "a float32 tile, as this case's kernel has"
        rows = [np.matmul(a.data[i:i + 1], b.data, dtype=d.data.dtype) for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot)


@pytest.mark.parametrize("window", [None, 20])
def test_a_row_gets_the_same_bits_decoded_or_prefilled_alone_or_in_a_batch(partition, window, row_by_row_dot):
    """Batch and schedule invariance: position 52 of one sequence, as a lone decode, as a decode
    among others, and as the last row of a prefill chunk, gives the same bits: split into key
    partitions across programs (decodes) or combining them in one (a chunk's tile) alike, and with
    a window that masks a partition whole for some of the chunk's rows (tile products row by row:
    ``row_by_row_dot``)."""
    hq, hkv, d = 8, 2, 64
    seqs = sequences([(53, 1), (37, 1), (70, 1), (53, 20)], hq, hkv, d, seed=5)
    seqs[3] = (53, 20, seqs[0][2], torch.cat([seqs[3][3][:19], seqs[0][3]]), seqs[0][4], seqs[0][5])
    caches = [torch.zeros(NUM_BLOCKS * BLOCK, hkv, d) for _ in range(2)]
    backend = CudaPagedAttention()
    alone = run_backend(backend, seqs[:1], caches, hq, hkv, d, torch.float32, window)[0]
    batched = run_backend(backend, seqs[:3], caches, hq, hkv, d, torch.float32, window)[0]
    prefilled = run_backend(backend, seqs[3:], caches, hq, hkv, d, torch.float32, window)[0][-1:]
    assert decode_partitions(backend, seqs[:1]) == -(-53 // partition)
    assert torch.equal(alone, batched) and torch.equal(alone, prefilled)
    ref = run_backend(TorchPagedAttention(), seqs[:1], caches, hq, hkv, d, torch.float32, window)[0]
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)


def test_a_grid_with_more_partitions_than_a_row_needs_equals_the_exact_one(monkeypatch):
    """A CUDA graph's grid holds partitions for the longest context its table can (fixed at capture):
    the programs past a row's context return, and the reduce reads only the row's own."""
    monkeypatch.setattr(triton_attention, "PARTITION_SIZE", BLOCK)
    hq, hkv, d = 8, 2, 32
    seqs = sequences([(37, 1), (70, 1), (5, 1)], hq, hkv, d, seed=11)
    caches = [torch.zeros(NUM_BLOCKS * BLOCK, hkv, d) for _ in range(2)]
    backend = CudaPagedAttention()
    exact = run_backend(backend, seqs, caches, hq, hkv, d, torch.float32)
    monkeypatch.setattr(CudaPagedAttention, "_group", staticmethod(_widened(CudaPagedAttention._group, 9)))
    wide = run_backend(backend, seqs, caches, hq, hkv, d, torch.float32)
    for a, b in zip(wide, exact, strict=True):
        assert torch.equal(a, b)


def _widened(make_group, parts):
    """``CudaPagedAttention._group`` with the decodes' partition count set to ``parts``."""
    def group(*args, **kwargs):
        g = make_group(*args, **kwargs)
        if kwargs.get("split"):
            assert parts > g.kernel_args[4]
            g.kernel_args = (*g.kernel_args[:4], parts)
        return g
    return group
