"""Llama family (Llama 2/3, SmolLM, Mistral without sliding window)."""

from pagellm.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Plain Llama: bias-free projections (unless ``attention_bias``), no q/k norm."""


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama's layout; the loader caps ``max_model_len`` at ``sliding_window``."""
