"""One switch for numba's on-disk cache of compiled index functions.

``KVTIER_NUMBA_CACHE`` (default ``1``): set to ``0``/``false``/``no``/``off`` to compile in memory only
(useful when the package lives on a read-only file system or while editing the jitted code).
"""
from __future__ import annotations

import os

__all__ = ["NUMBA_CACHE"]


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


NUMBA_CACHE: bool = _env_flag("KVTIER_NUMBA_CACHE", True)
