"""The jitted core of the host index: page-trie operations over the arrays of a :class:`TrieState` (free
functions, prefix ``tr_``); :class:`~kvtier.index.page_trie.PageTrie` is its Python face.

Protocol (all functions return status codes or counts and never raise; ``PageTrie`` validates input, grows the
arrays and raises):

* The entry points take the state's arrays as separate arguments (``i32, i64, i8, tokens, table, meta``) or the
  one buffer they are views of (``blob``), not the namedtuple: unboxing a tuple of arrays per call costs more
  than the arrays alone.
* A page is cached only if its parent page is, so "the first k pages of a query are cached" is monotone
  in k. A node is identified by (parent, page tokens); its chained hash ``i64[HASH, x]`` keys the table.
* The matcher, ``_walk``, returns the longest cached prefix (count, deepest node): descend from the namespace
  root; the child for page k is first tried at ``node + 1`` (a chain is allocated consecutively), then through
  the parent's hint (last child created/found), each confirmed by parent identity and the page's tokens; only
  when ``node + 1`` misses is ``h_k = xxh64(page k, seed=hash[parent])`` computed (its table slot is prefetched
  while the hint is checked) and, if the hint misses too, the table probed for a node with that hash, that
  parent and those tokens. Pages confirmed through guesses are never hashed, and every matched page's tokens are
  compared, so a hash collision costs time, never a wrong page. (Gallop + binary search over table probes is the
  other exact matcher; it lost to the walk and is kept in the tests as a second opinion: docs/DESIGN.md,
  "Host index".)
* Lazy indexing: a page is put in the table only when it can be reached no other way, and hashed only when it
  or a page below it is put there. In ``i8[FLAGS, x]``, FL_HASHED marks a page whose stored hash is valid and
  FL_INDEXED one that is also in the table; invariants (checked by the state machine after every step):
  I1 a hashed page's stored hash is its chained page hash; the table holds exactly the indexed pages, which
     are hashed;
  I2 the parent of a hashed page is hashed (its hash seeds the child's); first pages are always indexed;
  I3 a page that is not indexed is its parent's only child and its parent's hint.
  So the walk finds an unindexed child through ``node + 1`` or the hint, and under a node that is not hashed
  it never probes the table (no indexed child can exist, I2). An insert writes a new chain without
  hashing; only a chain's first page is indexed, and only if it gets a sibling (it then indexes the
  old only child too, after ``tr_index_path`` hashed the parent and its unhashed ancestors). The ancestors
  stay out of the table: each is its parent's only child, found through ``node + 1`` or the hint, so a long
  prefix with one branch at its end costs the table two entries, and its eviction two deletes.
* Token range: a query page can only equal a stored page if its ids lie in [0, 2**32) (the compare
  extends stored uint32 and query ids to int64), so only the tokens after the matched prefix are
  range-checked; an insert stores nothing before that check passed.
* Ticks: every touching match/insert takes the next tick; logically every page of its path gets it.
  Lazy ticks: only the deepest page of the path is written (an insert that adds pages writes the new
  ones); a page's logical tick is the max stored tick in its subtree, kept exact for leaves because
  a freed page hands max(tick) and the sum of hits to its parent (``_free_chain``). Only leaves are ever
  keyed in the heap, so the eviction order is the same as writing every page. Evictable = unlocked leaf; the
  heap holds exactly the evictable nodes, ordered by (tick, node) with lazy keys (a touch writes the tick only;
  ``hp_pop`` refreshes stale keys, see _heap.py).
  Ticks are unique among leaves (a tick is written on one root path, which holds at most one leaf).
* Locks cover a root..node path (lock(parent) >= lock(child)); locked pages are never evicted.
"""
from __future__ import annotations

import numba
import numpy as np

