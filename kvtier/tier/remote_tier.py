"""RemoteTier: the remote medium behind the CPU pool (a :class:`~kvtier.storage.mooncake_store.MooncakeStore`):
IO jobs run off the engine's threads, every value checked, every wait bounded.

The tier's owner (:class:`~kvtier.tier.remote_link.RemoteLink`) decides what to put and what to fetch; this class
runs it:

* :meth:`RemoteTier.put` stores CPU blocks (header + KV, zero-copy from the registered pool) on the put thread.
  The caller keeps the blocks unchanged until the job is done. Blocks beyond the owner's cap of queued puts are
  dropped and counted.
* A block whose bytes are not one range (``layer_first``: one row per layer) is staged instead: copied
  into the worker's registered buffer behind its header, so that each value is one range (and read back the same
  way, copied into the block once verified). Mooncake's TCP transport moves every range as a transfer of its own:
  57 ranges of 32 KiB per value run at a third of one range's bandwidth, and a batch of them overflows its
  per-peer transfer queue (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, 1024 by default), failing values
  (``TRANSFER_FAIL``); the copy costs a fraction of a millisecond per block (``bench/bench_remote.py``).
* A batch's blocks are copied and checksummed on :data:`PREP_THREADS` threads where the machine has cores to
  spare (a batch's copy and checksum cost about what its transfer does: docs/DESIGN.md, Remote tier), on the
  worker's own thread otherwise.
* :meth:`RemoteTier.probe` asks the store, on the probe thread, how many leading blocks of a prefix it holds
  (``batch_is_exist``); :meth:`RemoteTier.get` then reads them into CPU blocks the caller owns. Every block is
  checked before it counts (value size, header checksum, fingerprint, chain hash, namespace, tokens, payload
  checksum); reading stops at the first that fails, which is counted as missing, failed (its holder, another
  client's segment, did not serve it: a dead peer) or corrupt.
* The owner never blocks on the network except in :meth:`RemoteTier.wait`, bounded by ``timeout_s`` per call. A
  call that outlasts it, or that finds the master unreachable, marks the tier down: no probes, puts dropped
  (counted), until a health probe (every :data:`RETRY_S`) finds the master again. Mooncake's client reconnects by
  itself. A call given up on still occupies its thread until it returns (a get from a hung peer: about a minute),
  so until then no fetch starts (counted skipped) and puts are dropped, also once the master answers again.

A job's blocks stay the job's until its calls have returned (:meth:`RemoteJob.finished`), also when the owner
stopped waiting for it. Single-owner: every method except the workers' is called under the owner's lock.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Callable, ContextManager, Optional

import numpy as np
import xxhash

from kvtier.storage.aligned_io import aligned
from kvtier.storage.block_format import ALIGN, BlockHeader, pack_block_header, unpack_block_header
from kvtier.storage.mooncake_store import MooncakeStore, block_key, gone, transfer_failed, unreachable
from kvtier.tier.queue_thread import QueueThread
from kvtier.tier.room_advice import RoomAdvice

logger = logging.getLogger(__name__)

__all__ = ["RemoteTier", "RemoteJob", "RemoteStats", "RETRY_S", "BATCH_BYTES", "PREP_THREADS", "PUT_CALL_NICE",
           "PUT_PREP_NICE", "LEFT_TO_EXIT"]

# Tuned constants: docs/DESIGN.md, "Tuned constants".
BATCH_BYTES = 64 << 20  # one put or get call per this many bytes
MAX_BATCH_BLOCKS = 256  # and at most this many blocks (the header buffer)
STAGE_RANGES = 1  # a block in more ranges than this is staged: copied, header first, into one range per value
RETRY_S = 1.0  # a down tier probes the master this often
_WATCH_S = 0.02  # how often a waiting owner checks the calls' deadlines
# Threads that copy and checksum a batch's blocks (numpy and xxhash release the GIL): a quarter of the CPUs, at most
# 4; none (the worker alone) below 8 CPUs, where Mooncake's own calls already keep the cores busy.
_CPUS = os.cpu_count() or 1
PREP_THREADS = min(4, _CPUS // 4) if _CPUS >= 8 else 0
# Niceness added to the thread that makes the put calls and to the put worker's own thread (which prepares the next
# batch: staging copy, checksum, header); both 0. Every thread of the tier takes the GIL, and CPython hands the GIL
# over under a mutex that the taking and the dropping thread lock for a moment: a nicer thread preempted there (at
# 10, a tenth of a nice-0 thread's share of a core) holds every Python thread of the process until the scheduler
# runs it again. On 2 loaded cores a put thread at 10 held them 30-90 ms at a time (``bench_remote_stalls.py
# --gil-trace``: the GIL free, the engine's threads asleep on its mutex or condition, a put thread the only Python
# thread runnable; docs/DESIGN.md, "Tuned constants"). The bench's ``on:nice=N`` phases set both.
PUT_CALL_NICE = 0
PUT_PREP_NICE = 0

ViewFn = Callable[[int], np.ndarray]  # CPU block id -> its bytes, uint8 [layers, row] (rows contiguous)
# Clients closed with a call still running or their master not answering: kept until the process exits (a destructor
# would close them, holding the GIL while it waits for the master).
LEFT_TO_EXIT: list[MooncakeStore] = []


def _ranges(rows: np.ndarray) -> list[tuple[int, int]]:
    """(address, bytes) of a block's rows (``[layers, row]``, each row contiguous, one stride apart), adjacent
    rows merged: one range when the block is contiguous. From the strides: a loop over the rows' ``ctypes`` costs
    a tenth of the block's time on the wire (docs/DESIGN.md, Remote tier)."""
    a = rows.__array_interface__["data"][0]
    if rows.flags.c_contiguous:
        return [(a, rows.nbytes)]
    row, stride = rows.shape[1] * rows.itemsize, rows.strides[0]
    if rows.strides[1] != rows.itemsize or stride < row:  # not rows one stride apart: walk them
        out: list[list[int]] = []
        for r in rows:
            p = r.__array_interface__["data"][0]
            if out and out[-1][0] + out[-1][1] == p:
                out[-1][1] += r.nbytes
            else:
                out.append([p, r.nbytes])
        return [(p, n) for p, n in out]
    return [(a + i * stride, row) for i in range(rows.shape[0])]


