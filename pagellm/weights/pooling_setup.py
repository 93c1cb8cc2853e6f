"""The pooling a checkpoint declares: sentence-transformers' ``modules.json`` lists a ``Pooling``
module (its ``config.json`` names the mode) and, where the vectors are normalized, a ``Normalize``
module; Qwen3-Embedding-style checkpoints declare last-token pooling the same way. Read, never
guessed: without them vLLM's default for a decoder applies (the last token, normalized)."""

from __future__ import annotations

import json
import os

# sentence-transformers' flags -> pooling_type
_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN"}


def checkpoint_pooling(path: str) -> tuple[str | None, bool | None]:
    """``(pooling_type, normalize)`` from a sentence-transformers checkpoint directory, ``(None,
    None)`` where it declares nothing; a mode pagellm has not built is a ``ValueError``."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return None, None
    with open(modules_file) as f:
        modules = json.load(f)
    pooling_type, normalize = None, False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            with open(os.path.join(path, module.get("path", ""), "config.json")) as f:
                cfg = json.load(f)
            modes = [name for name, on in cfg.items() if name.startswith("pooling_mode") and on]
            if len(modes) != 1 or modes[0] not in _MODES:
                raise ValueError(f"{path}: sentence-transformers pooling {modes} is not supported (one of "
                                 f"{sorted(_MODES)})")
            pooling_type = _MODES[modes[0]]
        elif kind.endswith(".Normalize"):
            normalize = True
    return pooling_type, normalize if pooling_type is not None else None


def resolve_pooling(path: str, pooling_type: str | None, normalize: bool | None,
                    default_type: str = "LAST") -> tuple[str, bool]:
    """The given fields, else the checkpoint's, else ``default_type`` (vLLM's: a decoder's last
    token, an encoder's CLS), normalized."""
    declared_type, declared_norm = checkpoint_pooling(path) if os.path.isdir(path) else (None, None)
    return (pooling_type or declared_type or default_type,
            normalize if normalize is not None else declared_norm if declared_norm is not None else True)
