"""LowerTiers: how :class:`~kvtier.tier.KVTier` drives its lower tiers (:mod:`kvtier.tier.lower`): what they hear of
the CPU index, their reads as tasks, and their writes at close.

A lookup past the CPU hit asks each lower tier in order for a read (:meth:`LowerTiers.find`); the first that plans
one starts it as a ``"read"`` task, whose CPU blocks are allocated once its count is known (:meth:`advance`), and
whose verified leading blocks enter the CPU index when it is finalized (:meth:`finalize`). Waits let go of the
tier's lock and are bounded by the read's tier (:meth:`wait`). Runs under the tier's lock, on the tier's index, room
and task table.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, cast

import numpy as np

from kvtier.index import page_hashes
from kvtier.tier.host_pool import synchronized
from kvtier.tier.lower import LowerTier, ReadPlan, SharedRead
from kvtier.tier.observers import Transfer
from kvtier.tier.tasks import InsertRecord, TaskKind
from kvtier.tier.tier_stats import TierHit


def _tier(rec: InsertRecord) -> LowerTier:
    """The lower tier of a read's record (every read's record names one)."""
    assert rec.tier is not None
    return rec.tier

__all__ = ["LowerTiers", "Agree"]

Agree = Callable[[list[int]], list[int]]  # each rank's offer per lower tier -> the MIN of each over the ranks


class LowerTiers:
    """A tier's lower tiers, fastest first; ``owner`` is the :class:`~kvtier.tier.KVTier` they serve."""

    def __init__(self, owner, lower: list[LowerTier]) -> None:
        self.owner, self.lower = owner, lower
        self._lock = owner._lock  # the public calls take the owner's lock

    def named(self, name: str) -> Optional[LowerTier]:
        return next((t for t in self.lower if t.name == name), None)

    def used(self, toks: np.ndarray, ns, num_blocks: int) -> None:
        """A prefix of ``num_blocks`` blocks of ``toks`` was loaded from the CPU tier."""
        if any(t.wants_used() for t in self.lower):
            B = self.owner.block_tokens
            hashes = page_hashes(toks[:num_blocks * B], B, ns)
            for t in self.lower:
                t.used(hashes)

    def entered(self, ids: np.ndarray, toks: np.ndarray, ns, positions: np.ndarray, source: Optional[str]) -> None:
        """CPU blocks ``ids`` entered the CPU index as blocks ``positions`` of ``toks``."""
        if self.lower and ids.size:
            B = self.owner.block_tokens
            hashes = page_hashes(toks[:(int(positions[-1]) + 1) * B], B, ns)[positions]  # once, for every tier
            for t in self.lower:
                t.entered(ids, toks, ns, positions, hashes, source)

    def write_back_all(self) -> None:
        """At destroy: a write-back tier is given every CPU block (a restart serves them), a round at a time."""
        for t in self.lower:
            batch = t.before_close_evict()
            if batch:
                t.drain(wait=True)
                while self.owner.room.evict(batch):
                    t.drain(wait=True)

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """The owner's lock let go of (however deeply this thread holds it) for the block: other threads' calls
        (stats, lookups) run while this one waits on IO."""
        state = self.owner._lock._release_save()
        try:
            yield
        finally:
            self.owner._lock._acquire_restore(state)

    def find(self, toks: np.ndarray, ns, m, n: int, agree: Optional[Agree] = None) -> TierHit:
        """The CPU hit ``m`` of ``toks``'s first ``n`` blocks, and the read that brings the blocks past it: from the
        first tier that holds (or may hold) the next block, started here unless one from the same block is in
        flight (none when admission refuses it). Several ranks (ordered finalization): no read, unless ``agree``
        is given (:meth:`find_agreed`)."""
        o = self.owner
        G, held = o._pages_per_block, m.num_pages
        hit = held * G
        if held >= n or not self.lower or (not o._auto_finalize and agree is None):
            return TierHit(hit, 0, None)
        chain = page_hashes(toks[:n * o.block_tokens], o.block_tokens, ns)  # once, for every lower tier
        if not o._auto_finalize:
            assert agree is not None  # tested above
            return self.find_agreed(toks, ns, m, chain, agree)
        for tier in self.lower:
            plan = tier.plan_read(toks, ns, held, chain)
            if isinstance(plan, SharedRead):
                rec = o._inflight.get(plan.task_id)  # it brings the blocks both share, of those it got blocks for
                return (TierHit(hit, min(plan.blocks * G, rec.task.num_pages), rec.task) if rec is not None
                        else TierHit(hit, 0, None))
            if plan is not None:
                task = self.start(tier, toks, ns, m, plan)
                return TierHit(hit, task.num_pages if task is not None else 0, task)
            if tier.holds_next(chain[held:held + 1]):  # held (refused, or no room): not asked further down
                break
        return TierHit(hit, 0, None)

    def find_agreed(self, toks: np.ndarray, ns, m, chain: np.ndarray, agree: Agree) -> TierHit:
        """:meth:`find` for several ranks, whose lower tiers differ (each rank's writes end at its own moments):
        each offers, per tier, the blocks it would read (0 below the first tier that plans a read, holds the next
        block or reads it already), ``agree`` returns the MIN of each offer over the ranks, and the first tier with
        a nonzero MIN reads exactly that many blocks on every rank (a tier whose count comes later, from a probe,
        probes that many: the owner agrees on the count, :meth:`count_known`, :meth:`wanted`, :meth:`count`). A
        read in flight is not shared: whether it covers this query depends on this rank's lower index. ``chain``:
        the chain hashes of the blocks looked up."""
        held, G = m.num_pages, self.owner._pages_per_block
        plans: list[Optional[ReadPlan]] = [None] * len(self.lower)
        for i, tier in enumerate(self.lower):
            plan = tier.plan_read(toks, ns, held, chain)
            if isinstance(plan, ReadPlan):
                plans[i] = plan
            if plan is not None or tier.holds_next(chain[held:held + 1]):
                break
        agreed = agree([0 if p is None else int(p.hashes.size) for p in plans])
        for tier, plan, k in zip(self.lower, plans, agreed):
            if k:
                if plan is None or k > plan.hashes.size:  # a verdict this rank did not take part in
                    raise RuntimeError(f"kvtier: the ranks agreed on reading {k} blocks of the {tier.name} tier, "
                                       "more than this rank offered: its lower tier lags the deciding ranks'")
                task = self.start(tier, toks, ns, m, plan.head(k))
                return TierHit(held * G, task.num_pages if task is not None else 0, task)
        return TierHit(held * G, 0, None)

    def start(self, tier: LowerTier, toks: np.ndarray, ns, m, plan: ReadPlan):
        """Start ``tier``'s read of ``plan``'s blocks past the CPU-held prefix ``m`` (locked until the task is
        finalized); its CPU blocks are allocated as soon as its count is known."""
        o = self.owner
        held, B = plan.held, o.block_tokens
        task = o.tasks.new(TaskKind.READ, 0, num_held=held * o._pages_per_block)
        task.source = tier.name
        job = tier.start_read(plan, task.id)
        if job is None:
            return None
        if held:
            o.index.lock(m)
        rec = InsertRecord(task, job, np.empty(0, np.int64), m if held else None, 0,
                           tokens=toks[:(held + plan.hashes.size) * B].copy(), ns=ns,
                           prefix_ids=np.array(m.block_ids[:held], dtype=np.int64), tier=tier)
        o._inflight[task.id] = rec
        if job.awaiting_blocks() and self._counts_alone(tier):
            try:
                self.advance(rec)
            except BaseException:  # making room failed (an eviction policy's bug): nothing of the read is left
                self._undo(rec)
                raise
            if rec.block_ids.size == 0:  # no CPU block could be had: no read runs
                self._undo(rec)
                return None
        o._stats.reads += 1
        return task

    def _undo(self, rec: InsertRecord) -> None:
        """A read that never ran (it got no CPU block): gone from the task table, ended, its prefix unlocked."""
        del self.owner._inflight[rec.task.id]
        if rec.completion.awaiting_blocks():
            _tier(rec).fill(rec.completion, np.empty(0, np.int64))
        _tier(rec).end_read(rec.completion, cancelled=True)
        if rec.handle is not None:
            self.owner.index.unlock(rec.handle)

    def _counts_alone(self, tier: LowerTier) -> bool:
        """Whether this rank gives a read of ``tier`` its CPU blocks as soon as its count is known (one rank, or a
        count known at the plan, which the ranks agreed on); else only at the count the ranks agree on."""
        return self.owner._auto_finalize or tier.count_at_plan

    def _read(self, task) -> Optional[InsertRecord]:
        rec = self.owner._inflight.get(task.id)
        return cast(InsertRecord, rec) if rec is not None and task.kind.reads_lower_tier else None

    @synchronized
    def count_known(self, task) -> bool:
        """Whether the read ``task`` knows how many blocks it would read (its probe has returned, or it ended)."""
        rec = self._read(task)
        return rec is None or rec.completion.awaiting_blocks() or rec.completion.done()

    @synchronized
    def wanted(self, task) -> int:
        """The blocks this rank would read for ``task`` once :meth:`count_known` (its tier's admission decides; 0
        once it ended): the offer of the count agreement."""
        rec = self._read(task)
        if rec is None or not rec.completion.awaiting_blocks():
            return 0
        return _tier(rec).blocks_wanted(rec.completion, rec.tokens.size, rec.prefix_ids.size * self.owner.block_tokens)

    @synchronized
    def count(self, task, k: int) -> None:
        """Give the read ``task`` CPU blocks for ``k`` blocks (the ranks' agreed count, at most :meth:`wanted`)
        and start reading them; 0 ends it unread. No-op for a read that ended (given up on)."""
        rec = self._read(task)
        if rec is not None and rec.completion.awaiting_blocks():
            self.advance(rec, k)

    @synchronized
    def verified(self, task) -> int:
        """A read's leading blocks read and verified so far (final once it has completed)."""
        rec = self._read(task)
        return rec.completion.verified() if rec is not None else 0

    def advance(self, rec: InsertRecord, count: Optional[int] = None) -> None:
        """A read's count is known: allocate CPU blocks for what its tier admits (or ``count``, agreed) and start
        reading into them (none: it ends unread)."""
        o = self.owner
        job, tier, held = rec.completion, _tier(rec), rec.prefix_ids.size
        k = tier.blocks_wanted(job, rec.tokens.size, held * o.block_tokens) if count is None else count
        ids = np.empty(0, np.int64)
        if k:
            with tier.pinned(job):  # making room may write back evicted CPU blocks: what the read reads stays put
                ids = o.room.alloc_under(None, k)
        rec.block_ids, rec.nbytes = ids, int(ids.size) * o.pool.block_bytes
        rec.task.num_pages = int(ids.size) * o._pages_per_block
        tier.fill(job, ids)

    def poll(self, rec: InsertRecord) -> None:
        """A drain met ``rec``: blocks for it if it wants them, and its tier's deadline (polled, never waited for,
        it meets the same bound)."""
        if rec.completion.awaiting_blocks() and self._counts_alone(_tier(rec)):
            self.advance(rec)
        _tier(rec).check_deadline(rec.completion)

    def wait(self, rec: InsertRecord, discard: bool) -> None:
        """Block until the read is done, each call at most its tier's deadline (past it, it is given up on: it
        brings nothing, and its CPU blocks stay held until its IO returns); ``discard``: it is dropped after the
        wait, so it is waited for only as its tier requires."""
        job, tier = rec.completion, _tier(rec)
        if discard:
            tier.before_discard(job)
            return
        while not job.done() and self.owner._pending(rec):
            if job.awaiting_blocks():
                if not self._counts_alone(tier):  # its count is agreed first (a round of the ranks' agreement)
                    return
                self.advance(rec)
            elif not tier.wait_read(job, self.released):
                return

    def wait_progress(self, rec: InsertRecord, timeout_s: float) -> None:
        """Block at most ``timeout_s``, the owner's lock let go of, until the read's IO returns (at once when it is
        done or wants CPU blocks: the next drain advances it)."""
        job = rec.completion
        if not (job.done() or job.awaiting_blocks()):
            with self.released():
                job.wait(timeout_s)

    def finalize(self, rec: InsertRecord, cancelled: bool, limit: Optional[int] = None) -> None:
        """A read's verified leading blocks (at most ``limit``: the count several ranks agreed on) enter the index;
        the others go back to the pool, once no IO uses them (a read given up on: its tier holds them)."""
        o = self.owner
        job, tier, G = rec.completion, _tier(rec), o._pages_per_block
        ok = tier.end_read(job, cancelled)
        if limit is not None:
            if ok < limit:
                raise RuntimeError(f"kvtier: a {tier.name} read verified {ok} blocks on this rank where the ranks "
                                   f"agreed on {limit}: this rank's CPU tier would differ from the others'")
            ok = limit
        o.holds.release(rec.block_ids[ok:])
        inserted = int(o._insert(rec, ok).sum()) * G if ok else 0
        tier.note_read(inserted, 0 if cancelled else (rec.block_ids.size - ok) * G)
        if o._observers and ok:
            o._observers.notify("transfer_done", Transfer(tier.name, "load", ok * G, ok * o.pool.block_bytes,
                                                          job.seconds()))
