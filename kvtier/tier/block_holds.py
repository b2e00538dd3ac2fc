"""BlockHolds: CPU blocks that lower-tier IO (an SSD write, a remote put or fetch) still reads or writes.

The CPU index may let such a block go (evict it) while the IO runs; the pool gets it back only when the last IO
holding it has ended. Nothing rewrites a block an IO still uses. Single-owner: called under the
:class:`~kvtier.tier.KVTier` lock.
"""

from __future__ import annotations

from typing import Callable, Protocol, TypeVar

import numpy as np

from kvtier.tier.host_pool import HostBlockPool


class _HoldsBlocks(Protocol):
    @property
    def host_ids(self) -> np.ndarray: ...


Job = TypeVar("Job", bound=_HoldsBlocks)  # an IO job of a lower tier

__all__ = ["BlockHolds"]


class BlockHolds:
    """Hold counts over the blocks of ``pool``."""

    def __init__(self, pool: HostBlockPool) -> None:
        self.pool = pool
        self.refs = np.zeros(pool.num_blocks, np.int32)  # IO jobs using each CPU block
        self.free_later = np.zeros(pool.num_blocks, bool)  # let go of while an IO uses it

    def hold(self, ids: np.ndarray) -> None:
        """An IO job starts using blocks ``ids`` (repeats allowed)."""
        np.add.at(self.refs, ids, 1)

    def drop(self, ids: np.ndarray) -> None:
        """An IO job that held ``ids`` has ended: those let go of and no longer held go back to the pool."""
        np.add.at(self.refs, ids, -1)
        done = ids[(self.refs[ids] == 0) & self.free_later[ids]]
        self.free_later[done] = False
        self.pool.free(np.unique(done))

    def release(self, ids: np.ndarray) -> None:
        """Blocks ``ids`` are let go of: back to the pool now, or when the last IO holding them ends."""
        busy = self.refs[ids] > 0
        self.free_later[ids[busy]] = True
        self.pool.free(ids[~busy])

    def settle(self, jobs: list[Job], ended: Callable[[Job], bool], account: Callable[[Job], None]) -> list[Job]:
        """Of IO ``jobs`` holding blocks (``job.host_ids``), account each that has ``ended`` and drop its
        holds; the jobs still running."""
        running = []
        for job in jobs:
            if ended(job):
                account(job)
                self.drop(job.host_ids)
            else:
                running.append(job)
        return running

    @property
    def num_deferred(self) -> int:
        """Blocks let go of that an IO still holds."""
        return int(self.free_later.sum())

    def reset(self) -> np.ndarray:
        """Everything is let go of (the index emptied): the blocks an IO still uses stay held, quarantined until
        the last IO holding them ends (:meth:`drop`), and are returned; every other block is the pool's again."""
        held = np.flatnonzero(self.refs > 0)
        self.free_later[:] = False
        self.free_later[held] = True
        return held
