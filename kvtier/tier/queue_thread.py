"""A worker thread that runs the items put to it in order (the SSD and remote tiers' workers), and the per-thread
niceness it may take."""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, Optional


class QueueThread:
    """A daemon thread, started from its creator (whose niceness it inherits), that raises its niceness by ``nice``
    and then runs ``run(item)`` for each item :meth:`put` to it, in order, until :meth:`stop`."""

    def __init__(self, name: str, run: Callable[[Any], None], nice: int = 0) -> None:
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=_serve, args=(self._q, run, nice), name=name, daemon=True)
        self._thread.start()

    def put(self, item: Any) -> None:
        self._q.put(item)

    def stop(self, timeout: Optional[float] = None) -> bool:
        """Stop after the items put so far; whether the thread has ended within ``timeout`` (None: wait for it)."""
        self.request_stop()
        return self.join(timeout)

    def request_stop(self) -> None:
        """Make the thread end after the items put so far, without waiting for it."""
        self._q.put(None)

    def join(self, timeout: Optional[float] = None) -> bool:
        """Whether the thread has ended within ``timeout`` (None: wait for it)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _serve(q: queue.Queue, run: Callable[[Any], None], nice: int) -> None:
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
