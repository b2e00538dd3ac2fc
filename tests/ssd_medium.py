"""An SSD tier over real files and a numpy CPU pool, for the recovery tests: blocks named by their chain hash, each
with bytes and tokens derived from it, written, read back and checked through :class:`~kvtier.tier.ssd_tier.SsdTier`
as the host tier uses it (no torch, no engine)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvtier.storage import SsdStore, fingerprint
from kvtier.storage.block_format import ALIGN, padded
from kvtier.tier.ssd_tier import SsdTier

TOKENS = 16
BLOCK_BYTES = ALIGN + 200  # a padded payload: read and written through the IO threads' aligned buffers
FP = fingerprint(model="kvtier-recovery-test")


def payload(h: int) -> np.ndarray:
    """The bytes of block ``h``."""
    return np.random.default_rng(h).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def tokens(h: int) -> np.ndarray:
    return (np.arange(TOKENS, dtype=np.int64) + 7 * h) % 50_000


def open_store(d, slots: int, **kw) -> SsdStore:
    kw.setdefault("io_threads", 1)
    return SsdStore(str(d), capacity_bytes=slots * (ALIGN + padded(BLOCK_BYTES)), block_bytes=BLOCK_BYTES,
                    fingerprint=FP, tokens_per_block=TOKENS, **kw)


class Medium:
    """An :class:`SsdTier` of ``slots`` slots over ``d``, with a CPU pool of ``cpu_blocks`` numpy blocks."""

    def __init__(self, d, slots: int, cpu_blocks: int = 8, **kw) -> None:
        self.pool = np.zeros((cpu_blocks, BLOCK_BYTES), dtype=np.uint8)
        self.evicted: set[int] = set()  # hashes the index let go (evicted, removed) since it was built
        self.tier = SsdTier(open_store(d, slots, **kw), block_tokens=TOKENS, block_view=lambda b: self.pool[b])
        self.tier.on_removed = lambda hs: self.evicted.update(int(h) for h in hs)

    def write(self, hashes: list[int]) -> list[int]:
        """Write blocks ``hashes`` (at most the pool's size); the ones acknowledged (durable and findable)."""
        ids = np.arange(len(hashes))
        for i, h in enumerate(hashes):
            self.pool[i] = payload(h)
        job = self.tier.write(np.array(hashes, dtype=np.uint64), 0, np.stack([tokens(h) for h in hashes]), ids)
        if job is None:
            return []
        job.wait()
        self.tier.finish(job)
        return [int(h) for h in job.hashes[:job.ok]]

    def read(self, h: int) -> Optional[bool]:
        """Read block ``h``: None when the SSD index does not hold it, else whether it read back exactly."""
        got = self.read_state(h)
        return None if got is None else got == "exact"

    def read_state(self, h: int) -> Optional[str]:
        """Read block ``h``: None when the SSD index does not hold it, else ``exact``, ``miss`` (it failed a check)
        or ``wrong`` (served with other bytes than ``h``'s: never)."""
        slots = self.tier.match(np.array([h], dtype=np.uint64))
        if slots.size == 0:
            return None
        self.pool[0] = 0
        job = self.tier.read(slots, np.array([h], dtype=np.uint64), 0, tokens(h)[None], np.array([0]))
        job.wait()
        self.tier.finish(job)
        if job.ok != 1:
            return "miss"
        return "exact" if np.array_equal(self.pool[0], payload(h)) else "wrong"

    def held(self) -> set[int]:
        return {int(h) for h in self.tier.index._slot_of}

    def close(self) -> None:
        self.tier.close()
