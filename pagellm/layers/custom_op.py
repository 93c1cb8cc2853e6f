"""``CustomOp``: a layer with a reference implementation and a compiled CPU one, chosen once.

``forward_native`` is plain PyTorch: the oracle every test compares against, and the path in CPU
bfloat16 and wherever the kernels cannot run. ``forward_cpu`` calls a compiled kernel
(``kernels/cpu_ops.py``), ``forward_cuda`` a Triton one (``kernels/triton_ops.py``).
:func:`select_kernels` decides for every op of a loaded model at start-up, from its device and
dtype; ``forward`` never asks again (vLLM's ``CustomOp`` idea, decided by the worker instead of a
global platform)::

    model = load(...)                     # weights in their final dtype and device
    select_kernels(model, device, dtype)  # every CustomOp: use_kernel / use_triton
    model(...)                            # each op runs the implementation it was given
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
from torch import nn

from pagellm.kernels import cpu_ops


class CustomOp(nn.Module):
    """Subclasses implement ``forward_native`` and, where a kernel exists, ``forward_cpu``."""

    use_kernel: bool = False  # the compiled CPU kernel
    use_triton: bool = False  # the Triton kernel (a CUDA device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.use_kernel:
            return self.forward_cpu(*args, **kwargs)
        if self.use_triton:
            return self.forward_cuda(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)


def cpu_kernels_apply(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the compiled CPU ops can run a model on ``device`` in ``dtype`` (they compute in
    float32 on the CPU; built on the first call, ``False`` when disabled or unbuildable)."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_ops.available()


def triton_kernels_apply(device: torch.device) -> bool:
    """Whether the Triton ops run on ``device``: a CUDA one, Triton installed, and not switched off
    (``PAGELLM_TRITON_OPS=0``: the torch ops, to compare against)."""
    return device.type == "cuda" and os.environ.get("PAGELLM_TRITON_OPS", "1") != "0" \
        and importlib.util.find_spec("triton") is not None


def select_kernels(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Give every ``CustomOp`` of ``model`` its implementation; returns whether kernels are used."""
    use = cpu_kernels_apply(device, dtype)
    triton = triton_kernels_apply(device)
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.use_kernel = use
            module.use_triton = triton
    return use or triton
