"""Jitted page-trie operations over a :class:`TrieState` (free functions, prefix ``tr_``).

Protocol (all functions return status codes or counts and never raise; ``page_trie.PageTrie``
validates input, grows the arrays and raises):

* A page is cached only if its parent page is, so "the first k pages of a query are cached" is monotone
  in k. A node is identified by (parent, page tokens); its chained hash ``hashes[x]`` keys the table.
* Two exact matchers, both returning the longest cached prefix (count, deepest node):
  - ``_walk``: descend from the namespace root; the child for page k is first tried through the parent's
    hint (last child created/found), confirmed by parent identity and the page's tokens; only on a
    miss is ``h_k = xxh64(page k, seed=hashes[parent])`` computed and the table probed for a node with
    that hash, that parent and those tokens. Pages confirmed through hints are never hashed.
  - ``_gallop``: hash the query's pages lazily, probe page counts 1, 2, 4, 8 ... then binary search.
    A probe of page k accepts a node whose hash == h_k, depth == k, tokens == page k and whose parent's
    hash == h_{k-1} (root code for k == 0). The answer is then verified once by walking from the deepest
    node to the namespace root comparing every page's tokens and depth; if anything disagrees (a hash
    collision made the predicate lie) the result is recomputed by ``_walk``. So a collision costs time,
    never a wrong page.
* Ticks: every touching match/insert takes the next tick; logically every page of its path gets it.
  Lazy ticks: only the deepest page of the path is written (an insert that adds pages writes the new
  ones); a page's logical tick is the max stored tick in its subtree, kept exact for leaves because
  a freed page hands max(tick) and the sum of hits to its parent (``_free``). Only leaves are ever
  keyed in the heap, so the eviction order is the same as writing every page. Evictable = unlocked leaf; the heap holds exactly the evictable nodes, ordered by (tick, node).
  Ticks are unique among leaves (a tick is written on one root path, which holds at most one leaf).
* Locks cover a root..node path (lock(parent) >= lock(child)); locked pages are never evicted or
  removed.
"""
from __future__ import annotations

import numba
import numpy as np

from ._config import NUMBA_CACHE
from ._heap import hp_fix, hp_pop, hp_push, hp_remove
from ._state import (BLOCK, DEPTH, GEN, HINT, HITS, HPOS, LOCK, M_FALLBACK, M_FREE, M_HIGH, M_LIMIT, M_NFREE,
                     M_PROT, M_TICK, M_TOTAL, NCHILD, PARENT, TABLE_MAX_LOAD_DEN, TABLE_MAX_LOAD_NUM, TICK)
from ._table import tb_delete, tb_home, tb_insert
from ._tokens import tokens_in_range
from .xxh64 import xxh64_token_range

__all__ = ["tr_match", "tr_insert", "tr_lock", "tr_evict", "tr_remove", "tr_rebuild_table",
           "OK", "NEED_NODES", "BAD_TOKENS", "BAD_BLOCKS", "BAD_BLOCK_COUNT", "NEED_TABLE", "STALE_HANDLE",
           "NOT_LOCKED"]

OK = 0
NEED_NODES = -2
BAD_TOKENS = -3
BAD_BLOCKS = -4
BAD_BLOCK_COUNT = -5
NEED_TABLE = -6
STALE_HANDLE = -7
NOT_LOCKED = -8

_HITS_MAX = 2147483647
_FREE_PARENT = -2147483648  # parent of a free slot: equals no node and no namespace root code

# Hot loops never pass the state namedtuple to a helper: each such call increments and decrements
# the reference count of all its arrays (measured: 80 ns per call). Helpers take plain arrays.


@numba.njit(inline="always")
def _page_eq(tokens, x, q, start, ps):
    row = tokens[x]
    d = np.int64(0)
    for j in range(ps):  # no early exit: vectorizes
        d |= np.int64(row[j]) ^ np.int64(q[start + j])
    return d == 0


@numba.njit(inline="always")
def _touch(tick_arr, hits, x, tick, hit):
    tick_arr[x] = tick
    if hit and hits[x] < _HITS_MAX:
        hits[x] += 1


@numba.njit(inline="always")
def _find_child(table, hashes, parent, tokens, code, q, start, ps, h):
    """Node with hash ``h``, parent ``code`` and tokens ``q[start:start+ps]``, else -1."""
    tmask = table.shape[0] - 1
    i = tb_home(h, tmask)
    while True:
        x = table[i]
        if x < 0:
            return -1
        if hashes[x] == h and parent[x] == code and _page_eq(tokens, x, q, start, ps):
            return x
        i = (i + 1) & tmask


