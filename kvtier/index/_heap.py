"""Indexed binary min-heap of evictable nodes, keyed by (last-access tick, node id), with lazy keys.

The heap lives in two rows of the state blocks: ``i32[HEAP, 0:size]`` holds node ids and
``i64[HKEY, i]`` the key of ``i32[HEAP, i]`` (kept next to the ids so a sift reads one contiguous
row instead of a random ``tick[node]`` per level); ``i32[HPOS, node]`` is the node's position (-1 when
absent) and ``size`` lives in ``meta[M_HEAP]``. Push, pop and remove are O(log n); functions never
raise. They index the 2-D blocks directly: a row view would cost an atomic reference-count increment
and decrement per view.

Lazy keys: a node's tick only grows while it is in the heap, and a touch (a match or insert ending at
a leaf) only writes ``tick[x]``; the heap is ordered by the stored keys, each a lower bound of its
node's tick (``hkey[i] <= tick[heap[i]]``). ``hp_pop`` refreshes a stale root (new key, sift down)
until the root's key is exact; that root is then the least (tick, node) of all: every other node's
tick is >= its stored key >= the root's. So a touch costs no heap work and the eviction order is
the one eager keys give; each touch costs at most one extra sift at eviction time.
"""
from __future__ import annotations

import numba
import numpy as np

from ._state import HEAP, HKEY, HPOS, M_HEAP, TICK

_KEY_MAX = 2**63 - 1

__all__ = ["hp_push", "hp_pop", "hp_remove", "hp_precedes", "hp_precedes_key", "hp_key_floor"]


@numba.njit(inline="always")
def _less(ka, a, kb, b):
    return ka < kb or (ka == kb and a < b)


@numba.njit(inline="always")
def _put(i32, i64, i, x, k):
    i32[HEAP, i] = x
    i64[HKEY, i] = k
    i32[HPOS, x] = i


@numba.njit(inline="always")
def _sift_up(i32, i64, i):
    x = i32[HEAP, i]
    k = i64[HKEY, i]
    while i > 0:
        p = (i - 1) >> 1
        y = i32[HEAP, p]
        ky = i64[HKEY, p]
        if not _less(k, x, ky, y):
            break
        _put(i32, i64, i, y, ky)
        i = p
    _put(i32, i64, i, x, k)


@numba.njit(inline="always")
def _sift_down(i32, i64, i, size):
    x = i32[HEAP, i]
    k = i64[HKEY, i]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and _less(i64[HKEY, c + 1], i32[HEAP, c + 1], i64[HKEY, c], i32[HEAP, c]):
            c += 1
        y = i32[HEAP, c]
        ky = i64[HKEY, c]
        if not _less(ky, y, k, x):
            break
        _put(i32, i64, i, y, ky)
        i = c
    _put(i32, i64, i, x, k)


@numba.njit(inline="always")
def hp_push(i32, i64, meta, x):
    n = meta[M_HEAP]
    _put(i32, i64, n, x, i64[TICK, x])
    meta[M_HEAP] = n + 1
    _sift_up(i32, i64, n)


@numba.njit(inline="always")
def hp_remove(i32, i64, meta, x):
    i = i32[HPOS, x]
    n = meta[M_HEAP] - 1
    meta[M_HEAP] = n
    i32[HPOS, x] = -1
    if i == n:
        return
    last = i32[HEAP, n]
    _put(i32, i64, i, last, i64[HKEY, n])
    _sift_down(i32, i64, i, n)
    _sift_up(i32, i64, i32[HPOS, last])


@numba.njit(inline="always")
def hp_precedes_key(i32, i64, meta, k, x):
    """Whether node ``x`` (not in the heap) keyed ``k`` comes before every node in it: (k, x) is less than the
    root's (stored key, node), which is at most every node's (tick, node). Reads the heap, writes nothing."""
    if meta[M_HEAP] == 0:
        return True
    return _less(k, x, i64[HKEY, 0], i32[HEAP, 0])


@numba.njit(inline="always")
def hp_key_floor(i32, i64, meta):
    """The root's stored key (2**63 - 1 when the heap is empty): a node keyed below it comes before every node in
    the heap, whatever the node ids."""
    if meta[M_HEAP] == 0:
        return np.int64(_KEY_MAX)
    return i64[HKEY, 0]


@numba.njit(inline="always")
def hp_precedes(i32, i64, meta, x):
    """Whether node ``x`` (not in the heap) comes before every node in it, keyed by its tick: pushing ``x`` and
    popping would return ``x``."""
    return hp_precedes_key(i32, i64, meta, i64[TICK, x], x)


@numba.njit(inline="always")
def hp_pop(i32, i64, meta):
    """Remove and return the least-recently used node (-1 when empty)."""
    while True:
        n = meta[M_HEAP]
        if n == 0:
            return -1
        x = i32[HEAP, 0]
        t = i64[TICK, x]
        if i64[HKEY, 0] == t:
            hp_remove(i32, i64, meta, x)
            return x
        i64[HKEY, 0] = t  # a stale (smaller) key: refresh it and let it sink
        _sift_down(i32, i64, 0, n)

