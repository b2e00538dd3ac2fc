"""Several ranks read from their lower tiers alike: each rank's tier holds what its own writes made durable, so the
ranks offer different reads; they read the MIN of their offers and insert the MIN of what each verified
(:meth:`kvtier.tier.lower_tiers.LowerTiers.find_agreed`), so their CPU indexes stay identical. Two tiers in threads
of one process stand for two ranks, the toy medium of ``test_lower_protocol`` below each, and the agreement is an
exchange between the threads. Searched exhaustively over small states: blocks held below and the block whose read
fails, per rank."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvtier.index import Namespace
from kvtier.tier import KVTier
from kvtier.tier.lower import ReadPlan
from tests.test_lower_protocol import ToyTier, _registered, make, toy  # noqa: F401  (toy: the fixture)
from tests.tier_helpers import TINY, page_slots, prompt, same, slot_bytes

BLOCKS = 3  # of the prompt, all below the CPU pool
RANKS = 2
P = TINY.page_size


class Exchange:
    """The agreement between threads standing for ranks: every rank's list in, the element-wise MIN out."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks)
        self.offers: dict[int, list[int]] = {}

    def agree(self, rank: int, offer: list[int]) -> list[int]:
        self.offers[rank] = offer
        self.barrier.wait()
        out = [min(col) for col in zip(*self.offers.values())]
        self.barrier.wait()  # every rank has read the offers before the next exchange writes them
        return out


def rank_with_blocks_below(seed: int, toks, held: int, torn: int, medium_type=ToyTier) -> tuple[KVTier, ToyTier,
                                                                                               list]:
    """A rank's tier ("ordered", as under several ranks) whose CPU pool is empty and whose toy holds the first
    ``held`` blocks of ``toks`` (a later block's write had not ended), the read of block ``torn`` failing
    verification; the bytes stored."""
    tier = make(seed, finalize="ordered")
    medium = medium_type.opened[-1]
    src = page_slots(0, BLOCKS, P)
    want = slot_bytes(tier, src)
    tier.finalize(tier.store(toks, None, src))
    assert tier.evict(BLOCKS) == BLOCKS and tier.index.total_pages == 0
    hashes = list(medium.blocks)
    for h in hashes[held:]:
        del medium.blocks[h]
    medium.bad = set(hashes[torn:torn + 1])
    return tier, medium, want


def agreed_read(tiers: list[KVTier], toks, agree) -> list:
    """Each rank's lookup, in its own thread, through ``agree(rank, offer)``: the read task of each (or None)."""
    with ThreadPoolExecutor(len(tiers)) as pool:
        hits = list(pool.map(lambda r: tiers[r].lookup_tiers(toks, None, lambda o: agree(r, o)), range(len(tiers))))
    return [h.read for h in hits]


@pytest.mark.parametrize("held", list(itertools.product(range(BLOCKS + 1), repeat=RANKS)))
def test_ranks_read_what_every_rank_holds_and_insert_what_every_rank_verified(toy, held):  # noqa: F811
    toks = prompt(7, BLOCKS)
    for torn in itertools.product(range(BLOCKS + 1), repeat=RANKS):  # BLOCKS: no block torn
        ranks = [rank_with_blocks_below(r, toks, held[r], torn[r]) for r in range(RANKS)]
        tiers = [t for t, _, _ in ranks]
        reads = agreed_read(tiers, toks, Exchange(RANKS).agree)
        expect = min(held)
        assert [0 if t is None else t.num_pages for t in reads] == [expect] * RANKS, (held, torn)
        if expect:
            kept = min(tier.below.verified(t) for tier, t in zip(tiers, reads))
            assert kept == min(expect, *torn)
            for tier, t in zip(tiers, reads):
                tier.finalize(t, keep=kept)
        for tier, _, want in ranks:
            assert tier.lookup(toks) == min(expect, *torn)  # the same index on every rank
            dst = page_slots(20, BLOCKS, P)
            load = tier.load(toks, None, dst)
            tier.finalize(load)
            assert same(slot_bytes(tier, dst), want, load.num_pages)  # this rank's own bytes
            assert tier.in_flight() == {} and tier.pool.num_free + tier.index.total_pages == tier.pool.num_blocks
            tier.destroy()