from ._config import NUMBA_CACHE
from ._heap import hp_key_floor, hp_pop, hp_precedes, hp_precedes_key, hp_push, hp_remove
from ._simd import diff16, prefetch
from ._state import (BLOCK, DEPTH, FL_HASHED, FL_INDEXED, FLAGS, FREE_PARENT, GEN, HASH, HINT, HITS, HPOS, LOCK,
                     M_FREE, M_HIGH, M_INDEXED, M_MASK, M_NFREE, M_PROT, M_TICK, M_TOTAL, M_WIDE, NCHILD, NS_BASE,
                     OWN, PARENT, TABLE_MAX_LOAD_DEN, TABLE_MAX_LOAD_NUM, TICK, blob_views)
from ._table import EMPTY, tb_delete, tb_home, tb_insert, tb_node, tb_tag
from ._tokens import in_range_from
from .xxh64 import xxh64_token_range

__all__ = ["tr_match", "tr_insert", "tr_lock", "tr_evict", "tr_rebuild_table", "tr_index_path", "OK", "NEED_NODES",
           "BAD_TOKENS", "BAD_BLOCKS", "BAD_BLOCK_COUNT", "NEED_TABLE", "STALE_HANDLE", "NOT_LOCKED", "NEED_HASH",
           "F_TOUCH"]

OK = 0
NEED_NODES = -2
BAD_TOKENS = -3
BAD_BLOCKS = -4
BAD_BLOCK_COUNT = -5
NEED_TABLE = -6
STALE_HANDLE = -7
NOT_LOCKED = -8
NEED_HASH = -9

F_TOUCH = 1   # tr_match flag: tick the matched path (LRU) and count a hit

_HITS_MAX = 2147483647
_PF = 32  # pages ahead the chain loop prefetches (docs/DESIGN.md, "Tuned constants")
_CB = 16  # pages a chain's measure checks at a time (one cache line of an int32 row)
_PF_ROWS = 64  # pages ahead of the measure its rows are prefetched
_FREE_PARENT = FREE_PARENT  # a numba global constant

# Hot loops never pass the state namedtuple to a helper: each such call increments and decrements
# the reference count of all its arrays (bench/results/index_notes.md). Helpers take plain arrays.


@numba.njit(inline="always")
def _page_diff(tokens, x, q, s, ps):
    """0 iff page ``x``'s stored tokens equal ``q[s:s+ps]`` (see _simd.diff16 for the id extension)."""
    if ps == 16:
        return diff16(tokens, x, 0, q, s)
    d = np.int64(0)
    j = 0
    while j + 16 <= ps:
        d |= diff16(tokens, x, j, q, s + j)
        j += 16
    for i in range(j, ps):
        d |= np.int64(tokens[x, i]) ^ np.int64(q[s + i])
    return d


@numba.njit(inline="always")
def _find_child(table, i32, tokens, code, q, start, ps, tag, i):
    """Node with hash tag ``tag``, parent ``code`` and tokens ``q[start:start+ps]``, else -1; probing
    from slot i. Parent and tokens identify the child, the tag only filters the probe run."""
    tmask = table.shape[0] - 1
    while True:
        e = table[i]
        if e == EMPTY:
            return -1
        if (np.uint64(e) >> np.uint64(32)) == tag:
            x = tb_node(e)
            if i32[PARENT, x] == code and _page_diff(tokens, x, q, start, ps) == 0:
                return x
        i = (i + 1) & tmask


@numba.njit(inline="always")
def _chain16(i32, i64, tokens, q, high, n, blocks_out, k, node, write):
    """The walk's hot loop for 16-token pages: follow ``node + 1`` while it is the child holding page k,
    writing block ids if ``write``. Unsigned indices (no wraparound selects) and few live values keep it in
    registers. The tokens ``_PF`` pages ahead are prefetched: a chain is consecutive, and its tail
    is usually out of cache (the hardware prefetcher stops at 4 KiB boundaries)."""
    ku = np.uint64(k)
    nu = np.uint64(n)
    c = np.uint64(node + 1)
    hu = np.uint64(high)
    while ku < nu and c < hu:
        prefetch(tokens, c + np.uint64(_PF))
        if np.int64(i32[PARENT, c]) != np.int64(c) - 1 or diff16(tokens, c, np.uint64(0), q, ku * np.uint64(16)) != 0:
            break
        if write:
            blocks_out[ku] = i64[BLOCK, c]
        ku += np.uint64(1)
        c += np.uint64(1)
    return np.int64(ku), np.int64(c) - 1


