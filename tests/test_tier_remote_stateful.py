"""Stateful test of KVTier with its remote tier, against a real ``mooncake_master``: random interleavings of store
(written through to the store) / lookup (a fetch, waited for or not) / load / poll / evict / reset (the CPU tier
emptied: what the store holds comes back by fetches) / keys dropped from the store behind the tier's back.

The CPU pools are tiny (4-8 blocks of one page) so that they evict all the time; the put and fetch threads and the
store run for real. Every page has canonical bytes derived from its (namespace, token prefix) (as in the SSD
machine), so every copy of a page, on the CPU or in the store, must hold the same bytes. Checked:

* bytes: every load delivered the canonical bytes of every page it reported;
* CPU blocks: free + held by the CPU index + owned by in-flight stores and fetches + let go of while a remote call
  still uses them == the pool; the holds are exactly the blocks of the unfinished puts and abandoned fetches;
* a fetch waited for never fails a check (no value is forged here) and its pages are CPU hits.
"""

from __future__ import annotations

import uuid

import numpy as np
import torch
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvtier.index import page_hashes
from kvtier.index._state import DEPTH, M_HIGH
from tests.mooncake_master import Master, require_mooncake
from tests.test_tier_remote import make_remote_tier
from tests.test_tier_ssd_stateful import MAX_PAGES, NAMESPACES, canonical, layouts, region_slots, seqs
from tests.tier_helpers import TINY

P = TINY.page_size


