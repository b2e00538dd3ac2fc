"""Argument checks shared across kvtier (no torch, no numpy import needed by callers)."""

from __future__ import annotations

import numbers

__all__ = ["check_count"]


def check_count(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int, if it is an integer (not a bool, not a float) of at least ``minimum``; else ValueError
    naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)
