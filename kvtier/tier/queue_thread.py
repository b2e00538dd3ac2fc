"""The loop of a worker thread that runs the items of a queue in order, and the per-thread niceness it may take."""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable


def serve(q: queue.Queue, run: Callable[[Any], None], nice: int = 0) -> None:
    """A thread's loop: raise its niceness by ``nice``, then ``run`` each item taken from ``q``, in order, until
    None."""
    lower_priority(nice)
    while True:
        item = q.get()
        if item is None:
            return
        run(item)


def lower_priority(nice: int) -> None:
    """Raise the calling thread's niceness by ``nice``, at most to 19 (only its own: Linux niceness is per thread,
    and threads it starts inherit it); where that is not supported, it keeps its priority."""
    if nice:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except (OSError, AttributeError):
            pass
