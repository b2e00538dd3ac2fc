"""Trie state: six numpy arrays (struct of arrays) in one buffer, allocated and grown from Python.

Every array argument costs numba about 15-40 ns to unbox per call, so the per-node fields are packed
into an int32, an int64 and an int8 block, and the namespace table lives in ``meta``. The
six arrays are views of one 64-byte-aligned byte buffer ``blob`` (a 128-byte int64 header with the
sizes and offsets, then the arrays); the hot entry points (``tr_match``, ``tr_insert``, ``tr_evict``) take only the
buffer and rebuild the views in jitted code (``blob_views``), the others take the views.

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
    i32[OWN, x]      int32   locks taken through a handle ending at x: an unlock needs one (an ancestor's count
                             alone may come from a deeper handle's lock)
    i64[BLOCK, x]    int64   host block id holding this page's KV
    i64[TICK, x]     int64   last-access tick (a global counter bumped by every touching match/insert),
                             lazy: written on the deepest page of a touched path only; the logical
                             tick of x is the max over its subtree, exact for leaves (the only heap
                             keys) because a freed page hands max(tick) to its parent
    i64[HASH, x]     int64   chained page hash h_depth of the prefix ending at this page (page_hash.py),
                             the uint64 bit pattern stored as int64; valid only when FL_HASHED is set
    i8[FLAGS, x]     int8    FL_HASHED: ``i64[HASH, x]`` is valid (a node without it has a stale hash
                             field); FL_INDEXED: the node is in ``table`` too (lazy indexing: see trie_jit.py)
    tokens[x, :]     uint32  the page's token ids (a hash hit is confirmed against these)

Rows indexed by heap position ``i`` (not by node): ``i32[HEAP, i]`` the node at heap position i and
``i64[HKEY, i] == i64[TICK, i32[HEAP, i]]`` its key stored inline (an indexed binary min-heap of the
evictable nodes keyed by (tick, node), size ``meta[M_HEAP]``).

``table`` (int64 slots ``(hash tag << 32) | node``, open addressing with linear probing, -1 = empty,
power-of-two size, load <= 3/4; see _table.py; it holds the indexed pages only). ``meta`` (int64):
counters at the indices below, then two slots per namespace from ``NS_BASE``: ``meta[NS_BASE + 2 * ns_id]``
the namespace's last first-page node (a hint, -1: none) and ``meta[NS_BASE + 2 * ns_id + 1]`` its seed
(uint64 bit pattern).
"""
from __future__ import annotations

from collections import namedtuple

import numba
import numpy as np

__all__ = ["FREE_PARENT", "TrieState", "new_state", "grow_nodes", "grow_namespaces", "with_table", "table_slots_for",
           "state_nbytes", "blob_views"]

# rows of i32
PARENT, DEPTH, NCHILD, HINT, LOCK, GEN, HITS, HPOS, HEAP, OWN = range(10)
N_I32 = 10
# rows of i64
BLOCK, TICK, HASH, HKEY = range(4)
N_I64 = 4
# rows of i8
FLAGS = 0
N_I8 = 1
FL_INDEXED = 1    # i8[FLAGS] bit: in the table (always with FL_HASHED)
FL_HASHED = 2     # i8[FLAGS] bit: hash valid
# meta
M_TOTAL = 0       # live pages
M_HIGH = 1        # slots ever used (slots >= HIGH were never allocated)
M_FREE = 2        # head of the free-slot list (-1: empty)
M_NFREE = 3       # length of the free-slot list
M_TICK = 4        # last tick handed out
M_PROT = 5        # pages with lock > 0
M_HEAP = 6        # heap size
M_PAGE = 7        # page size
M_MASK = 8        # page-hash mask (uint64 bit pattern; all ones except in collision tests)
M_INDEXED = 9     # pages in the table (FL_INDEXED); the table's load is M_INDEXED / slots <= 3/4
M_WIDE = 10       # 1 once the trie holds a code of a wide id (page_trie.py): range checks cover whole queries
NS_BASE = 11      # per namespace: hint, seed
FREE_PARENT = -(2**31)  # i32[PARENT] of a free slot: equals no node and no namespace root code

TABLE_MAX_LOAD_NUM, TABLE_MAX_LOAD_DEN = 3, 4


# header of the blob (int64 words): node slots, page size, table slots, meta length, then byte offsets
H_NODES, H_PAGE, H_SLOTS, H_META, H_I32, H_I64, H_I8, H_TOKENS, H_TABLE, H_METAOFF = range(10)
HEADER_BYTES = 128
_ALIGN = 64


class TrieState(namedtuple("TrieState", ["i32", "i64", "i8", "tokens", "table", "meta", "blob"])):
    """The arrays of one trie, all views of one byte buffer ``blob`` (see ``blob_views``); the
    properties are views for tests and tools."""

    __slots__ = ()

    @property
    def hashes(self) -> np.ndarray:
        return self.i64[HASH].view(np.uint64)

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