def _checksum(rows: np.ndarray) -> int:
    """xxh3-64 of a block's bytes in row order (equal to that of the rows copied back to back)."""
    if rows.flags.c_contiguous:
        return xxhash.xxh3_64_intdigest(rows)  # type: ignore[arg-type]  # an ndarray is a buffer (numpy's stubs: 3.12+)
    h = xxhash.xxh3_64()
    for r in rows:
        h.update(r)
    return h.intdigest()


@dataclasses.dataclass
class RemoteJob:
    """A put, a probe-then-get fetch, or a health probe."""

    kind: str  # "put" | "fetch" | "health"
    hashes: np.ndarray  # uint64 chain hashes, one per block
    namespace: int  # signed namespace seed
    tokens: np.ndarray  # (blocks, tokens per block) int64
    host_ids: np.ndarray  # put: CPU blocks read; fetch: CPU blocks filled (set by get)
    views: list = dataclasses.field(default_factory=list, repr=False)  # the host blocks' bytes
    ok: int = 0  # put: blocks stored; fetch: leading blocks verified
    stored: list = dataclasses.field(default_factory=list, repr=False)  # put: which blocks were stored
    found: int = -1  # fetch: leading blocks the store holds (-1: not probed yet)
    missing: int = 0  # fetch: blocks gone between probe and get
    corrupt: int = 0  # fetch: values that failed a check
    failed: int = 0  # fetch: values whose holder did not serve them (a dead or hung peer)
    error: Optional[BaseException] = None
    down: bool = False  # a call found the master unreachable
    abandoned: bool = False  # the owner stopped waiting (the calls may still run)
    discarded: bool = False  # fetch: given up on, or ended before its get returned (it brings nothing)
    started: Optional[float] = None  # time.monotonic() when its running stage began (None: queued)
    call_at: Optional[float] = None  # when the call on its sender began (None: none runs)
    side_call_at: Optional[float] = None  # when a call its worker thread makes itself began (probe, size, remove)
    worker: Optional["_Worker"] = dataclasses.field(default=None, repr=False)  # the thread running its stages
    io_seconds: float = 0.0
    _stage: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)
    _ended: bool = False  # the owner ended the fetch after its probe

    @property
    def num_blocks(self) -> int:
        return int(self.hashes.size)

    def awaiting_blocks(self) -> bool:
        """A fetch whose probe has returned and whose owner must now start its get (or end it)."""
        return (self.kind == "fetch" and self._stage.is_set() and not self.host_ids.size and not self._ended
                and not self.abandoned)

    def finished(self) -> bool:
        """Whether no call of the job runs or will run (its blocks are free to reuse)."""
        return self._stage.is_set() and (self.kind != "fetch" or self._ended or self.host_ids.size > 0)

    def done(self) -> bool:
        """Whether the owner can account the job (finished, or abandoned)."""
        return self.finished() or self.abandoned

    def verified(self) -> int:
        """A fetch's leading blocks read and verified (0 once abandoned)."""
        return 0 if self.abandoned else self.ok

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the running stage; whether it has returned."""
        return self._stage.wait(timeout)

    def seconds(self) -> Optional[float]:
        return self.io_seconds


@dataclasses.dataclass
class RemoteStats:
    """Remote counters since construction."""

    puts: int = 0
    blocks_put: int = 0
    blocks_put_dropped: int = 0  # queue full, or the tier down
    blocks_put_failed: int = 0  # the store refused or failed the put
    probes: int = 0
    blocks_probed_hit: int = 0
    fetches: int = 0
    blocks_fetched: int = 0
    blocks_missing: int = 0  # held at the probe, gone at the get
    blocks_corrupt: int = 0  # wrong size, header, identity, tokens or checksum: a miss
    blocks_fetch_failed: int = 0  # the holder did not serve the value (a dead or hung peer): a miss
    fetches_abandoned: int = 0  # outlasted the timeout
    fetches_skipped: int = 0  # not started: the fetch thread still runs a call given up on
    errors: int = 0
    times_down: int = 0
    bytes_put: int = 0
    bytes_fetched: int = 0
    seconds_put: float = 0.0
    seconds_fetch: float = 0.0


class _Worker:
    """A thread running one kind of job, FIFO, and a sender thread for its store calls, with two registered
    buffers of a slot of ``slot_bytes`` per block of a batch (a header, followed by the block's bytes when blocks
    are staged): one batch is prepared or checked in one buffer while the other's call runs."""

    def __init__(self, name: str, store: MooncakeStore, batch: int, slot_bytes: int = ALIGN, nice: int = 0,
                 prep_nice: int = 0) -> None:
        self.slot_bytes = slot_bytes
        self.buffers = [aligned(batch * slot_bytes) for _ in range(2 if slot_bytes else 0)]
        for buf in self.buffers:
            store.register(buf.ctypes.data, buf.nbytes)
        self.sender = _CallThread(f"{name}-call", nice)
        self.running: Optional[RemoteJob] = None  # the job whose stage runs now
        self._thread = QueueThread(name, self._run, prep_nice)

    def submit(self, fn: Callable[[], None], job: RemoteJob) -> None:
        job._stage.clear()
        job.started, job.worker = None, self
        self._thread.put((fn, job))

    def _run(self, item: tuple) -> None:
        fn, job = item
        t0 = time.perf_counter()
        job.started = time.monotonic()
        self.running = job
        try:
            fn()
        except BaseException as e:  # the job ends here; its owner counts it
            job.error = e
        job.io_seconds += time.perf_counter() - t0
        self.running = None
        job._stage.set()

    def request_stop(self) -> None:
        """Make the thread end after the queued jobs, without waiting for it."""
        self._thread.request_stop()

    def join(self, until: float) -> bool:
        """Whether the thread has ended by ``until`` (``time.monotonic()``); if so, its sender is stopped too (no
        call of it runs: a job returns only once its calls have)."""
        if not self._thread.join(max(0.0, until - time.monotonic())):
            return False
        self.sender.shutdown()
        return True


