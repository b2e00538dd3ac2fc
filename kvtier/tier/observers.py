"""What a :class:`~kvtier.tier.KVTier` reports as it runs, for metrics, logs and KV events.

A :class:`TierObserver` (added with ``KVTier.add_observer``) is told of every completed transfer, of every block
that enters or leaves the CPU index, and of the blocks a lower tier (SSD, remote) comes to hold or stops holding.
Hooks run on the caller's thread, under the tier's lock: they must be quick and must not call back into the tier.
An observer that raises is logged and dropped; the tier carries on.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import numpy as np

__all__ = ["Transfer", "TierObserver", "Observers", "TIERS", "OPS"]

logger = logging.getLogger(__name__)

TIERS: tuple[str, ...] = ("cpu", "ssd", "remote")
OPS: tuple[str, ...] = ("store", "load")  # into the tier, out of it (towards the GPU)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One completed transfer.

    Attributes:
        tier: ``"cpu"`` (GPU <-> pinned CPU blocks), ``"ssd"`` or ``"remote"`` (CPU blocks <-> that tier).
        op: ``"store"`` (into ``tier``: a D2H copy, an SSD write, a remote put) or ``"load"`` (out of it: an H2D
            copy, an SSD read promoting blocks to the CPU, a remote fetch).
        pages: engine pages moved (for SSD and remote: the blocks' pages that arrived intact).
        nbytes: bytes moved.
        seconds: its duration (CUDA events on the GPU, wall time of the IO otherwise); None when unknown.
    """

    tier: str
    op: str
    pages: int
    nbytes: int
    seconds: Optional[float]

    @property
    def gbps(self) -> Optional[float]:
        return self.nbytes / self.seconds / 1e9 if self.seconds and self.nbytes else None


class TierObserver:
    """Every hook is a no-op here; an observer overrides those it watches."""

    def transfer_done(self, transfer: Transfer) -> None:
        """A transfer completed (failed and cancelled ones are not reported: the stats count them)."""

    def blocks_entered(self, block_ids: np.ndarray, tokens: np.ndarray, ns, positions: np.ndarray) -> None:
        """CPU blocks ``block_ids`` entered the index; block ``i`` holds ``tokens``' block ``positions[i]``
        (``tokens`` runs from the prefix's first token, in the namespace ``ns``)."""

    def blocks_evicted(self, block_ids: np.ndarray) -> None:
        """CPU blocks ``block_ids`` left the index (LRU eviction)."""

    def cleared(self) -> None:
        """Every CPU block left the index (``KVTier.reset``)."""

    def lower_stored(self, tier: str, hashes: np.ndarray, block_ids: np.ndarray) -> None:
        """Lower tier ``tier`` (``"ssd"``, ``"remote"``) now holds the blocks of chain ``hashes``, written from CPU
        blocks ``block_ids`` (each entered the CPU index earlier, and is unchanged until this returns)."""

    def lower_removed(self, tier: str, hashes: np.ndarray) -> None:
        """Lower tier ``tier`` no longer holds the blocks of chain ``hashes`` (evicted, or failed a check). The
        remote tier reports none: its values leave when the master evicts them or their holder stops."""


class Observers:
    """A tier's observers; :meth:`notify` calls a hook on each (one that raises is logged and dropped). Truthy
    when there is any, so that a caller builds a hook's arguments only then."""

    def __init__(self) -> None:
        self._list: list[TierObserver] = []

    def __bool__(self) -> bool:
        return bool(self._list)

    def add(self, observer: TierObserver) -> None:
        self._list.append(observer)

    def remove(self, observer: TierObserver) -> None:
        if observer in self._list:
            self._list.remove(observer)

    def all(self) -> tuple[TierObserver, ...]:
        return tuple(self._list)

    def notify(self, hook: str, *args) -> None:
        for observer in list(self._list):
            try:
                getattr(observer, hook)(*args)
            except Exception:
                logger.exception("kvtier: observer %r failed in %s; it is dropped", observer, hook)
                self._list.remove(observer)