@numba.njit(cache=NUMBA_CACHE)
def _walk(st, q, ps, n, ns_id, seed, mask, blocks_out):
    """Exact longest cached prefix: (pages, deepest node or -1). Touches nothing (lazy ticks: the
    caller writes the deepest node only, see _state.py).

    Candidates for the child of ``node`` holding page k, cheapest first: ``node + 1`` (an insert
    allocates a chain's pages consecutively, so this guess needs no load and lets the CPU run ahead),
    the parent's hint, then a table probe with ``h_k``. A candidate is accepted only if its parent is
    ``node`` and its tokens are the page's: the guesses are never trusted.
    """
    parent = st.i32[PARENT]
    hint = st.i32[HINT]
    block = st.i64[BLOCK]
    hashes = st.hashes
    tokens = st.tokens
    table = st.table
    ns_hint = st.ns_hint
    high = st.meta[M_HIGH]
    code = -1 - ns_id
    node = -1
    m = 0
    for k in range(n):
        s = k * ps
        c = node + 1
        if node < 0 or c >= high or parent[c] != code or not _page_eq(tokens, c, q, s, ps):
            c = ns_hint[ns_id] if node < 0 else hint[node]
            if not (c >= 0 and parent[c] == code and _page_eq(tokens, c, q, s, ps)):
                h = seed if node < 0 else hashes[node]
                h = xxh64_token_range(q, s, s + ps, h) & mask
                c = _find_child(table, hashes, parent, tokens, code, q, s, ps, h)
                if c < 0:
                    break
                if node >= 0:
                    hint[node] = c
                else:
                    ns_hint[ns_id] = c
        blocks_out[k] = block[c]
        node = c
        code = c
        m = k + 1
    return m, node


@numba.njit(inline="always")
def _probe(table, hashes, parent, depth, tokens, q, ps, k, hb, root_code):
    """Gallop predicate for page k: a node with hash hb[k], depth k, page-k tokens, parent hash hb[k-1]."""
    h = hb[k]
    tmask = table.shape[0] - 1
    i = tb_home(h, tmask)
    while True:
        x = table[i]
        if x < 0:
            return -1
        if hashes[x] == h and depth[x] == k and _page_eq(tokens, x, q, k * ps, ps):
            p = parent[x]
            if k == 0:
                if p == root_code:
                    return x
            elif p >= 0 and hashes[p] == hb[k - 1]:
                return x
        i = (i + 1) & tmask


