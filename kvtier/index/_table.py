"""Open-addressing hash table from page hash to node (linear probing, backward-shift deletion).

A slot is an int64 ``(tag << 32) | node`` with ``tag`` the low 32 bits of the page hash, or -1 when
empty (no live entry is -1: node ids are < 2**31, so the low half of an entry is never all ones).
The home slot is a multiplicative mix of the tag, so an entry carries everything a probe, a delete
(backward shift) or a rebuild needs: a lookup reads the node's arrays only for a candidate whose tag
matches (one dependent cache miss less than a table of bare node ids keyed through ``hashes[node]``).
Several nodes may share a hash or a tag (a real or, in tests, a forced collision): lookups walk the
probe run until an empty slot and the caller decides which candidate is the page it wants (tokens,
depth, parent, full hash). Functions never raise; the caller keeps the load <= 3/4.
"""
from __future__ import annotations

import numba
import numpy as np


__all__ = ["EMPTY", "tb_tag", "tb_home", "tb_entry", "tb_node", "tb_insert", "tb_delete"]

EMPTY = -1
_M32 = np.uint64(0xFFFFFFFF)
_MIX = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(inline="always")
def tb_tag(h):
    """Tag (uint64 < 2**32) of hash ``h`` (uint64, or its int64 bit pattern)."""
    return np.uint64(h) & _M32


@numba.njit(inline="always")
def tb_home(tag, tmask):
    """Home slot of ``tag`` in a table of ``tmask + 1`` slots (a power of two <= 2**32)."""
    return np.int64(((np.uint64(tag) * _MIX) >> np.uint64(32)) & np.uint64(tmask))


@numba.njit(inline="always")
def tb_entry(tag, node):
    return np.int64((np.uint64(tag) << np.uint64(32)) | np.uint64(node))


@numba.njit(inline="always")
def tb_node(e):
    return np.int64(np.uint64(e) & _M32)


@numba.njit(inline="always")
def tb_insert(table, h, node):
    """Insert ``node`` whose page hash is ``h``."""
    tmask = table.shape[0] - 1
    tag = tb_tag(h)
    i = tb_home(tag, tmask)
    while table[i] != EMPTY:
        i = (i + 1) & tmask
    table[i] = tb_entry(tag, node)


@numba.njit(inline="always")
def tb_delete(table, h, node):
    """Remove ``node`` (page hash ``h``); returns False if it was not in the table."""
    tmask = table.shape[0] - 1
    tag = tb_tag(h)
    e = tb_entry(tag, node)
    i = tb_home(tag, tmask)
    while table[i] != e:
        if table[i] == EMPTY:
            return False
        i = (i + 1) & tmask
    j = i
    while True:  # shift back entries whose probe run crosses the hole
        j = (j + 1) & tmask
        x = table[j]
        if x == EMPTY:
            break
        k = tb_home(np.uint64(x) >> np.uint64(32), tmask)
        if i <= j:
            stays = i < k <= j
        else:
            stays = k > i or k <= j
        if not stays:
            table[i] = x
            i = j
    table[i] = EMPTY
    return True

