"""RoomAdvice: warnings for stores a tier drops for lack of room, each naming the config key to raise.

A tier that cannot place what it is asked to store drops it and counts it (the stats); these warnings tell the
operator why and what to change. The first drop of a kind is logged at once; later ones at most once per
``interval_s``, with the count since the last line, so a saturated tier logs a line a minute, not one per request.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

__all__ = ["RoomAdvice", "INTERVAL_S"]

logger = logging.getLogger("kvtier.room")

INTERVAL_S = 60.0  # the shortest time between two warnings of one kind


class RoomAdvice:
    """Rate-limited drop warnings of one tier (single-owner: called under the tier's lock)."""

    def __init__(self, *, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._last: dict[str, float] = {}  # kind -> when its last warning was logged
        self._since: dict[str, int] = {}  # kind -> units dropped since then, not yet logged

    def host_store_dropped(self, dropped: int, prefix_blocks: int, pool, block_tokens: int) -> None:
        """A host-tier store of a ``prefix_blocks``-block prefix into ``pool`` (a host pool of blocks of
        ``block_tokens`` tokens) got no block for its last ``dropped``."""
        pool_blocks, block_bytes = pool.num_blocks, pool.block_bytes
        if prefix_blocks > pool_blocks:
            self._note("host_pool_small", dropped, lambda n, s: (
                f"kvtier: the host pool holds {pool_blocks} blocks ({pool_blocks * block_tokens} tokens) per rank, "
                f"fewer than one request's prefix ({prefix_blocks} blocks): {n} blocks of such stores were not "
                f"stored{s}. Raise cpu_cache_gb above {prefix_blocks * block_bytes / 2**30:.3g} (GiB per rank)"))
        else:
            self._note("host_no_room", dropped, lambda n, s: (
                f"kvtier: {n} blocks of host-tier stores were dropped for lack of room{s}: every other host block "
                "was locked by a load or held by a store or an SSD/remote write in flight. Raise cpu_cache_gb"))

    def ssd_write_dropped(self, *, dropped: int, queue_full: bool) -> None:
        """An SSD write dropped ``dropped`` blocks: its queue was full, or no slot could be had."""
        if queue_full:
            self._note("ssd_queue_full", dropped, lambda n, s: (
                f"kvtier: {n} blocks of SSD writes were dropped{s}: the disk falls behind the blocks to write (the "
                "queue holds half the host pool, at most 8 GiB). Raise ssd_io_threads, or cpu_cache_gb for a "
                "longer queue"))
        else:
            self._note("ssd_no_slot", dropped, lambda n, s: (
                f"kvtier: {n} blocks of SSD writes were dropped{s}: every SSD slot was being read or written. "
                "Raise ssd_cache_gb"))

    def remote_put_dropped(self, *, dropped: int) -> None:
        """A remote put dropped ``dropped`` blocks: its queue was full."""
        self._note("remote_queue_full", dropped, lambda n, s: (
            f"kvtier: {n} blocks of remote puts were dropped{s}: the store takes them more slowly than they arrive "
            "(the queue holds half the host pool, at most 4 GiB). Raise cpu_cache_gb for a longer queue"))

    def _note(self, kind: str, count: int, text: Callable[[int, str], str]) -> None:
        """``count`` more drops of ``kind``; logs ``text(drops, when)`` unless one was logged within the interval."""
        now = self.clock()
        total = self._since.get(kind, 0) + count
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._since[kind] = total
            return
        when = "" if last is None else f" in the last {now - last:.0f} s"
        logger.warning(text(total, when) + (f" (at most one such warning per {self.interval_s:.0f} s)"
                                            if last is None else ""))
        self._last[kind], self._since[kind] = now, 0
