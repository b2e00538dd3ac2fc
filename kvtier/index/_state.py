"""Trie state: a namedtuple of numpy arrays (struct of arrays), allocated and grown from Python.

Node ``x`` (0 <= x < number of node slots) is described by column ``x`` of every per-node array:

    hashes[x]        uint64  chained page hash h_depth of the prefix ending at this page (page_hash.py)
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
    tier[x]          int8    storage tier of the block (0 = host memory; reserved for the SSD tier)
    tokens[x, :]     uint32  the page's token ids (a hash hit is confirmed against these)

Other arrays: ``heap`` (int32, an indexed binary min-heap of the evictable nodes keyed by
(tick, node)), ``hkey`` (int64, ``hkey[i] == tick[heap[i]]``: the heap's keys stored inline),
``table`` (int32, open addressing with linear probing from page hash to node, -1 =
empty, power-of-two size, load <= 3/4), ``ns_hint`` (int32 per namespace: last first-page node) and
``meta`` (int64 counters, indices below).
"""
from __future__ import annotations

from collections import namedtuple

import numpy as np

__all__ = ["TrieState", "new_state", "grow_nodes", "table_slots_for", "state_nbytes"]

TrieState = namedtuple("TrieState", ["hashes", "i32", "i64", "tier", "tokens", "heap", "hkey", "table", "ns_hint",
                                     "meta"])

# rows of i32
PARENT, DEPTH, NCHILD, HINT, LOCK, GEN, HITS, HPOS = range(8)
N_I32 = 8
# rows of i64
BLOCK, TICK = range(2)
N_I64 = 2
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
N_META = 16

TABLE_MAX_LOAD_NUM, TABLE_MAX_LOAD_DEN = 3, 4


def table_slots_for(pages: int) -> int:
    """Smallest power of two whose 3/4 is >= pages (at least 16)."""
    need = max(16, -(-pages * TABLE_MAX_LOAD_DEN // TABLE_MAX_LOAD_NUM))
    return 1 << (need - 1).bit_length()


def new_state(page_size: int, nodes: int, limit: int = -1, ns_slots: int = 4) -> TrieState:
    """An empty trie with room for ``nodes`` pages (the table sized for them)."""
    nodes = max(int(nodes), 1)
    i32 = np.empty((N_I32, nodes), dtype=np.int32)
    i32[PARENT] = -(2**31)
    i32[DEPTH] = -1
    i32[HPOS] = -1
    i32[GEN] = 0
    meta = np.zeros(N_META, dtype=np.int64)
    meta[M_FREE] = -1
    meta[M_LIMIT] = limit
    meta[M_PAGE] = page_size
    return TrieState(
        hashes=np.zeros(nodes, dtype=np.uint64),
        i32=i32,
        i64=np.zeros((N_I64, nodes), dtype=np.int64),
        tier=np.zeros(nodes, dtype=np.int8),
        tokens=np.zeros((nodes, page_size), dtype=np.uint32),
        heap=np.empty(nodes, dtype=np.int32),
        hkey=np.empty(nodes, dtype=np.int64),
        table=np.full(table_slots_for(nodes), -1, dtype=np.int32),
        ns_hint=np.full(ns_slots, -1, dtype=np.int32),
        meta=meta,
    )


def grow_nodes(st: TrieState, nodes: int) -> TrieState:
    """Copy of ``st`` with ``nodes`` node slots (>= current); the table is reused as is."""
    old = st.hashes.shape[0]
    if nodes <= old:
        return st
    g = new_state(st.tokens.shape[1], nodes, int(st.meta[M_LIMIT]), st.ns_hint.shape[0])
    g.hashes[:old] = st.hashes
    g.i32[:, :old] = st.i32
    g.i64[:, :old] = st.i64
    g.tier[:old] = st.tier
    g.tokens[:old] = st.tokens
    g.heap[:old] = st.heap
    g.hkey[:old] = st.hkey
    g.meta[:] = st.meta
    return g._replace(table=st.table, ns_hint=st.ns_hint)


def state_nbytes(st: TrieState) -> int:
    """Bytes held by all arrays of the state."""
    return sum(a.nbytes for a in st)
