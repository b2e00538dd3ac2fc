"""Index operations the product does not use, kept for the tests: a second exact matcher and removal by sequence.

* ``match_gallop``: gallop + binary search over table probes, then the path verified. It hashes the query's pages
  lazily, probes page counts 1, 2, 4, 8 ... then binary-searches. A probe of page k accepts a node whose hash is
  h_k, depth k, tokens page k and whose parent's hash is h_{k-1} (the namespace's root code for k == 0). The answer
  is verified once by walking from the deepest node to the root comparing every page's tokens and depth; if
  anything disagrees (a hash collision made the predicate lie) the walk recomputes it from the root. Lazy indexing
  puts only some pages in the table, so the verified answer is a lower bound the walk continues from. It lost to
  the walk (docs/DESIGN.md, "Host index"); the state machines compare the two on every step.
* ``remove``: free the held pages of one sequence from the deepest up while they are unlocked leaves (it frees
  pages in an order eviction never does, which exercises ``_free_chain``'s hint, table and tick hand-off).
* ``evict_per_page``: LRU eviction one page at a time (a heap pop, or the parent known to come next, then a free
  of that page alone), the algorithm ``tr_evict``'s chain step must agree with: same block ids in the same order,
  same free list, same live pages, table and heap.

:class:`ExtrasTrie` is a :class:`~kvtier.index.PageTrie` with all three; ``narrow_trie(bits)`` one whose page hashes
keep ``bits`` bits, so collisions are everywhere.
"""

from __future__ import annotations

import numba
import numpy as np

from kvtier.index import MatchResult, Namespace, PageTrie
from kvtier.index._config import NUMBA_CACHE
from kvtier.index._heap import hp_pop, hp_precedes, hp_push, hp_remove
from kvtier.index._state import (BLOCK, DEPTH, FL_INDEXED, FLAGS, FREE_PARENT, GEN, HASH, HINT, HITS, HPOS, LOCK,
                                 M_FREE, M_INDEXED, M_MASK, M_NFREE, M_TOTAL, M_WIDE, NCHILD, NS_BASE, PARENT, TICK)
from kvtier.index._table import EMPTY, tb_delete, tb_home, tb_node, tb_tag
from kvtier.index._tokens import in_range_from
from kvtier.index.page_trie import _token_key
from kvtier.index.trie_jit import BAD_TOKENS, F_TOUCH, OK, _free_chain, _match_end, _page_diff, _walk
from kvtier.index.xxh64 import xxh64_token_range


@numba.njit(inline="always")
def _probe(table, hcol, parent, depth, tokens, q, ps, k, hb, root_code):
    """Gallop predicate for page k: a node with hash hb[k], depth k, page-k tokens, parent hash hb[k-1]."""
    h = hb[k]
    hi = np.int64(h)
    tag = tb_tag(h)
    tmask = table.shape[0] - 1
    i = tb_home(tag, tmask)
    while True:
        e = table[i]
        if e == EMPTY:
            return -1
        x = tb_node(e)
        if (np.uint64(e) >> np.uint64(32)) == tag and hcol[x] == hi and depth[x] == k \
                and _page_diff(tokens, x, q, k * ps, ps) == 0:
            p = parent[x]
            if k == 0:
                if p == root_code:
                    return x
            elif p >= 0 and hcol[p] == np.int64(hb[k - 1]):
                return x
        i = (i + 1) & tmask