@numba.njit(inline="always")
def _walk(i32, i64, i8, tokens, table, meta, q, ps, n, ns_id, blocks_out, k0, node0):
    """Exact longest cached prefix: (pages, deepest node or -1), continuing from ``node0`` holding page
    ``k0 - 1`` (``k0 = 0, node0 = -1``: from the namespace root). Touches nothing but hints (lazy ticks:
    the caller writes the deepest node only, see _state.py). ``blocks_out`` gets the block ids of the
    matched pages from ``k0`` on unless it is empty.

    Candidates for the child of ``node`` holding page k, cheapest first: ``node + 1`` (an insert
    allocates a chain's pages consecutively, so this guess needs no load and lets the CPU run ahead),
    the parent's hint, then a table probe with ``h_k``. A candidate is accepted only if its parent is
    ``node`` and its tokens are the page's: the guesses are never trusted. Lazy indexing: a node that
    is not indexed has no indexed child (I2), so its only possible child is its hint (I3) and the
    table is not probed (nor its hash needed).
    """
    high = meta[M_HIGH]
    mask = np.uint64(meta[M_MASK])
    tmask = table.shape[0] - 1
    nsh = NS_BASE + 2 * ns_id
    write = blocks_out.shape[0] > 0
    code = -1 - ns_id
    node = node0
    k = k0
    if node >= 0:
        code = node
    while k < n:
        if node >= 0:  # the hot loop: follow the chain node + 1
            if ps == 16:
                k, node = _chain16(i32, i64, tokens, q, high, n, blocks_out, k, node, write)
            else:
                while k < n:
                    c = node + 1
                    prefetch(tokens, c + _PF)
                    if c >= high or i32[PARENT, c] != node or _page_diff(tokens, c, q, k * ps, ps) != 0:
                        break
                    if write:
                        blocks_out[k] = i64[BLOCK, c]
                    node = c
                    k += 1
            if k >= n:
                break
            code = node
        # node + 1 missed: the parent's hint, then the table. Hash first and prefetch the table slot,
        # so a hint miss and the probe overlap
        s = k * ps
        if node < 0:
            h = np.uint64(meta[nsh + 1])
            c = meta[nsh]
        else:
            c = i32[HINT, node]
            if (i8[FLAGS, node] & FL_HASHED) == 0:  # no indexed child (I2): the hint is the only candidate
                if c >= 0 and i32[PARENT, c] == code and _page_diff(tokens, c, q, s, ps) == 0:
                    if write:
                        blocks_out[k] = i64[BLOCK, c]
                    node = c
                    code = c
                    k += 1
                    continue
                break
            h = np.uint64(i64[HASH, node])
        tag = tb_tag(xxh64_token_range(q, s, s + ps, h) & mask)
        i0 = tb_home(tag, tmask)
        prefetch(table, i0)
        if not (c >= 0 and i32[PARENT, c] == code and _page_diff(tokens, c, q, s, ps) == 0):
            c = _find_child(table, i32, tokens, code, q, s, ps, tag, i0)
            if c < 0:
                break
            if node >= 0:
                i32[HINT, node] = c
            else:
                meta[nsh] = c
        if write:
            blocks_out[k] = i64[BLOCK, c]
        node = c
        code = c
        k += 1
    return k, node


@numba.njit(inline="always")
def _match_end(i32, i64, q, meta, ps, m, node, flags):
    """Range check of the unmatched tail, then the touch; returns (pages or status, node, gen)."""
    # The matched pages equal stored ones, so only the unmatched tail needs the range check, unless the trie holds
    # codes of wide ids (M_WIDE): a caller's id in [2**31, 2**32) can equal one, so the whole query is checked.
    if not in_range_from(q, m * ps * (1 - meta[M_WIDE])):
        return BAD_TOKENS, -1, 0
    if flags & F_TOUCH:
        tick = meta[M_TICK] + 1
        meta[M_TICK] = tick
        if node >= 0:  # lazy ticks/hits: the deepest node only (see _state.py)
            i64[TICK, node] = tick  # a leaf's heap key goes stale: lazy keys, see _heap.py
            if i32[HITS, node] < _HITS_MAX:
                i32[HITS, node] += 1
    if node < 0:
        return 0, -1, 0
    return m, node, i32[GEN, node]


