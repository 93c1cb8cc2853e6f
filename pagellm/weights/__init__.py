"""Model files: read their config and stream their tensors under Hugging Face names."""

from pagellm.weights.loader import freq_factors, iter_weights, load_model_config

__all__ = ["freq_factors", "iter_weights", "load_model_config"]
