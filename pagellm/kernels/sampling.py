"""Random sampling of many rows at once on CPU (``sampling.c``): temperature, top-k, top-p, min-p
and one inverse-CDF draw per row, without sorting the vocabulary.

``pagellm/sampling/sampler.py`` calls :func:`sample_rows` from ``Sampler.forward_cpu``; its
``draw_native`` (PyTorch, the exponential race) is the reference ``tests/test_sampling.py``
compares the filtered distributions against.
"""

from __future__ import annotations

import ctypes

import torch

from pagellm import kernels

# The filters (``sampling/sampler.FILTERS`` by name) the kernel applies; a row using any other goes
# through the PyTorch reference instead.
KERNEL_FILTERS = frozenset({"temperature", "top_k", "top_p", "min_p"})

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES: kernels.Signatures = {
    "sample_rows_f32": (ctypes.c_int, [_P, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P]),
}


def available() -> bool:
    """Build (once) and load the library; ``False`` when disabled or impossible."""
    return kernels.load("sampling", _SIGNATURES) is not None


def sample_rows(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
                min_ps: list[float], uniforms: torch.Tensor, probs_out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of float32 ``logits [R, V]``: row ``r`` filtered by its temperature (> 0),
    top-k (0 or >= V: off), top-p (1: off) and min-p (0: off), then drawn with ``uniforms[r]``
    (float64 in [0, 1)). ``-1`` for a row with no finite maximum (all ``-inf``, or a NaN), which the
    caller handles. ``probs_out [R, V]``, if given, receives each row's final distribution."""
    lib = kernels.load("sampling", _SIGNATURES)
    assert lib is not None, "check available() first"
    r, v = logits.shape
    for name, values in (("temperatures", temperatures), ("top_ks", top_ks), ("top_ps", top_ps), ("min_ps", min_ps)):
        if len(values) != r:
            raise ValueError(f"{name} has {len(values)} values for {r} rows")
    if any(t <= 0.0 for t in temperatures):
        raise ValueError("temperatures must be > 0 (greedy rows do not come here)")
    if logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise ValueError(f"logits must be float32 on the CPU, got {logits.dtype} on {logits.device}")
    if uniforms.shape != (r,) or uniforms.dtype != torch.float64:
        raise ValueError(f"uniforms must be float64 of shape ({r},), got {uniforms.dtype} {tuple(uniforms.shape)}")
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    if probs_out is not None and (probs_out.shape != (r, v) or probs_out.dtype != torch.float32
                                  or not probs_out.is_contiguous()):
        raise ValueError(f"probs_out must be contiguous float32 of shape ({r}, {v})")
    tokens = torch.empty(r, dtype=torch.int64)
    if r == 0:
        return tokens
    temps = torch.tensor(temperatures, dtype=torch.float32)
    ks = torch.tensor(top_ks, dtype=torch.int64)
    ps = torch.tensor(top_ps, dtype=torch.float32)
    mps = torch.tensor(min_ps, dtype=torch.float32)
    u = uniforms.contiguous()
    if lib.sample_rows_f32(tokens.data_ptr(), x.data_ptr(), x.stride(0), r, v, temps.data_ptr(), ks.data_ptr(),
                           ps.data_ptr(), mps.data_ptr(), u.data_ptr(),
                           None if probs_out is None else probs_out.data_ptr()) != 0:
        raise MemoryError("the sampling kernel could not allocate its scratch")
    return tokens