class _CallThread:
    """One daemon thread running the calls submitted to it in order, each answered through a Future. Not a
    ThreadPoolExecutor, whose threads the interpreter joins at exit: a call hung in Mooncake (a master that stopped
    answering) would hold the process's exit for as long as the master hangs."""

    def __init__(self, name: str, nice: int = 0) -> None:
        self._thread = QueueThread(name, self._run, nice)  # from the creator: inherits its niceness, adds ``nice``

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._thread.put((future, fn, args))
        return future

    @staticmethod
    def _run(item: tuple) -> None:
        future, fn, args = item
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # the caller reads it from the future
            future.set_exception(e)

    def shutdown(self) -> None:
        """Stop after the calls submitted so far, once they have run."""
        self._thread.stop()


def _start_threads(pool: concurrent.futures.ThreadPoolExecutor, n: int) -> None:
    """Start ``pool``'s ``n`` threads (its ``max_workers``) now, from the calling thread: a thread inherits its
    creator's niceness, and a pool otherwise starts its threads from whichever thread submits first (a nicer
    worker's). If they do not all start, the pool is shut down and the error raised."""
    started = threading.Barrier(n + 1, timeout=10.0)  # a thread starts in microseconds: a bound, not a wait
    try:
        for _ in range(n):
            pool.submit(started.wait)
        started.wait()
    except BaseException:
        started.abort()  # threads already waiting return (with an error no one reads)
        pool.shutdown(wait=False)
        raise


