"""PageTrie: the Python face of the host index over its jitted core (``trie_jit.py``): validation, growth,
namespaces, errors.

Semantics (pages are ``page_size`` consecutive tokens; a trailing partial page is ignored everywhere):

* ``match(tokens, ns)`` -> the longest cached prefix (whole pages) and its block ids. By default it
  touches the path (new tick on every matched page, hit count + 1); ``touch=False`` only looks.
* ``insert(tokens, block_ids, ns)`` offers ``block_ids[k]`` for page k. Pages already held keep their
  block; ``new_mask[k]`` says which offered blocks the index now owns -- the caller frees the others.
  Insert never evicts (the caller evicts first to make room in its pool). The whole path gets a new tick.
* ``lock(h)`` / ``unlock(h)`` with a MatchResult or InsertResult ``h``: +-1 on every page of the
  root..deepest path. A stale handle (its node was freed since) raises.
* ``evict(n)`` frees up to n pages, always the unlocked leaf with the oldest tick first (LRU among
  unlocked leaves; a parent becomes a candidate when its last child goes); returns their block ids in
  eviction order. O(log n) per heap pop; a chain of pages that leave one after the other goes in one
  step (``trie_jit.tr_evict``). Which pages go first is the eviction policy's choice
  (:mod:`kvtier.index.eviction`); LRU is the jitted heap's order.
* Pages of different namespaces are never shared.
"""
from __future__ import annotations

import time
from array import array
from typing import NamedTuple

import numba
import numpy as np

from kvtier._checks import check_count

from ._state import (DEPTH, FREE_PARENT, GEN, M_HEAP, M_HIGH, M_INDEXED, M_PROT, M_TOTAL, M_WIDE, NS_BASE, PARENT,
                     TrieState, grow_namespaces, grow_nodes, new_state, state_nbytes, table_slots_for, with_table)
from ._tokens import RAW_MAX, as_token_array
from .page_hash import DEFAULT_NAMESPACE, FULL_HASH_MASK, Namespace, page_hashes
from .trie_jit import (BAD_BLOCK_COUNT, BAD_BLOCKS, BAD_TOKENS, F_TOUCH, NEED_HASH, NEED_NODES, NEED_TABLE,
                       NOT_LOCKED, OK, STALE_HANDLE, tr_evict, tr_index_path, tr_insert, tr_lock, tr_match,
                       tr_rebuild_table)

__all__ = ["PageTrie", "MatchResult", "InsertResult"]


class MatchResult(NamedTuple):
    """Longest cached prefix: ``num_pages`` pages held in ``block_ids``; (node, gen) is the lock handle."""

    num_pages: int
    block_ids: np.ndarray
    node: int
    gen: int


class InsertResult(NamedTuple):
    """``new_mask[k]``: page k's offered block is now owned by the index (else the caller frees it)."""

    new_mask: np.ndarray
    num_held: int
    num_new: int
    node: int
    gen: int


class _FastCall:
    """Call a jitted function through the entry point compiled for the argument types.

    numba's dispatcher types every argument on every call (bench/results/index_notes.md); the
    types here only depend on a small key (token dtype, writability), so the entry point is looked up
    once per key. ``Dispatcher.compile`` loads from the on-disk cache like a normal call.
    """

    def __init__(self, dispatcher) -> None:
        self._dispatcher = dispatcher
        self._by_key: dict = {}

    def __call__(self, key, *args):
        fn = self._by_key.get(key)
        if fn is None:
            fn = self._dispatcher.compile(tuple(numba.typeof(a) for a in args))
            self._by_key[key] = fn
        return fn(*args)

    def get(self, key):
        """The compiled entry point for ``key`` or None (hot paths call it without ``__call__``)."""
        return self._by_key.get(key)


_match = _FastCall(tr_match)
_match_get = _match.get
_insert = _FastCall(tr_insert)
_insert_get = _insert.get
_lock = _FastCall(tr_lock)
_evict = _FastCall(tr_evict)
_evict_get = _evict.get

_STATUS_MSG = {
    BAD_TOKENS: "token ids must be in [0, 2**63)",
    BAD_BLOCKS: "block ids must be >= 0",
    STALE_HANDLE: "stale handle: its page was evicted since the match/insert that returned it",
    NOT_LOCKED: "unlock of a path that is not locked",
}


