"""Argument checks shared across kvtier (no torch, no numpy import needed by callers)."""

from __future__ import annotations

import numbers
import os
from typing import Any, Iterable, Mapping, Optional

__all__ = ["is_int", "check_count", "check_int_in", "split_host_port", "same_directory", "directories",
           "model_identity"]


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
    """The first two of ``dirs`` that name one directory (after ``~``, links and ``..``), or None."""
    seen: dict[str, str] = {}
    for d in dirs:
        real = os.path.realpath(os.path.expanduser(d))
        if real in seen:
            return seen[real], d
        seen[real] = d
    return None


def directories(spec: Any) -> list[str]:
    """The directories of ``spec`` (a ``;``-separated string, as ``ssd_cache_dir``, or a list), each stripped of
    blanks around it, ``~`` expanded and made absolute (so that a later ``chdir`` moves none); blank entries are
    dropped."""
    items = spec.split(";") if isinstance(spec, str) else list(spec)
    return [os.path.abspath(os.path.expanduser(d.strip())) for d in items if d.strip()]


_JSON_SCALARS = (str, int, float, bool, type(None))


def model_identity(value: Any) -> dict:
    """``value`` as a model identity (what a lower tier's blocks belong to): a non-empty mapping of str keys to JSON
    data (str, number, bool, None, lists and mappings of them), or a non-empty str naming the model. Anything else is
    a ValueError naming the key: an empty identity lets two models of one geometry share blocks, and a value whose
    ``str()`` differs between processes (an object's address) makes every restart refuse the directory."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("model_identity must name the model: got an empty string")
        return {"model": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"model_identity must be a mapping (model path and revision, TP rank and size, ...) or a "
                         f"str naming the model, got {type(value).__name__}")
    if not value:
        raise ValueError("model_identity is empty: name the model (path and revision), TP rank and size, or two "
                         "models of one KV geometry read each other's blocks")

    def check(key: str, v: Any) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise ValueError(f"model_identity{key} has a key {k!r} that is not a str")
                check(f"{key}[{k!r}]", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                check(f"{key}[{i}]", x)
        elif not isinstance(v, _JSON_SCALARS) or (isinstance(v, float) and v != v):
            raise ValueError(f"model_identity{key} must be JSON data (str, number, bool, None, lists and mappings "
                             f"of them), got {type(v).__name__}: its text may differ between processes")
    check("", value)
    return dict(value)
