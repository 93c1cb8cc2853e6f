"""Model registry: the one table of supported architectures, each class imported lazily."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    """One supported HF architecture (``config.architectures[0]``, also its class's name) and the other
    names it goes by: its ``model_type``, its GGUF ``general.architecture`` with the ``transformers``
    config class a GGUF header becomes, and its ``AutoModel`` checkpoints' name (no LM head)."""

    name: str
    module: str  # under pagellm.models
    model_type: str
    gguf: str | None = None
    hf_config: str | None = None
    base_model: str | None = None
    llava_text: bool = False  # may be a LLaVA checkpoint's text model
    encoder: bool = False  # bidirectional, pooling runner only (``models/bert.py``)


ARCHITECTURES = (
    Architecture("LlamaForCausalLM", "llama", "llama", "llama", "LlamaConfig", "LlamaModel", llava_text=True),
    Architecture("MistralForCausalLM", "llama", "mistral", base_model="MistralModel", llava_text=True),
    Architecture("Phi3ForCausalLM", "llama", "phi3", "phi3", "Phi3Config", "Phi3Model", llava_text=True),
    Architecture("Qwen2ForCausalLM", "qwen", "qwen2", "qwen2", "Qwen2Config", "Qwen2Model", llava_text=True),
    Architecture("Qwen3ForCausalLM", "qwen", "qwen3", "qwen3", "Qwen3Config", "Qwen3Model"),
    Architecture("Gemma2ForCausalLM", "gemma", "gemma2", "gemma2", "Gemma2Config", "Gemma2Model", llava_text=True),
    Architecture("Gemma3ForCausalLM", "gemma", "gemma3_text", "gemma3", "Gemma3TextConfig"),
    Architecture("Lfm2ForCausalLM", "lfm2", "lfm2", "lfm2", "Lfm2Config", "Lfm2Model"),
    Architecture("Qwen3_5ForCausalLM", "qwen3_5", "qwen3_5_text", "qwen35", "Qwen3_5TextConfig", "Qwen3_5TextModel"),
    Architecture("GraniteMoeHybridForCausalLM", "granite_hybrid", "granitemoehybrid", "granitehybrid",
                 "GraniteMoeHybridConfig", "GraniteMoeHybridModel"),
    Architecture("Qwen3NextForCausalLM", "qwen3_5", "qwen3_next", hf_config="Qwen3NextConfig",
                 base_model="Qwen3NextModel"),
    Architecture("Qwen3_5MoeForCausalLM", "qwen3_5", "qwen3_5_moe_text", "qwen35moe", "Qwen3_5MoeTextConfig",
                 "Qwen3_5MoeTextModel"),
    Architecture("NemotronHForCausalLM", "nemotron_h", "nemotron_h", hf_config="NemotronHConfig",
                 base_model="NemotronHModel"),
    # llama.cpp writes Mixtral as "llama" with experts (weights/gguf_file.py).
    Architecture("MixtralForCausalLM", "moe", "mixtral", hf_config="MixtralConfig"),
    Architecture("Qwen2MoeForCausalLM", "moe", "qwen2_moe", "qwen2moe", "Qwen2MoeConfig"),
    Architecture("Qwen3MoeForCausalLM", "moe", "qwen3_moe", "qwen3moe", "Qwen3MoeConfig"),
    Architecture("LlavaForConditionalGeneration", "llava", "llava"),
    Architecture("Qwen2VLForConditionalGeneration", "qwen2_vl", "qwen2_vl"),
    Architecture("Qwen2_5_VLForConditionalGeneration", "qwen2_vl", "qwen2_5_vl"),
    Architecture("BertModel", "bert", "bert", encoder=True),
    Architecture("BertForSequenceClassification", "bert", "bert", encoder=True),
    Architecture("XLMRobertaModel", "bert", "xlm-roberta", encoder=True),
    Architecture("XLMRobertaForSequenceClassification", "bert", "xlm-roberta", encoder=True),
)
_BY_NAME = {a.name: a for a in ARCHITECTURES}
BASE_MODELS = {a.base_model: a.name for a in ARCHITECTURES if a.base_model}
GGUF_ARCHITECTURES = {a.gguf: a for a in ARCHITECTURES if a.gguf}
LLAVA_TEXT_FAMILIES = {a.model_type: a.name for a in ARCHITECTURES if a.llava_text}


def architecture(name: str) -> Architecture:
    """The table's row for an HF architecture name (an ``AutoModel`` name gives its causal LM's)."""
    arch = _BY_NAME.get(BASE_MODELS.get(name, name))
    if arch is None:
        raise ValueError(f"model architecture {name!r} is not supported; supported: {sorted(_BY_NAME)}")
    return arch


def get_model_class(name: str):
    arch = architecture(name)
    return getattr(importlib.import_module(f"pagellm.models.{arch.module}"), arch.name)