@numba.njit(cache=NUMBA_CACHE)
def _gallop(st, q, ps, n, ns_id, seed, mask, blocks_out):
    """Gallop + binary search, verified; falls back to ``_walk`` on a failed verification."""
    parent = st.i32[PARENT]
    depth = st.i32[DEPTH]
    hashes = st.hashes
    tokens = st.tokens
    table = st.table
    block = st.i64[BLOCK]
    root_code = -1 - ns_id
    hb = np.empty(n, dtype=np.uint64)
    done = 0  # pages hashed so far
    h = seed
    lo, lo_node, hi = 0, -1, n + 1  # lo pages known cached, hi pages known not (n + 1: none known)
    c = 1
    while c <= n:
        while done < c:
            h = xxh64_token_range(q, done * ps, (done + 1) * ps, h) & mask
            hb[done] = h
            done += 1
        x = _probe(table, hashes, parent, depth, tokens, q, ps, c - 1, hb, root_code)
        if x < 0:
            hi = c
            break
        lo, lo_node = c, x
        if c == n:
            break
        c = min(2 * c, n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        x = _probe(table, hashes, parent, depth, tokens, q, ps, mid - 1, hb, root_code)  # mid-1 < done
        if x >= 0:
            lo, lo_node = mid, x
        else:
            hi = mid
    # verify the whole path once: every page's tokens and depth, and the namespace root
    x = lo_node
    ok = True
    for j in range(lo - 1, -1, -1):
        if x < 0 or depth[x] != j or not _page_eq(tokens, x, q, j * ps, ps):
            ok = False
            break
        blocks_out[j] = block[x]
        x = parent[x]
    if not ok or (lo > 0 and x != root_code):
        st.meta[M_FALLBACK] += 1
        return _walk(st, q, ps, n, ns_id, seed, mask, blocks_out)
    return lo, lo_node


@numba.njit(cache=NUMBA_CACHE)
def tr_match(st, q, ns_id, seed, mask, touch, gallop):
    """Longest cached prefix of q: (pages, block ids, deepest node, its gen); pages < 0 is an error status."""
    ps = st.tokens.shape[1]
    n = q.shape[0] // ps
    blocks = np.empty(n, dtype=np.int64)
    if not tokens_in_range(q):
        return BAD_TOKENS, blocks[:0], -1, 0
    tick = 0
    if touch:
        tick = st.meta[M_TICK] + 1
        st.meta[M_TICK] = tick
    if gallop:
        m, node = _gallop(st, q, ps, n, ns_id, seed, mask, blocks)
    else:
        m, node = _walk(st, q, ps, n, ns_id, seed, mask, blocks)
    if node < 0:
        return 0, blocks[:0], -1, 0
    if touch:  # lazy ticks/hits: the deepest node only (see _state.py)
        tick_arr = st.i64[TICK]
        _touch(tick_arr, st.i32[HITS], node, tick, True)
        hpos = st.i32[HPOS]
        if hpos[node] >= 0:
            hp_fix(st.heap, st.hkey, hpos, tick_arr, st.meta, node)
    return m, blocks[:m], node, st.i32[GEN, node]


@numba.njit(inline="always")
def _alloc(meta, hint):
    x = meta[M_FREE]
    if x >= 0:
        meta[M_FREE] = hint[x]
        meta[M_NFREE] -= 1
    else:
        x = meta[M_HIGH]
        meta[M_HIGH] = x + 1
    return x


@numba.njit(inline="always")
def _free(i32, i64, hashes, table, ns_hint, meta, x):
    """Unlink node x (a leaf, not in the heap) from its parent and the table; put its slot on the free list.

    Lazy ticks/hits: the parent inherits max(tick) and the (saturating) sum of hits of x.
    """
    p = i32[PARENT, x]
    if p >= 0:
        if i64[TICK, x] > i64[TICK, p]:
            i64[TICK, p] = i64[TICK, x]
        hsum = np.int64(i32[HITS, p]) + np.int64(i32[HITS, x])
        i32[HITS, p] = min(hsum, _HITS_MAX)
        i32[NCHILD, p] -= 1
        if i32[HINT, p] == x:
            i32[HINT, p] = -1
    else:
        ns_id = -1 - p
        if ns_hint[ns_id] == x:
            ns_hint[ns_id] = -1
    tb_delete(table, hashes, x)
    i32[PARENT, x] = _FREE_PARENT  # guesses (node + 1, hints) check the parent: a free slot never passes
    i32[DEPTH, x] = -1
    i32[GEN, x] += 1
    i32[HINT, x] = meta[M_FREE]
    meta[M_FREE] = x
    meta[M_NFREE] += 1
    meta[M_TOTAL] -= 1


@numba.njit(cache=NUMBA_CACHE)
def tr_insert(st, q, ns_id, seed, mask, blocks):
    """Store the pages of q not yet held, page k -> blocks[k].

    Returns (status, pages already held, pages stored, deepest node of the path, its gen). With a
    page limit only the first pages that fit are stored. NEED_NODES / NEED_TABLE: nothing changed,
    grow and call again (the count needed is in the third field).
    """
    ps = st.tokens.shape[1]
    n = q.shape[0] // ps
    if blocks.shape[0] != n:
        return BAD_BLOCK_COUNT, 0, 0, -1, 0
    if not tokens_in_range(q):
        return BAD_TOKENS, 0, 0, -1, 0
    for k in range(n):
        if blocks[k] < 0:
            return BAD_BLOCKS, 0, 0, -1, 0
    meta = st.meta
    scratch = np.empty(n, dtype=np.int64)
    m, node = _walk(st, q, ps, n, ns_id, seed, mask, scratch)
    want = n - m
    limit = meta[M_LIMIT]
    if limit >= 0:
        want = min(want, max(limit - meta[M_TOTAL], 0))
    free_slots = st.hashes.shape[0] - meta[M_HIGH] + meta[M_NFREE]
    if want > free_slots:
        return NEED_NODES, m, want - free_slots, -1, 0
    if (meta[M_TOTAL] + want) * TABLE_MAX_LOAD_DEN > st.table.shape[0] * TABLE_MAX_LOAD_NUM:
        return NEED_TABLE, m, want, -1, 0
    i32 = st.i32
    parent = i32[PARENT]
    hint = i32[HINT]
    hits = i32[HITS]
    hpos = i32[HPOS]
    tick_arr = st.i64[TICK]
    block = st.i64[BLOCK]
    hashes = st.hashes
    tokens = st.tokens
    table = st.table
    heap = st.heap
    hkey = st.hkey
    tick = meta[M_TICK] + 1
    meta[M_TICK] = tick
    if node >= 0:  # lazy ticks: with want > 0 the new pages below node carry the tick
        if want == 0:
            tick_arr[node] = tick
        if hpos[node] >= 0:
            if want > 0:
                hp_remove(heap, hkey, hpos, tick_arr, meta, node)
            else:
                hp_fix(heap, hkey, hpos, tick_arr, meta, node)
    code = -1 - ns_id
    h = seed
    if node >= 0:
        code = node
        h = hashes[node]
    for k in range(m, m + want):
        s = k * ps
        h = xxh64_token_range(q, s, s + ps, h) & mask
        x = _alloc(meta, hint)
        hashes[x] = h
        parent[x] = code
        i32[DEPTH, x] = k
        i32[NCHILD, x] = 0
        hint[x] = -1
        i32[LOCK, x] = 0
        hits[x] = 0
        block[x] = blocks[k]
        tick_arr[x] = tick
        st.tier[x] = 0
        row = tokens[x]
        for j in range(ps):
            row[j] = q[s + j]
        tb_insert(table, hashes, x)
        if code >= 0:
            i32[NCHILD, code] += 1
            hint[code] = x
        else:
            st.ns_hint[ns_id] = x
        code = x
    meta[M_TOTAL] += want
    if want > 0:
        hp_push(heap, hkey, hpos, tick_arr, meta, code)
        node = code
    if node < 0:
        return OK, m, want, -1, 0
    return OK, m, want, node, i32[GEN, node]


@numba.njit(cache=NUMBA_CACHE)
def tr_lock(st, node, gen, delta):
    """Add ``delta`` (+1 or -1) to the lock count of every page on the root..node path."""
    i32 = st.i32
    if node < 0 or node >= st.meta[M_HIGH] or i32[DEPTH, node] < 0 or i32[GEN, node] != gen:
        return STALE_HANDLE
    if delta < 0 and i32[LOCK, node] <= 0:
        return NOT_LOCKED
    lock = i32[LOCK]
    hpos = i32[HPOS]
    parent = i32[PARENT]
    nchild = i32[NCHILD]
    tick_arr = st.i64[TICK]
    heap = st.heap
    hkey = st.hkey
    meta = st.meta
    x = node
    while x >= 0:
        if delta > 0:
            if lock[x] == 0:
                meta[M_PROT] += 1
                if hpos[x] >= 0:
                    hp_remove(heap, hkey, hpos, tick_arr, meta, x)
            lock[x] += 1
        else:
            lock[x] -= 1
            if lock[x] == 0:
                meta[M_PROT] -= 1
                if nchild[x] == 0:
                    hp_push(heap, hkey, hpos, tick_arr, meta, x)
        x = parent[x]
    return OK


@numba.njit(cache=NUMBA_CACHE)
def tr_evict(st, n):
    """Free up to n pages, least-recently used unlocked leaf first; returns their block ids in order."""
    meta = st.meta
    out = np.empty(max(0, min(n, meta[M_TOTAL])), dtype=np.int64)
    i32 = st.i32
    hpos = i32[HPOS]
    tick_arr = st.i64[TICK]
    block = st.i64[BLOCK]
    heap = st.heap
    hkey = st.hkey
    hashes = st.hashes
    table = st.table
    ns_hint = st.ns_hint
    k = 0
    while k < out.shape[0]:
        x = hp_pop(heap, hkey, hpos, tick_arr, meta)
        if x < 0:
            break
        out[k] = block[x]
        k += 1
        p = i32[PARENT, x]
        _free(i32, st.i64, hashes, table, ns_hint, meta, x)
        if p >= 0 and i32[NCHILD, p] == 0 and i32[LOCK, p] == 0:
            hp_push(heap, hkey, hpos, tick_arr, meta, p)
    return out[:k]


@numba.njit(cache=NUMBA_CACHE)
def tr_remove(st, q, ns_id, seed, mask):
    """Drop the held pages of q from the deepest up while they are unlocked leaves: (status, block ids)."""
    ps = st.tokens.shape[1]
    n = q.shape[0] // ps
    out = np.empty(n, dtype=np.int64)
    if not tokens_in_range(q):
        return BAD_TOKENS, out[:0]
    m, x = _walk(st, q, ps, n, ns_id, seed, mask, out)
    i32 = st.i32
    hpos = i32[HPOS]
    meta = st.meta
    k = 0
    while x >= 0 and i32[NCHILD, x] == 0 and i32[LOCK, x] == 0:
        out[k] = st.i64[BLOCK, x]
        k += 1
        if hpos[x] >= 0:
            hp_remove(st.heap, st.hkey, hpos, st.i64[TICK], meta, x)
        p = i32[PARENT, x]
        _free(i32, st.i64, st.hashes, st.table, st.ns_hint, meta, x)
        x = p
    return OK, out[:k]


@numba.njit(cache=NUMBA_CACHE)
def tr_rebuild_table(st, table):
    """Insert every live node into the empty ``table`` (after growing it)."""
    depth = st.i32[DEPTH]
    for x in range(st.meta[M_HIGH]):
        if depth[x] >= 0:
            tb_insert(table, st.hashes, x)
