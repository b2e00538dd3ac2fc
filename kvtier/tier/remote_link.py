"""RemoteLink: a shared remote store as a lower tier of the CPU pool (:class:`~kvtier.tier.lower.LowerTier`):
write-through puts, fetches (its reads) and their admission.

* Puts (:meth:`RemoteLink.entered`): each block entering the CPU index (from a store or an SSD promotion, not from
  a fetch) is put to the remote store, asynchronously; the CPU block is held until the put returns
  (:class:`~kvtier.tier.block_holds.BlockHolds`). Queued puts are bounded; what does not fit is dropped, counted.
* Fetches (:meth:`plan_read`): the leading blocks past the local hits, probed on the remote (``batch_is_exist``)
  without blocking the lookup. When the probe returns, the owner asks :meth:`blocks_wanted` how many to read
  (admission by cost, :class:`~kvtier.tier.admission.CostAdmission`, against the measured fetch bandwidth),
  allocates CPU blocks and :meth:`fill` starts the get. A fetch from the same first block in flight is shared, not
  repeated.
* A fetch its owner stopped waiting for (past ``remote_timeout_s``) keeps its CPU blocks held until its calls
  return (:meth:`end_read`, :meth:`drain`).

Keys and fingerprints: a block's key is its chain hash under the store's key prefix and the fingerprint of the
model identity, geometry, dtype and block size; MHA blocks are per TP rank (the identity's rank), MLA blocks are
the same on every rank, so their fingerprint drops the rank and only rank 0 puts them.

Single-owner: called under the :class:`~kvtier.tier.KVTier` lock.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping, Optional

import numpy as np

from kvtier.config import TierConfig
from kvtier.geometry import KVGeometry
from kvtier.index import Namespace
from kvtier.storage import fingerprint
from kvtier.storage.mooncake_store import MooncakeStore, RemoteStoreError
from kvtier.tier.admission import CostAdmission, lower_read_blocks
from kvtier.tier.block_holds import BlockHolds
from kvtier.tier.host_pool import HostBlockPool
from kvtier.tier.lower import LowerTier, ReadPlan, SharedRead, register, shared_read
from kvtier.tier.master_probe import check_master_answers
from kvtier.tier.remote_tier import RemoteJob, RemoteTier
from kvtier.tier.ssd_tier import signed64

logger = logging.getLogger(__name__)

__all__ = ["RemoteLink", "remote_fingerprint", "TP_KEYS"]

_DEFAULT_NS = Namespace()
TP_KEYS = ("tp_rank", "tp_size")  # identity fields an MLA block does not depend on
# Puts queued beyond this are dropped, and beyond half of the pool's blocks (they hold CPU blocks until sent: a slow
# store must leave the pool room for stores; docs/DESIGN.md).
MAX_PENDING_BYTES = 4 << 30


def remote_fingerprint(geometry: KVGeometry, block_tokens: int, identity: Mapping) -> bytes:
    """What a remote block belongs to (as :func:`~kvtier.tier.ssd_link.ssd_fingerprint`), without the TP rank
    and size for MLA, whose blocks every rank shares."""
    ident = {k: v for k, v in identity.items() if not (geometry.is_mla and k in TP_KEYS)}
    return fingerprint(kind="kvtier-remote-block", identity=ident, num_layers=geometry.num_layers,
                       num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim, is_mla=geometry.is_mla,
                       dtype=str(geometry.dtype), block_tokens=block_tokens, payload="page_first")


class RemoteLink(LowerTier[RemoteJob]):
    """The CPU tier's remote tier (see the module docstring); built by :meth:`open`."""

    name = "remote"
    count_at_plan = False  # a fetch's count comes from its probe

    def __init__(self, remote: RemoteTier, pool: HostBlockPool, holds: BlockHolds, config: TierConfig,
                 block_tokens: int, *, writer: bool = True) -> None:
        self.medium, self.pool, self.holds, self.block_tokens = remote, pool, holds, block_tokens
        self.writer = writer  # whether this rank puts (MLA: rank 0 only)
        self.admission = CostAdmission(config.remote_admission, read_gbps=config.remote_read_gbps,
                                       prefill_tokens_per_s=config.prefill_tokens_per_s,
                                       measured_read_gbps=lambda: remote.read_gbps)
        self._puts: list[RemoteJob] = []
        self._fetching: dict[int, tuple[int, np.ndarray]] = {}  # first block's chain hash -> (task, hashes)
        self._abandoned: list[RemoteJob] = []
        self.fetch_bytes_inflight = 0
        self.refused_tokens = 0
        self.fetches = self.pages_fetched = self.pages_fetch_failed = 0
        self.config = config

    @classmethod
    def open(cls, config: TierConfig, pool: HostBlockPool, holds: BlockHolds, block_tokens: int,
             identity: Mapping) -> Optional["RemoteLink"]:
        """The remote tier of ``config``, connected, with the pool registered; None without ``remote_backend``, or
        when the master cannot be reached or does not answer (:func:`~kvtier.tier.master_probe.check_master_answers`:
        Mooncake's set-up would hold the GIL for minutes) and ``remote_required`` is false (a warning says so).

        Raises:
            kvtier.storage.mooncake_store.RemoteStoreError: the store cannot be used and ``remote_required``.
        """
        if config.remote_backend is None:
            return None
        assert config.remote_master is not None  # TierConfig requires it with remote_backend
        try:
            check_master_answers(config.remote_master, min(5.0, max(1.0, config.remote_timeout_s)))
            store = MooncakeStore(config.remote_master, protocol=config.remote_protocol, device=config.remote_device,
                                  local_hostname=config.remote_local_hostname,
                                  metadata_server=config.remote_metadata_server,
                                  segment_bytes=config.remote_segment_bytes, tenant=config.remote_tenant,
                                  timeout_s=max(config.remote_timeout_s, 5.0))
        except RemoteStoreError as e:
            if config.remote_required:
                raise
            logger.warning("%s; running without the remote tier (remote_required: false)", e)
            return None
        try:
            store.register(pool.host.data_ptr(), pool.nbytes)
            geo = pool.geometry
            tier = RemoteTier(store, block_tokens=block_tokens, block_bytes=pool.block_bytes,
                              fingerprint=remote_fingerprint(geo, block_tokens, identity),
                              key_prefix=config.remote_key_prefix, block_view=pool.block_rows,
                              timeout_s=config.remote_timeout_s,
                              max_pending_bytes=min(MAX_PENDING_BYTES, pool.num_blocks // 2 * pool.block_bytes))
        except BaseException:
            store.close()
            raise
        writer = not (geo.is_mla and int(identity.get("tp_rank", 0) or 0) != 0)
        logger.info("kvtier: remote tier on Mooncake master %s (%s, %.1f GiB segment, key prefix %r%s)",
                    config.remote_master, config.remote_protocol, config.remote_segment_bytes / (1 << 30),
                    config.remote_key_prefix, "" if writer else ", MLA: rank 0 puts")
        return cls(tier, pool, holds, config, block_tokens, writer=writer)

    # --- blocks entering the CPU index ---

    def observe(self, on_written, on_stored, on_removed) -> None:
        """Report finished puts and blocks put to the owner (the store evicts without telling: no removals)."""
        self.medium.on_written, self.medium.on_stored = on_written, on_stored

    def entered(self, ids: np.ndarray, tokens: np.ndarray, ns: Optional[Namespace], positions: np.ndarray,
                hashes: np.ndarray, source: Optional[str]) -> None:
        """CPU blocks ``ids`` entered the index as blocks ``positions`` (ascending) of ``tokens``'s chain (a block
        fetched from the remote is there already)."""
        if ids.size == 0 or not self.writer or source == self.name:
            return
        B = self.block_tokens
        rows = tokens[:(int(positions[-1]) + 1) * B].reshape(-1, B)[positions]
        job = self.medium.put(hashes, signed64((ns or _DEFAULT_NS).seed), rows, ids)
        if job is not None:
            self.holds.hold(job.host_ids)
            self._puts.append(job)

    def drain(self, wait: bool = False, until: Optional[float] = None) -> None:
        """Account finished puts and abandoned fetches and free the CPU blocks they held.

        With ``wait``, first wait for each job holding CPU blocks to finish: a call past its timeout is given up on
        (the tier goes down, and the jobs queued behind it are skipped). Without ``until`` (a ``time.monotonic()``
        deadline) that waits for calls given up on too, which return by Mooncake's own RPC timeout (~30 s), so
        that no remote call still uses a CPU block. With it, no job given up on is waited for and none past
        ``until``: the blocks of a job still running stay held (quarantined) until its calls return. A fetch given
        up on while it probed holds no block and is never waited for."""
        for job in self._puts + self._abandoned if wait else ():
            if job.host_ids.size:
                self._wait_job(job, until)
        for job in self._puts:  # queued behind a call given up on, or the tier down: skipped when it runs
            if not job.abandoned and self.medium.expired(job):
                self.medium.abandon(job)
        self._puts = self.holds.settle(self._puts, RemoteJob.finished, self.medium.finish)
        self._abandoned = self.holds.settle(self._abandoned, RemoteJob.finished, self.medium.finish)
        self.medium.tick()

    def flush(self) -> None:
        """Wait for every queued put, for at most ``remote_timeout_s`` (a put past it is given up on: the tier goes
        down, and the puts queued behind it are skipped, counted failed)."""
        self.drain(wait=True, until=time.monotonic() + self.medium.timeout_s)

    def _wait_job(self, job: RemoteJob, until: Optional[float]) -> None:
        """Wait for ``job`` to finish, giving up on calls past their timeout (and a job queued behind one); with
        ``until``, not for a job given up on, nor past ``until``."""
        medium = self.medium
        while not job.finished():
            medium.watch()
            if medium.expired(job):  # queued behind a call given up on, or the tier down: it is skipped
                medium.abandon(job)
            if until is not None and (job.abandoned or time.monotonic() >= until):
                return
            job.wait(0.05 if until is None else min(0.05, until - time.monotonic()))

    # --- fetches ---

    def plan_read(self, tokens: np.ndarray, ns: Optional[Namespace], held: int,
                  chain: np.ndarray) -> Optional[ReadPlan | SharedRead]:
        """The blocks after ``held`` local ones of ``tokens``'s first blocks (``chain``: their chain hashes) to
        probe; the fetch in flight from the same block (its count unknown until its probe returns); None when there
        is nothing to ask (or the tier is down)."""
        n = chain.size
        if held >= n or not self.medium.can_fetch():  # a plan's probe starts: several ranks agree on the plan
            return None
        B = self.block_tokens
        k = lower_read_blocks(n - held, self.pool.num_blocks)
        hashes = chain[held:held + k]
        inflight = self._fetching.get(int(hashes[0]))
        if inflight is not None:
            return shared_read(inflight, hashes, known=False)
        rows = tokens[held * B:(held + k) * B].reshape(k, B)
        return ReadPlan(held, hashes, signed64((ns or _DEFAULT_NS).seed), rows)

    def start_read(self, plan: ReadPlan, task_id: int) -> Optional[RemoteJob]:
        """Start ``plan``'s probe for task ``task_id``; None when the tier is down or its fetch thread still runs
        a call given up on."""
        job = self.medium.probe(plan.hashes, plan.namespace, plan.tokens)
        if job is not None:
            self._fetching[int(plan.hashes[0])] = (task_id, job.hashes)
            self.fetches += 1
        return job

    def blocks_wanted(self, job: RemoteJob, tokens: int, held_tokens: int) -> int:
        """Blocks of a probed fetch to read: those the store holds, if reading them beats recomputing them."""
        k = max(job.found, 0)
        if job.down or job.error is not None or k == 0 or not self.medium.can_fetch():
            return 0
        B = self.block_tokens
        if not self.admission.admit(k * B, tokens - held_tokens, k * self.pool.block_bytes,
                                    self.fetch_bytes_inflight):
            self.refused_tokens += k * B
            return 0
        return k

    def fill(self, job: RemoteJob, ids: np.ndarray) -> None:
        """Get the fetch's leading blocks into CPU blocks ``ids`` (none: the fetch ends after its probe)."""
        if ids.size == 0:
            self.medium.end(job)
            return
        self.medium.get(job, ids)
        self.fetch_bytes_inflight += ids.size * self.pool.block_bytes

    def wait_read(self, job: RemoteJob, released) -> bool:
        return self.medium.wait(job, released)

    def before_discard(self, job: RemoteJob) -> None:
        """A fetch dropped is not waited for: it ends, its CPU blocks held while a call runs."""

    def check_deadline(self, job: RemoteJob) -> None:
        if self.medium.expired(job):
            self.medium.abandon(job)  # polled, never waited for: the same deadline

    def end_read(self, job: RemoteJob, cancelled: bool) -> int:
        """The fetch's task is being finalized: its CPU blocks are held while its calls still run. A fetch given
        up on, or ended before its get returned, is ``discarded``: it brings nothing, even if its get returns
        first."""
        self._fetching.pop(int(job.hashes[0]), None)
        self.fetch_bytes_inflight -= job.host_ids.size * self.pool.block_bytes
        if not job.host_ids.size:
            self.medium.end(job)  # no get follows the probe
        job.discarded = job.abandoned or not job.finished()
        if job.finished():
            self.medium.finish(job)
        else:
            self.holds.hold(job.host_ids)
            self._abandoned.append(job)
        return 0 if cancelled or job.discarded else job.ok

    def note_read(self, pages: int, failed_pages: int) -> None:
        self.pages_fetched += pages
        self.pages_fetch_failed += failed_pages

    # --- life cycle ---

    def note_prefill(self, tokens: int, seconds: float, cached_tokens: int = 0) -> None:
        self.admission.note_prefill(tokens, seconds, cached_tokens)

    def settle(self) -> None:
        """Before a reset: no remote call is waited for; the CPU blocks one still uses stay held until it
        returns."""
        self.drain()

    @property
    def close_timeout_s(self) -> float:
        return self.medium.timeout_s

    def describe(self) -> str:
        c = self.config
        return (f"remote tier {c.remote_backend} at {c.remote_master} over {c.remote_protocol} (admission "
                f"{c.remote_admission})")

    def stats(self) -> dict:
        out = {f"remote_{k}": v for k, v in self.medium.snapshot().items()}
        out.update(fetches=self.fetches, pages_fetched=self.pages_fetched, pages_fetch_failed=self.pages_fetch_failed)
        out.update(remote_admitted=self.admission.admitted, remote_refused=self.admission.refused,
                   remote_tokens_refused=self.refused_tokens)
        return out

    def close(self, until: Optional[float] = None) -> None:
        """Account what has finished, then stop the tier's threads and disconnect by ``until`` (default: the
        timeout from now); jobs still running keep their blocks (and the client) to themselves."""
        if until is None:
            until = time.monotonic() + self.medium.timeout_s
        self.drain(wait=True, until=until)
        self.medium.close(until)


register("remote", RemoteLink.open, lambda config: config.remote_backend is not None)