def test_a_rank_that_verified_fewer_blocks_than_agreed_raises(toy):  # noqa: F811
    """Under TP the agreed count is a MIN that includes this rank's own; a rank that finds fewer (a later pipeline
    stage following the first stage's verdict) cannot hold the others' index, and says so."""
    toks = prompt(8, BLOCKS)
    tier, _, _ = rank_with_blocks_below(0, toks, BLOCKS, 1)
    (read,) = agreed_read([tier], toks, Exchange(1).agree)
    assert read.num_pages == BLOCKS and tier.below.verified(read) == 1
    with pytest.raises(RuntimeError, match="agreed on 2"):
        tier.finalize(read, keep=2)
    tier.destroy()


class ProbeJob:
    """A toy read that learns its count from a probe (as the remote tier's fetch): the probe finds the leading
    blocks its tier holds; then it wants CPU blocks, and is read once it has them."""

    def __init__(self, plan, found: int) -> None:
        self.plan, self.found, self.host_ids, self.ok = plan, found, np.empty(0, np.int64), 0
        self.given = self.ended = False

    def awaiting_blocks(self) -> bool:
        return not (self.given or self.ended)

    def done(self) -> bool:
        return self.given or self.ended

    def verified(self) -> int:
        return self.ok

    def wait(self, timeout=None) -> bool:
        return True

    def seconds(self):
        return 0.0


class ProbingToy(ToyTier):
    """The toy medium, probed: a plan asks for every block past the CPU hit, whatever the toy holds."""

    name = "probing-toy"
    count_at_plan = False

    def plan_read(self, tokens, ns, held, chain):
        if held >= chain.size:
            return None
        B = self.pool.geometry.page_size
        k = chain.size - held
        return ReadPlan(held, chain[held:], (ns or Namespace()).seed, tokens[held * B:(held + k) * B].reshape(k, B))

    def start_read(self, plan, task_id):
        found = 0
        while found < plan.hashes.size and int(plan.hashes[found]) in self.blocks:
            found += 1
        return ProbeJob(plan, found)

    def blocks_wanted(self, job, tokens, held_tokens) -> int:
        return job.found

    def fill(self, job, ids) -> None:
        if ids.size == 0:
            job.ended = True
            return
        super().fill(job, ids)


@pytest.fixture
def probing():
    yield from _registered(ProbingToy)


@pytest.mark.parametrize("held", list(itertools.product(range(BLOCKS + 1), repeat=RANKS)))
def test_ranks_agree_on_a_probed_count_before_any_cpu_block_is_given(probing, held):  # noqa: F811
    """A probed read starts on every rank (its plan asks for every block); no rank gives it a CPU block until the
    ranks agree on its count, the MIN of what each would read; then each inserts the MIN of what each verified."""
    toks = prompt(9, BLOCKS)
    for torn in itertools.product(range(BLOCKS + 1), repeat=RANKS):
        ranks = [rank_with_blocks_below(r, toks, held[r], torn[r], ProbingToy) for r in range(RANKS)]
        tiers = [t for t, _, _ in ranks]
        free = [t.pool.num_free for t in tiers]
        reads = agreed_read(tiers, toks, Exchange(RANKS).agree)
        assert all(t is not None and t.num_pages == 0 for t in reads)  # started, no block given
        assert [t.pool.num_free for t in tiers] == free
        for tier, t in zip(tiers, reads):
            tier.wait(t)  # ordered: a read whose count is agreed later is not given blocks by a wait either
            tier.poll()
            assert tier.below.count_known(t) and t.num_pages == 0
        count = min(tier.below.wanted(t) for tier, t in zip(tiers, reads))
        assert count == min(held)
        for tier, t in zip(tiers, reads):
            tier.below.count(t, count)
            assert t.num_pages == count
        kept = min(tier.below.verified(t) for tier, t in zip(tiers, reads))
        assert kept == min(count, *torn)
        for tier, t in zip(tiers, reads):
            tier.finalize(t, keep=kept)
        for tier, _, want in ranks:
            assert tier.lookup(toks) == kept
            dst = page_slots(20, BLOCKS, P)
            load = tier.load(toks, None, dst)
            tier.finalize(load)
            assert same(slot_bytes(tier, dst), want, load.num_pages)
            assert tier.in_flight() == {} and tier.pool.num_free + tier.index.total_pages == tier.pool.num_blocks
            tier.destroy()
