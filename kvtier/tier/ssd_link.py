"""SsdLink: how the CPU tier uses the SSD tier behind it: the write policy, CPU blocks held for writes, promotion
plans and their admission.

* Write policy (``ssd_write_policy``): ``write_through`` writes each block as it enters the CPU index
  (:meth:`SsdLink.entered`); ``write_back`` writes each block the CPU index evicts (:meth:`SsdLink.release`), for
  which it keeps every CPU block's chain hash, namespace and tokens.
* A CPU block in a write job is held (:class:`~kvtier.tier.block_holds.BlockHolds`): the CPU index may evict it,
  but the pool gets it back only when the write is durable or failed (:meth:`drain`). Nothing rewrites a block
  the disk still reads.
* Promotion (:meth:`plan_promotion`): the leading blocks past a CPU hit that the SSD holds, if admission by cost
  (:class:`~kvtier.tier.admission.CostAdmission`) lets them in, and if they are not already being promoted.

Single-owner: called under the :class:`~kvtier.tier.KVTier` lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Mapping, NamedTuple, Optional

import numpy as np

from kvtier.config import TierConfig
from kvtier.geometry import KVGeometry
from kvtier.index import Namespace, page_hashes
from kvtier.storage import BlockFileError, SsdStore, fingerprint
from kvtier.tier.admission import CostAdmission, lower_read_blocks
from kvtier.tier.block_holds import BlockHolds
from kvtier.tier.host_pool import HostBlockPool
from kvtier.tier.ssd_tier import MAX_PENDING_BYTES, IoJob, SsdTier

logger = logging.getLogger(__name__)

__all__ = ["SsdLink", "PromotionPlan", "InFlight", "ssd_fingerprint"]

_DEFAULT_NS = Namespace()


def ssd_fingerprint(geometry: KVGeometry, block_tokens: int, identity: Mapping) -> bytes:
    """What an SSD block belongs to: the engine's model identity (model, revision, TP rank and size, ...), the KV
    geometry and dtype, the block size, and the payload order (a ``page_first`` block's, whatever the CPU layout)."""
    return fingerprint(kind="kvtier-ssd-block", identity=dict(identity), num_layers=geometry.num_layers,
                       num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim, is_mla=geometry.is_mla,
                       dtype=str(geometry.dtype), block_tokens=block_tokens, payload="page_first")


class InFlight(NamedTuple):
    """A promotion in flight from the same first block: its task and the blocks it shares with the query."""

    task_id: int
    blocks: int


def in_flight(entry: tuple[int, np.ndarray], hashes: np.ndarray) -> InFlight:
    """The task of an in-flight read ``entry`` (task id, its chain hashes) and how many leading ``hashes`` it
    shares."""
    task_id, theirs = entry
    m = min(theirs.size, hashes.size)
    differ = np.flatnonzero(theirs[:m] != hashes[:m])
    return InFlight(task_id, int(differ[0]) if differ.size else m)


class PromotionPlan(NamedTuple):
    """SSD blocks to read past a CPU hit of ``held`` blocks."""

    held: int  # CPU blocks before them
    slots: np.ndarray
    hashes: np.ndarray
    namespace: int
    tokens: np.ndarray  # (blocks, block_tokens)


class SsdLink:
    """The CPU tier's SSD tier (see the module docstring); built by :meth:`open`."""

    def __init__(self, ssd: SsdTier, pool: HostBlockPool, holds: BlockHolds, config: TierConfig,
                 block_tokens: int) -> None:
        self.medium, self.pool, self.holds, self.block_tokens = ssd, pool, holds, block_tokens  # the SSD tier
        self.write_back = config.ssd_write_policy == "write_back"
        self.admission = CostAdmission(config.ssd_admission, read_gbps=config.ssd_read_gbps,
                                       prefill_tokens_per_s=config.prefill_tokens_per_s,
                                       measured_read_gbps=lambda: ssd.read_gbps)
        n = pool.num_blocks
        self._writes: list[IoJob] = []
        self._promoting: dict[int, tuple[int, np.ndarray]] = {}  # first block's chain hash -> (task, hashes)
        self.promote_bytes_inflight = 0
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
             identity: Mapping) -> "SsdLink":
        """The SSD tier of ``config`` (directories created if missing), recovered from what is durable there.

        Raises:
            kvtier.storage.BlockFileError: a directory cannot be used (no access, no space, another model's file).
        """
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

    def entered(self, ids: np.ndarray, tokens: np.ndarray, ns: Optional[Namespace], positions: np.ndarray) -> None:
        """CPU blocks ``ids`` entered the index as blocks ``positions`` (ascending) of ``tokens``'s chain."""
        if ids.size == 0:
            return
        B = self.block_tokens
        end = (int(positions[-1]) + 1) * B
        hashes = page_hashes(tokens[:end], B, ns)[positions]
        rows = tokens[:end].reshape(-1, B)[positions]
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

    def drain(self, wait: bool = False) -> None:
        """Account finished writes (all of them, waiting, with ``wait``) and free the CPU blocks they held."""
        for job in self._writes if wait else ():
            job.wait()
        self._writes = self.holds.settle(self._writes, IoJob.done, self.medium.finish)

    def used(self, tokens: np.ndarray, ns: Optional[Namespace]) -> None:
        """``tokens``' blocks were loaded from the CPU tier: the SSD's copies of them become the most recently
        used too (a prefix hot on the CPU is kept on the SSD, which serves it after an eviction or a restart)."""
        if tokens.size and self.medium.num_held:
            self.medium.touch(self.medium.match(page_hashes(tokens, self.block_tokens, ns)))

    # --- promotion ---

    def plan_promotion(self, tokens: np.ndarray, ns: Optional[Namespace], held: int,
                       chain: np.ndarray) -> Optional[InFlight | PromotionPlan]:
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
            return in_flight(inflight, hashes)
        k = lower_read_blocks(int(slots.size), self.pool.num_blocks)
        if not self.admission.admit(k * B, tokens.size - held * B, k * self.pool.block_bytes,
                                    self.promote_bytes_inflight):
            self.refused_tokens += k * B
            return None
        rows = tokens[held * B:(held + k) * B].reshape(k, B)
        return PromotionPlan(held, slots[:k], hashes[:k], (ns or _DEFAULT_NS).seed, rows)

    def start_promotion(self, plan: PromotionPlan, ids: np.ndarray, task_id: int) -> IoJob:
        """Read the first ``ids.size`` blocks of ``plan`` into CPU blocks ``ids`` (owned by task ``task_id``)."""
        k = ids.size
        job = self.medium.read(plan.slots[:k], plan.hashes[:k], plan.namespace, plan.tokens[:k], ids)
        self._promoting[int(plan.hashes[0])] = (task_id, job.hashes)
        self.promote_bytes_inflight += k * self.pool.block_bytes
        return job

    @contextlib.contextmanager
    def holding(self, plan: PromotionPlan):
        """Keep ``plan``'s slots from being evicted (by the write-back of the CPU blocks evicted to make room for
        the promotion) until its read locks them."""
        self.medium.lock(plan.slots)
        try:
            yield
        finally:
            self.medium.unlock(plan.slots)

    def end_promotion(self, job: IoJob) -> None:
        self.medium.finish(job)
        self._promoting.pop(int(job.hashes[0]), None)
        self.promote_bytes_inflight -= job.num_blocks * self.pool.block_bytes

    # --- life cycle ---

    def note_prefill(self, tokens: int, seconds: float, cached_tokens: int = 0) -> None:
        self.admission.note_prefill(tokens, seconds, cached_tokens)

    def stats(self) -> dict:
        out = {f"ssd_{k}": v for k, v in self.medium.snapshot().items()}
        out.update(ssd_write_policy="write_back" if self.write_back else "write_through",
                   ssd_free_target_blocks=self.free_target,
                   ssd_admitted=self.admission.admitted, ssd_refused=self.admission.refused,
                   ssd_tokens_refused=self.refused_tokens,
                   ssd_prefill_1k_tokens_s=self.admission.prefill.seconds(1024))
        return out

    def close(self) -> None:
        self.drain(wait=True)
        self.medium.close()
