"""Stateful test of KVTier: random interleavings of store / load / GPU progress / poll / wait / cancel / evict / reset.

Copies go through a DeferredExecutor: each is queued on its stream and runs only when a rule releases it (or a wait
or cancel needs it), in issue order per stream, as on a GPU. So in-flight copies are real: a block freed, evicted or
reused while a copy still uses it ends up with, or delivers, the wrong bytes.

Every page has canonical bytes derived from its (namespace, token prefix). A store fills its source slots with the
canonical bytes of its pages (and the test never touches them until the store is finalized: the engine contract);
a load's destination is poisoned first. Checked:

* bytes: every finalized load (done, cancelled or reset) delivered the canonical bytes of every page it reported;
* no leak: free blocks + blocks held by the index + blocks of in-flight stores == pool size, and the three sets are
  disjoint;
* locked pages stay: the pages an in-flight load reads, and the held prefix an in-flight store hangs from, are still
  in the index with the same blocks (never evicted);
* visibility: right after ``wait`` of a store that was in flight and not truncated, all its pages are held;
* ``poll`` reports each task id at most once.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from kvtier.index import Namespace
from kvtier.index._state import BLOCK, DEPTH, M_HIGH
from kvtier.tier.executor import DeferredExecutor, FailingExecutor
from tests.tier_helpers import TINY, make_tier

P = TINY.page_size
MAX_PAGES = 4
REGIONS = 4  # source regions and destination regions, MAX_PAGES pages each
NUM_BLOCKS = 7  # small: stores evict and get truncated often
NAMESPACES = [None, Namespace(extra_key="b")]
ROW = TINY.row_bytes
NBUF = TINY.num_layers * TINY.kv_count

# Pages drawn from two values so that sequences share prefixes often; sometimes a trailing partial page.
seqs = st.builds(lambda pages, tail: [t for v in pages for t in [v] * P] + tail,
                 st.lists(st.sampled_from([0, 1]), min_size=1, max_size=MAX_PAGES),
                 st.sampled_from([[], [7]]))


def canonical(ns_i: int, prefix: tuple) -> np.ndarray:
    """Bytes of the page ending ``prefix`` in namespace ``ns_i``: ``[buffers, P, row_bytes]``."""
    seed = zlib.crc32(repr((ns_i, prefix)).encode())
    return np.random.default_rng(seed).integers(0, 256, (NBUF, P, ROW), dtype=np.uint8)


def region_slots(region: int, dest: bool) -> torch.Tensor:
    first = (REGIONS * int(dest) + region) * MAX_PAGES * P
    return torch.arange(first, first + MAX_PAGES * P, dtype=torch.int64)


class TierMachine(RuleBasedStateMachine):
    stored = Bundle("stored")  # (tokens, namespace index) of stores issued: loads draw from it to hit often

    def __init__(self, layout: str = "layer_first", mode: str = "auto", failure_rate: float = 0.0,
                 block_pages: int = 1) -> None:
        super().__init__()
        self.layout, self.mode, self.failure_rate = layout, mode, failure_rate
        self.B = block_pages * P  # tokens per host block

    @initialize(seed=st.integers(0, 2**16))
    def start(self, seed) -> None:
        self.ex = DeferredExecutor()
        executor = FailingExecutor(self.ex, self.failure_rate, seed) if self.failure_rate else self.ex
        self.tier = make_tier(num_slots=2 * REGIONS * MAX_PAGES * P, num_blocks=NUM_BLOCKS, layout=self.layout,
                              mode=self.mode, executor=executor, tokens_per_block=self.B)
        self.rows = [b.view(torch.uint8).view(b.shape[0], -1) for b in self.tier.kv.buffers]
        self.src_busy: dict[int, object] = {}  # source region -> store task using it
        self.dst_busy: dict[int, tuple] = {}  # destination region -> (load task, tokens, ns index)
        self.reported: set[int] = set()
        self.loads_checked = 0
        self.steps = 0

    # --- helpers ---

    def _settle(self) -> None:
        """Release source regions of finalized stores; verify and release destinations of finalized loads."""
        for r, task in list(self.src_busy.items()):
            if task.done:
                del self.src_busy[r]
        for r, (task, toks, ns_i, start) in list(self.dst_busy.items()):
            if task.done:
                got = torch.stack([rows[region_slots(r, True)] for rows in self.rows]).numpy()
                for k in range(task.num_pages):  # the region holds pages start, start + 1, ...
                    want = canonical(ns_i, tuple(toks[:(start + k + 1) * P]))
                    assert np.array_equal(got[:, k * P:(k + 1) * P], want), (
                        f"load task {task.id} ({task.status}) page {start + k} has wrong bytes")
                self.loads_checked += 1
                del self.dst_busy[r]

    def _held_blocks(self) -> np.ndarray:
        s = self.tier.index._st
        high = int(s.meta[M_HIGH])
        live = np.flatnonzero(s.i32[DEPTH, :high] >= 0)
        return s.i64[BLOCK, live]

    # --- rules ---

    @precondition(lambda self: len(self.src_busy) < REGIONS)
    @rule(target=stored, toks=seqs, ns_i=st.integers(0, len(NAMESPACES) - 1))
    def store(self, toks, ns_i):
        r = next(i for i in range(REGIONS) if i not in self.src_busy)
        slots = region_slots(r, False)
        for k in range(len(toks) // P):
            page = torch.from_numpy(canonical(ns_i, tuple(toks[:(k + 1) * P])))
            for b, rows in enumerate(self.rows):
                rows[slots[k * P:(k + 1) * P]] = page[b]
        task = self.tier.store(np.array(toks), NAMESPACES[ns_i], slots[:len(toks) // P * P])
        note(f"store {toks} ns={ns_i} -> task {task.id} held={task.num_held} new={task.num_pages}")
        self.src_busy[r] = task
        self._settle()
        return toks, ns_i

    @precondition(lambda self: len(self.dst_busy) < REGIONS)
    @rule(item=stored, layerwise=st.booleans(), start=st.integers(0, MAX_PAGES))
    def load_stored(self, item, layerwise, start) -> None:
        self.load(item[0], item[1], layerwise, start)

    @precondition(lambda self: len(self.dst_busy) < REGIONS)
    @rule(toks=seqs, ns_i=st.integers(0, len(NAMESPACES) - 1), layerwise=st.booleans(),
          start=st.integers(0, MAX_PAGES))
    def load(self, toks, ns_i, layerwise, start=0) -> None:
        """Load from page ``start`` on (the pages before it stand for a device-held prefix; with blocks of several
        pages the load can begin mid-block)."""
        r = next(i for i in range(REGIONS) if i not in self.dst_busy)
        slots = region_slots(r, True)
        for rows in self.rows:
            rows[slots] = 0xA5  # poison: stale bytes
        fn = self.tier.load_layerwise if layerwise else self.tier.load
        task = fn(np.array(toks), NAMESPACES[ns_i], slots[:(MAX_PAGES - start) * P], start_page=start)
        note(f"load{'_layerwise' if layerwise else ''} {toks} ns={ns_i} from page {start} -> task {task.id} "
             f"pages={task.num_pages}")
        self.dst_busy[r] = (task, list(toks), ns_i, start)
        self._settle()

    @rule(stream=st.sampled_from(["store", "load"]), n=st.integers(1, 3))
    def gpu_progress(self, stream, n) -> None:
        note(f"release {n} on {stream}: ran {self.ex.release(stream, n)}")

    @rule()
    def poll(self) -> None:
        ids = self.tier.poll()
        note(f"poll -> {ids}")
        assert len(set(ids)) == len(ids) and not self.reported & set(ids), f"task reported twice: {ids}"
        self.reported |= set(ids)
        self._settle()

    @precondition(lambda self: self.tier.inflight_ids)
    @rule(data=st.data())
    def wait(self, data) -> None:
        tid = data.draw(st.sampled_from(sorted(self.tier.inflight_ids)))
        rec = self.tier.in_flight()[tid]
        task = self.tier.wait(tid)
        note(f"wait {tid} ({task.kind})")
        assert task.status == "done"
        if task.kind == "store" and task.num_held + task.num_pages == rec.tokens.size // P:
            n_full = rec.tokens.size // P
            assert self.tier.lookup(rec.tokens, rec.ns) >= n_full, "completed store not visible"
        self._settle()

    @precondition(lambda self: self.tier.inflight_ids)
    @rule(data=st.data())
    def cancel(self, data) -> None:
        tid = data.draw(st.sampled_from(sorted(self.tier.inflight_ids)))
        note(f"cancel {tid}")
        assert self.tier.cancel(tid)
        assert not self.tier.cancel(tid)
        self._settle()

    @rule(n=st.sampled_from([1, 2, NUM_BLOCKS]))
    def evict(self, n) -> None:
        note(f"evict {n} -> {self.tier.evict(n)}")

    @precondition(lambda self: self.steps % 20 == 19)  # rare but deterministic (zarr's with_frequency)
    @rule()
    def reset(self) -> None:
        note("reset")
        self.tier.reset()
        assert self.ex.pending("store") == self.ex.pending("load") == 0
        assert self.tier.pool.num_free == NUM_BLOCKS and self.tier.index.total_pages == 0
        self._settle()
        assert not self.src_busy and not self.dst_busy

    # --- invariants ---

    @invariant()
    def count_steps(self) -> None:
        self.steps += 1

    @invariant()
    def no_block_leak(self) -> None:
        free = {i for i in range(NUM_BLOCKS) if self.tier.pool.is_free(i)}
        held = self._held_blocks().tolist()
        inflight = [int(b) for r in self.tier.in_flight().values() if r.task.kind == "store" for b in r.block_ids]
        assert len(free) == self.tier.pool.num_free
        assert len(set(held)) == len(held), f"a block held twice by the index: {held}"
        assert len(set(inflight)) == len(inflight), f"a block owned twice by in-flight stores: {inflight}"
        assert not free & set(held), f"free blocks held by the index: {free & set(held)}"
        assert not free & set(inflight), f"free blocks owned by in-flight stores: {free & set(inflight)}"
        assert not set(held) & set(inflight), f"blocks both held and in flight: {set(held) & set(inflight)}"
        assert len(free) + len(held) + len(inflight) == NUM_BLOCKS, "blocks leaked"

    @invariant()
    def locked_pages_stay(self) -> None:
        for r in self.tier.in_flight().values():
            if r.task.kind == "store":
                n, ids = r.prefix_ids.size, r.prefix_ids
                toks = r.tokens[:n * self.B]
            else:
                n, ids = r.block_ids.size, r.block_ids  # the blocks read: the last n of the matched path
                toks = self._load_tokens(r.task.id)
            if n == 0:
                continue
            m = self.tier.index.match(toks, r.ns, touch=False)
            first = len(toks) // self.B - n if r.task.kind != "store" else 0
            assert m.num_pages >= first + n and np.array_equal(m.block_ids[first:first + n], ids), (
                f"task {r.task.id} ({r.task.kind}): a locked page was evicted or moved")

    def _load_tokens(self, tid: int) -> np.ndarray:
        for task, toks, _, start in self.dst_busy.values():
            if task.id == tid:
                return np.array(toks[:(start + task.num_pages) * P])
        raise AssertionError(f"in-flight load {tid} has no destination region")

    def teardown(self) -> None:
        if hasattr(self, "tier"):
            self.tier.reset()
            self._settle()


SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("layout,mode", [("layer_first", "auto"), ("page_first", "direct")])
def test_tier_interleavings(layout, mode):
    class Machine(TierMachine):
        def __init__(self) -> None:
            super().__init__(layout, mode)

    run_state_machine_as_test(Machine, settings=SETTINGS)


def test_tier_interleavings_with_failing_copies():
    """A fifth of the copies fail while being issued (before or after reaching the stream): every invariant above
    still holds (nothing leaks, no wrong byte is served, locked pages stay), 10k steps."""
    class Machine(TierMachine):
        def __init__(self) -> None:
            super().__init__("layer_first", "auto", failure_rate=0.2)

    run_state_machine_as_test(Machine, settings=settings(SETTINGS, max_examples=100, stateful_step_count=100))


@pytest.mark.parametrize("layout,mode", [("layer_first", "auto"), ("page_first", "staged")])
def test_tier_interleavings_with_blocks_of_two_pages(layout, mode):
    """Host blocks of two engine pages: hits, stores and evictions in whole blocks, loads that start mid-block
    (a device-held prefix ending inside a block) copy only the pages after it; a tenth of the copies fail."""
    class Machine(TierMachine):
        def __init__(self) -> None:
            super().__init__(layout, mode, failure_rate=0.1, block_pages=2)

    run_state_machine_as_test(Machine, settings=SETTINGS)
