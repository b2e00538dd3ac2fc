"""What :class:`~kvtier.tier.KVTier` reports: a lookup's hit across the tiers, its counters, its configuration."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from kvtier.tier.tasks import TierTask

__all__ = ["TierHit", "TierStats", "describe", "snapshot"]


class TierHit(NamedTuple):
    """What :meth:`KVTier.lookup_tiers` found: leading pages on the CPU, the pages past them that a read from a lower
    tier brings (0 while its count is not known yet), and that read (None, and 0 pages, when none runs: no lower tier
    holds the next page, admission refused it, or no CPU block could be had); ``read.source`` names its tier."""

    cpu_pages: int
    lower_pages: int
    read: Optional[TierTask]


@dataclasses.dataclass
class TierStats:
    """Counters since construction (``reset`` keeps them)."""

    lookups: int = 0
    hit_pages: int = 0  # lookup: pages found
    miss_pages: int = 0  # lookup: full pages asked for and not found
    stores: int = 0
    pages_stored: int = 0  # pages that entered the index from completed stores
    pages_store_skipped: int = 0  # already held when the store was issued
    pages_store_dropped: int = 0  # no room (everything else locked or in flight)
    pages_store_duplicate: int = 0  # copied, but another store inserted them first
    loads: int = 0
    pages_loaded: int = 0
    pages_evicted: int = 0
    cancelled: int = 0
    failed_stores: int = 0  # issuing the copy raised: unwound, nothing stored
    failed_loads: int = 0  # issuing the copy raised: unwound, nothing loaded (the engine recomputes)
    reads: int = 0  # lower-tier reads started (each tier counts its pages)
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    seconds_d2h: float = 0.0  # device time of completed stores (CUDA events; wall time on CPU)
    seconds_h2d: float = 0.0

    def count_copy(self, stream: str, nbytes: int, seconds: Optional[float]) -> None:
        """A completed ``"store"`` (device to host) or ``"load"`` (host to device) copy."""
        if stream == "store":
            self.bytes_d2h += nbytes
            self.seconds_d2h += seconds or 0.0
        else:
            self.bytes_h2d += nbytes
            self.seconds_h2d += seconds or 0.0

    def count_failure(self, stream: str) -> None:
        """A ``"store"`` or ``"load"`` copy whose issue raised."""
        if stream == "store":
            self.failed_stores += 1
        else:
            self.failed_loads += 1

    @property
    def gbps_d2h(self) -> Optional[float]:
        return self.bytes_d2h / self.seconds_d2h / 1e9 if self.seconds_d2h > 0 else None

    @property
    def gbps_h2d(self) -> Optional[float]:
        return self.bytes_h2d / self.seconds_h2d / 1e9 if self.seconds_h2d > 0 else None


def describe(tier) -> str:
    """``tier``'s configuration in force, in one line (its start-up log line)."""
    c, geo, pool = tier.config, tier.geometry, tier.pool
    parts = [f"host pool {pool.num_blocks * pool.block_bytes / (1 << 30):.2f} GiB ({pool.num_blocks} blocks of "
             f"{tier.block_tokens} tokens, {pool.block_bytes / (1 << 20):.2f} MiB each, {tier.layout})",
             f"{geo.num_layers} layers on {tier.kv.device}",
             f"page {tier.page_size} tokens", f"transfer {c.transfer_mode}",
             "layerwise loads" if c.layerwise else "whole loads",
             f"finalize {'auto' if tier._auto_finalize else 'ordered'}"]
    if len(tier.store_layers) != geo.num_layers:
        parts.append(f"stores copy layers {tier.store_layers.start}..{tier.store_layers.stop - 1} (the pool is "
                     f"shared with other processes)" if tier.store_layers else
                     "stores copy no layer (the pool is shared with other processes)")
    parts += [t.describe() for t in tier.lower]
    return ", ".join(parts)


def snapshot(tier) -> dict:
    """``tier.stats()``: its counters, its pool's and index's state, and each lower tier's counters."""
    s = tier._stats
    out = dataclasses.asdict(s)
    out.update(gbps_d2h=s.gbps_d2h, gbps_h2d=s.gbps_h2d, occupancy=tier.pool.occupancy,
               blocks_used=tier.pool.num_used, blocks_total=tier.pool.num_blocks,
               tokens_per_block=tier.block_tokens, page_size=tier.page_size, block_bytes=tier.pool.block_bytes,
               pages_held=tier.index.total_pages * tier._pages_per_block,
               pages_locked=tier.index.protected_pages * tier._pages_per_block,
               inflight_tasks=len(tier._inflight),
               inflight_store_blocks=sum(r.block_ids.size for r in tier._inflight.values()
                                         if r.task.kind == "store"))
    out["held_cpu_blocks"] = tier.holds.num_deferred
    for t in tier.lower:
        out.update(t.stats())
    return out
