"""Model registry: HF architecture name -> class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS = {
    "Gemma2ForCausalLM": ("pagellm.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("pagellm.models.gemma", "Gemma3ForCausalLM"),
    "LlamaForCausalLM": ("pagellm.models.llama", "LlamaForCausalLM"),
    "LlavaForConditionalGeneration": ("pagellm.models.llava", "LlavaForConditionalGeneration"),
    "MistralForCausalLM": ("pagellm.models.llama", "MistralForCausalLM"),
    "MixtralForCausalLM": ("pagellm.models.moe", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("pagellm.models.llama", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("pagellm.models.qwen", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("pagellm.models.moe", "Qwen2MoeForCausalLM"),
    "Qwen2VLForConditionalGeneration": ("pagellm.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("pagellm.models.qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3ForCausalLM": ("pagellm.models.qwen", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("pagellm.models.moe", "Qwen3MoeForCausalLM"),
}


# A base model without its LM head (``AutoModel``'s checkpoints, most embedding models): its causal
# LM's class, weights named without the ``model.`` prefix (``runner="pooling"`` only).
BASE_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
               "Qwen3Model": "Qwen3ForCausalLM", "Gemma2Model": "Gemma2ForCausalLM", "Phi3Model": "Phi3ForCausalLM"}


def get_model_class(architecture: str):
    architecture = BASE_MODELS.get(architecture, architecture)
    if architecture not in _MODELS:
        raise ValueError(f"model architecture {architecture!r} is not supported; supported: {sorted(_MODELS)}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)

