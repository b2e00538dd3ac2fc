"""Indexed binary min-heap of evictable nodes, keyed by (last-access tick, node id).

``heap[0:size]`` holds node ids, ``hpos[node]`` the node's position (-1 when absent), ``size`` lives in
``meta[M_HEAP]``. Push, pop, remove and re-key are O(log n); functions never raise.
"""
from __future__ import annotations

import numba

from ._config import NUMBA_CACHE
from ._state import M_HEAP

__all__ = ["hp_push", "hp_pop", "hp_remove", "hp_fix"]


@numba.njit(inline="always")
def _less(tick, a, b):
    return tick[a] < tick[b] or (tick[a] == tick[b] and a < b)


@numba.njit(inline="always")
def _put(heap, hpos, i, x):
    heap[i] = x
    hpos[x] = i


@numba.njit(cache=NUMBA_CACHE)
def _sift_up(heap, hpos, tick, i):
    x = heap[i]
    while i > 0:
        p = (i - 1) >> 1
        y = heap[p]
        if not _less(tick, x, y):
            break
        _put(heap, hpos, i, y)
        i = p
    _put(heap, hpos, i, x)


@numba.njit(cache=NUMBA_CACHE)
def _sift_down(heap, hpos, tick, i, size):
    x = heap[i]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and _less(tick, heap[c + 1], heap[c]):
            c += 1
        y = heap[c]
        if not _less(tick, y, x):
            break
        _put(heap, hpos, i, y)
        i = c
    _put(heap, hpos, i, x)


@numba.njit(cache=NUMBA_CACHE)
def hp_push(heap, hpos, tick, meta, x):
    n = meta[M_HEAP]
    _put(heap, hpos, n, x)
    meta[M_HEAP] = n + 1
    _sift_up(heap, hpos, tick, n)


@numba.njit(cache=NUMBA_CACHE)
def hp_remove(heap, hpos, tick, meta, x):
    i = hpos[x]
    n = meta[M_HEAP] - 1
    meta[M_HEAP] = n
    hpos[x] = -1
    if i == n:
        return
    last = heap[n]
    _put(heap, hpos, i, last)
    _sift_down(heap, hpos, tick, i, n)
    _sift_up(heap, hpos, tick, hpos[last])


@numba.njit(cache=NUMBA_CACHE)
def hp_pop(heap, hpos, tick, meta):
    """Remove and return the least-recently used node (-1 when empty)."""
    if meta[M_HEAP] == 0:
        return -1
    x = heap[0]
    hp_remove(heap, hpos, tick, meta, x)
    return x


@numba.njit(cache=NUMBA_CACHE)
def hp_fix(heap, hpos, tick, meta, x):
    """Restore heap order after ``tick[x]`` changed."""
    i = hpos[x]
    _sift_up(heap, hpos, tick, i)
    _sift_down(heap, hpos, tick, hpos[x], meta[M_HEAP])