_EVICT_OUT_MAX = 1 << 16  # evict(n) allocates n block ids up to this, else no more than the pages held
_tuple_new = tuple.__new__  # builds a NamedTuple from a tuple without a Python frame
_empty = np.empty
_zeros = np.zeros
_I64 = np.dtype(np.int64)
_BOOL = np.dtype(bool)
# _FastCall keys: "aq" for an array('q') (numba reads it through the buffer protocol, no numpy view),
# else the token dtype's char: token arrays reach the jitted code C-contiguous and writable
# (as_token_array), block ids as C-contiguous writable int64, so this key fixes the argument types.


def _token_key(tokens):
    """(a caller's tokens as the jitted code takes them, _FastCall key). uint32 is the trie's code type, so a
    caller's uint32 array is widened."""
    if type(tokens) is array and tokens.typecode == "q":  # SGLang's RadixKey: read in place
        return tokens, "aq"
    q = as_token_array(tokens)
    if q.dtype == np.uint32:
        q = q.astype(np.int64)
    return q, q.dtype.char


# Wide ids: token ids >= 2**31 (SGLang's multimodal pad values are MM_PAD_SHIFT_VALUE plus a 62-bit hash) reach
# the 32-bit trie as codes in [2**31, 2**32): each distinct wide id inserted gets the next code, so codes stand
# for ids one to one and every hit is still verified against the real ids. A lookup of a wide id never inserted
# uses _UNSEEN, which no stored token equals. Token arrays with no wide id (text) go to the jitted code as they
# are; one with a wide id is refused there (BAD_TOKENS) and retried coded. Once the codes handed out reach twice
# those in live pages (at least RECLAIM_CODES_AT), the ids of codes no page holds are forgotten and their codes
# handed out again: a server seeing ever new images keeps as many codes as its pages hold.
_FIRST_CODE = RAW_MAX + 1
_UNSEEN = (1 << 32) - 1


