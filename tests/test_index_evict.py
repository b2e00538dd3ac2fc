"""Chain eviction (``trie_jit.tr_evict``): a leaf and the chain above it leave in one step, with the result of
freeing one page at a time (``ExtrasTrie.evict_per_page``, the reference kept in ``tests/index_extras.py``).

Two tries get the same operations; one evicts by chains, the other a page at a time. After every eviction the
block ids (and their order) and the whole state must be equal: every node slot's links, locks, generation and free
list link, the live pages' ticks and hits, the flags and hashes, the table, the heap and the counters.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvtier.index import Namespace
from kvtier.index._state import BLOCK, DEPTH, HITS, LOCK, M_HEAP, NCHILD, TICK
from tests.index_extras import ExtrasTrie

PAGE = 2


def assert_same_state(a: ExtrasTrie, b: ExtrasTrie) -> None:
    """Equal states, except the ticks and hits of free slots (a slot taken from the free list is written whole)."""
    sa, sb = a._st, b._st
    live = sa.i32[DEPTH] >= 0
    assert np.array_equal(live, sb.i32[DEPTH] >= 0), "different live slots"
    for r in range(sa.i32.shape[0]):
        if r == HITS:
            assert np.array_equal(sa.i32[r, live], sb.i32[r, live]), "hits of live pages"
        else:
            assert np.array_equal(sa.i32[r], sb.i32[r]), f"i32 row {r}"
    for r in range(sa.i64.shape[0]):
        if r == TICK:
            assert np.array_equal(sa.i64[r, live], sb.i64[r, live]), "ticks of live pages"
        else:
            assert np.array_equal(sa.i64[r], sb.i64[r]), f"i64 row {r}"
    assert np.array_equal(sa.i8, sb.i8), "flags"
    assert np.array_equal(sa.table, sb.table), "table"
    assert np.array_equal(sa.meta, sb.meta), "meta"


def locked_blocks(trie: ExtrasTrie) -> set:
    s = trie._st
    return set(s.i64[BLOCK, (s.i32[DEPTH] >= 0) & (s.i32[LOCK] > 0)].tolist())


class Twins:
    """The same operations on a chain-evicting trie and a page-at-a-time one."""

    def __init__(self, initial_nodes: int) -> None:
        self.a = ExtrasTrie(PAGE, initial_nodes=initial_nodes)
        self.b = ExtrasTrie(PAGE, initial_nodes=initial_nodes)
        self.handles: list = []  # (tokens, ns, (handle a, handle b)) locked once each
        self.next_block = 0

    def insert(self, toks, ns=None):
        n = len(toks) // PAGE
        blocks = np.arange(self.next_block, self.next_block + n, dtype=np.int64)
        self.next_block += n
        ra, rb = self.a.insert(toks, blocks, ns), self.b.insert(toks, blocks, ns)
        assert ra.new_mask.tolist() == rb.new_mask.tolist()
        return ra, rb

    def match(self, toks, ns=None):
        ra, rb = self.a.match(toks, ns), self.b.match(toks, ns)
        assert ra.block_ids.tolist() == rb.block_ids.tolist()
        return ra, rb

    def lock(self, toks, ns=None):
        ra, rb = self.match(toks, ns)
        if ra.num_pages:
            self.a.lock(ra)
            self.b.lock(rb)
            self.handles.append((toks, ns, (ra, rb)))

    def unlock_one(self, i):
        _, _, (ra, rb) = self.handles.pop(i)
        self.a.unlock(ra)
        self.b.unlock(rb)

    def evict(self, n):
        locked = locked_blocks(self.a)
        evictable = self.a.evictable_pages
        total = self.a.total_pages
        got = self.a.evict(n)
        want = self.b.evict_per_page(n)
        assert got.tolist() == want.tolist(), "chain eviction's order differs from one page at a time"
        assert got.dtype == np.int64
        assert len(got) == min(n, evictable), "an unlocked page was left while fewer than n were freed"
        assert not set(got.tolist()) & locked, "a locked page was evicted"
        assert self.a.total_pages == total - len(got)
        assert_same_state(self.a, self.b)
        return got


def random_workload(seed: int, steps: int) -> None:
    """Long shared prefixes (chains in consecutive slots), branches, chains extending leaves, chains built in
    reused slots, touches of inner pages (a newer tick stops a chain), locks anywhere, evictions of every size."""
    rng = np.random.default_rng(seed)
    tw = Twins(initial_nodes=64)  # small: the arrays grow while the workload runs
    namespaces = [None, Namespace(extra_key="x")]
    bases = [rng.integers(0, 50, int(rng.integers(2, 160)) * PAGE).tolist() for _ in range(6)]
    seen: list = []
    for _ in range(steps):
        op = rng.random()
        ns = namespaces[int(rng.integers(0, 2))] if rng.random() < 0.2 else None
        if op < 0.35:
            base = bases[int(rng.integers(0, len(bases)))]
            cut = int(rng.integers(0, len(base) // PAGE + 1)) * PAGE
            tail = rng.integers(0, 50, int(rng.integers(0, 60)) * PAGE).tolist()
            toks = base[:cut] + tail
            tw.insert(toks, ns)
            seen.append((toks, ns))
        elif op < 0.55 and seen:
            toks, ns = seen[int(rng.integers(0, len(seen)))]
            cut = int(rng.integers(1, len(toks) // PAGE + 2)) * PAGE
            tw.match(toks[:cut], ns)  # touches an inner page when the cut is short
        elif op < 0.65 and seen:
            toks, ns = seen[int(rng.integers(0, len(seen)))]
            cut = int(rng.integers(1, len(toks) // PAGE + 2)) * PAGE
            tw.lock(toks[:cut], ns)
        elif op < 0.75 and tw.handles:
            tw.unlock_one(int(rng.integers(0, len(tw.handles))))
        else:
            n = int(rng.choice([1, 2, 3, 7, 16, 17, 40, 100, 1000]))
            tw.evict(n)
    while tw.handles:
        tw.unlock_one(0)
    while tw.a.total_pages:
        tw.evict(int(rng.integers(1, 64)))
    tw.evict(5)  # nothing left: empty and equal


@pytest.mark.parametrize("seed", range(8))
def test_chain_eviction_equals_page_at_a_time_on_random_workloads(seed):
    random_workload(seed, steps=400)


def test_a_chain_leaves_deepest_first_and_stops_at_the_budget():
    tw = Twins(initial_nodes=256)
    toks = list(range(2 * 100))  # 100 pages, one chain in consecutive slots
    tw.insert(toks)
    assert tw.evict(37).tolist() == list(range(99, 62, -1))
    assert tw.a.evictable_leaves == 1  # the rest of the chain waits in the heap, its new leaf on top
    assert tw.evict(1000).tolist() == list(range(62, -1, -1))
    assert tw.a.total_pages == 0


def test_a_lock_stops_the_chain_below_the_locked_page():
    tw = Twins(initial_nodes=256)
    toks = list(range(2 * 50))
    tw.insert(toks)
    tw.lock(toks[:2 * 20])  # pages 0..19 locked
    assert tw.evict(1000).tolist() == list(range(49, 19, -1))
    assert tw.a.total_pages == 20 and tw.a.evictable_pages == 0
    tw.unlock_one(0)
    assert tw.evict(1000).tolist() == list(range(19, -1, -1))


def test_a_newer_touch_inside_the_chain_hands_the_rest_back_to_the_heap():
    """Page 29 touched after the other chain was inserted: pages 49..30 go, then the other chain's leaf (older),
    then 29..0."""
    tw = Twins(initial_nodes=256)
    a = list(range(2 * 50))
    tw.insert(a)                       # tick 1
    b = [1000 + i for i in range(2 * 5)]
    tw.insert(b)                       # tick 2
    tw.match(a[:2 * 30])               # tick 3 on page 29
    assert tw.evict(1000).tolist() == list(range(49, 29, -1)) + list(range(54, 49, -1)) + list(range(29, -1, -1))


def test_a_parent_with_other_children_ends_the_chain():
    tw = Twins(initial_nodes=256)
    base = list(range(2 * 10))
    tw.insert(base + [500 + i for i in range(2 * 20)])   # blocks 0..29
    tw.insert(base + [900 + i for i in range(2 * 5)])    # offers 30..44: pages 10..14 take 40..44, under page 9
    assert tw.evict(20).tolist() == list(range(29, 9, -1))  # the first tail; page 9 keeps a child
    assert tw.evict(100).tolist() == list(range(44, 39, -1)) + list(range(9, -1, -1))


def test_evict_checks_its_count():
    t = ExtrasTrie(PAGE)
    t.insert(list(range(8)), np.arange(4))
    for bad in (-1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match="n must be an int >= 0"):
            t.evict(bad)
    assert t.evict(np.int64(2)).tolist() == [3, 2]
    assert t.evict(0).tolist() == [] and t.total_pages == 2


def test_the_heap_is_left_holding_exactly_the_unlocked_leaves():
    tw = Twins(initial_nodes=64)
    for i in range(6):
        tw.insert([i] * 2 * (10 + i))
    tw.lock([3] * 2 * 4)
    tw.evict(25)
    s = tw.a._st
    size = int(s.meta[M_HEAP])
    live = np.flatnonzero(s.i32[DEPTH] >= 0)
    leaves = {int(x) for x in live if s.i32[NCHILD, x] == 0 and s.i32[LOCK, x] == 0}
    assert set(s.heap[:size].tolist()) == leaves
