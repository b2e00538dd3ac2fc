"""SsdLink: the SSD as a lower tier of the CPU pool (:class:`~kvtier.tier.lower.LowerTier`): the write policy, CPU
blocks held for writes, promotions (its reads) and their admission.

* Write policy (``ssd_write_policy``): ``write_through`` writes each block as it enters the CPU index
  (:meth:`SsdLink.entered`); ``write_back`` writes each block the CPU index evicts (:meth:`SsdLink.release`), for
  which it keeps every CPU block's chain hash, namespace and tokens.
* A CPU block in a write job is held (:class:`~kvtier.tier.block_holds.BlockHolds`): the CPU index may evict it,
  but the pool gets it back only when the write is durable or failed (:meth:`drain`). Nothing rewrites a block
  the disk still reads.
* Promotion (:meth:`plan_read`): the leading blocks past a CPU hit that the SSD holds, if admission by cost
  (:class:`~kvtier.tier.admission.CostAdmission`) lets them in, and if they are not already being promoted; the
  owner allocates their CPU blocks (:meth:`pinned`: the slots stay put meanwhile) and :meth:`fill` reads them.

Single-owner: called under the :class:`~kvtier.tier.KVTier` lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Iterator, Mapping, Optional

import numpy as np

from kvtier.config import TierConfig
from kvtier.geometry import KVGeometry
from kvtier.index import Namespace
from kvtier.storage import BlockFileError, SsdStore, fingerprint
from kvtier.tier.admission import CostAdmission, lower_read_blocks
from kvtier.tier.block_holds import BlockHolds
from kvtier.tier.host_pool import HostBlockPool
from kvtier.tier.lower import LowerTier, ReadPlan, SharedRead, register, shared_read
from kvtier.tier.ssd_tier import MAX_PENDING_BYTES, IoJob, SsdTier

logger = logging.getLogger(__name__)

__all__ = ["SsdLink", "Promotion", "ssd_fingerprint"]

_DEFAULT_NS = Namespace()


def ssd_fingerprint(geometry: KVGeometry, block_tokens: int, identity: Mapping) -> bytes:
    """What an SSD block belongs to: the engine's model identity (model, revision, TP rank and size, ...), the KV
    geometry and dtype, the block size, and the payload order (a ``page_first`` block's, whatever the CPU layout)."""
    return fingerprint(kind="kvtier-ssd-block", identity=dict(identity), num_layers=geometry.num_layers,
                       num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim, is_mla=geometry.is_mla,
                       dtype=str(geometry.dtype), block_tokens=block_tokens, payload="page_first")


@dataclasses.dataclass
class Promotion:
    """An SSD read (the :class:`~kvtier.tier.lower.ReadJob` of this tier): its plan, then its IO job once it has
    CPU blocks."""

    plan: ReadPlan
    io: Optional[IoJob] = None
    ended: bool = False  # ended without a read (no CPU block could be had)

    @property
    def host_ids(self) -> np.ndarray:
        return self.io.host_ids if self.io is not None else np.empty(0, np.int64)

    @property
    def slots(self) -> np.ndarray:
        """The SSD slots its read locks (none before it reads)."""
        return self.io.slots if self.io is not None else np.empty(0, np.int64)

    def awaiting_blocks(self) -> bool:
        return self.io is None and not self.ended

    def done(self) -> bool:
        return self.ended or (self.io is not None and self.io.done())

    def verified(self) -> int:
        return self.io.ok if self.io is not None else 0

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.io.wait(timeout) if self.io is not None else self.done()

    def seconds(self) -> Optional[float]:
        return None if self.io is None else self.io.io_seconds


class SsdLink(LowerTier[Promotion]):
    """The CPU tier's SSD tier (see the module docstring); built by :meth:`open`."""

    name = "ssd"

    def __init__(self, ssd: SsdTier, pool: HostBlockPool, holds: BlockHolds, config: TierConfig,
                 block_tokens: int) -> None:
        self.medium, self.pool, self.holds, self.block_tokens = ssd, pool, holds, block_tokens  # the SSD tier
        self.config = config
        self.write_back = config.ssd_write_policy == "write_back"
        self.admission = CostAdmission(config.ssd_admission, read_gbps=config.ssd_read_gbps,
                                       prefill_tokens_per_s=config.prefill_tokens_per_s,
                                       measured_read_gbps=lambda: ssd.read_gbps)
        n = pool.num_blocks
        self._writes: list[IoJob] = []
        self._promoting: dict[int, tuple[int, np.ndarray]] = {}  # first block's chain hash -> (task, hashes)
        self.promote_bytes_inflight = 0
        self.promotions = self.pages_promoted = self.pages_promote_failed = 0
        if self.write_back:  # what an evicted block is, to write it
            self._hash = np.zeros(n, np.uint64)
            self._ns = np.zeros(n, np.uint64)
            self._tokens = np.zeros((n, block_tokens), np.int64)
        self.refused_tokens = 0
        # write_back: CPU blocks kept free or on their way back (evicted ahead, written, then freed), so that an
        # allocation finds them free instead of evicting blocks its writes hold; grows to the largest allocation
        # that came short, within half the pool and the write queue
        self._free_bound = max(1, min(ssd.max_pending_blocks, n // 2))
        self.free_target = min(self._free_bound, max(1, n // 16)) if self.write_back else 0

    @classmethod
    def open(cls, config: TierConfig, pool: HostBlockPool, holds: BlockHolds, block_tokens: int,
             identity: Mapping) -> Optional["SsdLink"]:
        """The SSD tier of ``config`` (directories created if missing), recovered from what is durable there; None
        without ``ssd_cache_gb``.

        Raises:
            kvtier.storage.BlockFileError: a directory cannot be used (no access, no space, another model's file).
        """
        if config.ssd_cache_gb <= 0:
            return None
        for d in config.ssd_dirs:
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as e:
                raise BlockFileError(f"kvtier: cannot create the SSD cache directory {d}: {e.strerror}") from None
        try:
            store = SsdStore(config.ssd_dirs, capacity_bytes=config.ssd_cache_bytes, block_bytes=pool.block_bytes,
                             fingerprint=ssd_fingerprint(pool.geometry, block_tokens, identity),
                             io_threads=config.ssd_io_threads, direct=config.ssd_direct_io,
                             wipe_mismatch=config.ssd_wipe_mismatch, tokens_per_block=block_tokens)
        except BlockFileError as e:
            if "left alone" not in str(e):
                raise
            raise BlockFileError(f"{e} (kvtier config: ssd_wipe_mismatch: true wipes it; a change of "
                                 f"ssd_cache_gb changes the slot geometry)") from None
        try:
            ssd = SsdTier(store, block_tokens=block_tokens, block_view=pool.block_rows,
                          max_pending_bytes=min(MAX_PENDING_BYTES, max(1, pool.num_blocks // 2) * pool.block_bytes))
        except BaseException:
            store.close()
            raise
        logger.info("kvtier: SSD tier of %d blocks over %s (%s IO, %s), %d blocks recovered", store.num_slots,
                    ";".join(store.dirs), "O_DIRECT" if store.direct else "buffered", config.ssd_write_policy,
                    ssd.stats.blocks_recovered)
        return cls(ssd, pool, holds, config, block_tokens)

    # --- blocks entering and leaving the CPU index ---

    def observe(self, on_written, on_stored, on_removed) -> None:
        """Report finished writes, and blocks that became findable or stopped being findable, to the owner."""
        self.medium.on_written, self.medium.on_stored, self.medium.on_removed = on_written, on_stored, on_removed

    def entered(self, ids: np.ndarray, tokens: np.ndarray, ns: Optional[Namespace], positions: np.ndarray,
                hashes: np.ndarray, source: Optional[str]) -> None:
        """CPU blocks ``ids`` entered the index as blocks ``positions`` (ascending) of ``tokens``'s chain."""
        if ids.size == 0:
            return
        B = self.block_tokens
        rows = tokens[:(int(positions[-1]) + 1) * B].reshape(-1, B)[positions]
        seed = (ns or _DEFAULT_NS).seed
        if self.write_back:
            self._hash[ids], self._ns[ids], self._tokens[ids] = hashes, seed, rows
        else:
            self._write(hashes, seed, rows, ids)

    def evicted(self, ids: np.ndarray) -> None:
        """CPU blocks ``ids`` are leaving the index (``write_back``: they are written now, and held until
        durable)."""
        if ids.size == 0 or not self.write_back:
            return
        for seed in np.unique(self._ns[ids]).tolist():
            pick = ids[self._ns[ids] == seed]
            self._write(self._hash[pick], seed, self._tokens[pick], pick)

    def reclaim(self, free: int, freeing: int) -> int:
        return self.to_reclaim(free, freeing)

    def before_close_evict(self) -> int:
        """write_back: every CPU block is written at destroy, a write queue's worth a round."""
        return self.medium.max_pending_blocks if self.write_back else 0

    def to_reclaim(self, free: int, freeing: int) -> int:
        """CPU blocks to evict now so that ``free`` free blocks and ``freeing`` on their way back reach the free
        target (write_back; 0 for write_through, whose evicted blocks are already written)."""
        return max(0, self.free_target - free - freeing)

    def came_short(self, n: int, held: int) -> None:
        """An allocation of ``n`` blocks found too few free while ``held`` evicted blocks waited for their writes:
        with write_back, keep ``n`` free from now on. A shortfall with none held (a prefix longer than the pool,
        blocks locked by running requests) is not the writes' doing and changes nothing."""
        if self.write_back and held > 0:
            self.free_target = min(self._free_bound, max(self.free_target, n))

    def _write(self, hashes: np.ndarray, seed: int, rows: np.ndarray, ids: np.ndarray) -> None:
        job = self.medium.write(hashes, seed, rows, ids)
        if job is not None:
            self.holds.hold(job.host_ids)
            self._writes.append(job)

    def drain(self, wait: bool = False, until: Optional[float] = None) -> None:
        """Account finished writes (all of them, waiting, with ``wait``) and free the CPU blocks they held."""
        for job in self._writes if wait else ():
            job.wait()
        self._writes = self.holds.settle(self._writes, IoJob.done, self.medium.finish)

    def flush(self) -> None:
        self.drain(wait=True)

    def wants_used(self) -> bool:
        return self.medium.num_held > 0

    def used(self, hashes: np.ndarray) -> None:
        """A prefix of these chain hashes was loaded from the CPU tier: the SSD's copies of them become the most
        recently used too (a prefix hot on the CPU is kept on the SSD, which serves it after an eviction or a
        restart)."""
        if hashes.size and self.medium.num_held:
            self.medium.touch(self.medium.match(hashes))

    # --- promotion ---

    def holds_next(self, hashes: np.ndarray) -> bool:
        return self.medium.match(hashes[:1]).size > 0

    def plan_read(self, tokens: np.ndarray, ns: Optional[Namespace], held: int,
                  chain: np.ndarray) -> Optional[ReadPlan | SharedRead]:
        """The SSD blocks after ``held`` CPU-held blocks of ``tokens``'s first blocks (``chain``: their chain
        hashes), if admitted; the promotion in flight from the same block, if any; None when nothing is to be
        read."""
        if held >= chain.size or self.medium.num_held == 0:
            return None
        B = self.block_tokens
        hashes = chain[held:]
        slots = self.medium.match(hashes)
        if slots.size == 0:
            return None
        inflight = self._promoting.get(int(hashes[0]))
        if inflight is not None:
            return shared_read(inflight, hashes)
        k = lower_read_blocks(int(slots.size), self.pool.num_blocks)
        if not self.admission.admit(k * B, tokens.size - held * B, k * self.pool.block_bytes,
                                    self.promote_bytes_inflight):
            self.refused_tokens += k * B
            return None
        rows = tokens[held * B:(held + k) * B].reshape(k, B)
        return ReadPlan(held, hashes[:k], (ns or _DEFAULT_NS).seed, rows, slots[:k])

    def start_read(self, plan: ReadPlan, task_id: int) -> Promotion:
        """A promotion of ``plan`` for task ``task_id``: it reads once it has CPU blocks (:meth:`fill`)."""
        self._promoting[int(plan.hashes[0])] = (task_id, plan.hashes)
        return Promotion(plan)

    @contextlib.contextmanager
    def pinned(self, job: Promotion) -> Iterator[None]:
        """Keep the promotion's slots from being evicted (by the write-back of the CPU blocks evicted to make room
        for it) until its read locks them."""
        slots = job.plan.detail
        self.medium.lock(slots)
        try:
            yield
        finally:
            self.medium.unlock(slots)

    def blocks_wanted(self, job: Promotion, tokens: int, held_tokens: int) -> int:
        return job.plan.hashes.size  # admitted when planned

    def fill(self, job: Promotion, ids: np.ndarray) -> None:
        """Read the first ``ids.size`` blocks of the promotion into CPU blocks ``ids`` (none: it ends unread)."""
        plan, k = job.plan, ids.size
        if k == 0:
            job.ended = True
            return
        job.io = self.medium.read(plan.detail[:k], plan.hashes[:k], plan.namespace, plan.tokens[:k], ids)
        self.promote_bytes_inflight += k * self.pool.block_bytes
        self.promotions += 1

    def end_read(self, job: Promotion, cancelled: bool) -> int:
        self._promoting.pop(int(job.plan.hashes[0]), None)
        if job.io is None:
            return 0
        self.medium.finish(job.io)
        self.promote_bytes_inflight -= job.io.num_blocks * self.pool.block_bytes
        return 0 if cancelled else job.io.ok

    def note_read(self, pages: int, failed_pages: int) -> None:
        self.pages_promoted += pages
        self.pages_promote_failed += failed_pages

    # --- life cycle ---

    def note_prefill(self, tokens: int, seconds: float, cached_tokens: int = 0) -> None:
        self.admission.note_prefill(tokens, seconds, cached_tokens)

    def stats(self) -> dict:
        out = {f"ssd_{k}": v for k, v in self.medium.snapshot().items()}
        out.update(promotions=self.promotions, pages_promoted=self.pages_promoted,
                   pages_promote_failed=self.pages_promote_failed)
        out.update(ssd_write_policy="write_back" if self.write_back else "write_through",
                   ssd_free_target_blocks=self.free_target,
                   ssd_admitted=self.admission.admitted, ssd_refused=self.admission.refused,
                   ssd_tokens_refused=self.refused_tokens,
                   ssd_prefill_1k_tokens_s=self.admission.prefill.seconds(1024))
        return out

    def describe(self) -> str:
        c = self.config
        return (f"SSD tier {c.ssd_cache_gb:g} GiB on {';'.join(c.ssd_dirs)} ({c.ssd_write_policy}, admission "
                f"{c.ssd_admission})")

    def close(self, until: Optional[float] = None) -> None:
        self.drain(wait=True)
        self.medium.close()


register("ssd", SsdLink.open, lambda config: config.ssd_cache_gb > 0)