@numba.njit(cache=NUMBA_CACHE, _nrt=False)  # type: ignore[call-overload]  # _nrt: numba's private flag
def tr_match(blob, q, ns_id, flags, blocks_out):
    """Longest cached prefix of q by the walk: (pages, deepest node, its gen); the block ids go to
    ``blocks_out[:pages]``, whose length is the query's full-page count. pages < 0 is an error status.

    Compiled without numba's reference counting (``_nrt=False``: nothing in here allocates), which
    saves an atomic increment and decrement per array argument and view, and the unboxing wrapper
    wraps no array in a MemInfo (a call costs less than half: bench/results/index_notes.md). The state
    comes as its one buffer (``_state.blob_views``): one array to unbox instead of six.
    """
    i32, i64, i8, tokens, table, meta = blob_views(blob)
    ps = tokens.shape[1]
    n = blocks_out.shape[0]
    m, node = _walk(i32, i64, i8, tokens, table, meta, q, ps, n, ns_id, blocks_out, 0, -1)
    return _match_end(i32, i64, q, meta, ps, m, node, flags)


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
def _free_chain(i32, i64, i8, table, meta, top, x):
    """Free the pages in slots ``top..x``: leaf ``x`` and its ancestors ``x - 1 .. top``, each the only child of
    the slot below it (``_chain_top``), none locked, none in the heap. Unlinks ``top`` from its parent (or its
    namespace root), drops the indexed ones from the table, and puts the slots on the free list as freeing them
    one at a time from ``x`` up would: ``top`` at the head, then ``top + 1`` .. ``x``, then the old list.

    Lazy ticks/hits: the parent of ``top`` inherits the max tick and the (saturating) sum of hits of the chain,
    what it gets when the pages go one at a time. The slots' own ticks and hits are left as they are (a slot
    taken from the free list is written whole). Each row is read or written by its own loop over the range
    (each vectorizes): a page costs a few vector lanes, not a pass over its fields.
    """
    parent = i32[PARENT]
    depth = i32[DEPTH]
    nchild = i32[NCHILD]
    hint = i32[HINT]
    gen = i32[GEN]
    hits = i32[HITS]
    tick = i64[TICK]
    flags = i8[FLAGS]
    n = x - top + 1
    t0 = np.uint64(top)  # unsigned indices: no wraparound select, the loops vectorize
    nu = np.uint64(n)
    m = tick[t0]
    for j in range(nu):
        v = tick[t0 + j]
        m = v if v > m else m
    hs = np.int64(0)
    for j in range(nu):
        hs += hits[t0 + j]
    p = parent[t0]
    if p >= 0:
        if m > tick[p]:
            tick[p] = m
        hits[p] = min(np.int64(hits[p]) + hs, _HITS_MAX)
        nchild[p] -= 1
        if hint[p] == top:
            hint[p] = -1
    else:
        nsh = NS_BASE + 2 * (-1 - p)
        if meta[nsh] == top:
            meta[nsh] = -1
    # the table drops the indexed pages deepest first, as one-at-a-time frees do; a chain holds few (I3: only a
    # page that had a sibling), so blocks of 16 flags are skipped with one vector OR
    b = x + 1
    while b > top:
        a = max(b - 16, top)
        fl = np.int8(0)
        for j in range(np.uint64(b - a)):
            fl |= flags[np.uint64(a) + j]
        if fl & FL_INDEXED:
            for i in range(b - 1, a - 1, -1):
                if flags[i] & FL_INDEXED:
                    tb_delete(table, i64[HASH, i], i)
                    meta[M_INDEXED] -= 1
        if fl != 0:
            for j in range(np.uint64(b - a)):
                flags[np.uint64(a) + j] = 0
        b = a
    for j in range(nu):
        parent[t0 + j] = _FREE_PARENT  # guesses (node + 1, hints) check the parent: a free slot never passes
    for j in range(nu):
        depth[t0 + j] = -1
    for j in range(nu):
        nchild[t0 + j] = 0
    for j in range(nu):
        gen[t0 + j] += 1
    nxt = np.int32(top + 1)
    for j in range(nu):
        hint[t0 + j] = nxt + np.int32(j)  # a free slot's hint is the next free slot
    hint[x] = meta[M_FREE]
    meta[M_FREE] = top
    meta[M_NFREE] += n
    meta[M_TOTAL] -= n


