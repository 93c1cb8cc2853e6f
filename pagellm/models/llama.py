"""Llama family (Llama 2/3, SmolLM, Mistral) and Phi-3: the same decoder, differing only in flags."""

from pagellm.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """Plain Llama: bias-free projections (unless ``attention_bias``), no q/k norm."""


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: Llama's layout, every layer attending within ``sliding_window`` (``decoder.sliding_window``)."""


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 / 3.5 / Phi-4-mini: Llama's layer; the checkpoint stores ``qkv_proj`` and ``gate_up_proj``
    fused (cut into parts at load), rotary may be partial and ``longrope``-scaled (``layers/rotary.py``),
    and its ``sliding_window`` applies to every layer, as in transformers."""
