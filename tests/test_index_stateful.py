"""Stateful test of PageTrie against a plain-Python model (dict of token-tuple prefixes).

Every rule applies one operation to the trie and to the model and compares the answers; the
invariants (checked after every step) compare the whole trie with the model: the set of held
(namespace, prefix) pages, their blocks and lock counts, the parent/child/depth links, the stored
chained hashes and the lazily indexed table, the counters, the eviction heap, and the longest cached prefix of
every sequence seen (by the trie's walk and by the gallop kept in ``tests/index_extras.py``, without touching). Two
machines: full hashes and 3-bit hashes (collisions everywhere). CI runs >= 10k steps (120 examples x 100 steps for
the first).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.index import Namespace, PageTrie
from kvtier.index._state import (BLOCK, DEPTH, FL_HASHED, FL_INDEXED, HINT, HPOS, LOCK, M_HEAP, M_INDEXED, NCHILD,
                                 PARENT, TICK)
from tests.index_extras import ExtrasTrie, narrow_trie

PAGE = 2
# more namespaces than the trie's first 4 slots: registration, reclaim of empty ones and growth all run
NAMESPACES = [None, Namespace(extra_key="a"), Namespace(lora_id=1), Namespace(extra_key="b"), Namespace(cache_salt="s"),
              Namespace(extra_key="a", lora_id=2), Namespace(lora_id="x")]
DEFAULT = Namespace()

# mostly small ids (prefixes are shared), sometimes wide ones: the smallest wide id, one whose low 32 bits are a
# small id's, the largest (the trie holds wide ids as codes: page_trie.py)
tokens_st = st.lists(st.one_of(st.integers(0, 3), st.sampled_from([2**31, 2**32 + 1, 2**63 - 1])), max_size=12)
ns_st = st.sampled_from(NAMESPACES)


@dataclass
class Page:
    block: int
    tick: int
    uid: int
    lock: int = 0
    nchild: int = 0


@dataclass
class Model:
    """Reference: pages keyed by (namespace, token prefix of whole pages)."""

    page_size: int
    pages: dict = field(default_factory=dict)
    tick: int = 0
    uid: int = 0

    def keys(self, ns, tokens):
        ns = DEFAULT if ns is None else ns
        n = len(tokens) // self.page_size
        return [(ns, tuple(tokens[: (k + 1) * self.page_size])) for k in range(n)]

    def prefix(self, ns, tokens):
        out = []
        for key in self.keys(ns, tokens):
            if key not in self.pages:
                break
            out.append(key)
        return out

    def match(self, ns, tokens, touch=True):
        path = self.prefix(ns, tokens)
        if touch:
            self.tick += 1
            for key in path:
                self.pages[key].tick = self.tick
        return path

    def insert(self, ns, tokens, blocks):
        keys = self.keys(ns, tokens)
        path = self.prefix(ns, tokens)
        m = len(path)
        want = len(keys) - m
        self.tick += 1
        for key in path:
            self.pages[key].tick = self.tick
        for k in range(m, m + want):
            self.uid += 1
            self.pages[keys[k]] = Page(int(blocks[k]), self.tick, self.uid)
            if k > 0:
                self.pages[keys[k - 1]].nchild += 1
        mask = np.zeros(len(keys), dtype=bool)
        mask[m: m + want] = True
        return mask, keys[: m + want]

    def parent(self, key):
        ns, pre = key
        return (ns, pre[: -self.page_size]) if len(pre) > self.page_size else None

    def drop(self, key):
        p = self.parent(key)
        if p is not None:
            self.pages[p].nchild -= 1
        del self.pages[key]

    def evictable_leaves(self):
        return [k for k, p in self.pages.items() if p.nchild == 0 and p.lock == 0]

    def evict(self, n):
        out = []
        for _ in range(n):
            leaves = self.evictable_leaves()
            if not leaves:
                break
            ticks = sorted(self.pages[k].tick for k in leaves)
            assert len(ticks) < 2 or ticks[0] != ticks[1], "model: two LRU leaves share a tick"
            key = min(leaves, key=lambda k: self.pages[k].tick)
            out.append(self.pages[key].block)
            self.drop(key)
        return out

    def remove(self, ns, tokens):
        out = []
        for key in reversed(self.prefix(ns, tokens)):
            p = self.pages[key]
            if p.nchild or p.lock:
                break
            out.append(p.block)
            self.drop(key)
        return out

    def lock(self, path, delta):
        for key in path:
            self.pages[key].lock += delta


def snapshot(trie: PageTrie):
    """(ns_id, token prefix) -> node for every live node, walking parent links (wide ids decoded)."""
    s = trie._st
    live = np.flatnonzero(s.i32[DEPTH] >= 0)
    ids = {code: v for v, code in trie._codes.items()}
    out = {}
    for x in live:
        toks, y = [], int(x)
        while y >= 0:
            toks[:0] = [ids.get(t, t) for t in s.tokens[y].tolist()]
            y = int(s.i32[PARENT, y])
        out[(-1 - y, tuple(toks))] = int(x)
    return out


class IndexMachine(RuleBasedStateMachine):
    """One PageTrie beside the model."""

    hash_bits = 64

    def __init__(self) -> None:
        super().__init__()
        self.trie: ExtrasTrie = narrow_trie(self.hash_bits)(PAGE, initial_nodes=4)
        self.model = Model(PAGE)
        self.next_block = 0
        self.seen: list = []  # (ns, tokens) queried or inserted, for the match invariant
        self.locked: list = []  # (handle, model path)
        self.handles: list = []  # (handle, uid of its deepest page)
        self.steps = 0

    seqs = Bundle("seqs")

    def _ns_id(self, ns) -> int:
        return self.trie._ns_ids[DEFAULT if ns is None else ns]

    def _remember(self, ns, tokens) -> None:
        if (ns, tokens) not in self.seen:
            self.seen.append((ns, tokens))
            del self.seen[:-40]

    def _blocks(self, n: int) -> np.ndarray:
        b = np.arange(self.next_block, self.next_block + n, dtype=np.int64)
        self.next_block += n
        return b

    @initialize()
    def start(self) -> None:
        self.trie.reset()

    # ---- rules ------------------------------------------------------------------------------------
    @rule(target=seqs, tokens=tokens_st, ns=ns_st)
    def insert(self, tokens, ns):
        return self._insert(tokens, ns)

    @rule(target=seqs, base=seqs, tail=tokens_st)
    def extend(self, base, tail):
        return self._insert(base[1] + tail, base[0])

    def _insert(self, tokens, ns):
        blocks = self._blocks(len(tokens) // PAGE)
        note(f"insert ns={ns} tokens={tokens} blocks={blocks.tolist()}")
        r = self.trie.insert(tokens, blocks, ns)
        mask, path = self.model.insert(ns, tokens, blocks)
        assert r.new_mask.tolist() == mask.tolist()
        if path:
            self.handles.append((r, self.model.pages[path[-1]].uid))
        self._remember(ns, tokens)
        return (ns, tokens)

    @rule(seq=seqs, method=st.sampled_from(["walk", "gallop"]))
    def match(self, seq, method):
        ns, tokens = seq
        r = (self.trie.match if method == "walk" else self.trie.match_gallop)(tokens, ns)
        path = self.model.match(ns, tokens)
        note(f"match ns={ns} tokens={tokens} -> {r.num_pages} pages")
        assert r.num_pages == len(path)
        assert r.block_ids.tolist() == [self.model.pages[k].block for k in path]

    @rule(tokens=tokens_st, ns=ns_st)
    def match_fresh(self, tokens, ns):
        r = self.trie.match(tokens, ns)
        assert r.num_pages == len(self.model.match(ns, tokens))
        self._remember(ns, tokens)

    @rule(seq=seqs)
    def lock(self, seq):
        ns, tokens = seq
        r = self.trie.match(tokens, ns)
        path = self.model.match(ns, tokens)
        self.trie.lock(r)
        self.model.lock(path, +1)
        note(f"lock {len(path)} pages of ns={ns} tokens={tokens}")
        if path:
            self.locked.append((r, path))
            self.handles.append((r, self.model.pages[path[-1]].uid))

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locked) - 1))
        r, path = self.locked.pop(i)
        note(f"unlock {len(path)} pages")
        self.trie.unlock(r)
        self.model.lock(path, -1)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def relock_old_handle(self, data):
        """An old handle locks iff its deepest page was never freed since; otherwise it raises."""
        r, uid = data.draw(st.sampled_from(self.handles))
        live = [k for k, p in self.model.pages.items() if p.uid == uid]
        if live:
            path = self.model.prefix(live[0][0], [t for t in live[0][1]])
            self.trie.lock(r)
            self.model.lock(path, +1)
            self.locked.append((r, path))
        else:
            with pytest.raises(ValueError, match="stale"):
                self.trie.lock(r)

    @rule(n=st.integers(0, 8))
    def evict(self, n):
        locked_blocks = {p.block for p in self.model.pages.values() if p.lock}
        got = self.trie.evict(n).tolist()
        want = self.model.evict(n)
        note(f"evict {n} -> {got}")
        assert not set(got) & locked_blocks, "evicted a locked page"
        assert got == want, "eviction is not LRU among unlocked leaves"

    @rule(seq=seqs)
    def remove(self, seq):
        ns, tokens = seq
        got = self.trie.remove(tokens, ns).tolist()
        assert got == self.model.remove(ns, tokens)

    @precondition(lambda self: self.steps % 37 == 36)
    @rule()
    def reset(self):
        note("reset")
        self.trie.reset()
        self.model.pages.clear()
        self.locked.clear()
        self.handles.clear()

    # ---- invariants -------------------------------------------------------------------------------
    @invariant()
    def count_steps(self):
        self.steps += 1

    @invariant()
    def same_pages_and_namespaces(self):
        snap = snapshot(self.trie)
        want = {(self._ns_id(ns), pre) for ns, pre in self.model.pages}
        assert set(snap) == want

    @invariant()
    def blocks_and_locks(self):
        s, snap = self.trie._st, snapshot(self.trie)
        blocks = []
        for (ns, pre), p in self.model.pages.items():
            x = snap[(self._ns_id(ns), pre)]
            assert s.i64[BLOCK, x] == p.block
            assert s.i32[LOCK, x] == p.lock
            blocks.append(p.block)
        assert len(blocks) == len(set(blocks)), "a block is owned twice"

    @invariant()
    def links(self):
        s = self.trie._st
        live = np.flatnonzero(s.i32[DEPTH] >= 0)
        par = s.i32[PARENT, live]
        kids = np.bincount(par[par >= 0], minlength=s.i32.shape[1])
        for x, p in zip(live, par):
            assert s.i32[NCHILD, x] == kids[x]
            if p >= 0:
                assert s.i32[DEPTH, p] >= 0, "parent is free"
                assert s.i32[DEPTH, x] == s.i32[DEPTH, p] + 1
                assert s.i32[LOCK, p] >= s.i32[LOCK, x] >= 0
            else:
                assert s.i32[DEPTH, x] == 0

    @invariant()
    def lazy_index(self):
        """Lazy indexing (trie_jit.py): the table holds exactly the indexed live pages, each once, under
        their chained hash (recomputed from the tokens along the path, not from stored hashes);
        I1 a hashed page's stored hash is that chain hash, and indexed pages are hashed; I2 a hashed page's
        parent is hashed; I3 a page that is not indexed is its parent's only child and its parent's hint;
        first pages are always indexed."""
        s = self.trie._st
        mask = int(self.trie._mask)
        chain: dict = {}
        by_id = {i: ns for ns, i in self.trie._ns_ids.items()}

        def h(x):
            if x not in chain:
                p = int(s.i32[PARENT, x])
                seed = h(p) if p >= 0 else by_id[-1 - p].seed
                chain[x] = xxhash.xxh64_intdigest(s.tokens[x].astype("<u4").tobytes(), seed) & mask
            return chain[x]

        live = np.flatnonzero(s.i32[DEPTH] >= 0)
        indexed = {int(x) for x in live if s.flags[x] & FL_INDEXED}
        hashed = {int(x) for x in live if s.flags[x] & FL_HASHED}
        assert not s.flags[s.i32[DEPTH] < 0].any(), "free slot flagged"
        assert indexed <= hashed, "indexed page without a hash"
        for x in map(int, live):
            p = int(s.i32[PARENT, x])
            if x in hashed:
                assert int(s.hashes[x]) == h(x), "stored hash is not the chained page hash"
                assert p < 0 or p in hashed, "hashed page under a page that is not hashed"
            if x not in indexed:
                assert p >= 0, "first page not indexed"
                assert s.i32[NCHILD, p] == 1 and s.i32[HINT, p] == x, "page not indexed and not findable by the hint"
        entries = [int(e) for e in s.table if e != -1]
        got = sorted((e & 0xFFFFFFFF, (e >> 32) & 0xFFFFFFFF) for e in entries)
        want = sorted((x, h(x) & 0xFFFFFFFF) for x in indexed)
        assert got == want, "table entries are not exactly the indexed pages with their hash tags"
        assert s.meta[M_INDEXED] == len(indexed), "indexed-page count"

    @invariant()
    def counts(self):
        pages = self.model.pages.values()
        assert self.trie.total_pages == len(self.model.pages)
        assert self.trie.protected_pages == sum(p.lock > 0 for p in pages)
        assert self.trie.evictable_pages == sum(p.lock == 0 for p in pages)
        assert self.trie.evictable_leaves == len(self.model.evictable_leaves())

    @invariant()
    def heap_holds_unlocked_leaves(self):
        s = self.trie._st
        size = int(s.meta[M_HEAP])
        heap = s.heap[:size]
        key = s.hkey[:size]
        assert all(s.i32[HPOS, x] == i for i, x in enumerate(heap))
        # lazy keys (see _heap.py): ordered by the stored keys, each a lower bound of its node's tick
        assert (key <= s.i64[TICK, heap]).all()
        for i in range(1, size):
            j = (i - 1) // 2
            assert (key[j], heap[j]) < (key[i], heap[i])
        live = np.flatnonzero(s.i32[DEPTH] >= 0)
        leaves = {int(x) for x in live if s.i32[NCHILD, x] == 0 and s.i32[LOCK, x] == 0}
        assert set(heap.tolist()) == leaves

    @invariant()
    def match_is_longest_cached_prefix(self):
        for ns, tokens in self.seen:
            want = [self.model.pages[k].block for k in self.model.prefix(ns, tokens)]
            for method, match in (("walk", self.trie.match), ("gallop", self.trie.match_gallop)):
                r = match(tokens, ns, touch=False)
                assert r.block_ids.tolist() == want, f"{method} match of {tokens} in {ns}"


class NarrowHashMachine(IndexMachine):
    """3-bit page hashes: most pages collide; answers must not change."""

    hash_bits = 3


_fast = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
IndexMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=100, **_fast)
NarrowHashMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=100, **_fast)

TestIndexMachine = IndexMachine.TestCase
TestNarrowHashMachine = NarrowHashMachine.TestCase
