"""Nested configs given as a dict or as their JSON text (a CLI flag)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from pagellm.utils import reject_unknown


def config_dict(value: object, name: str, example: str, cls: type | None) -> dict[str, Any]:
    """A nested config given as a dict or as its JSON text (a CLI flag), its keys checked against ``cls``
    (``None``: the caller checks them)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be JSON, e.g. '{example}': {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")
    if cls is not None:
        reject_unknown(f"{name} field(s)", value, {f.name for f in fields(cls)})
    return value