@numba.njit(inline="always")
def _hash(i64, i8, tokens, meta, x, seed):
    """Hash node x from its parent's hash (or namespace seed) ``seed`` and store it."""
    h = xxh64_token_range(tokens[x], 0, tokens.shape[1], np.uint64(seed)) & np.uint64(meta[M_MASK])
    i64[HASH, x] = np.int64(h)
    i8[FLAGS, x] = FL_HASHED


@numba.njit(inline="always")
def _index(i64, i8, tokens, table, meta, x, seed):
    """Put node x (not indexed) in the table, hashing it first from ``seed`` (its parent's hash or namespace
    seed) unless it is hashed."""
    if (i8[FLAGS, x] & FL_HASHED) == 0:
        _hash(i64, i8, tokens, meta, x, seed)
    tb_insert(table, i64[HASH, x], x)
    i8[FLAGS, x] = FL_HASHED | FL_INDEXED
    meta[M_INDEXED] += 1


@numba.njit(inline="always")
def _write_fresh_chain(parent, depth, nchild, hint, block, tick_arr, tokens, meta, q, blocks, m, want, code, tick,
                       nsh):
    """Pages ``m .. m + want`` of q as a chain in the fresh slots from ``meta[M_HIGH]`` on, below ``code`` (a
    node, or ``-1 - ns`` for a namespace root): what the per-node loop of ``tr_insert`` writes, one array at a
    time (each loop vectorizes). Slots from ``M_HIGH`` on have never been used, so their lock, hits and flags still
    hold ``_init_nodes``' zeros and are not written again (three fewer cold streams). Returns (first node, last
    node)."""
    x0 = meta[M_HIGH]
    meta[M_HIGH] = x0 + want
    last = x0 + want - 1
    for i in range(want):
        parent[x0 + i] = x0 + i - 1
    parent[x0] = code
    for i in range(want):
        depth[x0 + i] = m + i
    for i in range(want):
        nchild[x0 + i] = 1
    nchild[last] = 0
    for i in range(want):
        hint[x0 + i] = x0 + i + 1
    hint[last] = -1
    for i in range(want):
        block[x0 + i] = blocks[m + i]
    for i in range(want):
        tick_arr[x0 + i] = tick
    ps = tokens.shape[1]
    flat = tokens.reshape(tokens.shape[0] * ps)
    src = np.uint64(m * ps)
    dst = np.uint64(x0 * ps)
    for j in range(np.uint64(want * ps)):  # unsigned indices: no wraparound select, the copy vectorizes
        flat[dst + j] = q[src + j]
    if code >= 0:
        nchild[code] += 1
        hint[code] = x0
    else:
        meta[nsh] = x0
    return x0, last


