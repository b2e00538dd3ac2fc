"""BlockRoom: CPU blocks for new pages, and room made for them by evicting from the CPU index.

Free blocks first; when too few are free, unlocked blocks are evicted (the eviction policy's choice) and go back to
the pool through the lower tiers' write policies (a write-back tier writes them now), once no lower-tier IO holds
them (:class:`~kvtier.tier.block_holds.BlockHolds`).

``ordered`` (the ranks of one cache finalize in an agreed order and their indexes must evolve alike): how many blocks
to evict, and how many an allocation gets, count free and held blocks together, which is the same on every rank
whatever its IO's timing; blocks this rank's IO still holds are waited for (each tier by its deadline).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from kvtier.tier.block_holds import BlockHolds
from kvtier.tier.host_pool import HostBlockPool
from kvtier.tier.lower import LowerTier

__all__ = ["BlockRoom"]


class BlockRoom:
    """Allocation and eviction of one tier's CPU blocks; ``on_evicted(ids)`` hears of every eviction first."""

    def __init__(self, pool: HostBlockPool, index, eviction, holds: BlockHolds, lower: Sequence[LowerTier],
                 on_evicted: Callable[[np.ndarray], None], *, ordered: bool = False) -> None:
        self.pool, self.index, self.eviction, self.holds = pool, index, eviction, holds
        self.lower, self.on_evicted, self.ordered = lower, on_evicted, ordered

    def evict(self, n: int) -> int:
        """Evict up to ``n`` unlocked blocks, chosen by the eviction policy, and let them go; returns how many."""
        ids = self.eviction.evict(n)
        self.on_evicted(ids)
        for t in self.lower:
            t.evicted(ids)
        self.holds.release(ids)  # to the pool once no lower-tier IO uses them
        return int(ids.size)

    def alloc(self, n: int) -> np.ndarray:
        """Up to ``n`` free blocks, evicting for room; fewer when not enough can be evicted, or when the evicted
        blocks are held by lower-tier writes (a write-back tier then has blocks evicted ahead of the next
        allocation, :meth:`~kvtier.tier.lower.LowerTier.reclaim`)."""
        if self.ordered:
            return self._alloc_ordered(n)
        ids = self.pool.alloc(n)
        if ids is None:
            for t in self.lower:
                t.drain()  # finished writes give their blocks back (perhaps all that is missing)
            self.evict(max(0, n - self.pool.num_free))
            ids = self.pool.alloc(min(n, self.pool.num_free))
            if ids is None:
                ids = np.empty(0, np.int64)
            if ids.size < n:
                for t in self.lower:
                    t.came_short(n, held=self.holds.num_deferred)
        return self._reclaim(ids)

    def _alloc_ordered(self, n: int) -> np.ndarray:
        """:meth:`alloc` the same on every rank: room is free and held blocks together; this rank's IO holding
        blocks it needs is waited for."""
        room = self.pool.num_free + self.holds.num_deferred
        if room < n:
            room += self.evict(n - room)
        k = min(n, room)
        if self.pool.num_free < k:
            for t in self.lower:
                t.drain(wait=True, until=time.monotonic() + t.close_timeout_s)
        ids = self.pool.alloc(k)
        if ids is None:
            raise RuntimeError(f"kvtier: {k - self.pool.num_free} CPU blocks are still held by lower-tier IO past "
                               "its deadline: this rank's host tier can no longer evolve as the other ranks' do")
        return self._reclaim(ids)

    def _reclaim(self, ids: np.ndarray) -> np.ndarray:
        """After an allocation: a write-back tier's blocks evicted ahead of the next (``ids`` given back if that
        raises)."""
        if self.lower:
            ahead = max(t.reclaim(self.pool.num_free, self.holds.num_deferred) for t in self.lower)
            if ahead:
                try:
                    self.evict(ahead)
                except BaseException:
                    self.pool.free(ids)
                    raise
        return ids

    def alloc_under(self, handle, n: int) -> np.ndarray:
        """:meth:`alloc` for new blocks hanging from the prefix ``handle`` (locked; None: no prefix), which is
        unlocked again if making room fails (an eviction policy that raises)."""
        try:
            return self.alloc(n)
        except BaseException:
            if handle is not None:
                self.index.unlock(handle)
            raise
