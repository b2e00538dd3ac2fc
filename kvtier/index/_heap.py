"""Indexed binary min-heap of evictable nodes, keyed by (last-access tick, node id).

``heap[0:size]`` holds node ids, ``hkey[i]`` the tick of ``heap[i]`` (a copy kept next to the ids so a
sift reads one contiguous array instead of a random ``tick[node]`` per level), ``hpos[node]`` the
node's position (-1 when absent), ``size`` lives in ``meta[M_HEAP]``. Push, pop, remove and re-key
are O(log n); functions never raise.
"""
from __future__ import annotations

import numba

from ._config import NUMBA_CACHE
from ._state import M_HEAP

__all__ = ["hp_push", "hp_pop", "hp_remove", "hp_fix"]


@numba.njit(inline="always")
def _less(ka, a, kb, b):
    return ka < kb or (ka == kb and a < b)


@numba.njit(inline="always")
def _put(heap, hkey, hpos, i, x, k):
    heap[i] = x
    hkey[i] = k
    hpos[x] = i


@numba.njit(cache=NUMBA_CACHE)
def _sift_up(heap, hkey, hpos, i):
    x = heap[i]
    k = hkey[i]
    while i > 0:
        p = (i - 1) >> 1
        y = heap[p]
        ky = hkey[p]
        if not _less(k, x, ky, y):
            break
        _put(heap, hkey, hpos, i, y, ky)
        i = p
    _put(heap, hkey, hpos, i, x, k)


@numba.njit(cache=NUMBA_CACHE)
def _sift_down(heap, hkey, hpos, i, size):
    x = heap[i]
    k = hkey[i]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and _less(hkey[c + 1], heap[c + 1], hkey[c], heap[c]):
            c += 1
        y = heap[c]
        ky = hkey[c]
        if not _less(ky, y, k, x):
            break
        _put(heap, hkey, hpos, i, y, ky)
        i = c
    _put(heap, hkey, hpos, i, x, k)


@numba.njit(cache=NUMBA_CACHE)
def hp_push(heap, hkey, hpos, tick, meta, x):
    n = meta[M_HEAP]
    _put(heap, hkey, hpos, n, x, tick[x])
    meta[M_HEAP] = n + 1
    _sift_up(heap, hkey, hpos, n)


@numba.njit(cache=NUMBA_CACHE)
def hp_remove(heap, hkey, hpos, tick, meta, x):
    i = hpos[x]
    n = meta[M_HEAP] - 1
    meta[M_HEAP] = n
    hpos[x] = -1
    if i == n:
        return
    last = heap[n]
    _put(heap, hkey, hpos, i, last, hkey[n])
    _sift_down(heap, hkey, hpos, i, n)
    _sift_up(heap, hkey, hpos, hpos[last])


@numba.njit(cache=NUMBA_CACHE)
def hp_pop(heap, hkey, hpos, tick, meta):
    """Remove and return the least-recently used node (-1 when empty)."""
    if meta[M_HEAP] == 0:
        return -1
    x = heap[0]
    hp_remove(heap, hkey, hpos, tick, meta, x)
    return x


@numba.njit(cache=NUMBA_CACHE)
def hp_fix(heap, hkey, hpos, tick, meta, x):
    """Restore heap order after ``tick[x]`` changed."""
    i = hpos[x]
    hkey[i] = tick[x]
    _sift_up(heap, hkey, hpos, i)
    _sift_down(heap, hkey, hpos, hpos[x], meta[M_HEAP])
