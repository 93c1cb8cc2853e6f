"""The causal depthwise convolution of state layers (Mamba2's, gated DeltaNet's) over their cached
states, by a step's ``StateMetadata``, in PyTorch (beside the attention backends: a state layer's
mixer reads its cache as attention reads K/V): the
reference of ``kernels/linear_attention.causal_conv`` and the path off a CPU."""

from __future__ import annotations

import torch

from pagellm.attention.metadata import StateMetadata


def causal_conv_native(x: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       meta: StateMetadata) -> torch.Tensor:
    """``x [T, C]`` (float32) convolved along each span's rows by ``weight [C, taps]`` (plus ``bias``),
    continuing from its convolution state ``conv [blocks, C, taps - 1]`` (zeros where its run starts
    the request), which is rewritten. Every token is the same sum in the same order in a prefill, a
    chunk or a decode."""
    out = torch.empty_like(x)
    w = weight.float()
    taps = w.shape[1]
    keep = taps - 1
    for spans in meta.each_round(conv):
        for row0, n, fresh, block in spans:
            past = x.new_zeros(keep, x.shape[1]) if fresh else conv[block].t()
            xp = torch.cat([past, x[row0:row0 + n]])  # [keep + n, C]
            acc = xp[0:n] * w[:, 0]
            for j in range(1, taps):
                acc = acc + xp[j:j + n] * w[:, j]
            out[row0:row0 + n] = acc if bias is None else acc + bias.float()
            conv[block] = xp[n:].t()
    return out
