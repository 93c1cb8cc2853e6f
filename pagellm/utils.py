"""Small helpers shared by every layer (stdlib only)."""

from __future__ import annotations

import contextlib
import gc
import os
import re
from collections.abc import Iterator

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 2**10, "M": 10**6, "MB": 10**6, "MIB": 2**20,
          "G": 10**9, "GB": 10**9, "GIB": 2**30, "T": 10**12, "TB": 10**12, "TIB": 2**40}


class UnknownArgumentError(ValueError, TypeError):
    """An unknown keyword: a ``ValueError`` naming it, and a ``TypeError`` like any bad Python call."""


def reject_unknown(kind: str, given: set[str] | dict, known: set[str]) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        raise UnknownArgumentError(f"unknown {kind}: {', '.join(unknown)}")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


def parse_size(value: int | float | str, field: str = "size") -> int:
    """Parse a byte count given as a number or a string like ``"4GiB"`` / ``"512MB"``."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a byte count, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{field} must be >= 0, got {value!r}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m or (m.group(2) or "").upper() not in _UNITS:
        raise ValueError(f"{field}: cannot parse {value!r} as a size (examples: 2147483648, '2GiB', '512MB')")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def random_uuid() -> str:
    import uuid

    return uuid.uuid4().hex


def cache_dir(kind: str) -> str:
    """``$PAGELLM_CACHE/kind`` (default ``~/.cache/pagellm/kind``): converted tokenizers, built kernels."""
    root = os.environ.get("PAGELLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagellm")
    return os.path.join(root, kind)


class InvariantError(AssertionError):
    """A ``check_invariants()`` failure: the bookkeeping is corrupt. Raised explicitly (not by
    ``assert``) so the checks also run under ``python -O``; an ``AssertionError`` for callers."""


@contextlib.contextmanager
def gc_paused_then_frozen() -> Iterator[None]:
    """Start-up work with Python's cyclic collector paused, then every object it made frozen.

    Loading builds a large heap of long-lived objects (modules, tokenizer, per-layer state); each
    full collection while it grows walks all of it (SmolLM2: nine of them, ~1 s of a ~5 s start),
    and afterwards every full collection would walk it again for nothing. ``gc.freeze()`` moves the
    survivors out of the collector's sight, as vLLM's ``freeze_gc_heap`` does after start-up;
    ``gc_unfreeze`` undoes it when the engine shuts down, so an in-process engine's objects can be
    collected again. On an exception nothing is frozen.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
    gc.collect()
    gc.freeze()


def gc_unfreeze() -> None:
    """Give frozen objects back to the collector (``gc_paused_then_frozen``'s undo)."""
    gc.unfreeze()
