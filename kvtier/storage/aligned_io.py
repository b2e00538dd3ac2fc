"""Page-aligned buffers and whole-buffer positional reads and writes: what O_DIRECT file IO needs."""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvtier.storage.block_format import ALIGN

__all__ = ["aligned", "write_all", "read_all"]


def aligned(nbytes: int) -> np.ndarray:
    """A page-aligned, zeroed uint8 buffer of ``nbytes`` (anonymous mmap)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, ALIGN)), dtype=np.uint8)[:nbytes]


def write_all(fd: int, buf: np.ndarray, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (retrying short writes)."""
    mv = memoryview(buf)
    while len(mv):
        n = os.pwritev(fd, [mv], offset)
        mv, offset = mv[n:], offset + n


def read_all(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill ``buf`` from ``offset`` (retrying short reads); bytes past the end of the file read as zeros."""
    mv = memoryview(buf)
    while len(mv):
        n = os.preadv(fd, [mv], offset)
        if n == 0:
            mv[:] = b"\0" * len(mv)
            return
        mv, offset = mv[n:], offset + n
