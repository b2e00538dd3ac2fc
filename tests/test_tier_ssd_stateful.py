"""Stateful test of KVTier with its SSD tier, on real files: random interleavings of store / lookup and promotion /
load / poll / wait / cancel / evict / SSD flush / reset / restart (destroy, then a new tier over the same directory,
in either CPU layout), with bytes flipped on disk between restarts.

The tiers are tiny (4-8 CPU blocks, 3-10 SSD slots, blocks of one page) so that both evict all the time; the write
policy (``write_through`` / ``write_back``) and whether device copies run at once or only when a rule releases them
(a :class:`~kvtier.tier.DeferredExecutor`) are drawn per run. The SSD's IO threads run for real.

Every page has canonical bytes derived from its (namespace, token prefix), so every stored copy of a page, on the
CPU or on the SSD, from any store, must hold the same bytes. Checked:

* bytes: every finalized load delivered the canonical bytes of every page it reported (nothing wrong is ever
  served, whatever was evicted, promoted, restarted or damaged);
* CPU blocks: free + held by the CPU index + owned by in-flight stores and promotions + held for SSD writes after
  the CPU index let them go (``held_cpu_blocks``) == the pool, the sets disjoint; a block an SSD write reads is
  never free nor owned by a store or promotion (nothing rewrites a block the disk still reads);
* SSD slots: held + pending + free (+ removed while locked) == total; pending == the slots of unfinished writes;
  slot locks == the in-flight promotions reading them (never negative);
* counters are monotone within a tier's life; without damage no SSD block ever fails its check and no promotion
  reads fewer pages than it started; a waited promotion's pages are CPU hits;
* durability: after ``flush_lower()`` and a restart, every page the SSD held before is held again.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import zlib

import numpy as np
import torch
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from kvtier.index import Namespace, page_hashes
from kvtier.index._state import BLOCK, DEPTH, M_HIGH
from kvtier.storage.block_format import ALIGN, padded
from kvtier.storage.ssd_store import FILE_NAME
from kvtier.tier.executor import DeferredExecutor
from kvtier.tier.manager import TierStats
from kvtier.tier.ssd_tier import SsdStats
from tests.test_tier_ssd import make_ssd_tier
from tests.tier_helpers import TINY

P = TINY.page_size  # tokens per page = per block
MAX_PAGES = 5
REGIONS = 3  # source regions and destination regions, MAX_PAGES pages each (6 * 10 slots of the 128)
NAMESPACES = [None, Namespace(extra_key="b")]
ROW = TINY.row_bytes
NBUF = TINY.num_layers * TINY.kv_count

# Counters: never decrease while a tier lives (reset keeps them).
MONOTONE = ([f.name for f in dataclasses.fields(TierStats)] + [f"ssd_{f.name}" for f in dataclasses.fields(SsdStats)]
            + ["ssd_blocks_evicted", "ssd_admitted", "ssd_refused", "ssd_tokens_refused", "promotions",
               "pages_promoted", "pages_promote_failed"])

# Pages drawn from two values so that prompts share prefixes often; sometimes a trailing partial page.
seqs = st.builds(lambda pages, tail: [t for v in pages for t in [v] * P] + tail,
                 st.lists(st.sampled_from([0, 1]), min_size=1, max_size=MAX_PAGES),
                 st.sampled_from([[], [7]]))
layouts = st.sampled_from(["layer_first", "page_first"])


def canonical(ns_i: int, prefix: tuple) -> np.ndarray:
    """Bytes of the page ending ``prefix`` in namespace ``ns_i``: ``[buffers, P, row_bytes]``."""
    seed = zlib.crc32(repr(("ssd", ns_i, prefix)).encode())
    return np.random.default_rng(seed).integers(0, 256, (NBUF, P, ROW), dtype=np.uint8)


def region_slots(region: int, dest: bool) -> torch.Tensor:
    first = (REGIONS * int(dest) + region) * MAX_PAGES * P
    return torch.arange(first, first + MAX_PAGES * P, dtype=torch.int64)


class SsdTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvtier-ssd-stateful-")
        self.tier = None
        self.restarts = 0
        self.steps = 0

    # --- life cycle ---

    @initialize(policy=st.sampled_from(["write_through", "write_back"]), deferred=st.booleans(),
                num_blocks=st.integers(4, 8), ssd_slots=st.integers(3, 10), layout=layouts,
                warm=st.lists(st.tuples(seqs, st.integers(0, len(NAMESPACES) - 1)), max_size=4))
    def start(self, policy, deferred, num_blocks, ssd_slots, layout, warm) -> None:
        note(f"start: {policy}, {'deferred' if deferred else 'immediate'} copies, {num_blocks} CPU blocks, "
             f"{ssd_slots} SSD slots, {layout}")
        self.policy, self.deferred, self.num_blocks, self.ssd_slots = policy, deferred, num_blocks, ssd_slots
        self.known: dict[int, tuple] = {}  # chain hash -> (ns index, token prefix) of every page seen
        self.prompts: list[tuple] = []  # (tokens, ns index) stored so far: the rules draw from them to hit
        self.damaged = False  # a byte was flipped on disk (since then a block may fail its check: a miss)
        self._open(layout)
        for toks, ns_i in warm:  # tiers that start full: evictions on both from the first rule on
            self._store(toks, ns_i)
            self._finish_all()
        self.tier.flush_lower()

    def _open(self, layout: str) -> None:
        self.tier = make_ssd_tier(self.dir, layout=layout, num_blocks=self.num_blocks, seed=self.restarts,
                                  ssd_slots=self.ssd_slots, ssd_write_policy=self.policy)
        self.ex = None
        if self.deferred:  # before any copy: copies then run only when a rule (or a wait) releases them
            self.ex = self.tier.executor = DeferredExecutor()
        assert self.tier.lower_tier("ssd").medium.index.num_slots == self.ssd_slots
        self.rows = [b.view(torch.uint8).view(b.shape[0], -1) for b in self.tier.kv.buffers]
        self.src_busy: dict[int, object] = {}  # source region -> store task reading it
        self.dst_busy: dict[int, tuple] = {}  # destination region -> (load task, tokens, ns index, start page)
        self.reported: set[int] = set()
        self.last_stats: dict = {}

    def _finish_all(self) -> None:
        """Every copy run and finalized, every destination checked."""
        if self.ex is not None:
            self.ex.release_all()
        self.tier.wait_all()
        self._settle()
        assert not self.src_busy and not self.dst_busy

    def _destroy(self) -> None:
        """``tier.destroy()``: the SSD tier closed (its files, journal and threads), the pool released."""
        t = self.tier
        t.destroy()
        medium = t.lower_tier("ssd").medium
        assert t.pool.destroyed is True and medium._writer is None and all(f._fd < 0 for f in medium.store.files)
        self.tier = None

    def teardown(self) -> None:
        try:
            if self.tier is not None:
                try:
                    self._finish_all()
                finally:
                    self._destroy()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # --- helpers ---

    def _learn(self, toks, ns_i: int) -> None:
        n = len(toks) // P
        for k, h in enumerate(page_hashes(np.array(toks[:n * P]), P, NAMESPACES[ns_i]).tolist()):
            self.known[h] = (ns_i, tuple(toks[:(k + 1) * P]))

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
                        f"load task {task.id} ({task.status}) page {start + k} of {toks} ns={ns_i} has wrong bytes")
                del self.dst_busy[r]

    def _held_blocks(self) -> np.ndarray:
        s = self.tier.index._st
        high = int(s.meta[M_HIGH])
        live = np.flatnonzero(s.i32[DEPTH, :high] >= 0)
        return s.i64[BLOCK, live]

    def _region(self, busy: dict) -> int:
        """A free source or destination region; when all are busy, the first one once its task is waited for. (Not
        a precondition: whether a task is still in flight depends on the SSD threads' timing, and hypothesis needs
        the rules it may draw not to.)"""
        free = [i for i in range(REGIONS) if i not in busy]
        if free:
            return free[0]
        entry = busy[0]
        self.tier.wait(entry[0] if isinstance(entry, tuple) else entry)
        self._settle()
        assert 0 not in busy
        return 0

    def _ssd_held_hashes(self) -> set:
        idx = self.tier.lower_tier("ssd").medium.index
        return {h for h in self.known if idx.contains(h)}

    # --- rules ---

    def _pick(self, data) -> tuple:
        """A prompt: two times in three one stored before (hits on both tiers), else any."""
        fresh = st.tuples(seqs, st.integers(0, len(NAMESPACES) - 1))
        if not self.prompts:
            return data.draw(fresh)
        return data.draw(st.one_of(st.sampled_from(self.prompts), st.sampled_from(self.prompts), fresh))

    def _store(self, toks, ns_i):
        r = self._region(self.src_busy)
        slots = region_slots(r, False)
        for k in range(len(toks) // P):
            page = torch.from_numpy(canonical(ns_i, tuple(toks[:(k + 1) * P])))
            for b, rows in enumerate(self.rows):
                rows[slots[k * P:(k + 1) * P]] = page[b]
        self._learn(toks, ns_i)
        task = self.tier.store(np.array(toks), NAMESPACES[ns_i], slots[:len(toks) // P * P])
        note(f"store {toks} ns={ns_i} -> task {task.id} held={task.num_held} new={task.num_pages}")
        self.src_busy[r] = task
        if (toks, ns_i) not in self.prompts:
            self.prompts.append((toks, ns_i))
        self._settle()

    def _lookup(self, toks, ns_i, wait):
        """lookup_tiers starts promoting what the SSD holds past the CPU hit; optionally wait for it."""
        n = len(toks) // P
        started0 = self.tier.stats()["promotions"]
        hit = self.tier.lookup_tiers(np.array(toks), NAMESPACES[ns_i])
        prom = hit.read
        started = self.tier.stats()["promotions"] > started0
        note(f"lookup {toks} ns={ns_i} -> cpu={hit.cpu_pages} ssd={hit.lower_pages} promotion="
             f"{None if prom is None else (prom.id, prom.num_held, prom.num_pages, 'new' if started else 'shared')}")
        assert 0 <= hit.cpu_pages <= n
        if prom is None:
            assert hit.cpu_pages + hit.lower_pages <= n
            self._settle()
            return
        assert prom.kind == "read" and prom.source == "ssd" and prom.num_held == hit.cpu_pages and prom.num_pages > 0
        # The promotion may be one in flight from the same block for another prompt: the pages it brings this prompt
        # are those the two prompts share.
        mine = self.tier.in_flight()[prom.id].tokens
        k = min(mine.size, n * P)
        common = k if np.array_equal(mine[:k], toks[:k]) else int(np.argmax(mine[:k] != np.array(toks[:k])))
        covered = min(common // P, prom.num_held + prom.num_pages) - prom.num_held
        assert covered > 0, "a promotion shared by a prompt that does not share its first block"
        if started:  # it reads what the SSD holds past the CPU hit, or its first blocks when fewer CPU blocks are free
            assert hit.lower_pages >= prom.num_pages == covered and hit.cpu_pages + hit.lower_pages <= n
        else:  # one in flight: TierHit reports the pages it brings this prompt
            assert hit.lower_pages == covered, (hit, covered)
        if wait:
            failed0 = self.tier.stats()["pages_promote_failed"]
            self.tier.wait(prom)
            assert prom.status == "done", prom
            got = self.tier.lookup(np.array(toks), NAMESPACES[ns_i])
            note(f"  promotion {prom.id} waited: cpu hit {got}")
            if not self.damaged:
                assert self.tier.stats()["pages_promote_failed"] == failed0
                assert got >= prom.num_held + covered, (
                    f"promoted {covered} pages of this prompt past {prom.num_held}, but the CPU hit is {got}")
        self._settle()

    def _load(self, toks, ns_i, layerwise=False, start=0) -> None:
        r = self._region(self.dst_busy)
        slots = region_slots(r, True)
        for rows in self.rows:
            rows[slots] = 0xA5  # poison: stale bytes
        fn = self.tier.load_layerwise if layerwise else self.tier.load
        task = fn(np.array(toks), NAMESPACES[ns_i], slots[:(MAX_PAGES - start) * P], start_page=start)
        note(f"load{'_layerwise' if layerwise else ''} {toks} ns={ns_i} from page {start} -> task {task.id} "
             f"pages={task.num_pages}")
        self.dst_busy[r] = (task, list(toks), ns_i, start)
        self._settle()

    @rule(data=st.data(), wait=st.booleans())
    def request(self, data, wait) -> None:
        """What an engine does for a request: look up (promoting from the SSD), load the hit, store the prompt."""
        toks, ns_i = self._pick(data)
        self._lookup(toks, ns_i, wait)
        self._load(toks, ns_i)
        self._store(toks, ns_i)

    @rule(data=st.data())
    def store(self, data):
        self._store(*self._pick(data))

    @rule(data=st.data(), wait=st.booleans())
    def lookup(self, data, wait) -> None:
        self._lookup(*self._pick(data), wait)

    @rule(data=st.data(), layerwise=st.booleans(), start=st.sampled_from([0, 0, 0, 1, 2]))
    def load(self, data, layerwise, start) -> None:
        self._load(*self._pick(data), layerwise, start)

    @precondition(lambda self: self.ex is not None)
    @rule(stream=st.sampled_from(["store", "load"]), n=st.integers(1, 3))
    def gpu_progress(self, stream, n) -> None:
        note(f"release {n} on {stream}: ran {self.ex.release(stream, n)}")

    # Which in-flight task is drawn as an index, not from the task list: promotions finish on the SSD's read thread,
    # so which tasks are still in flight depends on timing, and hypothesis needs draws that do not.
    @rule(i=st.integers(0, 255))
    def wait(self, i) -> None:
        ids = sorted(self.tier.inflight_ids)
        if not ids:
            return
        task = self.tier.wait(ids[i % len(ids)])
        note(f"wait {task.id} ({task.kind}) -> {task.status}")
        assert task.status == "done"
        self._settle()

    @rule(i=st.integers(0, 255))
    def cancel(self, i) -> None:
        ids = sorted(self.tier.inflight_ids)
        if not ids:
            return
        tid = ids[i % len(ids)]
        note(f"cancel {tid}")
        assert self.tier.cancel(tid)
        assert not self.tier.cancel(tid)
        self._settle()

    @rule(n=st.sampled_from([1, 2, 8]))
    def evict(self, n) -> None:
        note(f"evict {n} -> {self.tier.evict(n)}")

    @rule()
    def poll(self) -> None:
        ids = self.tier.poll()
        note(f"poll -> {ids}")
        assert len(set(ids)) == len(ids) and not self.reported & set(ids), f"task reported twice: {ids}"
        self.reported |= set(ids)
        self._settle()

    @rule(layout=layouts, damage=st.booleans(), victim=st.integers(0, 255), byte=st.integers(0, 1 << 16))
    def restart(self, layout, damage, victim, byte) -> None:
        """destroy, optionally flip a byte of a held block's payload in the file, and a new tier over the same
        directory: the CPU tier starts empty, the SSD tier serves what was durable."""
        self._finish_all()
        self.tier.flush_lower()
        block_bytes = self.tier.pool.block_bytes
        index = self.tier.lower_tier("ssd").medium.index
        self._destroy()  # write_back writes the CPU's blocks here, which may evict SSD ones
        before = {h for h in self.known if index.contains(h)}  # what the closed tier held durably
        slot_of = {h: index.slot_of(h) for h in before}
        self.restarts += 1
        hit = None
        if damage and before:
            hit = sorted(before)[victim % len(before)]
            byte %= block_bytes
            off = ALIGN + slot_of[hit] * (ALIGN + padded(block_bytes)) + ALIGN + byte  # file header, slot header
            with open(os.path.join(self.dir, FILE_NAME), "r+b") as f:
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 0x5A]))
            self.damaged = True
        note(f"restart ({layout}): {len(before)} pages on the SSD, damaged {hit and self.known[hit]}")
        self._open(layout)
        s = self.tier.stats()
        assert s["pages_held"] == 0 and s["ssd_blocks_recovered"] == s["ssd_blocks_held"] >= len(before)
        lost = before - self._ssd_held_hashes()
        assert not lost, f"durable pages not recovered: {[self.known[h] for h in lost]}"

    @rule()
    def flush_ssd(self) -> None:
        """Wait for every SSD write: the CPU blocks they held go back, no slot is pending."""
        self.tier.flush_lower()
        s = self.tier.stats()
        note(f"flush: ssd held {s['ssd_blocks_held']}")
        assert s["held_cpu_blocks"] == 0 and s["ssd_blocks_pending"] == 0

    @precondition(lambda self: self.steps % 12 == 11)  # rare but deterministic, as in test_tier_stateful
    @rule()
    def reset(self) -> None:
        note("reset")
        if self.ex is not None:
            self.ex.release_all()  # reset waits for copies; a deferred one needs its release
        self.tier.reset()
        self._settle()
        assert not self.src_busy and not self.dst_busy
        s = self.tier.stats()
        assert self.tier.pool.num_free == self.num_blocks and s["pages_held"] == 0 and s["inflight_tasks"] == 0
        assert s["held_cpu_blocks"] == 0 and s["ssd_blocks_pending"] == 0

    # --- invariants ---

    @invariant()
    def count_steps(self) -> None:
        self.steps += 1

    @precondition(lambda self: self.tier is not None)
    @invariant()
    def cpu_blocks_accounted(self) -> None:
        t, link = self.tier, self.tier.lower_tier("ssd")
        n = t.pool.num_blocks
        free = {i for i in range(n) if t.pool.is_free(i)}
        held = self._held_blocks().tolist()
        stores = [int(b) for r in t.in_flight().values() if r.task.kind == "store" for b in r.block_ids]
        promos = [int(b) for r in t.in_flight().values() if r.task.kind == "read" for b in r.block_ids]
        for_ssd = np.flatnonzero(t.holds.free_later).tolist()
        assert len(free) == t.pool.num_free
        owned = [held, stores, promos, for_ssd]
        everything = [b for part in owned for b in part]
        assert len(set(everything)) == len(everything), f"a block owned twice: {owned}"
        assert not free & set(everything), f"free blocks owned: {free & set(everything)}, {owned}"
        assert len(free) + len(everything) == n, f"blocks leaked: free {sorted(free)}, owned {owned}"
        s = t.stats()
        assert (t.pool.num_free + s["pages_held"] + s["inflight_store_blocks"] + len(promos)
                + s["held_cpu_blocks"]) == s["blocks_total"] == n
        # SSD writes: the CPU blocks they read are kept (in the index, or held for the write), never reused
        refs = np.zeros(n, np.int32)
        for job in link._writes:
            np.add.at(refs, job.host_ids, 1)
        assert np.array_equal(refs, t.holds.refs), "CPU block write references out of step"
        reading = set(np.flatnonzero(refs).tolist())
        assert not reading & (free | set(stores) | set(promos)), "a CPU block an SSD write reads was reused"
        assert set(for_ssd) <= reading, "a CPU block held for a write that no write reads"

    @precondition(lambda self: self.tier is not None)
    @invariant()
    def ssd_slots_accounted(self) -> None:
        link = self.tier.lower_tier("ssd")
        idx = link.medium.index
        assert idx.num_held + idx.num_pending + idx.num_free + len(idx._doomed) == idx.num_slots == self.ssd_slots
        assert len(set(idx._free)) == len(idx._free), "an SSD slot free twice"
        assert not set(idx._free) & set(idx._lru), "an SSD slot both free and held"
        assert idx.num_pending == sum(j.num_blocks for j in link._writes), "pending slots without a write"
        locks = np.zeros(idx.num_slots, np.int32)
        for r in self.tier.in_flight().values():
            if r.task.kind == "read":
                np.add.at(locks, r.completion.slots, 1)
        assert np.array_equal(idx._locks, locks), f"SSD slot locks {idx._locks} != in-flight reads {locks}"
        assert all(locks[s] for s in idx._doomed), "a removed slot kept although no read holds it"

    @precondition(lambda self: self.tier is not None)
    @invariant()
    def counters(self) -> None:
        s = self.tier.stats()
        for k in MONOTONE:
            assert s[k] >= self.last_stats.get(k, 0), f"counter {k} went down: {self.last_stats.get(k)} -> {s[k]}"
        self.last_stats = s
        assert s["pages_locked"] >= 0 and s["ssd_blocks_write_failed"] == 0 and s["ssd_read_errors"] == 0
        if not self.damaged:
            assert s["ssd_blocks_corrupt"] == 0, "an undamaged SSD block failed its check"
            assert s["pages_promote_failed"] == 0, "a promotion read fewer pages than it started, without damage"


SETTINGS = settings(max_examples=50, stateful_step_count=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_ssd_tier_interleavings_with_restarts():
    run_state_machine_as_test(SsdTierMachine, settings=SETTINGS)


def test_a_promotion_whose_planned_slot_a_write_back_takes_is_a_miss_not_a_crash(tmp_path):
    """Found by the machine above (write_back, tiny tiers): making room for a promotion writes back evicted CPU
    blocks, which must not take the SSD slots the promotion is about to read. The SSD's LRU order after a restart
    is slot order, so the first block of a prefix can be the LRU slot."""
    t = make_ssd_tier(tmp_path, num_blocks=4, ssd_slots=2, ssd_write_policy="write_back")
    a, b = np.arange(2 * P) + 1000, np.arange(3 * P) + 2000
    slots = torch.arange(3 * P, dtype=torch.int64)
    t.wait(t.store(a[:P], None, slots[:P]))
    t.evict(100)
    t.flush_lower()  # a's first block: SSD slot 0
    t.wait(t.store(a, None, slots[:2 * P]))
    t.evict(100)
    t.flush_lower()  # a's second block: SSD slot 1; the SSD is full
    t.destroy()
    t = make_ssd_tier(tmp_path, num_blocks=4, ssd_slots=2, ssd_write_policy="write_back")
    try:
        assert t.lower_tier("ssd").medium.match(page_hashes(a, P)).tolist() == [0, 1]
        t.wait(t.store(b, None, slots))  # 3 of the 4 CPU blocks
        # plans slots [0, 1]; room for 2 CPU blocks evicts one of b's, written back into the SSD's LRU slot: 0
        hit = t.lookup_tiers(a, None)
        if hit.read is not None:
            t.wait(hit.read)
        t.flush_lower()
        s = t.stats()
        assert s["ssd_blocks_corrupt"] == 0 and t.pool.num_free + s["pages_held"] == 4
    finally:
        t.destroy()
