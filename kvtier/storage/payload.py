"""A block's payload as the disk sees it: an array's bytes in order, moved in place or through an aligned buffer.

A payload is an array that is contiguous, or has contiguous rows (a CPU block in ``layer_first``: one row per layer, the
layers far apart). A contiguous one of whole aligned pages goes to and from the disk where it is (O_DIRECT into the
caller's memory); any other is gathered into, or scattered from, this thread's aligned buffer
(:func:`kvtier.storage.aligned_io.scratch`) with one copy call. Rows are not moved in place although O_DIRECT could
(rows of whole pages): a request of many short segments is slow on a virtual disk. On the CPU machine's, Qwen3-8B
``layer_first`` blocks move faster through the buffer than from or into their rows, both ways (bench/results/README.md,
"SSD tier").
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvtier.storage.block_format import ALIGN

__all__ = ["byte_rows", "in_place", "gather", "scatter"]


def byte_rows(arr: np.ndarray) -> Optional[np.ndarray]:
    """``arr``'s bytes as a uint8 view of contiguous rows: one row for a contiguous array, its rows for a 2-D array
    with contiguous rows; None for any other layout."""
    if arr.flags.c_contiguous:
        return arr.reshape(1, -1).view(np.uint8)
    if arr.ndim == 2 and arr.strides[1] == arr.itemsize:
        return arr.view(np.uint8)
    return None


def in_place(arr: np.ndarray, span: int, *, exact: bool = True) -> bool:
    """Whether O_DIRECT moves ``span`` bytes (whole pages) to or from ``arr`` where it is: it is contiguous, starts
    on a page, and holds exactly ``span`` bytes (``exact``) or at least that many."""
    return (arr.flags.c_contiguous and arr.__array_interface__["data"][0] % ALIGN == 0 and span % ALIGN == 0
            and (arr.nbytes == span or (not exact and arr.nbytes > span)))


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
    assert rows is not None  # arr is contiguous or has contiguous rows
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