class RemoteTierMachine(RuleBasedStateMachine):
    master: Master  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.tier = None

    @initialize(num_blocks=st.integers(4, 8), layout=layouts)
    def start(self, num_blocks, layout) -> None:
        note(f"start: {num_blocks} CPU blocks, {layout}")
        self.tier = make_remote_tier(self.master.addr, layout=layout, num_blocks=num_blocks,
                                     remote_key_prefix=f"stateful-{uuid.uuid4().hex[:8]}", remote_timeout_s=30.0)
        self.rows = [b.view(torch.uint8).view(b.shape[0], -1) for b in self.tier.kv.buffers]
        self.prompts: list[tuple] = []

    def teardown(self) -> None:
        if self.tier is not None:
            self.tier.wait_all()
            self.tier.destroy()

    def _pick(self, data) -> tuple:
        fresh = st.tuples(seqs, st.integers(0, len(NAMESPACES) - 1))
        if not self.prompts:
            return data.draw(fresh)
        return data.draw(st.one_of(st.sampled_from(self.prompts), st.sampled_from(self.prompts), fresh))

    # --- rules ---

    @rule(data=st.data())
    def store(self, data) -> None:
        toks, ns_i = self._pick(data)
        slots = region_slots(0, False)
        for k in range(len(toks) // P):
            page = torch.from_numpy(canonical(ns_i, tuple(toks[:(k + 1) * P])))
            for b, rows in enumerate(self.rows):
                rows[slots[k * P:(k + 1) * P]] = page[b]
        task = self.tier.store(np.array(toks), NAMESPACES[ns_i], slots[:len(toks) // P * P])
        self.tier.wait(task)
        note(f"store {toks} ns={ns_i}: {task.num_pages} new pages")
        if (toks, ns_i) not in self.prompts:
            self.prompts.append((toks, ns_i))

    @rule(data=st.data(), wait=st.booleans())
    def lookup(self, data, wait) -> None:
        toks, ns_i = self._pick(data)
        hit = self.tier.lookup_tiers(np.array(toks), NAMESPACES[ns_i])
        task = hit.read
        note(f"lookup {toks} ns={ns_i}: {hit.cpu_pages} on the CPU, {task}")
        if task is not None and wait:
            before = self.tier.stats()["remote_blocks_corrupt"]
            self.tier.wait(task)
            assert task.status in ("done", "cancelled")
            assert self.tier.stats()["remote_blocks_corrupt"] == before  # nothing forged: every value checks
            if task.status == "done" and task.num_pages:
                assert self.tier.lookup(np.array(toks), NAMESPACES[ns_i]) >= task.num_held + 1

    @rule(data=st.data())
    def load(self, data) -> None:
        self.load_prompt(*self._pick(data))

    def load_prompt(self, toks, ns_i) -> None:
        dst = region_slots(0, True)
        task = self.tier.load(np.array(toks), NAMESPACES[ns_i], dst)
        self.tier.wait(task)
        got = torch.stack([rows[dst] for rows in self.rows]).numpy()
        for k in range(task.num_pages):
            want = canonical(ns_i, tuple(toks[:(k + 1) * P]))
            assert np.array_equal(got[:, k * P:(k + 1) * P], want), f"page {k} of {toks} ns={ns_i}: wrong bytes"
        note(f"load {toks} ns={ns_i}: {task.num_pages} pages")

    @rule()
    def poll(self) -> None:
        self.tier.poll()

    def _scribble_free(self) -> None:
        """Junk into every free CPU block: a block that a fetch fills must not pass for a page by its old bytes."""
        pool = self.tier.pool
        for b in range(pool.num_blocks):
            if pool.is_free(b):
                pool.block_rows(b)[...] = 0xA5

    @rule(n=st.integers(1, MAX_PAGES))
    def evict(self, n) -> None:
        self.tier.evict(n)
        self._scribble_free()

    @rule()
    def reset(self) -> None:
        self.tier.reset()  # the CPU tier empty; the store keeps what was put
        self._scribble_free()

    @rule(data=st.data(), k=st.integers(0, MAX_PAGES - 1))
    def drop_key(self, data, k) -> None:
        if not self.prompts:
            return
        toks, ns_i = data.draw(st.sampled_from(self.prompts))
        hashes = page_hashes(np.array(toks[:len(toks) // P * P]), P, NAMESPACES[ns_i])
        if k < hashes.size:
            medium = self.tier.lower_tier("remote").medium
            medium.store.remove(medium.keys(hashes[k:k + 1]))

    @rule(data=st.data(), k=st.integers(0, MAX_PAGES - 1))
    def key_gone_between_probe_and_get(self, data, k) -> None:
        """A fetch's probe returns, then the store drops one of the blocks it found, then the get runs."""
        if not self.prompts:
            return
        toks, ns_i = data.draw(st.sampled_from(self.prompts))
        hit = self.tier.lookup_tiers(np.array(toks), NAMESPACES[ns_i])
        task = hit.read
        if task is None or task.kind != "read" or task.id not in self.tier.in_flight():
            return
        job = self.tier.in_flight()[task.id].completion
        assert job.wait(30)
        if job.found > k:
            medium = self.tier.lower_tier("remote").medium
            medium.store.remove(medium.keys(job.hashes[k:k + 1]))
        self.tier.wait(task)
        note(f"fetch of {toks} ns={ns_i}: {job.found} found, block {k} dropped, {job.ok} read")
        self.load_prompt(toks, ns_i)

    # --- invariants ---

    @invariant()
    def cpu_blocks_accounted(self) -> None:
        t = self.tier
        if t is None:
            return
        st_ = t.index._st
        high = int(st_.meta[M_HIGH])
        held = int((st_.i32[DEPTH, :high] >= 0).sum())
        owned = sum(r.block_ids.size for r in t.in_flight().values() if r.task.kind in ("store", "read"))
        deferred = t.holds.num_deferred
        assert t.pool.num_free + held + owned + deferred == t.pool.num_blocks, (
            t.pool.num_free, held, owned, deferred)
        refs = np.zeros(t.pool.num_blocks, np.int32)
        for job in t.lower_tier("remote")._puts + t.lower_tier("remote")._abandoned:
            np.add.at(refs, job.host_ids, 1)
        assert np.array_equal(refs, t.holds.refs), "remote holds out of step with the unfinished calls"


def test_remote_tier_state_machine(tmp_path):
    require_mooncake()
    master = Master(str(tmp_path))
    try:
        RemoteTierMachine.master = master
        run_state_machine_as_test(RemoteTierMachine, settings=settings(
            max_examples=25, stateful_step_count=20, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
    finally:
        master.kill()
