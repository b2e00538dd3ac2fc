"""A medium plugs in below the CPU pool through :mod:`kvtier.tier.lower` alone: an in-memory toy tier, registered
and opened by the registry, written through as blocks enter the CPU index and read back as ``"read"`` tasks, with
no line of :mod:`kvtier.tier.manager` naming it."""

from __future__ import annotations

import inspect
from typing import Optional

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier.tier.manager as manager
from kvtier.config import TierConfig
from kvtier.index import Namespace
from kvtier.tier import HostBlockPool, KVTier
from kvtier.tier.executor import DeferredExecutor
from kvtier.tier.lower import LowerTier, ReadPlan, register, registered, unregister
from tests.kv_helpers import make_kv
from tests.tier_helpers import TINY, page_slots, prompt, same, slot_bytes

P = TINY.page_size
IDENTITY = {"model": "toy-test", "tp_rank": 0, "tp_size": 1}


class ToyJob:
    """A toy read: done once it has its CPU blocks (the copy is synchronous)."""

    def __init__(self, plan: ReadPlan) -> None:
        self.plan, self.host_ids, self.given, self.ok = plan, np.empty(0, np.int64), False, 0

    def awaiting_blocks(self) -> bool:
        return not self.given

    def done(self) -> bool:
        return self.given

    def verified(self) -> int:
        return self.ok

    def wait(self, timeout: Optional[float] = None) -> bool:
        return True

    def seconds(self) -> Optional[float]:
        return 0.0


class ToyTier(LowerTier):
    """Blocks kept in a dict by chain hash: written as they enter the CPU index, read back into CPU blocks."""

    name = "toy"
    opened: list["ToyTier"] = []

    def __init__(self, pool, holds) -> None:
        self.pool, self.holds = pool, holds
        self.blocks: dict[int, np.ndarray] = {}
        self.bad: set[int] = set()  # chain hashes whose reads fail verification (torn)
        self.reads = self.writes = 0
        self.closed = False
        ToyTier.opened.append(self)

    @classmethod
    def open(cls, config, pool, holds, block_tokens, identity) -> "ToyTier":
        assert identity["model"] == "toy-test"  # the tier's model identity reaches the medium
        return cls(pool, holds)

    def entered(self, ids, tokens, ns, positions, hashes, source) -> None:
        if source == self.name:  # brought from here: nothing to write
            return
        for i, h in zip(ids, hashes):
            self.blocks[int(h)] = self.pool.block_rows(int(i)).copy()
            self.writes += 1

    def holds_next(self, hashes) -> bool:
        return int(hashes[0]) in self.blocks

    def plan_read(self, tokens, ns, held, chain):
        k = 0
        while held + k < chain.size and int(chain[held + k]) in self.blocks:
            k += 1
        if k == 0:
            return None
        B = self.pool.geometry.page_size
        return ReadPlan(held, chain[held:held + k], (ns or Namespace()).seed,
                        tokens[held * B:(held + k) * B].reshape(k, B))

    def start_read(self, plan, task_id):
        return ToyJob(plan)

    def blocks_wanted(self, job, tokens, held_tokens) -> int:
        return job.plan.hashes.size

    def fill(self, job, ids) -> None:
        for i, h in zip(ids, job.plan.hashes):
            self.pool.block_rows(int(i))[...] = self.blocks[int(h)]
        bad = [k for k, h in enumerate(job.plan.hashes[:ids.size]) if int(h) in self.bad]
        job.host_ids, job.given, job.ok = ids, True, bad[0] if bad else int(ids.size)
        self.reads += 1

    def end_read(self, job, cancelled) -> int:
        return 0 if cancelled else job.ok

    def stats(self) -> dict:
        return {"toy_blocks": len(self.blocks), "toy_reads": self.reads}

    def close(self, until=None) -> None:
        self.closed = True


def _registered(cls):
    """Register ``cls`` as the medium of its name (asked for by every config) for the test, then unregister it."""
    register(cls.name, cls.open, lambda config: True)
    cls.opened.clear()
    yield
    unregister(cls.name)


@pytest.fixture
def toy():
    yield from _registered(ToyTier)


def make(seed: int, num_blocks: int = 16, finalize: str = "auto") -> KVTier:
    """A tier over a tiny random KV pool (blocks of one page) with the toy below it."""
    kv = make_kv(TINY, 128, "cpu", torch.Generator().manual_seed(seed))
    return KVTier(kv, TierConfig(page_size=P, tokens_per_block=P, cpu_cache_gb=1.0), model_identity=IDENTITY,
                  pool=HostBlockPool(TINY, num_blocks), finalize=finalize)


def test_a_toy_medium_registered_through_the_protocol_serves_what_the_cpu_pool_evicted(toy):
    assert "toy" in registered()
    tier = make(0)
    (medium,) = ToyTier.opened
    assert tier.lower_tier("toy") is medium and "toy" in tier.describe()
    toks = prompt(1, 6)
    src = page_slots(0, 6, P)
    want = slot_bytes(tier, src)
    tier.wait(tier.store(toks, None, src))
    assert medium.writes == 6  # written through as the blocks entered the CPU index
    assert tier.evict(6) == 6 and tier.index.total_pages == 0
    hit = tier.lookup_tiers(toks, None)
    assert hit.cpu_pages == 0 and hit.read is not None and hit.read.source == "toy" and hit.read.kind == "read"
    assert hit.read.id in tier.in_flight() and tier.in_flight()[hit.read.id].completion.done()
    tier.wait(hit.read)
    assert tier.lookup(toks) == 6 and medium.writes == 6  # read back, not written again
    dst = page_slots(20, 6, P)
    task = tier.load(toks, None, dst)
    tier.wait(task)
    assert task.num_pages == 6 and same(slot_bytes(tier, dst), want, 6)
    s = tier.stats()
    assert s["reads"] == 1 and s["toy_reads"] == 1 and s["toy_blocks"] == 6
    tier.destroy()
    assert medium.closed