@numba.njit(cache=NUMBA_CACHE)
def _gallop(i32, i64, i8, tokens, table, meta, q, ps, n, ns_id, blocks_out):
    """(pages, deepest node, whether the verification failed and the walk redid the search)."""
    parent = i32[PARENT]
    depth = i32[DEPTH]
    hcol = i64[HASH]
    block = i64[BLOCK]
    mask = np.uint64(meta[M_MASK])
    root_code = -1 - ns_id
    hb = np.empty(n, dtype=np.uint64)
    done = 0  # pages hashed so far
    h = np.uint64(meta[NS_BASE + 2 * ns_id + 1])
    lo, lo_node, hi = 0, -1, n + 1  # lo pages known cached, hi pages known not (n + 1: none known)
    c = 1
    while c <= n:
        while done < c:
            h = xxh64_token_range(q, done * ps, (done + 1) * ps, h) & mask
            hb[done] = h
            done += 1
        x = _probe(table, hcol, parent, depth, tokens, q, ps, c - 1, hb, root_code)
        if x < 0:
            hi = c
            break
        lo, lo_node = c, x
        if c == n:
            break
        c = min(2 * c, n)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        x = _probe(table, hcol, parent, depth, tokens, q, ps, mid - 1, hb, root_code)  # mid-1 < done
        if x >= 0:
            lo, lo_node = mid, x
        else:
            hi = mid
    x = lo_node  # verify the whole path once: every page's tokens and depth, and the namespace root
    ok = True
    for j in range(lo - 1, -1, -1):
        if x < 0 or depth[x] != j or _page_diff(tokens, x, q, j * ps, ps) != 0:
            ok = False
            break
        blocks_out[j] = block[x]
        x = parent[x]
    if not ok or (lo > 0 and x != root_code):
        m, node = _walk(i32, i64, i8, tokens, table, meta, q, ps, n, ns_id, blocks_out, 0, -1)
        return m, node, True
    m, node = _walk(i32, i64, i8, tokens, table, meta, q, ps, n, ns_id, blocks_out, lo, lo_node)
    return m, node, False


@numba.njit(cache=NUMBA_CACHE)
def _match_gallop(i32, i64, i8, tokens, table, meta, q, ns_id, flags, blocks_out):
    ps = tokens.shape[1]
    m, node, fell_back = _gallop(i32, i64, i8, tokens, table, meta, q, ps, blocks_out.shape[0], ns_id, blocks_out)
    m, node, gen = _match_end(i32, i64, q, meta, ps, m, node, flags)
    return m, node, gen, fell_back


@numba.njit(cache=NUMBA_CACHE)
def _remove(i32, i64, i8, tokens, table, meta, q, ns_id):
    """Drop the held pages of q from the deepest up while they are unlocked leaves: (status, block ids)."""
    ps = tokens.shape[1]
    n = len(q) // ps
    out = np.empty(n, dtype=np.int64)
    m, x = _walk(i32, i64, i8, tokens, table, meta, q, ps, n, ns_id, out, 0, -1)
    if not in_range_from(q, m * ps * (1 - meta[M_WIDE])):
        return BAD_TOKENS, out[:0]
    hpos = i32[HPOS]
    k = 0
    while x >= 0 and i32[NCHILD, x] == 0 and i32[LOCK, x] == 0:
        out[k] = i64[BLOCK, x]
        k += 1
        if hpos[x] >= 0:
            hp_remove(i32, i64, meta, x)
        p = i32[PARENT, x]
        _free_chain(i32, i64, i8, table, meta, x, x)
        x = p
    return OK, out[:k]


_HITS_MAX = 2147483647
_FREE_PARENT = FREE_PARENT


@numba.njit(inline="always")
def _free_page(i32, i64, i8, table, meta, x):
    """Free leaf x alone: unlink it from its parent (which inherits max(tick) and the saturating sum of hits) and
    the table, and push its slot on the free list."""
    p = i32[PARENT, x]
    if p >= 0:
        if i64[TICK, x] > i64[TICK, p]:
            i64[TICK, p] = i64[TICK, x]
        i32[HITS, p] = min(np.int64(i32[HITS, p]) + np.int64(i32[HITS, x]), _HITS_MAX)
        i32[NCHILD, p] -= 1
        if i32[HINT, p] == x:
            i32[HINT, p] = -1
    else:
        nsh = NS_BASE + 2 * (-1 - p)
        if meta[nsh] == x:
            meta[nsh] = -1
    if i8[FLAGS, x] & FL_INDEXED:
        tb_delete(table, i64[HASH, x], x)
        meta[M_INDEXED] -= 1
    i8[FLAGS, x] = 0
    i32[PARENT, x] = _FREE_PARENT
    i32[DEPTH, x] = -1
    i32[GEN, x] += 1
    i32[HINT, x] = meta[M_FREE]
    meta[M_FREE] = x
    meta[M_NFREE] += 1
    meta[M_TOTAL] -= 1


