"""KVTier: the host tier of a prefix KV cache: lookup, asynchronous store and load, layerwise load, completion.

The engine-facing contract is :mod:`kvtier.tier.abstract`'s. Pages are the engine's (``config.page_size`` tokens);
the host holds them in blocks of ``config.block_tokens`` tokens (a multiple of the page), so hits, stores and
evictions come in whole blocks, and a load may start in the middle of one. A store's new pages enter the index, and
a lookup sees them, only once its copy has completed and been finalized (by the next call that drains, or by
:meth:`KVTier.finalize` in ``"ordered"`` mode); the engine keeps the slots' KV unchanged until then. A load's path
stays locked until its copy completes; the forward waits for it with :meth:`KVTier.wait_on_current_stream`, or per
layer through :attr:`KVTier.counter` for a layerwise load. Room for new blocks is made by the eviction policy
(:mod:`kvtier.tier.block_room`); copies take the path the transfer policy picks (:mod:`kvtier.tier.device_copies`).

Lower tiers (:mod:`kvtier.tier.lower`, fastest first) hear of every block that enters or leaves the CPU index; past
the CPU hit, a lookup starts a ``"read"`` task on the first that holds the next block (:mod:`kvtier.tier.lower_tiers`)
and never waits on it: :meth:`KVTier.lookup_tiers` returns the task, for an engine that does.

Invariants: pages read by an in-flight load or under an in-flight store or read are locked in the index, so never
evicted; blocks written by an in-flight store or read belong to the task (not free, not in the index); nothing is
freed before the copy that uses it has completed. Every pool block is free, held by the index, owned by one in-flight
store or read, or let go of and held until the lower-tier IO using it has returned. Two in-flight stores of the same
new pages both copy them; the first to complete inserts them, the second's blocks go back to the pool.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Callable, Mapping, Optional, Union, cast

import numpy as np

from kvtier._cleanup import run_all
from kvtier._checks import check_count
from kvtier.config import TierConfig
from kvtier.index import Namespace, PageTrie, eviction_policy
from kvtier.kernels import PagedKV
from kvtier.tier.abstract import HostTier
from kvtier.tier.block_holds import BlockHolds
from kvtier.tier.block_room import BlockRoom
from kvtier.tier.device_copies import DeviceCopies
from kvtier.tier.engine_args import as_config, as_slots, as_tokens, lower_tier_identity
from kvtier.tier.engine_args import store_layers as check_store_layers
from kvtier.tier.executor import CudaExecutor, ImmediateExecutor
from kvtier.tier.host_pool import HostBlockPool, synchronized
from kvtier.tier.lower import LowerTier, asked_for, open_lower_tiers
from kvtier.tier.lower_tiers import Agree, LowerTiers
from kvtier.tier.observers import Observers, TierObserver, Transfer
from kvtier.tier.signal import LayerDoneCounter
from kvtier.tier.room_advice import RoomAdvice
from kvtier.tier.tasks import (COMPLETED, CopyRecord, InFlight, InsertRecord, LoadRecord, TaskKind, TaskStatus,
                               TaskTable, TierTask)
from kvtier.tier.tier_stats import TierHit, TierStats, describe, snapshot
from kvtier.tier.transfer_policy import TransferPolicy

logger = logging.getLogger(__name__)

__all__ = ["KVTier", "TierTask", "TaskKind", "TaskStatus", "TierStats", "TierHit"]


class KVTier(HostTier):
    """Host tier for one KV pool: index + pinned block pool + transfers + layer signal (see module docstring).

    Args:
        kv: the engine's device KV buffers (its page size must equal ``config.page_size``); :attr:`kv` is the same
            buffers as the tier moves them, in host blocks of ``config.block_tokens`` tokens.
        config: settings (default :meth:`TierConfig.from_env`).
        pool: a host pool to use instead of one sized from ``config.cpu_cache_gb`` (its geometry and layout must
            match).
        executor: how copies are issued (default: :class:`CudaExecutor` on CUDA, :class:`ImmediateExecutor` on
            CPU; tests pass a :class:`~kvtier.tier.executor.DeferredExecutor`).
        counter_backend: LayerDoneCounter backend (``"auto"``, ``"cupy"``, ``"torch"``, ``"host"``).
        host_budget_bytes: this process's share of host memory (the engine's), which the pool must fit.
        finalize: ``"auto"``: a completed copy is finalized (store pages enter the index, locks drop) by the next
            call that drains; ``"ordered"``: only by :meth:`finalize`, which the engine calls in an order and at
            moments that every TP rank agrees on, so the index evolves identically on every rank (``wait`` then
            only blocks, and ``poll`` reports what was finalized).
        model_identity: what the engine's KV belongs to (model path and revision, TP rank and size, ...): a lower
            tier's blocks carry it, and blocks written under another identity are never read. Required with a lower
            tier.
        store_layers: the layers this tier's stores copy (default: all). Processes whose KV is the same (MLA under
            TP) share one pool's memory and split the layers of every store between them; each loads all layers.
    """

    def __init__(self, kv: PagedKV, config: Optional[TierConfig] = None, *, pool: Optional[HostBlockPool] = None,
                 executor=None, counter_backend: str = "auto", host_budget_bytes: Optional[int] = None,
                 finalize: str = "auto", model_identity: Optional[Mapping] = None,
                 store_layers: Optional[range] = None) -> None:
        self._lock = threading.RLock()
        self.config = as_config(config)
        logger.info("kvtier: starting: the host pool, then the host index (numba compiles it on a first start: up "
                    "to a few minutes; later starts load it from its cache)")
        model_identity = lower_tier_identity(asked_for(self.config), finalize, model_identity)
        geo = kv.geometry
        if geo.page_size != self.config.page_size:
            raise ValueError(f"the KV pool has page_size {geo.page_size}, the kvtier config {self.config.page_size}:"
                             " they must match (set page_size in the kvtier config to the engine's page size)")
        self.page_size = geo.page_size
        self.block_tokens = self.config.block_tokens
        self._pages_per_block = self.block_tokens // self.page_size
        if self.block_tokens != self.page_size:
            kv = kv.with_page_size(self.block_tokens)
            geo = kv.geometry
        self.kv, self.geometry = kv, geo
        self.store_layers = store_layers = check_store_layers(store_layers, geo.num_layers)
        if pool is None:
            pool = HostBlockPool(geo, cpu_cache_gb=self.config.cpu_cache_gb, layout=self.config.host_layout,
                                 budget_bytes=host_budget_bytes)
        elif pool.geometry != geo or pool.layout != self.config.host_layout:
            raise ValueError(f"host pool geometry/layout ({pool.geometry}, {pool.layout}) does not match the KV pool "
                             f"({geo}, {self.config.host_layout})")
        self.pool = pool
        self.layout = pool.layout
        self.index = PageTrie(self.block_tokens, initial_nodes=pool.num_blocks)  # one node per block: never grows
        self.eviction = eviction_policy(self.config.eviction_policy, self.index)
        logger.info("kvtier: host index ready (numba code compiled or loaded from its cache in %.1f s)",
                    PageTrie.compile(self.block_tokens))  # now, not on the first request
        if executor is None:
            executor = CudaExecutor(kv.device) if kv.is_cuda else ImmediateExecutor()
        self._auto_finalize = finalize == "auto"
        self.counter = LayerDoneCounter(geo.num_layers, device=kv.device if kv.is_cuda else "cpu",
                                        backend=counter_backend)
        self.policy = TransferPolicy(self.config.transfer_mode, self.layout, geo)
        self.copies = DeviceCopies(kv, pool, executor, self.policy, self.counter, store_layers,
                                   self.config.num_programs)
        if kv.is_cuda and self.config.transfer_mode != "direct":
            self.copies.staged()  # staging buffers now, where the engine's memory planning sees them, not mid-serving
        self.tasks = TaskTable()
        self._inflight = self.tasks.records  # task id -> in-flight copy
        self._stats = TierStats()
        self.room_advice = RoomAdvice()  # warnings for stores dropped for lack of room, naming the key to raise
        self.holds = BlockHolds(pool)  # CPU blocks lower-tier IO still uses
        self._observers = Observers()
        # the tiers below the CPU pool, fastest first
        self.lower: list[LowerTier] = open_lower_tiers(self.config, pool, self.holds, self.block_tokens,
                                                       model_identity)
        self.below = LowerTiers(self, self.lower)
        self.room = BlockRoom(pool, self.index, self.eviction, self.holds, self.lower, self._evicted,
                              ordered=not self._auto_finalize)
        for t in self.lower:
            t.observe(functools.partial(self._written, t.name),
                      *(functools.partial(self._observers.notify, hook, t.name) for hook in ("lower_stored",
                                                                                           "lower_removed")))
        logger.info("kvtier: %s", self.describe())

    def lower_tier(self, name: str) -> Optional[LowerTier]:
        """The lower tier of that name (:func:`kvtier.tier.lower.registered`), or None when it does not run."""
        return self.below.named(name)

    describe = describe  # the configuration in force, in one line (the start-up log line)

    def add_observer(self, observer: TierObserver) -> None:
        """Report transfers and CPU index changes to ``observer`` from now on (:mod:`kvtier.tier.observers`)."""
        with self._lock:
            self._observers.add(observer)

    def remove_observer(self, observer: TierObserver) -> None:
        """Stop reporting to ``observer`` (no-op if it is not observing)."""
        with self._lock:
            self._observers.remove(observer)

    # --- engine API ---

    @synchronized
    def lookup(self, tokens, ns: Optional[Namespace] = None) -> int:
        """Number of leading full pages of ``tokens`` held in the CPU tier (does not touch the LRU order); with lower
        tiers, also starts reading what they hold past them (:meth:`lookup_tiers`)."""
        return self.lookup_tiers(tokens, ns).cpu_pages

    @synchronized
    def lookup_tiers(self, tokens, ns: Optional[Namespace] = None, agree: Optional[Agree] = None) -> TierHit:
        """Leading full pages of ``tokens`` on the CPU, and, with lower tiers, the read that brings the pages past
        them into the CPU tier: from the first tier that holds (or may hold) the next block, started here unless
        one from the same block is in flight (none when admission refuses it). Never waits on a lower tier. Ordered:
        only through ``agree``, the ranks' MIN of their offers (:meth:`LowerTiers.find_agreed`)."""
        self._drain()
        toks = as_tokens(tokens)
        B, G = self.block_tokens, self._pages_per_block
        n = toks.size // B
        m = self.index.match(toks[:n * B], ns, touch=False)
        hit = m.num_pages * G
        self._stats.lookups += 1
        self._stats.hit_pages += hit
        self._stats.miss_pages += toks.size // self.page_size - hit
        return self.below.find(toks, ns, m, n, agree)

    @synchronized
    def flush_lower(self) -> None:
        """Block until every queued lower-tier write is durable (or failed), and account them. A clean shutdown
        calls it (``destroy`` does): queued writes are otherwise lost with the process."""
        for t in self.lower:
            t.flush()

    @synchronized
    def note_prefill(self, tokens: int, seconds: float, cached_tokens: int = 0) -> None:
        """The engine prefilled ``tokens`` tokens past ``cached_tokens`` cached ones (loaded, not computed) in
        ``seconds``: the prefill costs the lower tiers' admission compares reads with (unless
        ``prefill_tokens_per_s`` is configured; see :mod:`kvtier.tier.admission`)."""
        for t in self.lower:
            t.note_prefill(tokens, seconds, cached_tokens)

    @synchronized
    def store(self, tokens, ns: Optional[Namespace], slot_indices) -> TierTask:
        """Copy the full pages of ``tokens`` not yet held from their device slots to the host, asynchronously.

        Args:
            tokens: token ids (a trailing partial block is ignored).
            slot_indices: device slot of every token (at least the full blocks' tokens), in order.
            ns: namespace (requests share pages only within one).

        Returns:
            The task; its pages become visible to ``lookup``/``load`` once it completes. Keep the slots' KV
            unchanged until then.
        """
        toks, slots = as_tokens(tokens), as_slots(slot_indices)
        self._drain()
        B, G = self.block_tokens, self._pages_per_block
        n = toks.size // B  # blocks
        if slots.numel() < n * B:
            raise ValueError(f"{slots.numel()} slot indices for {n} full blocks of {B} tokens")
        toks = toks[:n * B]
        m = self.index.match(toks, ns, touch=True)
        held = m.num_pages
        self._stats.stores += 1
        self._stats.pages_store_skipped += held * G
        task = self.tasks.new(TaskKind.STORE, 0, num_held=held * G)
        if held == n:
            return self.tasks.finish_now(task)
        if held:
            self.index.lock(m)  # the prefix the new pages hang from must survive until they are inserted
        ids = self.room.alloc_under(m if held else None, n - held)
        self._stats.pages_store_dropped += (n - held - ids.size) * G
        if ids.size < n - held:
            self.room_advice.host_store_dropped(n - held - int(ids.size), n, self.pool, B)
        if ids.size == 0:
            if held:
                self.index.unlock(m)
            return self.tasks.finish_now(task)
        task.num_pages = int(ids.size) * G
        end = held + ids.size
        new_slots = slots[held * B:end * B]
        share = int(ids.size) * self.pool.block_bytes * len(self.store_layers) // self.geometry.num_layers
        prefix_ids = np.array(m.block_ids[:held], dtype=np.int64)
        stored = toks[:end * B].copy()

        def issue() -> InsertRecord:
            completion = self.copies.store(new_slots, ids)
            return InsertRecord(task, completion, ids, m if held else None, share, tokens=stored, ns=ns,
                                prefix_ids=prefix_ids, reads=new_slots)
        try:
            self._inflight[task.id] = issue()
        except Exception as e:
            return self._failed(task, "store", e, ids=ids, handle=m if held else None, retry=issue)
        return task

    @synchronized
    def load(self, tokens, ns: Optional[Namespace], slot_indices, *, start_page: int = 0) -> TierTask:
        """Copy the longest held prefix of ``tokens``, from page ``start_page`` on, into ``slot_indices``.

        Args:
            tokens: token ids.
            slot_indices: device slots of pages ``start_page, start_page + 1, ...``, page by page; at most
                ``len(slot_indices) // page_size`` pages load.
            ns: namespace.
            start_page: pages before it are already on the device (an engine's device-cached prefix): they must be
                held for the pages after them to count, but they are not copied (it may fall inside a block).

        Returns:
            The task (``num_pages`` pages copied). Before reading the slots the forward pass must wait for it:
            :meth:`wait_on_current_stream` (GPU-side) or :meth:`wait`.
        """
        return self._load(tokens, ns, slot_indices, layerwise=False, start_page=start_page)

    @synchronized
    def load_layerwise(self, tokens, ns: Optional[Namespace], slot_indices, *, start_page: int = 0) -> TierTask:
        """As :meth:`load`, one layer at a time, signalling each layer through :attr:`counter`.

        The engine then calls ``counter.set_consumer(task.producer_index)`` and the forward pass calls
        ``counter.wait_until(layer)`` before reading a layer. Each layer's copy is one ``executor.run("load", ...)``.
        """
        return self._load(tokens, ns, slot_indices, layerwise=True, start_page=start_page)

    @synchronized
    def poll(self) -> list[int]:
        """Drain completed copies (store pages enter the index, locks drop); the ids finalized since the last poll."""
        self._drain()
        return self.tasks.take_finished()

    @synchronized
    def wait(self, task: Union[TierTask, int]) -> Union[TierTask, int]:
        """Block the host until ``task``'s copy has completed, and finalize it (also reported by the next poll;
        ``finalize="ordered"``: only block). The task; ``task`` itself when it is no longer in flight."""
        rec = self._record(task)
        if rec is not None:
            self._wait(rec)
            if self._auto_finalize and self._pending(rec):
                self._finalize(rec, cancelled=False)
        return rec.task if rec is not None else task

    @synchronized
    def wait_progress(self, task: TierTask, timeout_s: float) -> None:
        """Block at most ``timeout_s``, the lock let go of, until the lower-tier read ``task``'s IO returns; nothing
        is finalized. An engine with nothing to run waits here instead of spinning (the IO threads need the GIL)."""
        rec = self._record(task)
        if rec is not None and rec.task.kind.reads_lower_tier:
            self.below.wait_progress(cast(InsertRecord, rec), timeout_s)  # a read's record

    @synchronized
    def wait_all(self) -> None:
        """Block until every in-flight copy has completed, and finalize them (``"ordered"``: only block)."""
        for rec in list(self._inflight.values()):
            if self._pending(rec):  # not finalized by another thread while this one waited for a fetch
                self._wait(rec)
            if self._auto_finalize and self._pending(rec):
                self._finalize(rec, cancelled=False)

    @synchronized
    def completed(self, task: Union[TierTask, int]) -> bool:
        """Whether ``task``'s copy has completed (or it is not in flight); never blocks."""
        rec = self._record(task)
        return rec is None or rec.completion.done()

    @synchronized
    def finalize(self, task: Union[TierTask, int], *, keep: Union[bool, int] = True) -> None:
        """Block until ``task``'s copy completes, then finalize it: a store's pages enter the index (``keep=False``:
        they are discarded, as by :meth:`cancel`), the locks drop; a read keeps its first ``keep`` blocks if an
        int (the ranks' agreed count). No-op for a task already finalized."""
        rec = self._record(task)
        if rec is not None:
            self._wait(rec)
            if self._pending(rec):
                self._finalize(rec, cancelled=not keep, limit=None if isinstance(keep, bool) else int(keep))

    @synchronized
    def retry(self, task: TierTask) -> bool:
        """Issue again a copy whose issue failed and that is kept for ordered finalization (``finalize="ordered"``):
        the same copy, between the same CPU blocks and device slots, its path still locked, as if the first issue
        had gone through; True when it did this time (the task is in flight again), False when it failed again
        (the task stays failed, still kept). A later pipeline stage repairs this way a copy the first stage
        completed: the blocks it holds are those every stage allocated at that point of the sequence.

        Raises:
            ValueError: ``task`` is not a failed copy kept by the tier.
        """
        rec = self._inflight.get(task.id)
        if rec is None or task.status != TaskStatus.FAILED or rec.retry is None:
            raise ValueError(f"task {task.id} is not a failed copy kept for ordered finalization")
        task.num_pages, task.status = rec.retry_pages, TaskStatus.INFLIGHT
        try:
            self._inflight[task.id] = rec.retry()
        except Exception as e:
            self._failed(task, task.kind.stream, e, ids=rec.block_ids, handle=rec.handle, retry=rec.retry)
            return False
        return True

    @synchronized
    def wait_on_current_stream(self, task: TierTask) -> None:
        """Make the engine's current stream wait (GPU-side on CUDA) for ``task``'s copy; the host does not block."""
        rec = self._inflight.get(task.id)
        if rec is not None and rec.task.kind.reads_lower_tier:  # IO: nothing on a stream to wait for
            self._wait(rec)
        elif rec is not None:
            self.executor.wait_current(rec.completion)

    @synchronized
    def cancel(self, task: Union[TierTask, int]) -> bool:
        """Discard an in-flight task after its copy completes (a store inserts nothing and frees its blocks); True
        if the task was in flight, False if it had already been finalized."""
        rec = self._record(task)
        if rec is None:
            return False
        self._wait(rec, discard=True)
        self._finalize(rec, cancelled=True)
        return True

    @synchronized
    def reset(self) -> None:
        """Wait for every in-flight copy, then drop every CPU page and task (pending poll reports included); lower
        tiers keep their blocks (a durable one outlives the process: a new KVTier over it serves them). Lower-tier IO
        past its tier's deadline is not waited for: a read in flight ends unread, and the CPU blocks such IO still
        uses stay held, never reused, until it returns."""
        for rec in list(self._inflight.values()):
            self._wait(rec, discard=True)  # a read's tier decides: it ends, its blocks held while its IO runs
            self._finalize(rec, cancelled=True)
        for t in self.lower:
            t.settle()  # no IO reads a CPU block any more, or its blocks stay held
        quarantined = self.holds.reset()  # still used by lower-tier IO: held until it returns
        self.index.reset()
        if self._observers:
            self._observers.notify("cleared")
        self.pool.reset(keep=quarantined)
        self.counter.reset()
        self.tasks.finished.clear()

    @synchronized
    def evict(self, num_pages: int) -> int:
        """Evict unlocked blocks now (by the eviction policy), at least ``num_pages`` pages' worth if there are;
        returns the pages evicted (ValueError: ``num_pages`` is not an int >= 0)."""
        G = self._pages_per_block
        return self.room.evict(-(-check_count("num_pages", num_pages, 0) // G)) * G

    def destroy(self) -> None:
        """Wait for in-flight copies and release the host pool (unpins it); idempotent. With lower tiers, stores in
        flight complete first (and go down the tiers), a write-back tier is given every CPU block, and every queued
        write is made durable: a restart serves them. Reads in flight end unread; lower-tier IO is waited for at most
        the longest tier's deadline in all: what still runs (its blocks held by it) is left to the process's exit."""
        with self._lock:
            if self.pool.destroyed:
                return
            if self.lower:
                for rec in list(self._inflight.values()):  # stores land (and go down the tiers); reads end
                    if not rec.task.kind.reads_lower_tier:
                        self._wait(rec)
                        self._finalize(rec, cancelled=False)
            self.below.write_back_all()  # a write-back tier writes the CPU's blocks: a restart serves them
            until = time.monotonic() + max((t.close_timeout_s for t in self.lower), default=0.0)
            self.reset()
            # each even if one before it raises (a close failing with EIO): no thread, file or pinned memory is left
            run_all(*(functools.partial(t.close, until) for t in self.lower),
                    self.copies.close,  # the staged path's row-issuing threads
                    self.pool.destroy)

    # --- accounting ---

    @synchronized
    def stats(self) -> dict:
        """Counters (:class:`TierStats`), the pool's and index's state, and each lower tier's counters."""
        return snapshot(self)

    @property
    def inflight_ids(self) -> list[int]:
        return list(self._inflight)

    @synchronized
    def in_flight(self) -> dict[int, InFlight]:
        """Every task in flight by id, as read-only copies (tests, benches and tools look; nothing changes)."""
        return self.tasks.view()

    @property
    def observers(self) -> tuple[TierObserver, ...]:
        """The observers reporting now (:meth:`add_observer`)."""
        return self._observers.all()

    @property
    def executor(self):
        """How copies are issued (:mod:`kvtier.tier.executor`); a test may swap in another before any copy."""
        return self.copies.executor

    @executor.setter
    def executor(self, executor) -> None:
        self.copies.executor = executor

    # --- internals ---

    def _written(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None:
        """A lower tier finished writing ``blocks`` CPU blocks."""
        if self._observers:
            G = self._pages_per_block
            self._observers.notify("transfer_done", Transfer(tier, "store", blocks * G, nbytes, seconds))

    def _wait(self, rec: CopyRecord, *, discard: bool = False) -> None:
        """Block until ``rec``'s copy has completed; a read: each call of its tier at most the tier's deadline (past
        it, it is given up on: it brings nothing, and its CPU blocks stay held until its IO returns). ``discard``:
        the task is dropped after the wait, so a read is waited for only as its tier requires (finalizing it ends it;
        IO still running keeps its blocks held until it returns)."""
        if not rec.task.kind.reads_lower_tier:
            rec.completion.wait()
            return
        self.below.wait(cast(InsertRecord, rec), discard)  # a read's record

    def _record(self, task: Union[TierTask, int]) -> Optional[CopyRecord]:
        return self._inflight.get(task.id if isinstance(task, TierTask) else int(task))

    def _pending(self, rec: CopyRecord) -> bool:
        """Whether ``rec`` is still in flight (a wait for a fetch lets go of the lock: another thread may have
        finalized it meanwhile)."""
        return self._inflight.get(rec.task.id) is rec

    def _load(self, tokens, ns, slot_indices, *, layerwise: bool, start_page: int = 0) -> TierTask:
        start_page = check_count("start_page", start_page, 0)
        toks, slots = as_tokens(tokens), as_slots(slot_indices)
        self._drain()
        P, B = self.page_size, self.block_tokens
        start = start_page * P  # tokens on the device already
        n = min(toks.size, start + slots.numel() // P * P) // B  # blocks the slots can take
        m = self.index.match(toks[:n * B], ns, touch=True)
        copied = max(0, m.num_pages * B - start)  # tokens to copy; those before start are on the device already
        self._stats.loads += 1
        task = self.tasks.new(TaskKind.LOAD_LAYERWISE if layerwise else TaskKind.LOAD, copied // P)
        if copied == 0:
            return self.tasks.finish_now(task)
        self.index.lock(m)  # the whole matched path: the copied pages hang from the prefix
        self.below.used(toks, ns, m.num_pages)
        ids = np.array(m.block_ids[start // B:m.num_pages])
        dst = slots[:copied]

        def issue() -> LoadRecord:
            completion = self.copies.load(dst, ids, skip=start % B, layerwise=layerwise,
                                          set_slot=functools.partial(setattr, task, "producer_index"))
            return LoadRecord(task, completion, ids, m, copied * self.geometry.token_bytes, ns=ns, reads=dst)
        try:
            self._inflight[task.id] = issue()
        except Exception as e:
            return self._failed(task, "load", e, handle=m, retry=issue)
        return task

    def _failed(self, task: TierTask, stream: str, error: Exception, *, ids: Optional[np.ndarray] = None,
                handle=None, retry: Optional[Callable[[], CopyRecord]] = None) -> TierTask:
        """Unwind a copy whose issue raised: wait for whatever of it reached the stream (it may still read or
        write the slots and blocks), give its blocks back, unlock its path, count it; the task fails.

        ``finalize="ordered"``: the blocks and the lock are kept, as for a copy in flight, until the engine
        finalizes the task (which then discards it): TP ranks whose copies failed and succeeded alike hold the same
        blocks until they agree, so their host pools and indexes evolve identically."""
        self.copies.settle(stream)
        self._stats.count_failure(stream)
        logger.warning("kvtier: %s of %d pages failed and was unwound (%s: %s)", task.kind, task.num_pages,
                       type(error).__name__, error, exc_info=error)
        pages = task.num_pages
        task.num_pages, task.producer_index, task.status = 0, -1, TaskStatus.FAILED
        # Recorded as a completed copy: finalizing it (now, or when the engine does in "ordered" mode) frees its
        # blocks and unlocks its path, as for any discarded copy; until then it can be issued again (retry).
        record = InsertRecord if task.kind.inserts else LoadRecord
        rec = record(task, COMPLETED, ids if ids is not None else np.empty(0, np.int64), handle, 0, retry=retry,
                     retry_pages=pages)
        self._inflight[task.id] = rec
        if self._auto_finalize:
            self._finalize(rec, cancelled=True)
        return task

    def _evicted(self, ids: np.ndarray) -> None:
        """Blocks leave the CPU index by eviction (before the lower tiers hear of it)."""
        if self._observers and ids.size:
            self._observers.notify("blocks_evicted", ids)
        self._stats.pages_evicted += ids.size * self._pages_per_block

    def _drain(self) -> None:
        for t in self.lower:
            t.drain()
        if not (self._auto_finalize or self.lower):  # ordered and no lower tier: nothing to poll or finalize here
            return
        for rec in list(self._inflight.values()):
            if rec.task.kind.reads_lower_tier:
                self.below.poll(cast(InsertRecord, rec))  # a read's record: its deadline, and blocks when it wants
            if self._auto_finalize and rec.completion.done():
                self._finalize(rec, cancelled=False)

    def _insert(self, rec: InsertRecord, k: int) -> np.ndarray:
        """Insert the held prefix and the first ``k`` new blocks of a finished store or promotion; the new blocks
        another task inserted first go back to the pool. Returns which of the ``k`` the index took."""
        held, B = rec.prefix_ids.size, self.block_tokens
        ids = rec.block_ids[:k]
        toks = rec.tokens[:(held + k) * B]
        r = self.index.insert(toks, np.concatenate((rec.prefix_ids, ids)), rec.ns)
        owned = r.new_mask[held:]
        self.pool.free(ids[~owned])
        entered, positions = ids[owned], held + np.flatnonzero(owned)
        if self._observers and positions.size:
            self._observers.notify("blocks_entered", entered, toks, rec.ns, positions)
        self.below.entered(entered, toks, rec.ns, positions, rec.task.source)
        return owned

    def _finalize(self, rec: CopyRecord, *, cancelled: bool, limit: Optional[int] = None) -> None:
        """The copy of ``rec`` has completed: insert / free / unlock, and account (a failed copy is discarded
        and stays failed)."""
        task = rec.task
        del self._inflight[task.id]
        failed = task.status == TaskStatus.FAILED
        cancelled = cancelled or failed
        secs = rec.completion.seconds()
        if not task.kind.reads_lower_tier:
            self._stats.count_copy(task.kind.stream, rec.nbytes, secs)
        if task.kind == TaskKind.STORE:
            if cancelled:
                self.pool.free(rec.block_ids)
            else:
                owned = self._insert(cast(InsertRecord, rec), rec.block_ids.size)  # a store's record
                self._stats.pages_stored += int(owned.sum()) * self._pages_per_block
                self._stats.pages_store_duplicate += int((~owned).sum()) * self._pages_per_block
        elif task.kind.reads_lower_tier:
            self.below.finalize(cast(InsertRecord, rec), cancelled, limit)  # a read's record
        elif not cancelled:
            self._stats.pages_loaded += task.num_pages
        if rec.handle is not None:
            self.index.unlock(rec.handle)
        if cancelled and not failed:
            self._stats.cancelled += 1
        if self._observers and not cancelled and not task.kind.reads_lower_tier and task.num_pages:
            self._observers.notify("transfer_done", Transfer("cpu", task.kind.stream, task.num_pages, rec.nbytes, secs))
        task.status = TaskStatus.FAILED if failed else TaskStatus.CANCELLED if cancelled else TaskStatus.DONE
        self.tasks.finished.append(task.id)
