"""Open-addressing hash table from page hash to node (linear probing, backward-shift deletion).

Slots hold node ids (-1 = empty); the key of a slot is ``hashes[node]`` (the ``i64[HASH]`` row: uint64
bit patterns stored as int64). Several nodes may share a
hash (a real or, in tests, a forced collision): lookups walk the probe run until an empty slot and
let the caller decide which candidate is the page it wants (tokens, depth, parent). Functions take the
per-node ``hashes`` array and never raise; the caller keeps the load <= 3/4.
"""
from __future__ import annotations

import numba
import numpy as np

from ._config import NUMBA_CACHE

__all__ = ["tb_home", "tb_insert", "tb_delete", "tb_rebuild"]


@numba.njit(inline="always")
def tb_home(h, tmask):
    """Home slot of hash ``h`` (uint64, or its int64 bit pattern) in a table of ``tmask + 1`` slots."""
    u = np.uint64(h)
    return np.int64((u ^ (u >> np.uint64(31))) & np.uint64(tmask))


@numba.njit(cache=NUMBA_CACHE)
def tb_insert(table, hashes, node):
    tmask = table.shape[0] - 1
    i = tb_home(hashes[node], tmask)
    while table[i] >= 0:
        i = (i + 1) & tmask
    table[i] = node


@numba.njit(cache=NUMBA_CACHE)
def tb_delete(table, hashes, node):
    """Remove ``node``; returns False if it was not in the table."""
    tmask = table.shape[0] - 1
    i = tb_home(hashes[node], tmask)
    while table[i] != node:
        if table[i] < 0:
            return False
        i = (i + 1) & tmask
    j = i
    while True:  # shift back entries whose probe run crosses the hole
        j = (j + 1) & tmask
        x = table[j]
        if x < 0:
            break
        k = tb_home(hashes[x], tmask)
        if i <= j:
            stays = i < k <= j
        else:
            stays = k > i or k <= j
        if not stays:
            table[i] = x
            i = j
    table[i] = -1
    return True


@numba.njit(cache=NUMBA_CACHE)
def tb_rebuild(table, hashes, depth, high):
    """Fill an empty ``table`` with every live node (depth >= 0) below ``high``."""
    for x in range(high):
        if depth[x] >= 0:
            tb_insert(table, hashes, x)