def test_a_cancelled_toy_read_gives_its_blocks_back_and_leaves_the_index_empty(toy):
    tier = make(1)
    toks = prompt(2, 4)
    tier.wait(tier.store(toks, None, page_slots(0, 4, P)))
    tier.evict(4)
    free = tier.pool.num_free
    hit = tier.lookup_tiers(toks, None)
    assert hit.read is not None and tier.pool.num_free == free - 4
    assert tier.cancel(hit.read)
    assert tier.pool.num_free == free and tier.in_flight() == {} and tier.index.total_pages == 0
    tier.destroy()


def test_the_manager_names_no_medium():
    source = inspect.getsource(manager).lower()
    assert not any(word in source for word in ("ssd", "remote", "mooncake", "toy"))


def test_a_read_that_gets_no_cpu_block_starts_no_task(toy):
    """Every CPU block owned by a store in flight: the toy holds the prefix, but no read can run, so the lookup
    returns none (a read task of 0 pages, never finalized by the caller, was returned here once)."""
    tier = make(2, num_blocks=4)
    toks = prompt(3, 4)
    tier.wait(tier.store(toks, None, page_slots(0, 4, P)))
    tier.evict(4)
    tier.executor = DeferredExecutor()  # the next store's copy stays in flight, its 4 blocks owned by it
    store = tier.store(prompt(4, 4), None, page_slots(8, 4, P))
    assert store.num_pages == 4 and tier.pool.num_free == 0
    hit = tier.lookup_tiers(toks, None)
    assert hit.read is None and hit.lower_pages == 0 and list(tier.in_flight()) == [store.id]
    assert tier.stats()["reads"] == 0 and tier.index.protected_pages == 0
    tier.wait(store)
    tier.destroy()


def test_the_in_flight_view_is_read_only_and_builtin_tiers_stay_registered(toy):
    tier = make(3)
    tier.executor = DeferredExecutor()
    store = tier.store(prompt(5, 4), None, page_slots(0, 4, P))
    view = tier.in_flight()[store.id]
    assert view.task is store and view.block_ids.size == 4 and view.tokens.size == 4 * P
    with pytest.raises(ValueError):
        view.block_ids[0] = -1  # a copy, and frozen: the tier's own record is out of reach
    tier.wait(store)
    assert tier.in_flight() == {}
    with pytest.raises(ValueError, match="ships with kvtier"):
        unregister("ssd")
    tier.destroy()


class HeldWriteJob:
    def __init__(self, ids: np.ndarray) -> None:
        self.host_ids = ids


class SlowWriteTier(ToyTier):
    """The toy, its writes holding their CPU blocks until :meth:`complete` (or a drain that waits) ends them: one
    rank's IO timing."""

    name = "slow"

    def __init__(self, pool, holds) -> None:
        super().__init__(pool, holds)
        self.pending: list[HeldWriteJob] = []

    @classmethod
    def open(cls, config, pool, holds, block_tokens, identity) -> "SlowWriteTier":
        return cls(pool, holds)

    def entered(self, ids, tokens, ns, positions, hashes, source) -> None:
        super().entered(ids, tokens, ns, positions, hashes, source)
        job = HeldWriteJob(ids.copy())
        self.holds.hold(job.host_ids)
        self.pending.append(job)

    def complete(self, k: int) -> None:
        """The ``k`` oldest writes return."""
        for job in self.pending[:k]:
            self.holds.drop(job.host_ids)
        del self.pending[:k]

    def drain(self, wait: bool = False, until=None) -> None:
        if wait:
            self.complete(len(self.pending))


@pytest.fixture
def slow():
    yield from _registered(SlowWriteTier)


def _ordered(seed: int) -> KVTier:
    kv = make_kv(TINY, 128, "cpu", torch.Generator().manual_seed(seed))
    return KVTier(kv, TierConfig(page_size=P, tokens_per_block=P, cpu_cache_gb=1.0), model_identity=IDENTITY,
                  pool=HostBlockPool(TINY, 12), finalize="ordered")


OPS = st.lists(st.tuples(st.sampled_from(["store", "complete_a", "complete_b", "evict"]), st.integers(0, 5),
                         st.integers(1, 6)), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS)
def test_ranks_whose_lower_tier_writes_return_at_other_moments_keep_identical_indexes(slow, ops):
    """Two ranks' tiers (finalize="ordered") under the same stores and evictions, each rank's lower-tier writes
    returning at its own moments: a block evicted while its write runs is held on one rank and free on the other,
    yet every allocation evicts the same blocks and gets as many on both, so their indexes stay identical; and with
    several ranks the lookup starts no lower-tier read (the ranks have not agreed on one)."""
    SlowWriteTier.opened.clear()
    a, b = _ordered(0), _ordered(0)
    slow_a, slow_b = SlowWriteTier.opened
    prompts = [prompt(i, 6) for i in range(6)]
    for op, i, k in ops:
        if op == "store":
            for t in (a, b):
                task = t.store(prompts[i][:k * P], None, page_slots(0, k, P))
                t.finalize(task)
        elif op == "complete_a":
            slow_a.complete(k)
        elif op == "complete_b":
            slow_b.complete(k)
        else:
            assert a.evict(k) == b.evict(k)
        held = [[t.lookup(p) for p in prompts] for t in (a, b)]
        assert held[0] == held[1], (op, i, k)
        assert a.index.total_pages == b.index.total_pages
        assert all(t.lookup_tiers(prompts[i], None).read is None for t in (a, b))
    for t in (a, b):
        t.destroy()