@numba.njit(cache=NUMBA_CACHE, _nrt=False)  # type: ignore[call-overload]  # _nrt: numba's private flag
def tr_insert(blob, q, ns_id, blocks, new_mask):
    """Store the pages of q not yet held, page k -> blocks[k]; ``new_mask[k]`` (bool, one per block)
    is set to whether page k was stored by this call.

    Returns (status, pages already held, pages stored, deepest node of the path, its gen). NEED_NODES /
    NEED_TABLE: nothing changed,
    grow and call again (the count needed is in the third field). NEED_HASH: nothing changed, the
    deepest held page (fourth field) must be hashed first (``tr_index_path``), then call again.

    Lazy indexing (see the module docstring): the new chain's pages are written in one sequential
    pass and none of them is hashed, except its first page when its parent already has a child (that
    child is indexed too if it was not). A chain extending a leaf, or hanging off a namespace root
    (first pages are always indexed), costs at most one hash and one table insert.
    """
    i32, i64, i8, tokens, table, meta = blob_views(blob)
    ps = tokens.shape[1]
    n = len(q) // ps
    if blocks.shape[0] != n:
        return BAD_BLOCK_COUNT, 0, 0, -1, 0
    neg = np.int64(0)
    for k in range(n):  # no early exit: vectorizes
        neg |= blocks[k]
    if neg < 0:
        return BAD_BLOCKS, 0, 0, -1, 0
    m, node = _walk(i32, i64, i8, tokens, table, meta, q, ps, n, ns_id, blocks[:0], 0, -1)
    if not in_range_from(q, m * ps * (1 - meta[M_WIDE])):
        return BAD_TOKENS, 0, 0, -1, 0
    want = n - m
    free_slots = i32.shape[1] - meta[M_HIGH] + meta[M_NFREE]
    if want > free_slots:
        return NEED_NODES, m, want - free_slots, -1, 0
    if (meta[M_INDEXED] + 2) * TABLE_MAX_LOAD_DEN > table.shape[0] * TABLE_MAX_LOAD_NUM:
        return NEED_TABLE, m, 2, -1, 0  # an insert indexes at most 2 pages (its first and an old sibling)
    parent = i32[PARENT]
    depth = i32[DEPTH]
    nchild = i32[NCHILD]
    hint = i32[HINT]
    lock = i32[LOCK]
    hits = i32[HITS]
    hpos = i32[HPOS]
    tick_arr = i64[TICK]
    block = i64[BLOCK]
    flags = i8[FLAGS]
    # the new first page goes into the table iff it gets a sibling (I3), which needs its parent hashed (I2)
    branch = want > 0 and node >= 0 and nchild[node] > 0
    if branch and (flags[node] & FL_HASHED) == 0:
        return NEED_HASH, m, 0, node, 0
    nsh = NS_BASE + 2 * ns_id
    tick = meta[M_TICK] + 1
    meta[M_TICK] = tick
    if node >= 0:  # lazy ticks: with want > 0 the new pages below node carry the tick
        if want == 0:
            tick_arr[node] = tick
        if want > 0 and hpos[node] >= 0:  # no longer a leaf (with want == 0 its key just goes stale)
            hp_remove(i32, i64, meta, node)
    for k in range(n):
        new_mask[k] = m <= k < m + want
    if want == 0:
        if node < 0:
            return OK, m, 0, -1, 0
        return OK, m, 0, node, i32[GEN, node]
    code = -1 - ns_id
    if node >= 0:
        code = node
        if branch:
            u = hint[node]  # the only unindexed child a node can have is its hint (I3)
            if u >= 0 and (flags[u] & FL_INDEXED) == 0:
                _index(i64, i8, tokens, table, meta, u, i64[HASH, node])
    if meta[M_FREE] < 0:  # no freed slot to reuse: the chain takes fresh consecutive slots
        first, code = _write_fresh_chain(parent, depth, nchild, hint, block, tick_arr, tokens, meta, q, blocks, m,
                                         want, code, tick, nsh)
        want_loop = 0
    else:
        first = -1
        want_loop = want
    for k in range(m, m + want_loop):  # one pass of sequential stores, no hashing
        x = _alloc(meta, hint)
        if k == m:
            first = x
        parent[x] = code
        depth[x] = k
        nchild[x] = 0
        hint[x] = -1
        lock[x] = 0
        hits[x] = 0
        block[x] = blocks[k]
        tick_arr[x] = tick
        flags[x] = 0
        su = np.uint64(k * ps)  # unsigned indices: no wraparound select, the copy vectorizes
        for j in range(np.uint64(ps)):
            tokens[x, j] = q[su + j]
        if code >= 0:
            nchild[code] += 1
            hint[code] = x
        else:
            meta[nsh] = x
        code = x
    if node < 0:
        _index(i64, i8, tokens, table, meta, first, meta[nsh + 1])
    elif branch:
        _index(i64, i8, tokens, table, meta, first, i64[HASH, node])
    meta[M_TOTAL] += want
    hp_push(i32, i64, meta, code)
    return OK, m, want, code, i32[GEN, code]


