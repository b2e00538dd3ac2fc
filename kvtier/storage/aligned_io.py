"""Page-aligned buffers and whole-buffer positional reads and writes: what O_DIRECT file IO needs.

The vectored forms move a list of buffers to or from consecutive file bytes in as few system calls as the kernel
allows (one request for the disk where it completes them), so that a run of blocks and their headers is one IO.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Sequence

import numpy as np

from kvtier.storage.block_format import ALIGN

__all__ = ["aligned", "write_all", "read_all", "write_all_v", "read_all_v", "scratch", "use_region", "IOV_MAX"]

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers one vectored call takes
_local = threading.local()  # per thread: scratch buffers by name


def aligned(nbytes: int) -> np.ndarray:
    """A page-aligned, zeroed uint8 buffer of ``nbytes`` (anonymous mmap)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, ALIGN)), dtype=np.uint8)[:nbytes]


def scratch(name: str, nbytes: int) -> np.ndarray:
    """This thread's page-aligned buffer ``name`` of ``nbytes``: the one :func:`use_region` gave it, or one mapped on
    first use (reused by the next call with that name, replaced by a bigger one when a call needs more)."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(name)
    if buf is None or buf.size < nbytes:
        buf = bufs[name] = aligned(nbytes)
    return buf[:nbytes]


def use_region(region: np.ndarray, sizes: dict[str, int]) -> None:
    """Make this thread's scratch buffers (name -> bytes, whole pages each) consecutive pieces of ``region``.

    An IO pool gives each of its threads a share of one region mapped in one pass (every page touched) when the pool
    is made: the kernel interleaves the physical pages of buffers that several threads map at once, and an O_DIRECT
    request from such memory reaches a virtual disk as many small segments. On the CPU machine's virtual disk,
    ``layer_first`` writes through shares of one region run at the raw bound, through buffers each thread mapped far
    below it (bench/results/README.md, "SSD tier")."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    off = 0
    for name, n in sizes.items():
        bufs[name] = region[off:off + n]
        off += n


def write_all(fd: int, buf: np.ndarray, offset: int) -> None:
    """Write all of ``buf`` at ``offset`` (retrying short writes)."""
    write_all_v(fd, [buf], offset)


def read_all(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill ``buf`` from ``offset`` (retrying short reads); bytes past the end of the file read as zeros."""
    read_all_v(fd, [buf], offset)


def write_all_v(fd: int, bufs: Sequence, offset: int) -> None:
    """Write ``bufs`` one after another from ``offset`` (retrying short writes)."""
    _all_v(os.pwritev, fd, bufs, offset)


def read_all_v(fd: int, bufs: Sequence, offset: int) -> None:
    """Fill ``bufs`` one after another from ``offset`` (retrying short reads); bytes past the end of the file read
    as zeros."""
    _all_v(os.preadv, fd, bufs, offset)


def _all_v(call, fd: int, bufs: Sequence, offset: int) -> None:
    views = [v for v in (memoryview(b).cast("B") for b in bufs) if len(v)]
    i = 0
    while i < len(views):
        n = call(fd, views[i:i + IOV_MAX], offset)
        if n == 0 and call is os.preadv:  # the end of the file: the rest reads as zeros
            for v in views[i:]:
                v[:] = b"\0" * len(v)
            return
        offset += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]
