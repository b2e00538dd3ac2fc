"""A benchmark's progress, for ``kvtier bench``'s progress bar; a no-op when the bench runs on its own.

``kvtier bench`` (:mod:`kvtier.commands.run_bench`) passes the write end of a pipe in ``$KVTIER_BENCH_PROGRESS_FD``.
A bench calls :func:`plan` once it knows how many steps it takes, then :func:`step` after each; every call writes
one JSON line ``{"done": int, "total": int | null, "what": str}`` there.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from kvtier.commands.run_bench import PROGRESS_ENV

__all__ = ["plan", "step"]

_state = {"done": 0, "total": None}


def plan(total: Optional[int], what: str = "") -> None:
    """The bench takes ``total`` steps from here (None: unknown); none done yet."""
    _state.update(done=0, total=total)
    _send(what)


def step(what: str = "") -> None:
    """One more step done; ``what`` names it (shown beside the bar)."""
    _state["done"] += 1
    _send(what)


def _send(what: str) -> None:
    fd = os.environ.get(PROGRESS_ENV)
    if not fd:
        return
    line = json.dumps({"done": _state["done"], "total": _state["total"], "what": what}) + "\n"
    try:
        os.write(int(fd), line.encode())
    except OSError:  # the runner is gone: the bench carries on
        os.environ.pop(PROGRESS_ENV, None)