@numba.njit(cache=NUMBA_CACHE)
def tr_index_path(i32, i64, i8, tokens, meta, node):
    """Hash ``node`` and its unhashed ancestors (top down: each hash is chained from its parent's); returns how
    many were hashed.

    Called when a page that is not hashed gets a second child (NEED_HASH from ``tr_insert``): the parent of a
    hashed page must be hashed (I2). Costs one hash per page, once: the pages stay hashed until freed. None of
    them enters the table (each is its parent's only child, I3).
    """
    flags = i8[FLAGS]
    parent = i32[PARENT]
    j = 0
    x = node
    while x >= 0 and (flags[x] & FL_HASHED) == 0:
        j += 1
        x = parent[x]
    path = np.empty(j, dtype=np.int64)
    x = node
    for i in range(j - 1, -1, -1):
        path[i] = x
        x = parent[x]
    for i in range(j):
        x = path[i]
        p = parent[x]
        seed = i64[HASH, p] if p >= 0 else meta[NS_BASE + 2 * (-1 - p) + 1]
        _hash(i64, i8, tokens, meta, x, seed)
    return j


@numba.njit(cache=NUMBA_CACHE)
def tr_lock(i32, i64, meta, node, gen, delta):
    """Add ``delta`` (+1 or -1) to the lock count of every page on the root..node path."""
    if node < 0 or node >= meta[M_HIGH] or i32[DEPTH, node] < 0 or i32[GEN, node] != gen:
        return STALE_HANDLE
    if delta < 0 and i32[OWN, node] <= 0:  # no lock of a handle ending here: a deeper one's is not this one's
        return NOT_LOCKED
    i32[OWN, node] += delta
    lock = i32[LOCK]
    hpos = i32[HPOS]
    parent = i32[PARENT]
    nchild = i32[NCHILD]
    x = node
    while x >= 0:
        if delta > 0:
            if lock[x] == 0:
                meta[M_PROT] += 1
                if hpos[x] >= 0:
                    hp_remove(i32, i64, meta, x)
            lock[x] += 1
        else:
            lock[x] -= 1
            if lock[x] == 0:
                meta[M_PROT] -= 1
                if nchild[x] == 0:
                    hp_push(i32, i64, meta, x)
        x = parent[x]
    return OK


@numba.njit(inline="always")
def _prefetch_rows(i32, i64, i8, c):
    """Prefetch the fields of pages ``c .. c + 15`` that a chain's free reads or writes: a chain is walked
    downwards through ten rows at once, each a separate stream."""
    for r in (PARENT, DEPTH, NCHILD, HINT, LOCK, GEN, HITS):
        prefetch(i32[r], c)
    for r in (BLOCK, TICK):
        prefetch(i64[r], c)
        prefetch(i64[r], c + 8)
    prefetch(i8[FLAGS], c)


