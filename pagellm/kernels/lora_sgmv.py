"""The grouped multi-LoRA update (``lora_sgmv.c``): every adapter run of a step's rows in one
call, shrink and expand fused per block of rows, the zero blocks of fused projections skipped.
``pagellm/lora/layers.py`` holds the torch version it is tested against."""

from __future__ import annotations

import ctypes

import torch

from pagellm import kernels

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES: kernels.Signatures = {
    "lora_max_width": (ctypes.c_int, []),
    "lora_add_f32": (ctypes.c_int, [_P, _I, _P, _I, _P, _I, _P, _P, _I, _I, _I, _P, _I]),
}


def _lib() -> ctypes.CDLL | None:
    return kernels.load("lora_sgmv", _SIGNATURES)


def supports(at: torch.Tensor, bt: torch.Tensor) -> bool:
    """Whether the kernel takes slots of these shapes (float32 on the CPU, intermediate ≤ its width)."""
    lib = _lib()
    return (lib is not None and at.device.type == "cpu" and at.dtype == torch.float32 and bt.dtype == torch.float32
            and at.is_contiguous() and bt.is_contiguous() and at.shape[2] <= lib.lora_max_width())


def add(x: torch.Tensor, y: torch.Tensor, segments: torch.Tensor, at: torch.Tensor, bt: torch.Tensor,
        parts: torch.Tensor) -> None:
    """``y[s:e] += (x[s:e] At[slot]) Bt[slot]`` for each ``(s, e, slot)`` row of ``segments``
    (int64 ``[n, 3]``), reading only each part's ``(col, rank, out_off, out_len)`` block of ``Bt``."""
    lib = _lib()
    assert lib is not None and x.dtype == y.dtype == torch.float32
    assert x.stride(1) == 1 and y.stride(1) == 1, "rows must be contiguous"
    rc = lib.lora_add_f32(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), segments.data_ptr(),
                          segments.shape[0], at.data_ptr(), bt.data_ptr(), at.shape[1], at.shape[2], bt.shape[2],
                          parts.data_ptr(), parts.shape[0])
    if rc != 0:
        raise RuntimeError(f"lora_add_f32 refused shapes At {tuple(at.shape)} Bt {tuple(bt.shape)}")