class PageTrie:
    """Host index: which prefix pages are held and in which host blocks (see module docstring).

    Args:
        page_size: tokens per page (kvtier's host block).
        initial_nodes: pages the arrays hold before they first grow (a tier passes its pool's block count: the
            index then never grows).
    """

    # Page hashes keep all 64 bits; a test subclass narrows the mask to make collisions common (a collision
    # costs time, never a wrong page).
    HASH_MASK: int = FULL_HASH_MASK
    RECLAIM_CODES_AT: int = 1 << 16  # wide ids remembered before the first reclaim (a test lowers it)

    def __init__(self, page_size: int, initial_nodes: int = 4096) -> None:
        self._page_size = check_count("page_size", page_size)
        self._initial = max(1, check_count("initial_nodes", initial_nodes, 0))
        self._mask = np.uint64(self.HASH_MASK)
        self._gen_floor = 0  # the generation node slots start at: past every handle a reset made stale
        self._set_state(new_state(self._page_size, self._initial, mask=int(self._mask)))
        self._forget_namespaces()
        self._forget_codes()

    def _set_state(self, st: TrieState) -> None:
        self._st = st
        self._blob = st.blob  # the state argument of the hot entry points (match, insert, evict)
        self._meta = st.meta

    # ---- namespaces -------------------------------------------------------------------------------
    # A namespace gets an id (its meta slots: first-page hint, seed) when a page is inserted under it; a lookup
    # of an unregistered namespace registers nothing. Ids of namespaces that hold no page are reclaimed when
    # every slot is taken (one pass over the nodes, then at least as many registrations before the next).
    def _forget_codes(self) -> None:
        self._codes: dict[int, int] = {}  # wide id -> its code
        self._next_code = _FIRST_CODE  # codes below it were handed out
        self._free_codes = np.empty(0, dtype=np.uint32)  # reclaimed codes, handed out again first
        self._reclaim_at = self.RECLAIM_CODES_AT

    def _reclaim_codes(self) -> None:
        """Forget the wide ids no live page holds; their codes go to the free list."""
        st = self._st
        high = int(st.meta[M_HIGH])
        toks = st.tokens[:high][st.i32[DEPTH, :high] >= 0]
        used = np.unique(toks[toks >= _FIRST_CODE])
        live = set(used.tolist())
        self._codes = {v: c for v, c in self._codes.items() if c in live}
        self._free_codes = np.setdiff1d(np.arange(_FIRST_CODE, self._next_code, dtype=np.uint32), used)
        self._reclaim_at = max(self.RECLAIM_CODES_AT, 2 * len(self._codes))

    def _new_code(self) -> int:
        if self._free_codes.size:
            c, self._free_codes = int(self._free_codes[-1]), self._free_codes[:-1]
            return c
        if self._next_code >= _UNSEEN:
            raise ValueError(f"the index holds {_UNSEEN - _FIRST_CODE} distinct token ids >= 2**31, its most")
        self._next_code += 1
        return self._next_code - 1

    def _coded(self, q, register: bool) -> np.ndarray:
        """``q`` as uint32 codes: ids below 2**31 as they are, wide ids by their code (new ones get one when
        ``register``, else ``_UNSEEN``)."""
        a = np.frombuffer(q, dtype=np.int64) if type(q) is array else np.asarray(q)
        if a.size and int(a.min()) < 0:
            raise ValueError(f"token ids must be in [0, 2**63), got {int(a.min())}")
        wide = a > RAW_MAX
        out = np.where(wide, 0, a).astype(np.uint32)
        values, where = np.unique(a[wide], return_inverse=True)
        if register and len(self._codes) + values.size > self._reclaim_at:  # before this call's new codes
            self._reclaim_codes()
        codes = np.empty(values.size, dtype=np.uint32)
        for k, v in enumerate(values.tolist()):
            c = self._codes.get(v)
            if c is None:
                if not register:
                    c = _UNSEEN
                else:
                    c = self._codes[v] = self._new_code()
                    self._st.meta[M_WIDE] = 1  # from now on a caller's id can equal a stored code
            codes[k] = c
        out[wide] = codes[where]
        return out

    @property
    def num_wide_ids(self) -> int:
        """Distinct token ids >= 2**31 the index has codes for."""
        return len(self._codes)

    def _forget_namespaces(self) -> None:
        self._ns_ids: dict[Namespace, int] = {DEFAULT_NAMESPACE: 0}
        self._ns_free: list[int] = []  # reclaimed ids
        self._ns_next = 1  # ids below it were handed out
        self._st.meta[NS_BASE] = -1
        self._st.meta[NS_BASE + 1] = np.int64(np.uint64(DEFAULT_NAMESPACE.seed).view(np.int64))

    def _ns_lookup(self, ns: Namespace | None) -> int:
        """The id of ``ns``; -1 when it holds nothing (never registered, or reclaimed)."""
        if ns is None:
            return 0
        i = self._ns_ids.get(ns)
        if i is None:
            if not isinstance(ns, Namespace):
                raise TypeError(f"ns must be a kvtier.index.Namespace or None, got {type(ns).__name__}")
            return -1
        return i

    def _ns(self, ns: Namespace) -> int:
        """The id of ``ns``, registered now if needed (O(1) amortized)."""
        i = self._ns_lookup(ns)
        if i >= 0:
            return i
        if not self._ns_free and self._ns_next >= self._st.ns_slots:
            self._reclaim_namespaces()
        if self._ns_free:
            i = self._ns_free.pop()
        else:
            i = self._ns_next
            self._ns_next += 1
            if i >= self._st.ns_slots:
                self._set_state(grow_namespaces(self._st, 2 * self._st.ns_slots))
        self._ns_ids[ns] = i
        self._st.meta[NS_BASE + 2 * i] = -1
        self._st.meta[NS_BASE + 2 * i + 1] = np.int64(np.uint64(ns.seed).view(np.int64))
        return i

    def _reclaim_namespaces(self) -> None:
        """Free the ids of namespaces without a live page; grow the namespace table when that frees under a
        quarter of it (so the next pass comes after at least that many registrations)."""
        parent = self._st.i32[PARENT, :int(self._st.meta[M_HIGH])]
        roots = parent[(parent < 0) & (parent != FREE_PARENT)]
        live = set((-1 - roots).tolist())
        for ns, i in list(self._ns_ids.items()):
            if i and i not in live:
                del self._ns_ids[ns]
                self._ns_free.append(i)
        if len(self._ns_free) < self._st.ns_slots // 4:
            self._set_state(grow_namespaces(self._st, 2 * self._st.ns_slots))

    @property
    def num_namespaces(self) -> int:
        """Registered namespaces (the default one included)."""
        return len(self._ns_ids)

    @staticmethod
    def _raise(status: int) -> None:
        raise ValueError(_STATUS_MSG.get(status, f"index error (status {status})"))

    # ---- operations -------------------------------------------------------------------------------
    def match(self, tokens, ns: Namespace | None = None, *, touch: bool = True) -> MatchResult:
        """Longest cached prefix of ``tokens`` in ``ns`` (the walk of ``trie_jit.py``: hint-guided descent,
        hashing only where a hint misses; exact)."""
        if type(tokens) is array and tokens.typecode == "q":  # SGLang's RadixKey: read in place
            q, key = tokens, "aq"
        else:
            q, key = _token_key(tokens)
        i = 0 if ns is None else self._ns_lookup(ns)
        if i < 0:  # nothing held in that namespace (and a lookup registers nothing)
            return _tuple_new(MatchResult, (0, _empty(0, _I64), -1, 0))
        n = len(q) // self._page_size
        out = _empty(n, _I64)
        flags = F_TOUCH if touch else 0
        fn = _match_get(key)
        if fn is not None:
            m, node, gen = fn(self._blob, q, i, flags, out)
        else:
            m, node, gen = _match(key, self._blob, q, i, flags, out)
        if m == BAD_TOKENS:  # a wide id: match the codes
            m, node, gen = _match("I", self._blob, self._coded(q, register=False), i, flags, out)
        if m == n:
            return _tuple_new(MatchResult, (m, out, node, gen))
        if m < 0:
            self._raise(m)
        return _tuple_new(MatchResult, (m, out[:m], node, gen))

    def insert(self, tokens, block_ids, ns: Namespace | None = None) -> InsertResult:
        """Offer ``block_ids[k]`` for each full page k of ``tokens``; see the module docstring."""
        q: array | np.ndarray
        if type(tokens) is array and tokens.typecode == "q":
            q, key = tokens, "aq"
        else:
            q, key = _token_key(tokens)
        b = block_ids
        if (type(b) is not np.ndarray or b.dtype is not _I64 or b.ndim != 1 or not b.flags.c_contiguous
                or not b.flags.writeable):  # numba compiles read-only arrays as another type
            b = self._block_array(b, len(q) // self._page_size)
        i = 0 if ns is None else self._ns(ns)
        st = self._st
        new_mask = _empty(b.shape[0], _BOOL)
        fn = _insert_get(key)
        while True:
            if fn is not None:
                status, held, new, node, gen = fn(st.blob, q, i, b, new_mask)
            else:
                status, held, new, node, gen = _insert(key, st.blob, q, i, b, new_mask)
            if status == OK:
                break
            if status == NEED_HASH:
                tr_index_path(st.i32, st.i64, st.i8, st.tokens, st.meta, node)
            elif status == NEED_NODES:
                self._grow_nodes(new)
            elif status == NEED_TABLE:
                self._grow_table(new)
            elif status == BAD_TOKENS and key != "I":  # a wide id: insert the codes
                q, key = self._coded(q, register=True), "I"
                fn = _insert_get(key)
            elif status == BAD_BLOCK_COUNT:
                n = len(q) // self._page_size
                raise ValueError(f"got {b.shape[0]} block ids for {n} full pages "
                                 f"({len(q)} tokens, page_size {self._page_size})")
            else:
                self._raise(status)
            st = self._st
        return _tuple_new(InsertResult, (new_mask, held, new, node, gen))

    @staticmethod
    def _block_array(b, n: int) -> np.ndarray:
        """Block ids as a C-contiguous int64 array (the slow path of ``insert``)."""
        b = b if isinstance(b, np.ndarray) else np.asarray(b)
        if b.size == 0:
            return np.empty(0, dtype=np.int64)
        if b.ndim != 1:
            raise ValueError(f"block_ids must be 1-D, got shape {b.shape}")
        if b.dtype.kind not in "iu":
            raise TypeError(f"block_ids must be integers, got dtype {b.dtype}")
        if b.dtype == np.uint64 and b.size and int(b.max()) >= 1 << 63:
            raise ValueError("block ids must be < 2**63")
        return np.array(b, dtype=np.int64)

    def lock(self, handle: MatchResult | InsertResult) -> None:
        """Protect every page on the handle's root..deepest path from eviction."""
        self._lock(handle, 1)

    def unlock(self, handle: MatchResult | InsertResult) -> None:
        """Undo one ``lock`` of the same handle."""
        self._lock(handle, -1)

    def _lock(self, handle, delta: int) -> None:
        node, gen = int(handle.node), int(handle.gen)
        if node < 0:
            return  # empty path: nothing to (un)lock
        st = self._st
        status = _lock(0, st.i32, st.i64, st.meta, node, gen, delta)
        if status != OK:
            self._raise(status)

    def evict(self, n: int) -> np.ndarray:
        """Free up to ``n`` pages (LRU unlocked leaves first); returns their block ids in order."""
        if type(n) is not int or n < 0:
            n = check_count("n", n, 0)
        if n > _EVICT_OUT_MAX:  # "everything": no bigger buffer than the pages held
            n = min(n, self._meta.item(M_TOTAL))
        out = _empty(n, _I64)
        fn = _evict_get(0)
        k = fn(self._blob, out) if fn is not None else _evict(0, self._blob, out)
        return out if k == n else out[:k]

    def reset(self) -> None:
        """Drop every page (locks included) and shrink back to the initial size. Handles from before are stale:
        node slots start at a generation past every one they name."""
        self._gen_floor = max(self._gen_floor, int(self._st.i32[GEN].max())) + 1
        st = new_state(self._page_size, self._initial, mask=int(self._mask))
        st.i32[GEN] = self._gen_floor
        self._set_state(st)
        self._forget_namespaces()
        self._forget_codes()

    @classmethod
    def compile(cls, page_size: int) -> float:
        """Compile (or load from numba's disk cache) every entry point an engine calls, for numpy int64 and
        ``array('q')`` tokens and for wide ids, on a throwaway trie; returns the seconds it took. Engines call it
        at start-up so that the first request does not pay the compile (tens of seconds without the cache)."""
        t0 = time.perf_counter()
        trie = cls(page_size)
        n = 3 * page_size
        for toks in (np.arange(n, dtype=np.int64), array("q", range(n)),
                     np.array([1 << 40] * page_size + list(range(2 * page_size)), dtype=np.int64)):
            r = trie.insert(toks, np.arange(3))
            trie.lock(r)
            trie.unlock(r)
            for touch in (True, False):
                trie.match(toks, touch=touch)
            page_hashes(toks, page_size)  # the lower tiers' keys
        trie.insert(np.arange(n, dtype=np.int64), np.arange(3), Namespace(cache_salt="warm-up"))
        trie.evict(3)
        return time.perf_counter() - t0

    # ---- growth -----------------------------------------------------------------------------------
    def _grow_nodes(self, deficit: int) -> None:
        cur = self._st.i32.shape[1]
        want = max(2 * cur, cur + int(deficit))
        st = grow_nodes(self._st, want)
        st.i32[GEN, cur:] = self._gen_floor
        if st.table.shape[0] != self._st.table.shape[0]:
            tr_rebuild_table(st.i32, st.i64, st.i8, st.meta, st.table)
        self._set_state(st)

    def _grow_table(self, extra: int) -> None:
        slots = max(table_slots_for(int(self._st.meta[M_INDEXED]) + int(extra)), 2 * self._st.table.shape[0])
        st = with_table(self._st, slots)
        tr_rebuild_table(st.i32, st.i64, st.i8, st.meta, st.table)
        self._set_state(st)

    # ---- counts -----------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def total_pages(self) -> int:
        return int(self._st.meta[M_TOTAL])

    @property
    def protected_pages(self) -> int:
        """Pages with a lock count > 0."""
        return int(self._st.meta[M_PROT])

    @property
    def evictable_pages(self) -> int:
        """Unlocked pages (all can be evicted, leaves first)."""
        return self.total_pages - self.protected_pages

    @property
    def evictable_leaves(self) -> int:
        """Unlocked leaves: the pages ``evict`` could take right now."""
        return int(self._st.meta[M_HEAP])

    @property
    def nbytes(self) -> int:
        """Bytes held by the index arrays (tokens included)."""
        return state_nbytes(self._st)

    def __len__(self) -> int:
        return self.total_pages

    def __repr__(self) -> str:
        return (f"PageTrie(page_size={self._page_size}, pages={self.total_pages}, protected={self.protected_pages}, "
                f"nbytes={self.nbytes})")
