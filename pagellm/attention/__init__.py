"""Attention backends, looked up by name (lazy imports keep optional kernels optional)."""

from __future__ import annotations

from pagellm.attention.metadata import AttentionGroup, AttentionMetadata

_BACKENDS = {"torch": "pagellm.attention.torch_paged"}


def get_attention_backend(name: str = "torch"):
    """Return the backend module: ``build_metadata(...)`` and ``forward(...)``."""
    import importlib

    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return importlib.import_module(_BACKENDS[name])


__all__ = ["AttentionGroup", "AttentionMetadata", "get_attention_backend"]
