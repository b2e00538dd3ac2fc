"""Argument checks shared across kvtier (no torch, no numpy import needed by callers)."""

from __future__ import annotations

import numbers
import os
from typing import Any, Iterable, Optional

__all__ = ["is_int", "check_count", "check_int_in", "split_host_port", "same_directory"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer: a Python or numpy int, not a bool (``True`` is no count), not a float."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_count(name: str, value: Any, minimum: int = 1, why: str = "") -> int:
    """``value`` as an int, if it is an integer of at least ``minimum``; else ValueError naming ``name`` (and
    ``why`` the minimum is what it is, when given)."""
    if not is_int(value) or value < minimum:
        reason = f" ({why})" if why else ""
        raise ValueError(f"{name} must be an int >= {minimum}{reason}, got {value!r}")
    return int(value)


def check_int_in(name: str, value: Any, lo: int, hi: int, bounds: str = "") -> int:
    """``value`` as an int, if it is an integer in ``[lo, hi)``; else ValueError naming ``name`` and the range
    (``bounds``: how to write it, default ``[lo, hi)``)."""
    if not is_int(value) or not lo <= value < hi:
        raise ValueError(f"{name} must be an int in {bounds or f'[{lo}, {hi})'}, got {value!r}")
    return int(value)


def split_host_port(addr: Any) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port), the port in 1..65535; ValueError otherwise."""
    host, sep, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port with a port in 1..65535, got {addr!r}")
    return host.strip("[]"), int(port)


def same_directory(dirs: Iterable[str]) -> Optional[tuple[str, str]]:
    """The first two of ``dirs`` that name one directory (after links and ``..``), or None."""
    seen: dict[str, str] = {}
    for d in dirs:
        real = os.path.realpath(d)
        if real in seen:
            return seen[real], d
        seen[real] = d
    return None
