"""A process death at a chosen durable step, in process: the SSD store's modules see an ``os`` whose writes, syncs,
truncations, renames and unlinks are counted; the one at the kill point raises :class:`Killed` (a write torn
there leaves a prefix of its buffers), and so does every one after it, on every thread, as if the process had
died there. What reached the files before stays, as a SIGKILL leaves the page cache. :meth:`KillSwitch.fail` makes
one step fail with EIO instead (a disk error: the process goes on).

Only the storage modules' ``os`` is replaced (pytest's and hypothesis's file writes are not counted)."""

from __future__ import annotations

import errno
import os
import threading
from typing import Optional

from kvtier.storage import aligned_io, block_file, journal, reserve, ssd_store

MODULES = (aligned_io, block_file, journal, reserve, ssd_store)
COUNTED = ("pwrite", "pwritev", "fdatasync", "fsync", "ftruncate", "replace", "rename", "unlink",
           "posix_fallocate")


class Killed(BaseException):
    """The process died here (a BaseException: no ``except Exception`` handler of the code under test runs)."""


class _Os:
    """``os`` with the durable steps counted (see the module docstring)."""

    def __init__(self, switch: "KillSwitch") -> None:
        self._switch = switch

    def __getattr__(self, name: str):
        real = getattr(os, name)
        if name not in COUNTED:
            return real

        def step(*args, **kw):
            torn = self._switch._step(name)
            if torn and name == "pwritev":  # a prefix of the buffers reaches the file, then the process dies
                fd, bufs, offset = args[0], args[1], args[2]
                half = [memoryview(b).cast("B") for b in bufs]
                half = half[:max(1, len(half) // 2)]
                half[-1] = half[-1][:max(1, len(half[-1]) // 2)]
                os.pwritev(fd, half, offset)
                raise Killed(f"killed tearing {name}")
            return real(*args, **kw)
        return step


class KillSwitch:
    """Counts the storage modules' durable steps while installed; :meth:`arm` picks the step that kills."""

    def __init__(self) -> None:
        self.steps = 0
        self.dead = False
        self._at: Optional[int] = None
        self._tear = False
        self._fail_at: Optional[int] = None
        self._lock = threading.Lock()
        self._saved: list = []

    def install(self) -> "KillSwitch":
        self._saved = [(m, m.os) for m in MODULES]
        proxy = _Os(self)
        for m in MODULES:
            m.os = proxy
        return self

    def uninstall(self) -> None:
        for m, real in self._saved:
            m.os = real
        self._saved = []

    def fail(self, after: Optional[int]) -> None:
        """The ``after``-th durable step from now fails with EIO (the disk's error; the process goes on); None:
        none does."""
        with self._lock:
            self._fail_at, self.steps = after, 0

    def arm(self, after: int, tear: bool = False) -> None:
        """Kill at the ``after``-th durable step from now (0: the next one); ``tear``: a write killed there leaves
        a prefix of its bytes."""
        with self._lock:
            self._at, self._tear, self.steps, self.dead = after, tear, 0, False

    def disarm(self) -> None:
        """The process is restarted: nothing kills any more."""
        with self._lock:
            self._at, self.dead = None, False

    def _step(self, name: str) -> bool:
        """Count a step; raise if the process is dead; True when this step is the kill and tears its write."""
        with self._lock:
            if self.dead:
                raise Killed(f"{name} after the kill")
            n, self.steps = self.steps, self.steps + 1
            if self._fail_at is not None and n == self._fail_at:
                self._fail_at = None
                raise OSError(errno.EIO, f"injected at {name}")
            if self._at is None or n < self._at:
                return False
            self.dead = True
            if not self._tear:
                raise Killed(f"killed at {name}")
            return True
