"""Model registry: the one table of supported architectures, each class imported lazily."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    """One supported HF architecture (``config.architectures[0]``, also its class's name) and the other
    names it goes by: its ``model_type`` and its ``AutoModel`` checkpoints' name (no LM head). The
    GGUF families that load as it are ``weights/gguf_file.py``'s ``GGUF_FAMILIES`` rows."""

    name: str
    module: str  # under pagellm.models
    model_type: str
    base_model: str | None = None
    llava_text: bool = False  # may be a LLaVA checkpoint's text model
    encoder: bool = False  # bidirectional, pooling runner only (``models/bert.py``)


ARCHITECTURES = (
    Architecture("LlamaForCausalLM", "llama", "llama", "LlamaModel", llava_text=True),
    Architecture("MistralForCausalLM", "llama", "mistral", base_model="MistralModel", llava_text=True),
    Architecture("Phi3ForCausalLM", "llama", "phi3", "Phi3Model", llava_text=True),
    Architecture("Qwen2ForCausalLM", "qwen", "qwen2", "Qwen2Model", llava_text=True),
    Architecture("Qwen3ForCausalLM", "qwen", "qwen3", "Qwen3Model"),
    Architecture("Gemma2ForCausalLM", "gemma", "gemma2", "Gemma2Model", llava_text=True),
    Architecture("Gemma3ForCausalLM", "gemma", "gemma3_text"),
    Architecture("Lfm2ForCausalLM", "lfm2", "lfm2", "Lfm2Model"),
    Architecture("Qwen3_5ForCausalLM", "qwen3_5", "qwen3_5_text", "Qwen3_5TextModel"),
    Architecture("GraniteMoeHybridForCausalLM", "granite_hybrid", "granitemoehybrid", "GraniteMoeHybridModel"),
    Architecture("Qwen3NextForCausalLM", "qwen3_5", "qwen3_next", "Qwen3NextModel"),
    Architecture("Qwen3_5MoeForCausalLM", "qwen3_5", "qwen3_5_moe_text", "Qwen3_5MoeTextModel"),
    Architecture("NemotronHForCausalLM", "nemotron_h", "nemotron_h", "NemotronHModel"),
    Architecture("MixtralForCausalLM", "moe", "mixtral"),
    Architecture("Qwen2MoeForCausalLM", "moe", "qwen2_moe"),
    Architecture("Qwen3MoeForCausalLM", "moe", "qwen3_moe"),
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
