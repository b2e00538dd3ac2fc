"""SsdTier: the SSD medium behind the CPU pool: its slot index, and IO jobs run off the engine's threads.

The tier's owner (:class:`kvtier.tier.KVTier`) decides what to write and what to read; this class runs it:

* :meth:`SsdTier.write` takes CPU blocks that hold finished pages and writes them to free (or LRU-evicted) slots on
  a write thread. The caller keeps those CPU blocks unchanged until the job is done. A slot becomes findable only
  when its batch is durable (:meth:`finish`). Blocks beyond :data:`MAX_PENDING_BYTES` (or the owner's cap) of
  queued writes are dropped (a job's last blocks first) and counted: a slow disk never holds the CPU pool.
* :meth:`SsdTier.read` reads held slots into CPU blocks the caller owns, on a read thread (reads never wait behind
  writes). Every block is checked before it counts: header and payload checksums, fingerprint, chain hash,
  namespace, tokens. Reading stops at the first block that fails; that slot is removed and counted. The slots
  stay locked (never evicted, never rewritten) until :meth:`finish`. A slot found holding another whole block than
  its record named (a journal that lost records) is given to that block, else recorded free, on the write thread.

Each thread hands a whole job to the store (:meth:`SsdStore.put` in durable batches of :data:`BATCH_BYTES`, the next
one written while one commits; :meth:`SsdStore.read`), whose IO threads move the bytes straight between the disk
and the CPU blocks, seen through the owner's ``block_view`` (so this module knows neither torch nor the pool's
layout), and check each block as it arrives. Single-owner: every method except the workers' is called under the
owner's lock; the workers touch only their job and the store.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Optional

import numpy as np

from kvtier._cleanup import run_all
from kvtier.storage import Block, BlockHeader, SsdStore
from kvtier.tier.queue_thread import QueueThread
from kvtier.tier.room_advice import RoomAdvice
from kvtier.tier.slot_index import SlotIndex

logger = logging.getLogger(__name__)

__all__ = ["SsdTier", "IoJob", "SsdStats", "BATCH_BYTES", "MAX_PENDING_BYTES"]

# Tuned constants: docs/DESIGN.md, "Tuned constants".
BATCH_BYTES = 64 << 20  # one durable batch (a sync of each file and journal) per this many bytes written
MAX_PENDING_BYTES = 8 << 30  # writes queued beyond this are dropped (they hold CPU blocks until written)

BlockView = Callable[[int], np.ndarray]  # CPU block id -> its bytes (see SsdTier)


def signed64(x: int) -> int:
    """A uint64 (a namespace seed) as the int64 the on-disk header keeps."""
    x = int(x)
    return x - (1 << 64) if x >= 1 << 63 else x


@dataclasses.dataclass
class IoJob:
    """A batch of blocks to write to or read from the SSD; its completion interface is the executors' (``done``,
    ``wait``, ``seconds``)."""

    kind: str  # "write" | "read" | "free" | "adopt" (records of read slots, on the write thread) | "mark"
    slots: np.ndarray  # int64, one per block
    hashes: np.ndarray  # uint64 chain hashes
    namespace: int  # signed namespace seed
    tokens: np.ndarray  # (blocks, tokens per block) int64
    host_ids: np.ndarray  # CPU blocks read from (write) or filled (read)
    ok: int = 0  # leading blocks durable (write) or verified and copied in (read)
    bad: int = -1  # read: the block that failed a check (-1: none)
    other: Optional[BlockHeader] = None  # read: the whole block that the failed slot holds instead; adopt: it
    error: Optional[BaseException] = None  # an IO error that ended the job early
    io_seconds: float = 0.0
    _event: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    @property
    def num_blocks(self) -> int:
        return int(self.slots.size)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._event.wait(timeout)

    def seconds(self) -> Optional[float]:
        return self.io_seconds


@dataclasses.dataclass
class SsdStats:
    """SSD counters since construction."""

    blocks_recovered: int = 0
    writes: int = 0
    blocks_written: int = 0
    blocks_write_skipped: int = 0  # already on the SSD or being written
    blocks_write_dropped: int = 0  # the write queue was full, or no slot could be had
    blocks_write_failed: int = 0  # an IO error (disk full, device error): the slots go back, nothing is findable
    blocks_duplicate: int = 0
    reads: int = 0
    blocks_read: int = 0
    blocks_corrupt: int = 0  # failed a check on read: a miss, the slot freed
    blocks_stale: int = 0  # read: the slot held another whole block than its record named: a miss
    blocks_adopted: int = 0  # such slots given to the block they hold
    read_errors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    seconds_write: float = 0.0
    seconds_read: float = 0.0


class _Worker:
    """A thread running one kind of job, FIFO."""

    def __init__(self, name: str, run: Callable[[IoJob], None]) -> None:
        self._run = run
        self._thread = QueueThread(name, self._run_one)

    def submit(self, job: IoJob) -> None:
        self._thread.put(job)

    def _run_one(self, job: IoJob) -> None:
        t0 = time.perf_counter()
        try:
            self._run(job)
        except BaseException as e:  # an IO error: the job ends here, counted by finish()
            job.error = e
        job.io_seconds = time.perf_counter() - t0
        job._event.set()

    def close(self) -> None:
        self._thread.stop()


class SsdTier:
    """The SSD medium over ``store``, for blocks of ``block_tokens`` tokens.

    Args:
        store: the block files (its ``block_bytes`` is the CPU pool's block size).
        block_tokens: tokens per block.
        block_view: a CPU block's bytes, in the on-disk order, as an array that is contiguous or has contiguous
            rows (:mod:`kvtier.storage.payload`): the store's IO threads read and write it in place.
        max_pending_bytes: writes queued beyond this many bytes are dropped.
    """

    def __init__(self, store: SsdStore, *, block_tokens: int, block_view: BlockView,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.store, self.block_tokens = store, block_tokens
        self.block_bytes = store.block_bytes
        self._view = block_view
        self.index = SlotIndex(store.num_slots)
        self.stats = SsdStats()
        self.advice = RoomAdvice()  # warnings for dropped writes
        # called with (blocks, bytes, seconds) of every finished write (the tier's observers)
        self.on_written: Optional[Callable[[int, int, float], None]] = None
        # called with (chain hashes, CPU blocks) of blocks that became findable, and with the chain hashes of
        # blocks that stopped being findable (the tier's observers)
        self.on_stored: Optional[Callable[[np.ndarray, np.ndarray], None]] = None
        self.on_removed: Optional[Callable[[np.ndarray], None]] = None
        self.max_pending_blocks = max(1, max_pending_bytes // self.block_bytes)  # the write queue's bound
        self._pending_blocks = 0
        self._writing: set[int] = set()  # chain hashes of blocks in write jobs
        t0 = time.perf_counter()
        slots, hashes = store.recover_hashes()
        self.stats.blocks_recovered = self.index.recover(slots, hashes)
        self.index.on_removed = self._removed
        self.recovery_seconds = time.perf_counter() - t0
        if self.stats.blocks_recovered:
            logger.info("kvtier: SSD tier recovered %d blocks from %s in %.2f s", self.stats.blocks_recovered,
                        ";".join(store.dirs), self.recovery_seconds)
        self._batch = max(1, BATCH_BYTES // self.block_bytes)
        # None once closed (close() is idempotent; nothing is submitted after it)
        self._writer: _Worker = _Worker("kvtier-ssd-write", self._run_writer_job)
        self._reader: _Worker = _Worker("kvtier-ssd-read", self._run_read)

    # --- owner's side (under its lock) ---

    def match(self, hashes: np.ndarray) -> np.ndarray:
        """Slots of the leading ``hashes`` on the SSD (no IO)."""
        return self.index.match(hashes)

    @property
    def num_held(self) -> int:
        """Blocks findable on the SSD."""
        return self.index.num_held

    def touch(self, slots: np.ndarray) -> None:
        """Mark a prefix's held slots most recently used."""
        self.index.touch(slots)

    def lock(self, slots: np.ndarray) -> None:
        """Keep held slots from being evicted until :meth:`unlock`."""
        self.index.lock(slots)

    def unlock(self, slots: np.ndarray) -> None:
        self.index.unlock(slots)

    def write(self, hashes: np.ndarray, namespace: int, tokens: np.ndarray,
              host_ids: np.ndarray) -> Optional[IoJob]:
        """Start writing CPU blocks ``host_ids`` (chain ``hashes``, ``tokens`` rows) to the SSD; those already
        there or being written are skipped. None when nothing is written (all skipped, or dropped: the queue is
        full or every slot is locked or pending). The caller keeps the CPU blocks unchanged until the job is done
        and then calls :meth:`finish`."""
        keep = np.fromiter((not self.index.contains(h) and int(h) not in self._writing for h in hashes.tolist()),
                           dtype=bool, count=hashes.size)
        self.stats.blocks_write_skipped += int((~keep).sum())
        n = int(keep.sum())
        if n == 0:
            return None
        room = min(n, self.max_pending_blocks - self._pending_blocks)  # the first blocks: a prefix's head serves most
        slots = self.index.alloc(room) if room > 0 else np.empty(0, np.int64)
        self.stats.blocks_write_dropped += n - slots.size
        if slots.size < n:
            self.advice.ssd_write_dropped(dropped=n - slots.size, queue_full=room < n)
        if slots.size == 0:
            return None
        pick = np.flatnonzero(keep)[:slots.size]
        job = IoJob("write", slots, hashes[pick].astype(np.uint64), signed64(namespace),
                    np.ascontiguousarray(tokens[pick], dtype=np.int64), np.asarray(host_ids)[pick].copy())
        self._writing.update(job.hashes.tolist())
        self._pending_blocks += job.num_blocks
        self.stats.writes += 1
        self._writer.submit(job)
        return job

    def read(self, slots: np.ndarray, hashes: np.ndarray, namespace: int, tokens: np.ndarray,
             host_ids: np.ndarray) -> IoJob:
        """Start reading held ``slots`` (a prefix: ``hashes``, ``tokens`` rows) into CPU blocks ``host_ids`` the
        caller owns until the job is done and it has called :meth:`finish`."""
        self.index.lock(slots)
        self.index.touch(slots)
        job = IoJob("read", np.asarray(slots, np.int64), hashes.astype(np.uint64), signed64(namespace),
                    np.array(tokens, dtype=np.int64), np.asarray(host_ids).copy())  # a copy: the caller's may change
        self.stats.reads += 1
        self._reader.submit(job)
        return job

    def finish(self, job: IoJob) -> None:
        """Account a done job in the index: durable slots become findable, the others go back; read slots
        unlock, a slot that failed its check is removed."""
        n, ok = job.num_blocks, job.ok
        if job.kind == "write":
            stored = [i for i, (s, h) in enumerate(zip(job.slots[:ok].tolist(), job.hashes[:ok].tolist()))
                      if self.index.commit(s, h)]
            self.stats.blocks_duplicate += ok - len(stored)
            if self.on_stored is not None and stored:
                self.on_stored(job.hashes[stored], job.host_ids[stored])
            self.index.release(job.slots[ok:])
            self._writing.difference_update(job.hashes.tolist())
            self._pending_blocks -= n
            self.stats.blocks_written += ok
            self.stats.blocks_write_failed += n - ok
            self.stats.bytes_written += ok * self.block_bytes
            self.stats.seconds_write += job.io_seconds
            if self.on_written is not None and ok:
                self.on_written(ok, ok * self.block_bytes, job.io_seconds)
            if job.error is not None:
                logger.warning("kvtier: SSD write of %d blocks failed after %d (%s: %s); the CPU tier carries on",
                               n, ok, type(job.error).__name__, job.error)
        else:
            self.index.unlock(job.slots)
            if job.bad < 0 and job.error is not None and job.ok < n:  # another error: the reading stopped here
                job.bad = job.ok
            if job.bad >= 0:
                slot = int(job.slots[job.bad])
                self.index.remove(slot)
                if job.error is not None:
                    self.stats.read_errors += 1
                    logger.warning("kvtier: SSD read failed (%s: %s); the block is a miss",
                                   type(job.error).__name__, job.error)
                elif job.other is None:
                    self.stats.blocks_corrupt += 1
                    if not self.index.locked(slot):  # else the last read holding it records it (no write under a read)
                        self._record(IoJob("free", np.array([slot]), np.empty(0, np.uint64), 0, np.empty((0, 0)),
                                           np.empty(0, np.int64)))
                else:
                    self.stats.blocks_stale += 1
                    if not self.index.locked(slot):
                        self._settle_stale(slot, job.other)
            self.stats.blocks_read += ok
            self.stats.bytes_read += ok * self.block_bytes
            self.stats.seconds_read += job.io_seconds

    def _settle_stale(self, slot: int, other: BlockHeader) -> None:
        """``slot``, just removed, holds the whole block ``other``: it holds it from now on when that block is held
        nowhere else on the SSD, else it is recorded free; either durably, on the write thread (FIFO: before any
        later write into the slot)."""
        adopted = self.index.adopt(slot, other.chain_hash)
        self.stats.blocks_adopted += adopted
        self._record(IoJob("adopt" if adopted else "free", np.array([slot]), np.empty(0, np.uint64), 0,
                           np.empty((0, 0)), np.empty(0, np.int64), other=other))

    def _record(self, job: IoJob) -> None:
        self._writer.submit(job)

    def wait_idle(self) -> None:
        """Block until every job queued so far on the write and read threads has run (finished jobs still await
        :meth:`finish`)."""
        for worker in (self._writer, self._reader):
            mark = IoJob("mark", np.empty(0, np.int64), np.empty(0, np.uint64), 0, np.empty((0, 0)),
                         np.empty(0, np.int64))
            worker.submit(mark)
            mark.wait()

    def _removed(self, hashes: list[int]) -> None:
        if self.on_removed is not None:
            self.on_removed(np.array(hashes, dtype=np.uint64))

    @property
    def read_gbps(self) -> Optional[float]:
        """Measured read bandwidth of finished reads (None before any)."""
        s = self.stats
        return s.bytes_read / s.seconds_read / 1e9 if s.seconds_read > 0 and s.bytes_read else None

    def clear(self) -> None:
        """Forget every held block (their slots become free; nothing may be locked or pending)."""
        self.index.clear()

    def close(self) -> None:
        """Finish the queued jobs, stop the threads, close the files; idempotent."""
        if self._writer is None:
            return
        writer, reader = self._writer, self._reader
        self._writer = self._reader = None  # type: ignore[assignment]  # closed: see __init__
        run_all(writer.close, reader.close, self.store.close)

    def snapshot(self) -> dict:
        out = dataclasses.asdict(self.stats)
        out.update(blocks_held=self.index.num_held, blocks_pending=self.index.num_pending,
                   blocks_total=self.index.num_slots, blocks_evicted=self.index.evicted,
                   read_gbps=self.read_gbps, direct_io=self.store.direct)
        return out

    # --- worker side ---

    def _run_writer_job(self, job: IoJob) -> None:
        if job.kind == "write":
            self._run_write(job)
            return
        if job.kind == "mark":
            return
        try:  # a record of a read slot: nobody waits for it; a failure costs a miss after a restart, no more
            if job.kind == "adopt":
                assert job.other is not None  # an adopt job names the header
                self.store.adopt(int(job.slots[0]), job.other)
            else:  # "free"
                self.store.free(job.slots.tolist())
                self.store.sync()
        except Exception as e:  # noqa: BLE001 - logged: the slot's record stays as it was
            logger.warning("kvtier: recording SSD slot %d as %s failed (%s: %s)", int(job.slots[0]),
                           "adopted" if job.kind == "adopt" else "free", type(e).__name__, e)

    def _run_write(self, job: IoJob) -> None:
        blocks = [Block(job.namespace, h, job.tokens[i], self._view(b))
                  for i, (h, b) in enumerate(zip(job.hashes.tolist(), job.host_ids.tolist()))]

        def durable(n: int) -> None:
            job.ok = n

        self.store.put(job.slots.tolist(), blocks, batch=self._batch, on_durable=durable)

    def _run_read(self, job: IoJob) -> None:
        if job.kind == "mark":
            return
        hashes = job.hashes.tolist()

        def same_block(i: int, h) -> bool:  # on the store's IO threads
            return (h.chain_hash == hashes[i] and h.namespace == job.namespace and h.payload_len == self.block_bytes
                    and np.array_equal(h.tokens, job.tokens[i]))

        got = self.store.read(job.slots.tolist(), [self._view(b) for b in job.host_ids.tolist()],
                              accept=same_block, stop_at_bad=True)
        ok = next((i for i, h in enumerate(got.headers) if h is None), job.num_blocks)
        job.ok = ok
        if ok < job.num_blocks:
            job.bad = ok
            other = got.others.get(ok)
            if other is not None and other.chain_hash != hashes[ok]:  # a stale record (the same hash: a collision)
                job.other = other
            if got.error is not None and got.error_at == ok:  # an IO error, not a failed check
                raise got.error