def _timed(job: RemoteJob, clock: str, fn, *args):
    """``fn(*args)``, a store call of ``job``, with ``job.<clock>`` (``call_at``: the sender's call;
    ``side_call_at``: one its worker thread makes itself) set to its start while it runs: the owner's deadline."""
    setattr(job, clock, time.monotonic())
    try:
        return fn(*args)
    finally:
        setattr(job, clock, None)


def _stuck(worker: Optional[_Worker]) -> bool:
    """Whether ``worker`` still runs a call its owner gave up on (jobs queued behind it would wait for it)."""
    job = worker.running if worker is not None else None
    return job is not None and job.abandoned


class RemoteTier:
    """The remote medium over ``store`` for blocks of ``block_tokens`` tokens and ``block_bytes`` bytes.

    Args:
        store: the connected client.
        fingerprint: what the blocks belong to (part of every key and header).
        key_prefix: the first part of every key.
        block_view: a CPU block's bytes (in registered memory).
        timeout_s: the longest the owner waits for a call.
        max_pending_bytes: puts queued beyond this many bytes are dropped.
    """

    def __init__(self, store: MooncakeStore, *, block_tokens: int, block_bytes: int, fingerprint: bytes,
                 key_prefix: str, block_view: ViewFn, timeout_s: float, max_pending_bytes: int) -> None:
        self.store, self.block_tokens, self.block_bytes = store, block_tokens, block_bytes
        self.fingerprint, self.key_prefix, self.timeout_s = fingerprint, key_prefix, timeout_s
        self._view = block_view
        self.value_bytes = ALIGN + block_bytes
        self.stats = RemoteStats()
        self.advice = RoomAdvice()  # warnings for dropped puts
        # called with (blocks, bytes, seconds) of every finished put, and with the (chain hashes, CPU blocks) it
        # stored (the tier's observers)
        self.on_written: Optional[Callable[[int, int, float], None]] = None
        self.on_stored: Optional[Callable[[np.ndarray, np.ndarray], None]] = None
        self.up = True
        self._next_retry = 0.0
        self._health: Optional[RemoteJob] = None
        self._max_pending = max_pending_bytes // block_bytes
        self._pending_blocks = 0
        self._batch = max(1, min(MAX_BATCH_BLOCKS, BATCH_BYTES // block_bytes))
        self.staged = len(_ranges(block_view(0))) > STAGE_RANGES  # see the module docstring
        slot = self._slot_bytes = self.value_bytes if self.staged else ALIGN
        self._prep = (concurrent.futures.ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="kvtier-remote-prep")
                      if PREP_THREADS else None)
        self._putter = self._fetcher = self._prober = None
        try:
            if self._prep is not None:  # they check gets too: the creator's niceness, not the put worker's
                _start_threads(self._prep, PREP_THREADS)
            self._putter = _Worker("kvtier-remote-put", store, self._batch, slot, nice=PUT_CALL_NICE,
                                   prep_nice=PUT_PREP_NICE)
            self._fetcher = _Worker("kvtier-remote-fetch", store, self._batch, slot)
            self._prober = _Worker("kvtier-remote-probe", store, 0, 0)  # probes never queue behind gets
        except BaseException:  # no thread outlives a tier that failed to start (none has a job yet)
            self._stop_threads()
            raise

    def keys(self, hashes: np.ndarray) -> list[str]:
        return [block_key(self.key_prefix, self.fingerprint, h) for h in hashes.tolist()]

    # --- owner's side (under its lock) ---

    def put(self, hashes: np.ndarray, namespace: int, tokens: np.ndarray, host_ids: np.ndarray) -> Optional[RemoteJob]:
        """Start storing CPU blocks ``host_ids`` (chain ``hashes``, ``tokens`` rows); None when nothing is put
        (the tier is down, the put thread still runs a call given up on, or the queue is full: the blocks are
        dropped, counted)."""
        stuck = _stuck(self._putter)
        room = self._max_pending - self._pending_blocks if self.up and not stuck else 0
        k = max(0, min(hashes.size, room))  # the first blocks: a prefix's head serves most
        self.stats.blocks_put_dropped += hashes.size - k
        if self.up and not stuck and k < hashes.size:  # down or stuck: the tier-down warning says why
            self.advice.remote_put_dropped(dropped=hashes.size - k)
        if k == 0:
            return None
        ids = np.asarray(host_ids[:k]).copy()
        job = RemoteJob("put", hashes[:k].astype(np.uint64), namespace, np.ascontiguousarray(tokens[:k], np.int64),
                        ids, [self._view(int(b)) for b in ids.tolist()])
        self._pending_blocks += k
        self.stats.puts += 1
        assert self._putter is not None  # a store: the workers run until close
        self._putter.submit(lambda: self._run_put(job), job)
        return job

    def probe(self, hashes: np.ndarray, namespace: int, tokens: np.ndarray) -> Optional[RemoteJob]:
        """Start asking how many leading ``hashes`` the store holds (a fetch's first stage); None when down, or
        while the fetch thread still runs a get given up on (a get queued behind it would wait for it)."""
        if not self.can_fetch():
            return None
        job = RemoteJob("fetch", hashes.astype(np.uint64), namespace, np.array(tokens, dtype=np.int64),
                        np.empty(0, np.int64))
        self.stats.probes += 1
        assert self._prober is not None  # can_fetch(): the workers run
        self._prober.submit(lambda: self._run_probe(job), job)
        return job

    def can_fetch(self) -> bool:
        """Whether a fetch may start now: the tier is up and the fetch thread runs no call given up on (a get
        queued behind that call would wait for it); a fetch refused for the latter is counted skipped."""
        if not self.up:
            return False
        if _stuck(self._fetcher):
            self.stats.fetches_skipped += 1
            return False
        return True

    def get(self, job: RemoteJob, host_ids: np.ndarray) -> None:
        """Start reading the first ``host_ids.size`` blocks of a probed fetch into CPU blocks ``host_ids`` (the
        caller owns them until the job is finished)."""
        job.host_ids = np.asarray(host_ids, np.int64).copy()
        job.views = [self._view(int(b)) for b in job.host_ids.tolist()]
        job.io_seconds = 0.0  # the get's own time (read_gbps): not the probe's
        self.stats.fetches += 1
        assert self._fetcher is not None  # a probed fetch: the workers run
        self._fetcher.submit(lambda: self._run_get(job), job)

    def end(self, job: RemoteJob) -> None:
        """End a probed fetch without a get (nothing held, refused, or no CPU block)."""
        job._ended = True

    def wait(self, job: RemoteJob, released: Callable[[], ContextManager] = contextlib.nullcontext) -> bool:
        """Wait for ``job``'s stage; whether it returned. The stage is abandoned (and the tier marked down) once
        one of its calls has run ``timeout_s``, or, still queued, once the tier is down (a call ahead of it
        outlasted its own timeout: :meth:`watch`); time spent queued behind healthy calls does not count. Each
        wait for the stage runs inside ``released()`` (the owner lets go of its lock there), the checks between
        them outside."""
        while True:
            with released():
                if job.wait(_WATCH_S):
                    return True
            self.watch()  # may abandon this job, or the call ahead of it
            if self.expired(job):
                self.abandon(job)
            if job.abandoned:
                return False

    def expired(self, job: RemoteJob) -> bool:
        """Whether the owner gives up on ``job``'s stage: its running call outlasted ``timeout_s``; or it has
        not started and the tier is down (it is skipped when it runs) or the call ahead of it on its thread was
        given up on or is past its own timeout (it would wait for that call)."""
        if job.abandoned or job._stage.is_set():  # given up on already, or its stage returned
            return False
        if job.started is None:
            ahead = job.worker.running if job.worker is not None else None
            return not self.up or (ahead is not None and ahead is not job
                                   and (ahead.abandoned or self._overdue(ahead)))
        return self._overdue(job)

    def _overdue(self, job: RemoteJob) -> bool:
        """Whether a call of ``job``'s running stage has run longer than ``timeout_s`` (the work between calls,
        preparing and checking batches, does not count)."""
        now = time.monotonic()
        return not job._stage.is_set() and any(t is not None and now - t > self.timeout_s
                                                for t in (job.call_at, job.side_call_at))

    def abandon(self, job: RemoteJob) -> None:
        """Stop waiting for ``job`` (its calls may still run; its blocks stay the job's) and mark the tier
        down."""
        if job.abandoned:
            return
        job.abandoned = True
        self.stats.fetches_abandoned += job.kind == "fetch"
        self._mark_down(f"a {job.kind} call outlasted remote_timeout_s ({self.timeout_s:g} s)")

    def watch(self) -> None:
        """Abandon a put, get or probe whose calls outlasted their timeout (whoever waits for it), so that the
        jobs queued behind it end too: a hung master or peer never holds the owner longer than one timeout."""
        for worker in (self._putter, self._fetcher, self._prober):
            job = worker.running if worker is not None else None
            if job is not None and self.expired(job):
                self.abandon(job)

    def finish(self, job: RemoteJob) -> None:
        """Account a finished job (puts and gets; a job abandoned earlier too, once finished)."""
        if job.error is not None:
            self.stats.errors += 1
            logger.warning("kvtier: remote %s failed (%s: %s); the local tiers carry on", job.kind,
                           type(job.error).__name__, job.error)
        if job.down:
            self._mark_down("the Mooncake master did not answer")
        s = self.stats
        if job.kind == "put":
            self._pending_blocks -= job.num_blocks
            s.blocks_put += job.ok
            s.blocks_put_failed += job.num_blocks - job.ok
            s.bytes_put += job.ok * self.block_bytes
            s.seconds_put += job.io_seconds
            if self.on_written is not None and job.ok:
                self.on_written(job.ok, job.ok * self.block_bytes, job.io_seconds)
            if self.on_stored is not None and job.stored:
                self.on_stored(job.hashes[job.stored], job.host_ids[job.stored])
        elif job.kind == "fetch":
            s.blocks_probed_hit += max(job.found, 0)
            if job.discarded:  # its owner counted it failed: what it brought was never used
                return
            s.blocks_fetched += job.ok
            s.blocks_missing += job.missing
            s.blocks_corrupt += job.corrupt
            s.blocks_fetch_failed += job.failed
            s.bytes_fetched += job.ok * self.block_bytes
            s.seconds_fetch += job.io_seconds if job.host_ids.size else 0.0

    def _mark_down(self, why: str) -> None:
        if self.up:  # already down: the next health probe stays when it was due
            self.up = False
            self.stats.times_down += 1
            logger.warning("kvtier: remote tier down (%s); the local tiers carry on, retrying every %g s", why,
                           RETRY_S)
            self._next_retry = time.monotonic() + RETRY_S

    def tick(self) -> None:
        """Abandon calls past their timeout (:meth:`watch`); while down, probe the master every
        :data:`RETRY_S`; up again once it answers. Nothing once closed."""
        if self._prober is None:
            return
        self.watch()
        h = self._health
        if h is not None and h.finished():
            self._health = None
            if not h.down and h.error is None:
                self.up = True
                logger.info("kvtier: remote tier up again (master %s)", self.store.master)
            else:
                self._next_retry = time.monotonic() + RETRY_S
        if not self.up and self._health is None and time.monotonic() >= self._next_retry:
            job = RemoteJob("health", np.zeros(1, np.uint64), 0, np.zeros((1, 0), np.int64), np.empty(0, np.int64))
            self._health = job
            self._prober.submit(lambda: self._run_health(job), job)

    @property
    def read_gbps(self) -> Optional[float]:
        s = self.stats
        return s.bytes_fetched / s.seconds_fetch / 1e9 if s.seconds_fetch > 0 and s.bytes_fetched else None

    def snapshot(self) -> dict:
        out = dataclasses.asdict(self.stats)
        out.update(up=self.up, blocks_pending_put=self._pending_blocks, read_gbps=self.read_gbps)
        return out

    def close(self, until: Optional[float] = None) -> None:
        """Finish the queued calls, stop the threads, disconnect, all by ``until`` (``time.monotonic()``; default:
        ``timeout_s`` from now); idempotent. A client whose call still runs then (hung past its timeout) is left to
        the process's exit rather than torn down under that call, and so is one whose master does not answer by
        then: Mooncake's close holds the GIL while it waits for the master (30-60 s). A client left is kept
        referenced (:data:`LEFT_TO_EXIT`), so that no destructor closes it later either."""
        if self._putter is None:
            return
        if until is None:
            until = time.monotonic() + self.timeout_s
        self.up = False  # closed: no put or probe starts (a call of another thread after destroy)
        if not self._stop_threads(until):
            logger.warning("kvtier: a remote call still runs at shutdown; the Mooncake client is not closed")
            LEFT_TO_EXIT.append(self.store)
        elif not self._master_answers(until):
            logger.warning("kvtier: the Mooncake master did not answer within %g s at shutdown; the client is left "
                           "to the process's exit, not closed", self.timeout_s)
            LEFT_TO_EXIT.append(self.store)
        else:
            self.store.close()

    def _master_answers(self, until: float) -> bool:
        """Whether the master answers a health probe by ``until`` (the call releases the GIL; one that hangs is
        left on a daemon thread)."""
        codes: list = []
        probe = threading.Thread(target=lambda: codes.extend(self._health_codes()), name="kvtier-remote-close-probe",
                                 daemon=True)
        probe.start()
        probe.join(max(0.0, until - time.monotonic()))
        return bool(codes) and not any(unreachable(c) for c in codes)

    def _stop_threads(self, until: Optional[float] = None) -> bool:
        """Stop the workers there are (after their queued calls; all asked at once) and the prep threads; whether
        every worker ended by ``until`` (None: ``timeout_s`` from now)."""
        if until is None:
            until = time.monotonic() + self.timeout_s
        workers = [w for w in (self._putter, self._fetcher, self._prober) if w is not None]
        for w in workers:
            w.request_stop()
        stopped = all([w.join(until) for w in workers])
        self._putter = self._fetcher = self._prober = None
        if self._prep is not None:
            self._prep.shutdown(wait=stopped)
        return stopped

    # --- worker side ---

    def _slot(self, buf: np.ndarray, i: int) -> np.ndarray:
        """Slot ``i`` of a worker buffer: the header, then (staged) the block's bytes."""
        S = self._slot_bytes
        return buf[i * S:(i + 1) * S]

    def _staging(self, buf: np.ndarray, i: int, rows: np.ndarray) -> np.ndarray:
        """Slot ``i``'s block bytes (staged blocks), shaped as ``rows``."""
        return self._slot(buf, i)[ALIGN:].reshape(rows.shape)

    def _value(self, buf: np.ndarray, i: int, rows: np.ndarray) -> list[tuple[int, int]]:
        """The ranges of block ``rows``'s value in slot ``i``: the slot (staged), or its header and the rows."""
        head = self._slot(buf, i)
        if self.staged:
            return [(head.ctypes.data, self.value_bytes)]
        return [(head.ctypes.data, ALIGN)] + _ranges(rows)

    def _each(self, fn: Callable[[int], object], items: range) -> list:
        """``fn`` of every item, in order: on the prep threads where there are, else here. Returns (or raises the
        first item's error) only once every item has run."""
        if self._prep is None or len(items) < 2:
            return [fn(i) for i in items]
        futures = [self._prep.submit(fn, i) for i in items]
        concurrent.futures.wait(futures)  # none still writes a buffer or a CPU block when this returns or raises
        return [f.result() for f in futures]

    def _pipeline(self, job: RemoteJob, worker: _Worker, n: int, prepare, call, check) -> None:
        """Blocks ``0..n`` of ``job`` in batches: ``prepare(a, b, buf)`` fills batch ``[a, b)``'s buffer while the
        previous batch's ``call`` runs on the sender; ``check(a, b, buf, result)`` (False: stop) runs while the next
        batch's call does. No call starts once the job is abandoned, the tier is down or the last call found the
        master unreachable. Returns only once no call runs (none still writes a buffer or a CPU block)."""
        spans = [(a, min(a + self._batch, n)) for a in range(0, n, self._batch)]
        last: Optional[tuple[int, int, np.ndarray, concurrent.futures.Future]] = None  # the call in flight
        try:
            for k, (a, b) in enumerate(spans):
                buf = worker.buffers[k % 2]
                go = self._going(job)  # read once: a batch is sent only if it was filled
                if go:
                    prepare(a, b, buf)
                result = last[3].result() if last is not None else None
                if not go or not self._going(job) or (result is not None and any(unreachable(c) for c in result)):
                    break
                fut = worker.sender.submit(_timed, job, "call_at", call, a, b, buf)
                prev, last = last, (a, b, buf, fut)
                if prev is not None and not check(prev[0], prev[1], prev[2], result):
                    return
            else:
                result = last[3].result() if last is not None else None
            if last is not None:
                check(last[0], last[1], last[2], result)
        finally:
            if last is not None:
                concurrent.futures.wait([last[3]])

    def _going(self, job: RemoteJob) -> bool:
        """Whether ``job`` makes its next call: the tier is up, and its owner has neither given up on it nor
        discarded it (a fetch cancelled or reset)."""
        return self.up and not job.abandoned and not job.discarded

    def _run_put(self, job: RemoteJob) -> None:
        if not self._going(job):  # marked down or given up on while queued: not sent (counted failed)
            return

        def fill(buf: np.ndarray, a: int, i: int) -> None:
            rows = job.views[i]
            if self.staged:
                rows = self._staging(buf, i - a, rows)
                rows[...] = job.views[i]
            self._slot(buf, i - a)[:ALIGN] = np.frombuffer(pack_block_header(BlockHeader(
                self.fingerprint, job.namespace, int(job.hashes[i]), job.tokens[i], self.block_bytes,
                _checksum(rows))), np.uint8)

        def prepare(a: int, b: int, buf: np.ndarray) -> None:
            self._each(lambda i: fill(buf, a, i), range(a, b))

        def call(a: int, b: int, buf: np.ndarray) -> list[int]:
            return self.store.put(self.keys(job.hashes[a:b]),
                                  [self._value(buf, i - a, job.views[i]) for i in range(a, b)])

        def check(a: int, b: int, buf: np.ndarray, codes: list[int]) -> bool:
            job.down = job.down or any(unreachable(c) for c in codes)
            job.stored.extend(i for i, c in zip(range(a, b), codes) if c == 0)
            job.ok = len(job.stored)
            return not job.down

        assert self._putter is not None  # a put job runs on it
        self._pipeline(job, self._putter, job.num_blocks, prepare, call, check)

    def _run_probe(self, job: RemoteJob) -> None:
        if not self.up or job.abandoned:
            job.found = 0
            return
        codes = _timed(job, "side_call_at", self.store.exists, self.keys(job.hashes))
        job.down = any(unreachable(c) for c in codes)
        held = [c == 1 for c in codes] + [False]
        job.found = held.index(False)

    def _run_get(self, job: RemoteJob) -> None:
        if not self._going(job):  # down, given up on or discarded while queued: its blocks are free at once
            return

        def call(a: int, b: int, buf: np.ndarray) -> list[int]:
            return self.store.get(self.keys(job.hashes[a:b]),
                                  [self._value(buf, i - a, job.views[i]) for i in range(a, b)])

        def verify(buf: np.ndarray, a: int, i: int, code: int) -> bool:
            """Whether block ``i``'s value (``code``: what the get returned for it) is the block asked for; a
            verified staged block is copied into its CPU block (the job's until it finishes: one after a failed
            block is written too, never counted)."""
            h = unpack_block_header(self._slot(buf, i - a)) if code == self.value_bytes else None
            rows = self._staging(buf, i - a, job.views[i]) if self.staged else job.views[i]
            if (h is None or h.fingerprint != self.fingerprint or h.chain_hash != int(job.hashes[i])
                    or h.namespace != job.namespace or h.payload_len != self.block_bytes
                    or not np.array_equal(h.tokens, job.tokens[i]) or h.payload_checksum != _checksum(rows)):
                return False
            if self.staged:
                job.views[i][...] = rows
            return True

        def check(a: int, b: int, buf: np.ndarray, codes: list[int]) -> bool:
            got = next((k for k, c in enumerate(codes[:b - a]) if c < 0), b - a)  # values before the first miss
            good = self._each(lambda i: verify(buf, a, i, codes[i - a]), range(a, a + got))
            ok = next((k for k, g in enumerate(good) if not g), got)
            job.ok = a + ok
            if ok < got:
                job.corrupt += 1
                self._remove(job, a + ok)
                return False
            if got < b - a:  # gone since the probe, the master down, its holder dead, or a value of another size
                code: Optional[int] = codes[got]
                if transfer_failed(code):  # a dead or hung holder, or a value of another size: ask the master
                    size = _timed(job, "side_call_at", self.store.size, self.keys(job.hashes[a + got:a + got + 1])[0])
                    code = size if size < 0 else (code if size == self.value_bytes else None)
                missing, failed, job.down = gone(code), transfer_failed(code), unreachable(code)
                job.missing += missing
                job.failed += failed
                if not (job.down or missing or failed):
                    job.corrupt += 1
                    if code is None:  # the master records another size: a value not of this geometry
                        self._remove(job, a + got)
                return False
            return True

        assert self._fetcher is not None  # a get runs on it
        self._pipeline(job, self._fetcher, job.host_ids.size, lambda a, b, buf: None, call, check)

    def _remove(self, job: RemoteJob, i: int) -> None:
        """Remove block ``i``'s value, which failed its checks: a put of the same key is a no-op while it is there
        (the store answers it stored), so the block would stay a miss for every instance until the store evicts
        it. Forced: the reader's own lease would refuse it; another reader of the value reads a miss."""
        codes = _timed(job, "side_call_at", self.store.remove, self.keys(job.hashes[i:i + 1]))
        job.down = job.down or any(unreachable(c) for c in codes)

    def _health_codes(self) -> list[int]:
        """The codes of a probe of the health key (an unreachable code: the master did not answer)."""
        return self.store.exists([f"{self.key_prefix}/health"])

    def _run_health(self, job: RemoteJob) -> None:
        codes = _timed(job, "side_call_at", self._health_codes)
        job.down = any(unreachable(c) for c in codes) or any(c < 0 for c in codes)