@numba.njit(inline="always")
def _chain_top(i32, i64, i8, meta, x, most):
    """The top slot of the chain that leaves with leaf ``x`` (just popped or known to come first) in one step:
    ``x`` and then, while fewer than ``most`` pages are taken, its parent when it is the slot ``x - 1`` (an insert
    allocates a chain consecutively), unlocked, has no other child, and comes before every node in the heap keyed
    by the max tick of the pages below it and its own (the key it inherits once they are freed). One page at a
    time, each of them would be freed right after its child: LRU frees it next without touching the heap
    (``tr_evict``). The heap does not change while the chain is measured.

    Blocks of ``_CB`` pages are checked a row at a time (each check vectorizes, no branch a page) while the rows
    ``_free_chain`` then touches are prefetched ahead; a block that holds the chain's end, or a tick not below
    every heap key, is walked page by page for the exact end (a tie with the root's key is decided by node id)."""
    parent = i32[PARENT]
    nchild = i32[NCHILD]
    lock = i32[LOCK]
    tick = i64[TICK]
    m = tick[x]
    lo = max(x - most + 1, 0)
    floor = hp_key_floor(i32, i64, meta)
    t = x
    while t - _CB >= lo:
        b = t - _CB
        _prefetch_rows(i32, i64, i8, b - _PF_ROWS)
        bu = np.uint64(b)
        b32 = np.int32(b)
        bad = np.int32(0)
        for j in range(np.uint64(_CB)):  # page b + j is the parent of slot b + j + 1
            bad |= parent[bu + j + np.uint64(1)] ^ (b32 + np.int32(j))
        for j in range(np.uint64(_CB)):
            bad |= nchild[bu + j] ^ np.int32(1)
        for j in range(np.uint64(_CB)):
            bad |= lock[bu + j]
        bm = m
        for j in range(np.uint64(_CB)):
            v = tick[bu + j]
            bm = v if v > bm else bm
        if bad != 0 or bm >= floor:
            break
        m = bm
        t = b
    while t > lo:
        c = t - 1
        if parent[t] != c or nchild[c] != 1 or lock[c] != 0:
            break
        mc = max(m, tick[c])
        if not hp_precedes_key(i32, i64, meta, mc, c):
            break
        m = mc
        t = c
    return t


@numba.njit(cache=NUMBA_CACHE, _nrt=False)  # type: ignore[call-overload]  # _nrt: numba's private flag
def tr_evict(blob, out):
    """Free up to ``out.shape[0]`` pages, least-recently used unlocked leaf first; their block ids go to ``out`` in
    eviction order. Returns how many.

    A leaf popped from the heap goes with the chain above it in one step: the ancestors in consecutive slots that,
    one page at a time, would each be the next page freed (``_chain_top``: an unlocked only-child parent that,
    keyed by the tick it inherits, precedes every node in the heap), freed by ``_free_chain`` a row at a time.
    The chain's parent is then the next page too if it is left an unlocked leaf that precedes every node in the
    heap, else it joins the heap. So the order, the block ids, the free list and every live page's fields are
    those of freeing one page at a time, and a chain costs one heap pop and a few stores a page.

    Compiled without numba's reference counting (``_nrt=False``; the caller allocates ``out``): a call costs one
    array unboxing for the state (``_state.blob_views``) and one for ``out``.
    """
    i32, i64, i8, tokens, table, meta = blob_views(blob)
    block = i64[BLOCK]
    n = out.shape[0]
    k = 0
    x = -1  # the next page to free when known without the heap
    while k < n:
        if x < 0:
            x = hp_pop(i32, i64, meta)
            if x < 0:
                break
        top = _chain_top(i32, i64, i8, meta, x, n - k)
        ku = np.uint64(k)
        xu = np.uint64(x)
        for j in range(np.uint64(x - top + 1)):
            out[ku + j] = block[xu - j]
        k += x - top + 1
        p = i32[PARENT, top]
        _free_chain(i32, i64, i8, table, meta, top, x)
        x = -1
        if p >= 0 and i32[NCHILD, p] == 0 and i32[LOCK, p] == 0:
            if hp_precedes(i32, i64, meta, p):
                x = p
            else:
                hp_push(i32, i64, meta, p)
    if x >= 0:  # enough freed: the parent waits in the heap
        hp_push(i32, i64, meta, x)
    return k


@numba.njit(cache=NUMBA_CACHE)
def tr_rebuild_table(i32, i64, i8, meta, table):
    """Insert every indexed live node into the empty ``table`` (after growing it)."""
    for x in range(meta[M_HIGH]):
        if i32[DEPTH, x] >= 0 and (i8[FLAGS, x] & FL_INDEXED):
            tb_insert(table, i64[HASH, x], x)
