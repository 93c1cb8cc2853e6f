"""Llama family (Llama 2/3, SmolLM, Mistral)."""

from pagellm.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Plain Llama: bias-free projections (unless ``attention_bias``), no q/k norm."""


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama's layout, every layer attending within ``sliding_window`` (``decoder.sliding_window``)."""
