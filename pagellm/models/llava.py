"""LLaVA-1.5 style vision-language models (``LlavaForConditionalGeneration``): a CLIP or SigLIP
tower, a two-layer MLP projector, and any supported text decoder.

The text decoder is this class itself (a ``DecoderForCausalLM`` over ``config.text_config``, its
flags taken from the text family's class), so everything the worker does to a text model (packing,
numerics, the KV spec, decode graphs) applies unchanged. The runner asks ``encode_images`` for an
image's rows (one per placeholder token in the prompt) and passes them as ``inputs_embeds``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagellm.distributed import PipelineStage, TensorParallelGroup
from pagellm.layers.linear import Linear
from pagellm.models.decoder import DecoderForCausalLM
from pagellm.models.vision import VisionTower, load_vision_language_weights, vision_activation

_TEXT_FLAGS = ("qkv_bias", "qk_norm", "layer_cls", "embed_scale")


def _feature_layers(vision_config: Any, feature_layer: Any) -> int:
    """How many tower layers run: up to the one whose output (HF's ``hidden_states[feature_layer]``,
    index 0 being the embeddings) the projector reads."""
    if not isinstance(feature_layer, int):
        raise ValueError(f"vision_feature_layer={feature_layer!r}: only one feature layer is supported")
    n = vision_config.num_hidden_layers
    return feature_layer if feature_layer >= 0 else n + 1 + feature_layer


class MultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = Linear(text_hidden, text_hidden, bias=bias)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(DecoderForCausalLM):
    """Images in, text out: the text decoder plus ``vision_tower`` and ``multi_modal_projector``."""

    def __init__(self, config: Any, freq_factors: torch.Tensor | None = None,
                 tp: TensorParallelGroup | None = None, pp: PipelineStage | None = None) -> None:
        from pagellm.models import LLAVA_TEXT_FAMILIES, get_model_class

        text = config.text_config
        if (tp is not None and tp.world_size > 1) or (pp is not None and pp.num_stages > 1):
            raise ValueError("LlavaForConditionalGeneration runs on one worker (tensor_parallel_size=1, "
                             "pipeline_parallel_size=1)")
        family = LLAVA_TEXT_FAMILIES.get(text.model_type)
        if family is None:
            raise ValueError(f"LLaVA with a {text.model_type!r} text model is not supported "
                             f"(supported: {sorted(LLAVA_TEXT_FAMILIES)})")
        text_cls = get_model_class(family)
        for flag in _TEXT_FLAGS:  # the text family's flags, read by DecoderForCausalLM.__init__
            setattr(self, flag, getattr(text_cls, flag))
        super().__init__(text, freq_factors, tp, pp)
        self.mm_config = config
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy={strategy!r} is not supported (default, full)")
        self.drop_class_token = strategy == "default"
        vision = config.vision_config
        self.vision_tower = VisionTower(vision, _feature_layers(vision, config.vision_feature_layer))
        self.multi_modal_projector = MultiModalProjector(
            vision.hidden_size, text.hidden_size, config.projector_hidden_act,
            bool(getattr(config, "multimodal_projector_bias", True)))
        self.image_token_id = int(getattr(config, "image_token_id", None) or config.image_token_index)

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's rows for the text model (``[num_placeholder_tokens, hidden]``); images of one
        size run as one batch."""
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, im in enumerate(images):
            by_shape.setdefault(tuple(im["pixel_values"].shape), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(images)
        for idx in by_shape.values():
            features = self.vision_tower(torch.stack([images[i]["pixel_values"] for i in idx]))
            if self.drop_class_token:
                features = features[:, 1:]
            for i, rows in zip(idx, self.multi_modal_projector(features), strict=True):
                out[i] = rows
        return out  # type: ignore[return-value]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded_elsewhere: Iterable[str] = ()) -> None:
        """HF's names, old (``language_model.model.*``) and new (``model.language_model.*``)."""
        load_vision_language_weights(self, weights, self._rename, ("vision_tower.", "multi_modal_projector."),
                                     super().load_weights, loaded_elsewhere)

    def _rename(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        if name.startswith("language_model."):
            name = name.removeprefix("language_model.")
            return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"
        if name.startswith("vision_tower."):
            inner = self.vision_tower.hf_name(name.removeprefix("vision_tower."))
            return None if inner is None else f"vision_tower.{inner}"  # (None: past the feature layer)
        return name