@numba.njit(cache=NUMBA_CACHE)
def _evict_per_page(i32, i64, i8, table, meta, n):
    """Up to n pages, LRU unlocked leaf first, one page at a time: their block ids in order."""
    out = np.empty(max(0, min(n, meta[M_TOTAL])), dtype=np.int64)
    k = 0
    x = -1  # the next page to free when known without the heap
    while k < out.shape[0]:
        if x < 0:
            x = hp_pop(i32, i64, meta)
            if x < 0:
                break
        out[k] = i64[BLOCK, x]
        k += 1
        p = i32[PARENT, x]
        _free_page(i32, i64, i8, table, meta, x)
        x = -1
        if p >= 0 and i32[NCHILD, p] == 0 and i32[LOCK, p] == 0:
            if hp_precedes(i32, i64, meta, p):
                x = p
            else:
                hp_push(i32, i64, meta, p)
    if x >= 0:
        hp_push(i32, i64, meta, x)
    return out[:k]


class ExtrasTrie(PageTrie):
    """A PageTrie with :meth:`match_gallop` and :meth:`remove` (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.collision_fallbacks = 0  # gallop searches whose verification failed and were redone by the walk

    def _arrays(self) -> tuple:
        st = self._st
        return st.i32, st.i64, st.i8, st.tokens, st.table, st.meta

    def match_gallop(self, tokens, ns: Namespace | None = None, *, touch: bool = True) -> MatchResult:
        """:meth:`match`, by gallop + binary search (exact: verified, the walk redoes a failed search)."""
        q, _ = _token_key(tokens)
        i = self._ns_lookup(ns)
        if i < 0:
            return MatchResult(0, np.empty(0, np.int64), -1, 0)
        out = np.empty(len(q) // self.page_size, np.int64)
        flags = F_TOUCH if touch else 0
        m, node, gen, fell_back = _match_gallop(*self._arrays(), q, i, flags, out)
        if m == BAD_TOKENS:  # a wide id: match the codes
            m, node, gen, fell_back = _match_gallop(*self._arrays(), self._coded(q, register=False), i, flags, out)
        if m < 0:
            self._raise(m)
        self.collision_fallbacks += int(fell_back)
        return MatchResult(m, out[:m], node, gen)

    def remove(self, tokens, ns: Namespace | None = None) -> np.ndarray:
        """Free the held pages of ``tokens`` from the deepest up while unlocked leaves; their block ids."""
        q, _ = _token_key(tokens)
        i = self._ns_lookup(ns)
        if i < 0:
            return np.empty(0, np.int64)
        status, blocks = _remove(*self._arrays(), q, i)
        if status == BAD_TOKENS:  # a wide id: remove by the codes
            status, blocks = _remove(*self._arrays(), self._coded(q, register=False), i)
        if status != OK:
            self._raise(status)
        return blocks

    def evict_per_page(self, n: int) -> np.ndarray:
        """:meth:`evict` one page at a time (see the module docstring)."""
        return _evict_per_page(self._st.i32, self._st.i64, self._st.i8, self._st.table, self._st.meta, int(n))


def narrow_trie(bits: int) -> type[ExtrasTrie]:
    """An ExtrasTrie class whose page hashes keep ``bits`` bits (64: the product's)."""
    if bits == 64:
        return ExtrasTrie
    return type(f"Trie{bits}Bits", (ExtrasTrie,), {"HASH_MASK": (1 << bits) - 1})
