"""Shutdown steps that must all run: a failing step (a close that raises EIO) does not leave the rest undone."""

from __future__ import annotations

import logging
from typing import Callable, Optional

__all__ = ["run_all"]

logger = logging.getLogger(__name__)


def run_all(*steps: Optional[Callable[[], object]]) -> None:
    """Run every step in order (None: skipped), each even after an earlier one raised; then raise the first error
    (the later ones are logged)."""
    first: Optional[BaseException] = None
    for step in steps:
        if step is None:
            continue
        try:
            step()
        except Exception as e:  # noqa: BLE001 - re-raised below
            if first is None:
                first = e
            else:
                logger.warning("kvtier: a further shutdown step failed too: %r", e)
    if first is not None:
        raise first
