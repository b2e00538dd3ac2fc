"""A block's payload as the disk sees it: the contiguous byte segments of an array, in order, and their checksum.

A payload is any array that is contiguous (one segment) or has contiguous rows (a CPU block in ``layer_first``:
one segment per row). Segments of whole aligned pages go to and from the disk where they are (O_DIRECT into the
caller's memory); others are gathered into, or scattered from, an aligned buffer (one copy call).

Rows are written in place but read through the buffer (:meth:`kvtier.storage.BlockFile.read_run`), as measured on the CPU
machine's virtual disk with Qwen3-8B blocks (72 rows of 32 KiB) in ``layer_first``: reading into the rows ran at
1.40-1.46 GB/s and through the buffer at 1.80-2.05; writing from the rows at 0.58-0.59 GB/s and through the buffer
at 0.46 (``bench/bench_ssd.py``'s tier runs).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import xxhash

from kvtier.storage.block_format import ALIGN

__all__ = ["byte_rows", "first_bytes", "in_place", "gather", "scatter", "checksum"]


def byte_rows(arr: np.ndarray) -> Optional[np.ndarray]:
    """``arr``'s bytes as a uint8 view of one row per segment: one row for a contiguous array, its rows for a 2-D
    array with contiguous rows; None for any other layout."""
    if arr.flags.c_contiguous:
        return arr.reshape(1, -1).view(np.uint8)
    if arr.ndim == 2 and arr.strides[1] == arr.itemsize:
        return arr.view(np.uint8)
    return None


def first_bytes(segs: Sequence[np.ndarray], n: int) -> list[np.ndarray]:
    """The segments cut to their first ``n`` bytes in all (fewer when they hold fewer)."""
    out = []
    for s in segs:
        if n <= 0:
            break
        out.append(s if s.size <= n else s[:n])
        n -= s.size
    return out


def in_place(arr: np.ndarray, span: int, *, exact: bool = True, rows: bool = True) -> bool:
    """Whether O_DIRECT can move ``span`` bytes (whole pages) to or from ``arr`` where it is: it starts on a page,
    and is contiguous or (with ``rows``) has rows of whole pages a whole number of pages apart; it holds exactly
    ``span`` bytes (``exact``), or at least that many and is contiguous."""
    if arr.__array_interface__["data"][0] % ALIGN or span % ALIGN:
        return False
    if arr.flags.c_contiguous:
        return arr.nbytes == span or (not exact and arr.nbytes > span)
    return (rows and arr.nbytes == span and arr.ndim == 2 and arr.strides[1] == arr.itemsize
            and arr.strides[0] % ALIGN == 0 and (arr.shape[1] * arr.itemsize) % ALIGN == 0)


def gather(arr: np.ndarray, dst: np.ndarray) -> None:
    """Copy ``arr``'s bytes in order into the front of the flat uint8 ``dst`` (one copy call)."""
    rows = byte_rows(arr)
    if rows is None:
        rows = np.ascontiguousarray(arr).reshape(1, -1).view(np.uint8)
    np.copyto(dst[:rows.size].reshape(rows.shape), rows)


def scatter(src: np.ndarray, arr: np.ndarray) -> None:
    """Copy the flat uint8 ``src`` into ``arr``'s bytes in order, as far as it reaches (``arr`` is contiguous or
    has contiguous rows)."""
    rows = byte_rows(arr)
    if src.size == rows.size:
        np.copyto(rows, src.reshape(rows.shape))
        return
    off = 0
    for row in rows:
        k = min(row.size, src.size - off)
        if k <= 0:
            return
        row[:k] = src[off:off + k]
        off += k


def checksum(segs: Sequence[np.ndarray], n: int) -> int:
    """The xxh3-64 checksum of the first ``n`` bytes of the segments (equal to
    :func:`kvtier.storage.block_format.payload_checksum` of those bytes in one buffer)."""
    segs = first_bytes(segs, n)
    if len(segs) == 1:
        return xxhash.xxh3_64_intdigest(segs[0])
    h = xxhash.xxh3_64()
    for s in segs:
        h.update(s)
    return h.intdigest()
