"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): a ViT over each image at its own resolution
(patches of 14 px, a 2D rotary embedding, attention within one image), a patch merger that joins
2x2 patches into one row for the text model, and the Qwen2 decoder with M-RoPE (positions
``[3, T]``: an image's rows take (temporal, height, width) positions; ``layers/rotary.py``).

The text decoder is this class (``DecoderForCausalLM`` over ``config.text_config`` with Qwen2's
flags); the runner computes the M-RoPE positions from each image's grid (``mrope_positions``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed import PipelineStage, TensorParallelGroup
from pagellm.layers.linear import Linear
from pagellm.models.decoder import DecoderForCausalLM
from pagellm.models.vision import VisionMLP, load_vision_language_weights, vision_activation


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv, self.proj = Linear(dim, 3 * dim), Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        q = (q * cos + _rotate_half(q) * sin).to(v.dtype)  # (rotated in float32, as HF does)
        k = (k * cos + _rotate_half(k) * sin).to(v.dtype)
        out = [F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
               for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)]
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(n, d))


class VisionRMSNorm(nn.Module):
    """Qwen2.5-VL's norm: float32 statistics, the weight applied in the input's dtype (HF's order)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GatedVisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = Linear(dim, hidden), Linear(dim, hidden)
        self.down_proj = Linear(hidden, dim)
        self.act = F.silu if act == "silu" else vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_dim: int, act: str, v25: bool) -> None:
        super().__init__()
        norm = VisionRMSNorm if v25 else (lambda d: nn.LayerNorm(d, eps=1e-6))
        self.norm1, self.norm2 = norm(dim), norm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp: nn.Module = GatedVisionMLP(dim, mlp_dim, act) if v25 else VisionMLP(dim, mlp_dim, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """A strided 3-D convolution over each flattened ``[C, T, P, P]`` patch."""

    def __init__(self, config: Any, dim: int) -> None:
        super().__init__()
        p, tp = config.patch_size, config.temporal_patch_size
        self.shape = (config.in_channels, tp, p, p)
        self.proj = nn.Conv3d(config.in_channels, dim, (tp, p, p), stride=(tp, p, p), bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return self.proj(patches.to(w.dtype).view(-1, *self.shape)).view(patches.shape[0], -1)


class PatchMerger(nn.Module):
    """2x2 neighbouring patches (adjacent rows, in the processor's order) into one text-model row."""

    def __init__(self, dim: int, context_dim: int, merge: int, v25: bool) -> None:
        super().__init__()
        merged = context_dim * merge ** 2
        self.ln_q = VisionRMSNorm(context_dim) if v25 else nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(Linear(merged, merged), nn.GELU(), Linear(merged, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL's ViT, or Qwen2.5-VL's (``v25``: RMSNorm, a gated MLP, and attention within windows of
    ``window_size`` pixels except in the ``fullatt_block_indexes`` layers)."""

    def __init__(self, config: Any, text_hidden: int, v25: bool = False) -> None:
        super().__init__()
        d = config.hidden_size if v25 else config.embed_dim
        self.merge = config.spatial_merge_size
        self.head_dim = d // config.num_heads
        self.patch_embed = PatchEmbed(config, d)
        mlp_dim = config.intermediate_size if v25 else int(d * config.mlp_ratio)
        self.blocks = nn.ModuleList(Qwen2VisionBlock(d, config.num_heads, mlp_dim, config.hidden_act, v25)
                                    for _ in range(config.depth))
        self.merger = PatchMerger(text_hidden, d, self.merge, v25)
        # Qwen2.5-VL's windows, in merged rows per side (None: every layer attends to the whole image).
        self.window = config.window_size // self.merge // config.patch_size if v25 else None
        self.full_layers = set(getattr(config, "fullatt_block_indexes", None) or ())
        params = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(params.get("rope_theta", 10000.0))

    def rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) rotary angles, patches in the processor's order: 2x2 merge
        blocks row by row, the block's patches row by row inside it."""
        m = self.merge
        pos = []
        for t, h, w in grids:
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            shape = (h // m, m, w // m, m)
            hw = torch.stack([hh.reshape(shape).transpose(1, 2).flatten(), ww.reshape(shape).transpose(1, 2).flatten()])
            pos.append(hw.repeat(1, t))
        positions = torch.cat(pos, dim=1).to(device)  # [2, N]
        spatial = self.head_dim // 2
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
        freqs = positions[..., None].float() * inv_freq  # [2, N, spatial / 2]
        angles = torch.cat([freqs[0], freqs[1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [N, 1, head_dim]
        return angles.cos(), angles.sin()

    def windows(self, grids: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
        """Qwen2.5-VL: ``(order, lengths)``: the merged rows window by window (each frame cut into
        ``window x window`` squares, row-major, the last ones partial), and each window's patches."""
        assert self.window is not None
        win, unit = self.window, self.merge ** 2
        order: list[int] = []
        lengths: list[int] = []
        base = 0
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            for f in range(t):
                for r0 in range(0, gh, win):
                    for c0 in range(0, gw, win):
                        rows = [base + f * gh * gw + r * gw + c
                                for r in range(r0, min(r0 + win, gh)) for c in range(c0, min(c0 + win, gw))]
                        order += rows
                        lengths.append(len(rows) * unit)
            base += t * gh * gw
        return order, lengths

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embed(patches)
        cos, sin = self.rotary(grids, x.device)
        full = [h * w for t, h, w in grids for _ in range(t)]
        windowed = full
        order = None
        if self.window is not None:  # rows regrouped window by window (merge units kept together)
            order_list, windowed = self.windows(grids)
            order = torch.tensor(order_list, device=x.device)
            unit = self.merge ** 2
            x, cos, sin = (v.view(-1, unit, *v.shape[1:])[order].flatten(0, 1) for v in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if order is None or i in self.full_layers else windowed)
        out = self.merger(x)
        return out if order is None else out[torch.argsort(order)]


class Qwen2VLForConditionalGeneration(DecoderForCausalLM):
    """Images in, text out: Qwen2's decoder with M-RoPE, plus ``visual``."""

    qkv_bias = True
    v25 = False

    def __init__(self, config: Any, freq_factors: torch.Tensor | None = None,
                 tp: TensorParallelGroup | None = None, pp: PipelineStage | None = None) -> None:
        if (tp is not None and tp.world_size > 1) or (pp is not None and pp.num_stages > 1):
            raise ValueError(f"{type(self).__name__} runs on one worker (tensor_parallel_size=1, "
                             "pipeline_parallel_size=1)")
        text = config.get_text_config()
        super().__init__(text, freq_factors, tp, pp)
        self.mm_config = config
        self.visual = Qwen2VisionTransformer(config.vision_config, text.hidden_size, self.v25)
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    @staticmethod
    def rope_positions(layout: list[tuple[int, int, int, int, int]] | None, start: int, n: int) -> list[list[int]]:
        """M-RoPE's (t, h, w) rows: from the images' grids where the request has images."""
        return mrope_positions(layout, start, n) if layout else DecoderForCausalLM.rope_positions(None, start, n)

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's rows for the text model (``[t * h * w / merge^2, hidden]``), all images in one
        pass (attention stays within each image)."""
        grids = [tuple(int(v) for v in im["image_grid_thw"]) for im in images]
        rows = self.visual(torch.cat([im["pixel_values"] for im in images]), grids)
        return list(rows.split([t * h * w // self.spatial_merge_size ** 2 for t, h, w in grids]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded_elsewhere: Iterable[str] = ()) -> None:
        """HF's names, old (``model.layers.*``, ``visual.*``) and new (``model.language_model.*``,
        ``model.visual.*``)."""
        load_vision_language_weights(
            self, weights, lambda n: n.replace("model.language_model.", "model.").replace("model.visual.", "visual."),
            ("visual.",), super().load_weights, loaded_elsewhere)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL's layout; its ViT attends within windows (``Qwen2VisionTransformer``)."""

    v25 = True


def mrope_positions(layout: list[tuple[int, int, int, int, int]], start: int, n: int) -> list[list[int]]:
    """Qwen2-VL's M-RoPE positions ``[3][n]`` of tokens ``start ..``: a text token's three are its
    index plus the shift of the images before it; an image's token ``i`` (grid ``t, h, w`` after
    the merge, from ``offset``) gets ``(s + i // (h*w), s + i // w % h, s + i % w)`` where ``s`` is
    the image's first position; after an image the positions go on from ``s + max(h, w)``
    (HF's ``get_rope_index``). ``layout``: ``(offset, length, t, h, w)`` per image, in order."""
    out: list[list[int]] = [[], [], []]
    shift, i = 0, 0
    end = start + n
    p = start
    images = sorted(layout)
    while p < end:
        while i < len(images) and images[i][0] + images[i][1] <= p:  # images wholly before p
            o, length, _, h, w = images[i]
            shift += max(h, w) - length
            i += 1
        if i < len(images) and images[i][0] <= p:
            o, length, _, h, w = images[i]
            s = o + shift
            for k in range(p - o, min(length, end - o)):
                out[0].append(s + k // (h * w))
                out[1].append(s + k // w % h)
                out[2].append(s + k % w)
            p = min(o + length, end)
            continue
        stop = min(end, images[i][0]) if i < len(images) else end
        for row in out:
            row.extend(range(p + shift, stop + shift))
        p = stop
    return out