def _alloc_state(nodes: int, page_size: int, slots: int, meta_len: int) -> TrieState:
    """Uninitialised state: one 64-byte-aligned buffer holding a header and the six arrays.

    One buffer because the hot entry points take it as their only state argument: numba unboxes
    every array argument on every call (~235 ns a call with 8 array arguments, ~165 ns with 3)."""
    sizes = (4 * N_I32 * nodes, 8 * N_I64 * nodes, N_I8 * nodes, 4 * nodes * page_size, 8 * slots, 8 * meta_len)
    offs = []
    off = HEADER_BYTES
    for n in sizes:
        offs.append(off)
        off = -(-(off + n) // _ALIGN) * _ALIGN
    raw = np.empty(off + _ALIGN, dtype=np.uint8)
    shift = -raw.ctypes.data % _ALIGN  # token rows start on cache lines
    blob = raw[shift: shift + off]
    hdr = blob[:HEADER_BYTES].view(np.int64)
    hdr[:] = 0
    hdr[H_NODES], hdr[H_PAGE], hdr[H_SLOTS], hdr[H_META] = nodes, page_size, slots, meta_len
    hdr[H_I32:H_METAOFF + 1] = offs
    v = [blob[o: o + n] for o, n in zip(offs, sizes)]
    return TrieState(i32=v[0].view(np.int32).reshape(N_I32, nodes), i64=v[1].view(np.int64).reshape(N_I64, nodes),
                     i8=v[2].view(np.int8).reshape(N_I8, nodes),
                     tokens=v[3].view(np.uint32).reshape(nodes, page_size), table=v[4].view(np.int64),
                     meta=v[5].view(np.int64), blob=blob)


@numba.njit(inline="always")
def blob_views(blob):
    """(i32, i64, i8, tokens, table, meta) of a state buffer, in jitted code (no copies, no allocation)."""
    hdr = blob[:HEADER_BYTES].view(np.int64)
    n = hdr[H_NODES]
    ps = hdr[H_PAGE]
    o = hdr[H_I32]
    i32 = blob[o: o + 4 * N_I32 * n].view(np.int32).reshape((N_I32, n))
    o = hdr[H_I64]
    i64 = blob[o: o + 8 * N_I64 * n].view(np.int64).reshape((N_I64, n))
    o = hdr[H_I8]
    i8 = blob[o: o + N_I8 * n].view(np.int8).reshape((N_I8, n))
    o = hdr[H_TOKENS]
    tokens = blob[o: o + 4 * n * ps].view(np.uint32).reshape((n, ps))
    o = hdr[H_TABLE]
    table = blob[o: o + 8 * hdr[H_SLOTS]].view(np.int64)
    o = hdr[H_METAOFF]
    meta = blob[o: o + 8 * hdr[H_META]].view(np.int64)
    return i32, i64, i8, tokens, table, meta


def _init_nodes(st: TrieState, start: int) -> None:
    """Free-slot values for node slots ``start:`` (written once: no page faults in later inserts)."""
    st.i32[:, start:] = 0
    st.i32[PARENT, start:] = FREE_PARENT
    st.i32[DEPTH, start:] = -1
    st.i32[HINT, start:] = -1
    st.i32[HPOS, start:] = -1
    st.i64[:, start:] = 0
    st.i8[:, start:] = 0
    st.tokens[start:] = 0


def new_state(page_size: int, nodes: int, ns_slots: int = 4, mask: int = -1) -> TrieState:
    """An empty trie with room for ``nodes`` pages (the table sized for them).

    Every array is written once here, so the pages are mapped now and not by page faults inside
    later inserts.
    """
    nodes = max(int(nodes), 1)
    st = _alloc_state(nodes, page_size, table_slots_for(nodes), NS_BASE + 2 * ns_slots)
    _init_nodes(st, 0)
    st.table.fill(-1)
    meta = st.meta
    meta.fill(0)
    meta[NS_BASE::2] = -1
    meta[M_FREE] = -1
    meta[M_PAGE] = page_size
    mask = int(mask) & 0xFFFFFFFFFFFFFFFF
    meta[M_MASK] = mask - (1 << 64) if mask >= 1 << 63 else mask
    return st


def _resized(st: TrieState, nodes: int, slots: int, meta_len: int) -> TrieState:
    """Copy of ``st`` with more node slots, table slots or meta words; new node slots are free,
    new meta words zero, and a table of a new size empty (the caller rebuilds it)."""
    old = st.i32.shape[1]
    new = _alloc_state(nodes, st.tokens.shape[1], slots, meta_len)
    new.i32[:, :old] = st.i32
    new.i64[:, :old] = st.i64
    new.i8[:, :old] = st.i8
    new.tokens[:old] = st.tokens
    _init_nodes(new, old)
    if slots == st.table.shape[0]:
        new.table[:] = st.table
    else:
        new.table.fill(-1)
    new.meta.fill(0)
    new.meta[: st.meta.shape[0]] = st.meta
    return new


def grow_nodes(st: TrieState, nodes: int) -> TrieState:
    """Copy of ``st`` with ``nodes`` node slots (>= current). The table grows with them (to
    ``table_slots_for(nodes)``, so it never fills up on its own): when its size changed it is empty
    and the caller rebuilds it (``tr_rebuild_table``; the buffer is copied anyway)."""
    if nodes <= st.i32.shape[1]:
        return st
    return _resized(st, int(nodes), max(st.table.shape[0], table_slots_for(int(nodes))), st.meta.shape[0])


def with_table(st: TrieState, slots: int) -> TrieState:
    """Copy of ``st`` with an empty table of ``slots`` slots (rebuild it with ``tr_rebuild_table``)."""
    return _resized(st, st.i32.shape[1], int(slots), st.meta.shape[0])


def grow_namespaces(st: TrieState, ns_slots: int) -> TrieState:
    """Copy of ``st`` whose ``meta`` has room for ``ns_slots`` namespaces."""
    if ns_slots <= st.ns_slots:
        return st
    new = _resized(st, st.i32.shape[1], st.table.shape[0], NS_BASE + 2 * ns_slots)
    new.meta[st.meta.shape[0]:][::2] = -1  # per namespace: hint -1, seed (written by the caller)
    return new


def state_nbytes(st: TrieState) -> int:
    """Bytes held by the state (its buffer: the arrays, a 128-byte header and alignment padding)."""
    return st.blob.nbytes
