"""Vision towers: CLIP's and SigLIP's ViT encoders (``CLIPVisionModel``, ``SiglipVisionModel``).

An image's pixel values become one row per patch (and CLIP's class token). The projections are
``layers.linear.Linear``, so the text model's GEMM numerics (float32 exact, bfloat16 where chosen)
apply to the tower too; attention is bidirectional over one image's patches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.linear import Linear


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def vision_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"vision activation {name!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj, self.k_proj, self.v_proj = Linear(hidden, hidden), Linear(hidden, hidden), Linear(hidden, hidden)
        self.out_proj = Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = Linear(hidden, intermediate), Linear(intermediate, hidden)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(d, eps=eps), nn.LayerNorm(d, eps=eps)
        self.self_attn = VisionAttention(d, config.num_attention_heads)
        self.mlp = VisionMLP(d, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    """Patches by a strided convolution, plus learned positions; CLIP prepends a class token."""

    def __init__(self, config: Any, class_token: bool) -> None:
        super().__init__()
        d, p = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, d, p, stride=p, bias=not class_token)
        num_positions = (config.image_size // p) ** 2 + int(class_token)
        self.class_embedding = nn.Parameter(torch.empty(d)) if class_token else None
        self.position_embedding = nn.Embedding(num_positions, d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionTower(nn.Module):
    """CLIP (class token, pre-norm ``pre_layrnorm``) or SigLIP (neither) ViT, run up to the layer
    whose output the projector reads: ``num_layers`` layers (``feature_layer`` -1 is the last)."""

    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        clip = config.model_type.startswith("clip")
        self.embeddings = VisionEmbeddings(config, class_token=clip)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if clip else None
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(num_layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x)
        return x

    def hf_name(self, name: str) -> str | None:
        """This module's parameter for an HF vision-tower tensor name (``None``: one it never reads:
        a layer past the feature layer, the post-norm, SigLIP's pooling head)."""
        name = name.removeprefix("vision_model.")
        if name.startswith("encoder.layers."):
            i = int(name.split(".")[2])
            return name.removeprefix("encoder.") if i < len(self.layers) else None
        if name.startswith(("post_layernorm.", "head.")):
            return None
        return name


def load_vision_language_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                                 rename: Callable[[str], str | None], own: tuple[str, ...],
                                 load_text: Callable[[Iterator[tuple[str, torch.Tensor]], list[str]], None],
                                 loaded_elsewhere: Iterable[str] = ()) -> None:
    """A vision-language checkpoint: each HF name ``rename``d to the model's (``None``: a tensor it
    never reads); the parameters under the ``own`` prefixes (tower, projector) copied here, every one
    of them required and no other accepted; the rest handed to ``load_text`` (the text decoder's
    loader: fused and sharded parameters, its own strict report)."""
    params = dict(model.named_parameters())
    names = {n for n in params if n.startswith(own)}
    loaded: set[str] = set()

    def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, tensor in weights:
            name = rename(hf_name)
            if name is None:
                continue
            if not name.startswith(own):
                yield name, tensor
                continue
            param = params.get(name)
            if param is None or param.shape != tensor.shape:
                raise ValueError(f"checkpoint does not match {type(model).__name__}: unexpected {hf_name} "
                                 f"{tuple(tensor.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)

    load_text(text_weights(), [*loaded_elsewhere, *names])
    missing = sorted(names - loaded)
    if missing:
        raise ValueError(f"checkpoint does not match {type(model).__name__}: missing {len(missing)} {missing[:8]}")
