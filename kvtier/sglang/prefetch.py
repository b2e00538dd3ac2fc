"""The prefetch policy: a waiting request whose prefix is being read from a lower tier (SSD, remote) is held back
until the read is done or its deadline passes (SGLang HiCache's ``--hicache-storage-prefetch-policy``).

SGLang 0.5.23's scheduler asks the tree cache, for each waiting request in its admission loop, whether the
request's prefetch is done (``check_prefetch_progress``: False skips the request this round, the next ones are
still offered), and pops what the prefetch loaded (``pop_prefetch_loaded_span``). It runs that gate only with a
HiCache storage backend or ``--enable-lmcache``; with ``--radix-cache-backend kvtier --enable-lmcache`` the named
backend is built (LMCache is never imported) and kvtier answers the gate's calls. The read itself is the one
``KVTier.lookup_tiers`` starts when the request is matched on arrival (``_prefetch_kvcache``); this module only
decides how long the request waits for it:

* ``best_effort``: never;
* ``wait_complete``: until the read is done (it ends by itself: an SSD read completes or fails, a remote one has
  ``remote_timeout_s`` per call);
* ``timeout``: at most ``prefetch_timeout_base + prefetch_timeout_per_ki_token * tokens / 1024`` seconds from the
  first admission round that found it not done (HiCache starts its timer there too, so a request that queues behind
  others for other reasons keeps its whole budget).

A read of fewer than ``prefetch_threshold`` tokens is not waited for. The clock and the task are all it reads: no
SGLang import, no torch.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Hashable, Optional

from kvtier.config import TierConfig
from kvtier.tier.tasks import TaskStatus, TierTask
from kvtier.tier.tier_stats import TierHit

__all__ = ["PrefetchWaits", "PrefetchCounts"]


@dataclasses.dataclass
class _Wait:
    read: TierTask
    start_tokens: int  # the CPU-held prefix the read continues
    deadline: Optional[float] = None  # set at the first blocked admission round (timeout policy)


@dataclasses.dataclass
class PrefetchCounts:
    """Requests held back since construction, by how their wait ended."""

    waited: int = 0  # held back at least one admission round
    completed: int = 0  # the read completed before the request was admitted
    failed: int = 0  # the read failed or was cancelled (the request recomputes)
    timed_out: int = 0  # admitted at the deadline with the read still running
    dropped: int = 0  # the request was aborted while waiting


class PrefetchWaits:
    """Which waiting requests are held back for their own read, keyed by SGLang's ``cache_request_handle``."""

    def __init__(self, config: TierConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._waits: dict[Hashable, _Wait] = {}
        self._loaded: dict[Hashable, tuple[int, Optional[int]]] = {}  # what a finished wait's read brought
        self.counts = PrefetchCounts()
        # several ranks: whether any rank's clock passed the deadline (each rank calls it at the same point)
        self.agree_late: Callable[[bool], bool] = lambda late: late

    @property
    def pending(self) -> bool:
        """Some request waits (the scheduler is not idle while one does)."""
        return bool(self._waits)

    def oldest_read(self) -> Optional[TierTask]:
        """The read of the request that has waited longest and whose read is still running (None: none)."""
        return next((w.read for w in self._waits.values() if not w.read.done), None)

    def start(self, handle: Hashable, hit: TierHit) -> bool:
        """The request ``handle`` was matched on arrival and ``hit`` is what the tiers hold of its prefix: hold it
        back for ``hit.read`` under the policy; True when it waits."""
        self._waits.pop(handle, None)
        self._loaded.pop(handle, None)
        if self.config.prefetch_policy == "best_effort" or hit.read is None or hit.read.done:
            return False
        page_size = self.config.page_size
        tokens = hit.lower_pages * page_size  # 0 while the read's count is not known yet (a remote probe)
        if 0 < tokens < self.config.prefetch_threshold:
            return False
        self._waits[handle] = _Wait(hit.read, hit.cpu_pages * page_size)
        return True

    def ready(self, handle: Hashable) -> bool:
        """Whether the request may be admitted now (True for one that does not wait). A read is done once the tier
        has finalized it, so a finished read's blocks are in the CPU index."""
        w = self._waits.get(handle)
        if w is None:
            return True
        read = w.read
        if read.done:
            del self._waits[handle]
            if read.status is TaskStatus.DONE and read.num_pages:
                self.counts.completed += 1
                self._loaded[handle] = (read.num_pages * self.config.page_size, w.start_tokens)
            else:
                self.counts.failed += 1
            return True
        if self.config.prefetch_policy == "timeout":
            now = self.clock()
            if w.deadline is None:
                self.counts.waited += 1
                w.deadline = now + self.config.prefetch_timeout_s(read.num_pages * self.config.page_size)
            elif self.agree_late(now >= w.deadline):
                del self._waits[handle]
                self.counts.timed_out += 1
                return True
        elif w.deadline is None:
            self.counts.waited += 1
            w.deadline = float("inf")
        return False

    def pop_loaded(self, handle: Hashable) -> tuple[int, Optional[int]]:
        """Tokens the request's finished read brought into the CPU tier and where they start (0, None: none)."""
        return self._loaded.pop(handle, (0, None))

    def drop(self, handle: Hashable) -> None:
        """Forget the request (aborted, or matched again on arrival); its read goes on and lands in the CPU tier."""
        if self._waits.pop(handle, None) is not None:
            self.counts.dropped += 1
        self._loaded.pop(handle, None)

    def clear(self) -> None:
        self._waits.clear()
        self._loaded.clear()
