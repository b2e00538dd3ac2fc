"""Trie state: six numpy arrays (struct of arrays), allocated and grown from Python.

The jitted entry points take these arrays as separate arguments: every array argument costs numba
about 25-40 ns to unbox per call, so the per-node fields are packed into one int32 and one int64
block, and the namespace table lives in ``meta``.

Node ``x`` (0 <= x < number of node slots) is described by column ``x`` of every per-node array:

    i32[PARENT, x]   int32   parent node, or ``-1 - ns_id`` for a first page (root of namespace ns_id);
                             -2**31 for a free slot
    i32[DEPTH, x]    int32   page index in its sequence (0 = first page); -1 marks a free slot
    i32[NCHILD, x]   int32   live children
    i32[HINT, x]     int32   last child created or found through the table (-1: none); a free slot
                             keeps the next free slot here (free list)
    i32[LOCK, x]     int32   lock count; every lock covers a root..node path, so lock[parent] >= lock[x]
    i32[GEN, x]      int32   bumped when the slot is freed: a stale handle (node, gen) is detected
    i32[HITS, x]     int32   matches whose matched path ended at this page, plus the hits handed up by
                             freed children (lazy: the logical count "matches through x" is the sum
                             over x's subtree; saturates at 2**31-1)
    i32[HPOS, x]     int32   position in the eviction heap, -1 when not in it
    i64[BLOCK, x]    int64   host block id holding this page's KV
    i64[TICK, x]     int64   last-access tick (a global counter bumped by every touching match/insert),
                             lazy: written on the deepest page of a touched path only; the logical
                             tick of x is the max over its subtree, exact for leaves (the only heap
                             keys) because a freed page hands max(tick) to its parent
    i64[HASH, x]     int64   chained page hash h_depth of the prefix ending at this page (page_hash.py),
                             the uint64 bit pattern stored as int64; valid only when FL_INDEXED is set
    i8[TIER, x]      int8    storage tier of the block (0 = host memory; reserved for the SSD tier)
    i8[FLAGS, x]     int8    FL_INDEXED: the node is in ``table`` and ``i64[HASH, x]`` is valid (lazy
                             indexing, round 4: see trie.py); a node without it has a stale hash field
    tokens[x, :]     uint32  the page's token ids (a hash hit is confirmed against these)

Rows indexed by heap position ``i`` (not by node): ``i32[HEAP, i]`` the node at heap position i and
``i64[HKEY, i] == i64[TICK, i32[HEAP, i]]`` its key stored inline (an indexed binary min-heap of the
evictable nodes keyed by (tick, node), size ``meta[M_HEAP]``).

``table`` (int32, open addressing with linear probing from page hash to node, -1 = empty,
power-of-two size, load <= 3/4). ``meta`` (int64): counters at the indices below, then two slots per
namespace from ``NS_BASE``: ``meta[NS_BASE + 2 * ns_id]`` the namespace's last first-page node (a
hint, -1: none) and ``meta[NS_BASE + 2 * ns_id + 1]`` its seed (uint64 bit pattern).
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

__all__ = ["TrieState", "new_state", "grow_nodes", "grow_namespaces", "table_slots_for", "state_nbytes"]

# rows of i32
PARENT, DEPTH, NCHILD, HINT, LOCK, GEN, HITS, HPOS, HEAP = range(9)
N_I32 = 9
# rows of i64
BLOCK, TICK, HASH, HKEY = range(4)
N_I64 = 4
# rows of i8
TIER, FLAGS = range(2)
N_I8 = 2
FL_INDEXED = 1    # i8[FLAGS] bit: in the table, hash valid
# meta
M_TOTAL = 0       # live pages
M_HIGH = 1        # slots ever used (slots >= HIGH were never allocated)
M_FREE = 2        # head of the free-slot list (-1: empty)
M_NFREE = 3       # length of the free-slot list
M_TICK = 4        # last tick handed out
M_PROT = 5        # pages with lock > 0
M_HEAP = 6        # heap size
M_LIMIT = 7       # capacity in pages, -1 = unbounded
M_FALLBACK = 8    # gallop searches whose verification failed (hash collision) and fell back to the walk
M_PAGE = 9        # page size
M_MASK = 10       # page-hash mask (uint64 bit pattern; all ones except in collision tests)
NS_BASE = 16      # per namespace: hint, seed

TABLE_MAX_LOAD_NUM, TABLE_MAX_LOAD_DEN = 3, 4


class TrieState(namedtuple("TrieState", ["i32", "i64", "i8", "tokens", "table", "meta"])):
    """The arrays of one trie; the properties are views for tests and tools."""

    __slots__ = ()

    @property
    def hashes(self) -> np.ndarray:
        return self.i64[HASH].view(np.uint64)

    @property
    def tier(self) -> np.ndarray:
        return self.i8[TIER]

    @property
    def flags(self) -> np.ndarray:
        return self.i8[FLAGS]

    @property
    def heap(self) -> np.ndarray:
        return self.i32[HEAP]

    @property
    def hkey(self) -> np.ndarray:
        return self.i64[HKEY]

    @property
    def ns_slots(self) -> int:
        return (self.meta.shape[0] - NS_BASE) // 2


def table_slots_for(pages: int) -> int:
    """Smallest power of two whose 3/4 is >= pages (at least 16)."""
    need = max(16, -(-pages * TABLE_MAX_LOAD_DEN // TABLE_MAX_LOAD_NUM))
    return 1 << (need - 1).bit_length()


def _new_meta(ns_slots: int) -> np.ndarray:
    meta = np.zeros(NS_BASE + 2 * ns_slots, dtype=np.int64)
    meta[NS_BASE::2] = -1
    return meta


def new_state(page_size: int, nodes: int, limit: int = -1, ns_slots: int = 4, mask: int = -1) -> TrieState:
    """An empty trie with room for ``nodes`` pages (the table sized for them).

    Every array is written once here (``np.empty`` + fill), so the pages are mapped now and not by
    page faults inside later inserts.
    """
    nodes = max(int(nodes), 1)
    i32 = np.empty((N_I32, nodes), dtype=np.int32)
    i32.fill(0)
    i32[PARENT] = -(2**31)
    i32[DEPTH] = -1
    i32[HINT] = -1
    i32[HPOS] = -1
    i64 = np.empty((N_I64, nodes), dtype=np.int64)
    i64.fill(0)
    i8 = np.empty((N_I8, nodes), dtype=np.int8)
    i8.fill(0)
    tokens = np.empty((nodes, page_size), dtype=np.uint32)
    tokens.fill(0)
    meta = _new_meta(ns_slots)
    meta[M_FREE] = -1
    meta[M_LIMIT] = limit
    meta[M_PAGE] = page_size
    mask = int(mask) & 0xFFFFFFFFFFFFFFFF
    meta[M_MASK] = mask - (1 << 64) if mask >= 1 << 63 else mask
    return TrieState(i32=i32, i64=i64, i8=i8, tokens=tokens,
                     table=np.full(table_slots_for(nodes), -1, dtype=np.int64), meta=meta)


def grow_nodes(st: TrieState, nodes: int) -> TrieState:
    """Copy of ``st`` with ``nodes`` node slots (>= current); the table is reused as is."""
    old = st.i32.shape[1]
    if nodes <= old:
        return st
    nodes = int(nodes)
    i32 = np.empty((N_I32, nodes), dtype=np.int32)
    i32[:, :old] = st.i32
    i32[:, old:] = 0
    i32[PARENT, old:] = -(2**31)
    i32[DEPTH, old:] = -1
    i32[HINT, old:] = -1
    i32[HPOS, old:] = -1
    i64 = np.empty((N_I64, nodes), dtype=np.int64)
    i64[:, :old] = st.i64
    i64[:, old:] = 0
    i8 = np.empty((N_I8, nodes), dtype=np.int8)
    i8[:, :old] = st.i8
    i8[:, old:] = 0
    tokens = np.empty((nodes, st.tokens.shape[1]), dtype=np.uint32)
    tokens[:old] = st.tokens
    tokens[old:] = 0
    return TrieState(i32=i32, i64=i64, i8=i8, tokens=tokens, table=st.table, meta=st.meta)


def grow_namespaces(st: TrieState, ns_slots: int) -> TrieState:
    """Copy of ``st`` whose ``meta`` has room for ``ns_slots`` namespaces."""
    if ns_slots <= st.ns_slots:
        return st
    meta = _new_meta(ns_slots)
    meta[: st.meta.shape[0]] = st.meta
    return st._replace(meta=meta)


def state_nbytes(st: TrieState) -> int:
    """Bytes held by all arrays of the state."""
    return sum(a.nbytes for a in st)
