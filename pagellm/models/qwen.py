"""Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each head's q and k)."""

from pagellm.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
