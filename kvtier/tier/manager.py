"""KVTier: the host tier of a prefix KV cache: lookup, asynchronous store and load, layerwise load, completion.

Protocol (see :mod:`kvtier.tier.abstract` for the engine-facing contract). Pages are the engine's pages
(``config.page_size`` tokens); the host holds them in blocks of ``config.block_tokens`` tokens (a multiple of the
page), so hits, stores and evictions come in whole blocks, and a load may start in the middle of one:

* ``lookup(tokens, ns) -> pages``: how many leading full pages of ``tokens`` the host holds. Completed stores are
  drained first, so a store is visible from the first call after its copy finished, never before.
* ``store(tokens, ns, slots) -> TierTask``: D2H of the pages not already held. The held prefix is locked for the
  copy's duration (so the finished pages can be attached to it); blocks for the new pages are allocated, evicting
  unlocked pages from the index when the pool is full (the eviction policy's choice, LRU by default; when too few
  can be evicted, only the first new pages that fit are stored). The new pages enter the index only when the copy
  has completed (``poll``/``wait``/any call that drains). The engine must keep ``slots``' KV unchanged until then.
* ``load(tokens, ns, slots) -> TierTask``: H2D of the longest held prefix into the first ``pages * page_size``
  slots; the path is locked until the copy completes. Make the forward wait with :meth:`KVTier.wait_on_current_stream`.
* ``load_layerwise(tokens, ns, slots)``: the same, one launch per layer on the load stream, each followed by the
  :class:`~kvtier.tier.signal.LayerDoneCounter` event of that layer; ``task.producer_index`` is the slot the engine
  sets as consumer (-1 when nothing was loaded).
* SSD tier (``config.ssd_cache_gb`` > 0, :mod:`kvtier.tier.ssd_link`): blocks reach the SSD from the CPU blocks,
  off the engine's threads (``write_through``: as they enter the CPU index; ``write_back``: as it evicts them).
  ``lookup`` starts promoting the blocks the SSD holds past the CPU hit (a ``"promote"`` task, when admission by
  cost lets them in) and returns the CPU hit: it never waits on the disk. Promoted blocks become CPU hits when the
  task is finalized; :meth:`KVTier.lookup_tiers` returns the task, for an engine that waits for it (``wait``).
* Remote tier (``config.remote_backend``, :mod:`kvtier.tier.remote_link`): blocks entering the CPU index are put to
  the remote store asynchronously. When neither the CPU nor the SSD tier holds the next block, ``lookup`` starts
  a ``"fetch"`` task: a probe of the store, then (when the probe returns and admission lets it in) a get into new
  CPU blocks. It never waits on the network; ``wait`` on a fetch waits at most ``remote_timeout_s`` per stage.
* ``poll() -> [task ids]``: drain completions; every task id is reported by exactly one poll (unless ``reset``).
  ``wait(task)``: block until it completes and finalize it. ``cancel(task)``: wait for its copy, then discard it
  (a store frees its blocks and inserts nothing). ``reset()``: wait for every copy, then drop everything (remote
  calls are not waited for: the CPU blocks one still uses stay held, quarantined, until it returns).

Invariants: pages read by an in-flight load or under an in-flight store or promotion are locked in the index, so
never evicted; blocks written by an in-flight store or promotion belong to the task (not free, not in the index);
nothing is freed before the copy that uses it has completed. Every pool block is free, held by the index, owned by
one in-flight store, promotion or fetch, or let go of and held until the lower-tier IO using it has returned.

Two in-flight stores of the same new pages both copy them; the first to complete inserts them, the second's blocks
for those pages go back to the pool (correct, and rare: an engine stores a request's pages once).

Transfer modes (``TierConfig.transfer_mode``): ``direct`` and ``staged`` use that path for everything; ``auto``
chooses per copy (:mod:`kvtier.tier.transfer_policy`: stores through the copy engine, loads by their bytes and how
their host blocks run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from typing import Callable, Iterator, Mapping, NamedTuple, Optional, Union

import numpy as np
import torch

from kvtier._cleanup import run_all
from kvtier._checks import check_count, model_identity as check_model_identity
from kvtier.config import TierConfig
from kvtier.index import Namespace, PageTrie, eviction_policy, page_hashes
from kvtier.kernels import DirectCopy, PagedKV, StagedCopy, StagedTransfer, load_pages, store_pages
from kvtier.tier.abstract import HostTier
from kvtier.tier.block_holds import BlockHolds
from kvtier.tier.executor import CudaExecutor, ImmediateExecutor
from kvtier.tier.host_pool import HostBlockPool, synchronized
from kvtier.tier.observers import TierObserver, Transfer
from kvtier.tier.signal import LayerDoneCounter
from kvtier.tier.remote_link import FetchPlan, RemoteLink
from kvtier.tier.room_advice import RoomAdvice
from kvtier.tier.ssd_link import InFlight, PromotionPlan, SsdLink
from kvtier.tier.tasks import COMPLETED, CopyRecord, InsertRecord, LoadRecord, TaskKind, TaskStatus, TierTask
from kvtier.tier.transfer_policy import CopyPlan, Path, TransferPolicy

logger = logging.getLogger(__name__)

__all__ = ["KVTier", "TierTask", "TaskKind", "TaskStatus", "TierStats", "TierHit"]


class TierHit(NamedTuple):
    """What :meth:`KVTier.lookup_tiers` found: leading pages on the CPU, the pages past them that a promotion
    brings from the SSD, and that promotion (None, and 0 pages, when none runs: nothing on the SSD, admission refused
    it, or no CPU block could be had); or, when the SSD has nothing past the CPU hit, the remote fetch probing for
    them (its ``num_pages`` is known once its probe has returned)."""

    cpu_pages: int
    ssd_pages: int
    promotion: Optional["TierTask"]


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
    promotions: int = 0
    pages_promoted: int = 0  # SSD pages that entered the CPU index
    pages_promote_failed: int = 0  # started, but not read (a check or an IO error failed on the way)
    fetches: int = 0
    pages_fetched: int = 0  # remote pages that entered the CPU index
    pages_fetch_failed: int = 0  # blocks allocated for a fetch but not read (gone, corrupt, down, abandoned)
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    seconds_d2h: float = 0.0  # device time of completed stores (CUDA events; wall time on CPU)
    seconds_h2d: float = 0.0

    @property
    def gbps_d2h(self) -> Optional[float]:
        return self.bytes_d2h / self.seconds_d2h / 1e9 if self.seconds_d2h > 0 else None

    @property
    def gbps_h2d(self) -> Optional[float]:
        return self.bytes_h2d / self.seconds_h2d / 1e9 if self.seconds_h2d > 0 else None


def _range_check(slots: torch.Tensor) -> bool:
    """Whether a copy checks its indices' range: only host-side slots (a check of device ones costs a sync)."""
    return slots.device.type == "cpu"


def _as_tokens(tokens) -> np.ndarray:
    """Token ids as a contiguous array; an empty sequence (``[]`` is float64 to numpy) as empty int64: no page."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    toks = np.ascontiguousarray(np.asarray(tokens))
    return toks.astype(np.int64) if toks.size == 0 else toks


def _as_slots(slots, name: str = "slot_indices") -> torch.Tensor:
    """Slot indices as a 1-D int64 tensor; TypeError naming ``name`` for anything but integers (a float or bool
    slot is no index: it is not truncated), ValueError for another shape."""
    if not isinstance(slots, torch.Tensor):
        arr = np.asarray(slots)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        elif not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got {arr.dtype} values (floats and bools are not indices)")
        slots = torch.as_tensor(arr.astype(np.int64, copy=False))
    elif slots.dtype == torch.bool or slots.dtype.is_floating_point or slots.dtype.is_complex:
        raise TypeError(f"{name} must hold integers, got {slots.dtype} values (floats and bools are not indices)")
    if slots.dtype != torch.int64:
        slots = slots.to(torch.int64)
    if slots.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(slots.shape)}")
    return slots


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
        model_identity: what the engine's KV belongs to (model path and revision, TP rank and size, ...): the
            SSD tier's blocks carry it, and blocks written under another identity are never read. Required with an
            SSD tier.
        store_layers: the layers this tier's stores copy (default: all). Processes whose KV is the same (MLA under
            TP) share one pool's memory and split the layers of every store between them; each loads all layers.
    """

    def __init__(self, kv: PagedKV, config: Optional[TierConfig] = None, *, pool: Optional[HostBlockPool] = None,
                 executor=None, counter_backend: str = "auto", host_budget_bytes: Optional[int] = None,
                 finalize: str = "auto", model_identity: Optional[Mapping] = None,
                 store_layers: Optional[range] = None) -> None:
        self._lock = threading.RLock()
        if isinstance(config, Mapping):  # a kvtier config file's keys, as a dict: checked as the file's would be
            config = TierConfig.from_dict(config)
        elif config is not None and not isinstance(config, TierConfig):
            raise TypeError(f"KVTier: config must be a TierConfig, a mapping of its keys or None ($KVTIER_CONFIG), "
                            f"got {type(config).__name__}")
        self.config = config if config is not None else TierConfig.from_env()
        logger.info("kvtier: starting: the host pool, then the host index (numba compiles it on a first start: up "
                    "to a few minutes; later starts load it from its cache)")
        lower = [name for name, on in (("an SSD", self.config.ssd_cache_gb > 0),
                                       ("a remote", self.config.remote_backend is not None)) if on]
        for name in lower:
            if finalize == "ordered":
                raise ValueError(f"{name} tier does not run with finalize='ordered' (TP ranks) yet")
            if model_identity is None:
                raise ValueError(f"{name} tier needs model_identity (model path and revision, TP rank and size): "
                                 "its blocks outlive the process, and another model must never read them")
        if lower:
            model_identity = check_model_identity(model_identity)
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
        all_layers = range(geo.num_layers)
        if store_layers is None:
            store_layers = all_layers
        if not isinstance(store_layers, range) or store_layers.step != 1 or (
                len(store_layers) and (store_layers.start < 0 or store_layers.stop > geo.num_layers)):
            raise ValueError(f"store_layers must be a range of consecutive layers within {all_layers}, "
                             f"got {store_layers!r}")
        self.store_layers = store_layers
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
        self.executor = executor
        if finalize not in ("auto", "ordered"):
            raise ValueError(f"finalize must be 'auto' or 'ordered', got {finalize!r}")
        self._auto_finalize = finalize == "auto"
        self.counter = LayerDoneCounter(geo.num_layers, device=kv.device if kv.is_cuda else "cpu",
                                        backend=counter_backend)
        self.policy = TransferPolicy(self.config.transfer_mode, self.layout, geo)
        self._staged_transfer: Optional[StagedTransfer] = None
        if kv.is_cuda and self.config.transfer_mode != "direct":
            self._staged()  # staging buffers now, where the engine's memory planning sees them, not mid-serving
        self._inflight: dict[int, CopyRecord] = {}  # task id -> in-flight copy
        self._finished: list[int] = []  # task ids finalized since the last poll
        self._next_id = 0
        self._stats = TierStats()
        self.room_advice = RoomAdvice()  # warnings for stores dropped for lack of room, naming the key to raise
        self.holds = BlockHolds(pool)  # CPU blocks lower-tier IO still uses
        self._observers: list[TierObserver] = []
        self.ssd: Optional[SsdLink] = None
        self.remote: Optional[RemoteLink] = None
        if self.config.ssd_cache_gb > 0:
            self.ssd = SsdLink.open(self.config, pool, self.holds, self.block_tokens, model_identity)
        if self.config.remote_backend is not None:
            try:
                self.remote = RemoteLink.open(self.config, pool, self.holds, self.block_tokens, model_identity)
            except BaseException:
                if self.ssd is not None:
                    self.ssd.close()
                raise
        for name, link in (("ssd", self.ssd), ("remote", self.remote)):
            if link is not None:
                link.medium.on_written = functools.partial(self._written, name)
                link.medium.on_stored = functools.partial(self._lower, "lower_stored", name)
        if self.ssd is not None:
            self.ssd.medium.on_removed = functools.partial(self._lower, "lower_removed", "ssd")
        logger.info("kvtier: %s", self.describe())

    def describe(self) -> str:
        """The configuration in force, in one line (the start-up log line)."""
        c, geo, pool = self.config, self.geometry, self.pool
        parts = [f"host pool {pool.num_blocks * pool.block_bytes / (1 << 30):.2f} GiB ({pool.num_blocks} blocks of "
                 f"{self.block_tokens} tokens, {pool.block_bytes / (1 << 20):.2f} MiB each, {self.layout})",
                 f"{geo.num_layers} layers on {self.kv.device}",
                 f"page {self.page_size} tokens", f"transfer {c.transfer_mode}",
                 "layerwise loads" if c.layerwise else "whole loads",
                 f"finalize {'auto' if self._auto_finalize else 'ordered'}"]
        if len(self.store_layers) != geo.num_layers:
            parts.append(f"stores copy layers {self.store_layers.start}..{self.store_layers.stop - 1} (the pool is "
                         f"shared with other processes)" if self.store_layers else
                         "stores copy no layer (the pool is shared with other processes)")
        if self.ssd is not None:
            parts.append(f"SSD tier {c.ssd_cache_gb:g} GiB on {';'.join(c.ssd_dirs)} ({c.ssd_write_policy}, "
                         f"admission {c.ssd_admission})")
        if self.remote is not None:
            parts.append(f"remote tier {c.remote_backend} at {c.remote_master} over {c.remote_protocol} "
                         f"(admission {c.remote_admission})")
        return ", ".join(parts)

    def add_observer(self, observer: TierObserver) -> None:
        """Report transfers and CPU index changes to ``observer`` from now on (:mod:`kvtier.tier.observers`)."""
        with self._lock:
            self._observers.append(observer)

    def remove_observer(self, observer: TierObserver) -> None:
        """Stop reporting to ``observer`` (no-op if it is not observing)."""
        with self._lock:
            if observer in self._observers:
                self._observers.remove(observer)

    # --- engine API ---

    @synchronized
    def lookup(self, tokens, ns: Optional[Namespace] = None) -> int:
        """Number of leading full pages of ``tokens`` held in the CPU tier (does not touch the LRU order); with an
        SSD tier, also starts promoting what the SSD holds past them (:meth:`lookup_tiers`)."""
        return self.lookup_tiers(tokens, ns).cpu_pages

    @synchronized
    def lookup_tiers(self, tokens, ns: Optional[Namespace] = None) -> TierHit:
        """Leading full pages of ``tokens`` on the CPU, and, with an SSD tier, the pages past them on the SSD
        and the promotion reading them into the CPU tier (started here unless one from the same block is in
        flight; none when admission refuses it). Never waits on the disk."""
        self._drain()
        toks = _as_tokens(tokens)
        B, G = self.block_tokens, self._pages_per_block
        n = toks.size // B
        m = self.index.match(toks[:n * B], ns, touch=False)
        hit = m.num_pages * G
        self._stats.lookups += 1
        self._stats.hit_pages += hit
        self._stats.miss_pages += toks.size // self.page_size - hit
        held, plan = m.num_pages, None
        if held < n and (self.ssd is not None or self.remote is not None):
            chain = page_hashes(toks[:n * B], B, ns)  # once, for every lower tier
            if self.ssd is not None:
                plan = self.ssd.plan_promotion(toks, ns, held, chain)
            # the remote is asked only when the SSD does not hold the next block (its promotion may be refused
            # or in flight)
            if plan is None and self.remote is not None and (
                    self.ssd is None or self.ssd.medium.match(chain[held:held + 1]).size == 0):
                plan = self.remote.plan_fetch(toks, ns, held, chain)
        if plan is None:
            return TierHit(hit, 0, None)
        if isinstance(plan, InFlight):
            rec = self._inflight.get(plan.task_id)
            if rec is None:
                return TierHit(hit, 0, None)
            return TierHit(hit, plan.blocks * G if rec.task.kind == TaskKind.PROMOTE else 0, rec.task)
        if isinstance(plan, FetchPlan):
            return TierHit(hit, 0, self._fetch(toks, ns, m, plan))
        task = self._promote(toks, ns, m, plan)
        return TierHit(hit, task.num_pages if task is not None else 0, task)

    @synchronized
    def flush_ssd(self) -> None:
        """Block until every queued SSD write is durable (or failed), and account them; no-op without an SSD
        tier. A clean shutdown calls it (``destroy`` does): queued writes are otherwise lost with the process."""
        if self.ssd is not None:
            self.ssd.drain(wait=True)

    @synchronized
    def note_prefill(self, tokens: int, seconds: float, cached_tokens: int = 0) -> None:
        """The engine prefilled ``tokens`` tokens past ``cached_tokens`` cached ones (loaded, not computed) in
        ``seconds``: the prefill costs SSD and remote admission compare reads with (unless
        ``prefill_tokens_per_s`` is configured; see :mod:`kvtier.tier.admission`)."""
        if self.ssd is not None:
            self.ssd.note_prefill(tokens, seconds, cached_tokens)
        if self.remote is not None:
            self.remote.note_prefill(tokens, seconds, cached_tokens)

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
        toks = _as_tokens(tokens)
        slots = _as_slots(slot_indices)
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
        task = self._new_task(TaskKind.STORE, 0, num_held=held * G)
        if held == n:
            return self._finish_now(task)
        if held:
            self.index.lock(m)  # the prefix the new pages hang from must survive until they are inserted
        ids = self._alloc_under(m if held else None, n - held)
        self._stats.pages_store_dropped += (n - held - ids.size) * G
        if ids.size < n - held:
            self.room_advice.host_store_dropped(dropped=n - held - int(ids.size), prefix_blocks=n,
                                                pool_blocks=self.pool.num_blocks, block_tokens=B,
                                                block_bytes=self.pool.block_bytes)
        if ids.size == 0:
            if held:
                self.index.unlock(m)
            return self._finish_now(task)
        task.num_pages = int(ids.size) * G
        end = held + ids.size
        new_slots = slots[held * B:end * B]
        share = int(ids.size) * self.pool.block_bytes * len(self.store_layers) // self.geometry.num_layers
        prefix_ids = np.array(m.block_ids[:held], dtype=np.int64)
        stored = toks[:end * B].copy()

        def issue() -> InsertRecord:
            completion = self._launch("store", lambda: self._copy(True, new_slots, ids))
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
        out, self._finished = self._finished, []
        return out

    @synchronized
    def wait(self, task: Union[TierTask, int]) -> TierTask:
        """Block the host until ``task``'s copy has completed, and finalize it (also reported by the next poll;
        ``finalize="ordered"``: only block)."""
        tid = task.id if isinstance(task, TierTask) else int(task)
        rec = self._inflight.get(tid)
        if rec is not None:
            self._wait(rec)
            if self._auto_finalize and self._pending(rec):
                self._finalize(rec, cancelled=False)
        return rec.task if rec is not None else task

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
        rec = self._inflight.get(task.id if isinstance(task, TierTask) else int(task))
        return rec is None or rec.completion.done()

    @synchronized
    def finalize(self, task: Union[TierTask, int], *, keep: bool = True) -> None:
        """Block until ``task``'s copy completes, then finalize it: a store's pages enter the index (``keep=False``:
        they are discarded, as by :meth:`cancel`), the locks drop. No-op for a task already finalized."""
        rec = self._inflight.get(task.id if isinstance(task, TierTask) else int(task))
        if rec is not None:
            self._wait(rec)
            if self._pending(rec):
                self._finalize(rec, cancelled=not keep)

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
        stream = "store" if task.kind == TaskKind.STORE else "load"
        try:
            self._inflight[task.id] = rec.retry()
        except Exception as e:
            self._failed(task, stream, e, ids=rec.block_ids, handle=rec.handle, retry=rec.retry)
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
        """Discard an in-flight task after its copy completes (a store inserts nothing and frees its blocks).

        Returns:
            True if the task was in flight, False if it had already been finalized.
        """
        tid = task.id if isinstance(task, TierTask) else int(task)
        rec = self._inflight.get(tid)
        if rec is None:
            return False
        self._wait(rec, discard=True)
        self._finalize(rec, cancelled=True)
        return True

    @synchronized
    def reset(self) -> None:
        """Wait for every in-flight copy, then drop every CPU page and task (pending poll reports included); the
        SSD tier keeps its durable blocks (they outlive processes; a new KVTier over its directories serves them).
        Remote calls are not waited for: fetches in flight end unread, and the CPU blocks a put or get still uses
        stay held, never reused, until its call returns (a hung one: by Mooncake's own RPC timeout, ~30 s)."""
        for rec in list(self._inflight.values()):
            self._wait(rec, discard=True)  # a fetch is not waited for: it ends, its blocks held while a call runs
            self._finalize(rec, cancelled=True)
        if self.ssd is not None:
            self.ssd.drain(wait=True)  # no write reads a CPU block any more; the SSD tier keeps its blocks
        if self.remote is not None:
            self.remote.drain()
        quarantined = self.holds.reset()  # still used by a remote call: held until it returns
        self.index.reset()
        if self._observers:
            self._notify("cleared")
        self.pool.reset(keep=quarantined)
        self.counter.reset()
        self._finished = []

    @synchronized
    def evict(self, num_pages: int) -> int:
        """Evict unlocked blocks now (by the eviction policy), at least ``num_pages`` pages' worth if there are;
        returns the pages evicted.

        Raises:
            ValueError: ``num_pages`` is not an int >= 0.
        """
        G = self._pages_per_block
        return self._evict_blocks(-(-check_count("num_pages", num_pages, 0) // G)) * G

    def destroy(self) -> None:
        """Wait for in-flight copies and release the host pool (unpins it); idempotent. With an SSD tier, stores
        in flight complete first and every queued SSD write is made durable: a restart serves them. Fetches in
        flight end unread; remote calls are waited for at most ``remote_timeout_s`` in all: a client whose call
        still runs (its blocks held by it) is left to the process's exit."""
        with self._lock:
            if self.pool.destroyed:
                return
            if self.ssd is not None or self.remote is not None:
                for rec in list(self._inflight.values()):  # stores land (and go down the tiers); fetches end
                    if rec.task.kind != TaskKind.FETCH:
                        self._wait(rec)
                        self._finalize(rec, cancelled=False)
            if self.ssd is not None and self.ssd.write_back:  # the CPU's blocks are written too: a restart serves them
                self.ssd.drain(wait=True)
                while self._evict_blocks(self.ssd.medium.max_pending_blocks):  # as many as the write queue takes
                    self.ssd.drain(wait=True)
            until = None if self.remote is None else time.monotonic() + self.remote.medium.timeout_s
            self.reset()
            # each even if one before it raises (a close failing with EIO): no thread, file or pinned memory is left
            run_all(None if self.ssd is None else self.ssd.close,
                    None if self.remote is None else functools.partial(self.remote.close, until),
                    None if self._staged_transfer is None else self._staged_transfer.close,  # row-issuing threads
                    self.pool.destroy)

    # --- accounting ---

    @synchronized
    def stats(self) -> dict:
        s = self._stats
        out = dataclasses.asdict(s)
        out.update(gbps_d2h=s.gbps_d2h, gbps_h2d=s.gbps_h2d, occupancy=self.pool.occupancy,
                   blocks_used=self.pool.num_used, blocks_total=self.pool.num_blocks,
                   tokens_per_block=self.block_tokens, page_size=self.page_size, block_bytes=self.pool.block_bytes,
                   pages_held=self.index.total_pages * self._pages_per_block,
                   pages_locked=self.index.protected_pages * self._pages_per_block,
                   inflight_tasks=len(self._inflight),
                   inflight_store_blocks=sum(r.block_ids.size for r in self._inflight.values()
                                             if r.task.kind == TaskKind.STORE))
        out["held_cpu_blocks"] = self.holds.num_deferred
        if self.ssd is not None:
            out.update(self.ssd.stats())
        if self.remote is not None:
            out.update(self.remote.stats())
        return out

    @property
    def inflight_ids(self) -> list[int]:
        return list(self._inflight)

    # --- internals ---

    def _notify(self, hook: str, *args) -> None:
        for observer in list(self._observers):
            try:
                getattr(observer, hook)(*args)
            except Exception:
                logger.exception("kvtier: observer %r failed in %s; it is dropped", observer, hook)
                self._observers.remove(observer)

    def _written(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None:
        """A lower tier finished writing ``blocks`` CPU blocks."""
        if self._observers:
            self._notify("transfer_done", Transfer(tier, "store", blocks * self._pages_per_block, nbytes, seconds))

    def _lower(self, hook: str, tier: str, *args) -> None:
        """A lower tier's blocks changed (observers' ``lower_stored`` / ``lower_removed``)."""
        if self._observers:
            self._notify(hook, tier, *args)

    def _new_task(self, kind: TaskKind, num_pages: int, num_held: int = 0) -> TierTask:
        task = TierTask(self._next_id, kind, num_pages, num_held)
        self._next_id += 1
        return task

    def _finish_now(self, task: TierTask) -> TierTask:
        task.status = TaskStatus.DONE
        self._finished.append(task.id)
        return task

    def _promote(self, toks: np.ndarray, ns, m, plan: PromotionPlan) -> Optional[TierTask]:
        """Start reading ``plan``'s SSD blocks into new CPU blocks; they hang from the CPU-held prefix ``m``,
        locked until the task is finalized."""
        held = plan.held
        if held:
            self.index.lock(m)
        with self.ssd.holding(plan):  # making room may write back evicted CPU blocks, evicting SSD slots
            ids = self._alloc_under(m if held else None, plan.slots.size)
        if ids.size == 0:
            if held:
                self.index.unlock(m)
            return None
        G, B = self._pages_per_block, self.block_tokens
        task = self._new_task(TaskKind.PROMOTE, int(ids.size) * G, num_held=held * G)
        job = self.ssd.start_promotion(plan, ids, task.id)
        self._stats.promotions += 1
        self._inflight[task.id] = InsertRecord(task, job, ids, m if held else None,
                                               int(ids.size) * self.pool.block_bytes,
                                               tokens=toks[:(held + ids.size) * B].copy(), ns=ns,
                                               prefix_ids=np.array(m.block_ids[:held], dtype=np.int64))
        return task

    def _fetch(self, toks: np.ndarray, ns, m, plan: FetchPlan) -> Optional[TierTask]:
        """Start probing the remote for ``plan``'s blocks past the CPU-held prefix ``m`` (locked until the task
        is finalized); the blocks are allocated when the probe returns (:meth:`_advance_fetch`)."""
        held, B = plan.held, self.block_tokens
        task = self._new_task(TaskKind.FETCH, 0, num_held=held * self._pages_per_block)
        job = self.remote.start_fetch(plan, task.id)
        if job is None:
            return None
        if held:
            self.index.lock(m)
        self._stats.fetches += 1
        self._inflight[task.id] = InsertRecord(task, job, np.empty(0, np.int64), m if held else None, 0,
                                               tokens=toks[:(held + plan.hashes.size) * B].copy(), ns=ns,
                                               prefix_ids=np.array(m.block_ids[:held], dtype=np.int64))
        return task

    def _advance_fetch(self, rec: InsertRecord) -> None:
        """A fetch's probe has returned: allocate CPU blocks for what admission lets in and start the get."""
        job, held = rec.completion, rec.prefix_ids.size
        k = self.remote.admit(job, rec.tokens.size, held * self.block_tokens)
        ids = self._alloc(k) if k else np.empty(0, np.int64)
        if ids.size == 0:
            self.remote.medium.end(job)
            return
        rec.block_ids, rec.nbytes = ids, int(ids.size) * self.pool.block_bytes
        rec.task.num_pages = int(ids.size) * self._pages_per_block
        self.remote.start_get(job, ids)

    def _wait(self, rec: CopyRecord, *, discard: bool = False) -> None:
        """Block until ``rec``'s copy has completed; a fetch: each of its calls at most ``remote_timeout_s`` (past
        it, it is abandoned: it brings nothing, and its CPU blocks stay held until its calls return). ``discard``:
        the task is dropped after the wait, so a fetch is not waited for: finalizing it ends it (no get starts, and
        a get running makes no further call and keeps its blocks held until it returns)."""
        if rec.task.kind != TaskKind.FETCH:
            rec.completion.wait()
            return
        if discard:
            return
        job, medium = rec.completion, self.remote.medium
        while not job.done() and self._pending(rec):
            if job.awaiting_blocks():
                self._advance_fetch(rec)
            elif not medium.wait(job, self._released):
                return

    def _pending(self, rec: CopyRecord) -> bool:
        """Whether ``rec`` is still in flight (a wait for a fetch lets go of the lock: another thread may have
        finalized it meanwhile)."""
        return self._inflight.get(rec.task.id) is rec

    @contextlib.contextmanager
    def _released(self) -> Iterator[None]:
        """The tier's lock let go of (however deeply this thread holds it) for the block: other threads' calls
        (stats, lookups) run while this one waits on the network."""
        state = self._lock._release_save()
        try:
            yield
        finally:
            self._lock._acquire_restore(state)

    def _launch(self, stream: str, fn):
        self.executor.begin(stream)
        self.executor.run(stream, fn, own_stream=True)  # fn is a _copy: it passes the stream to its launches
        return self.executor.fence(stream)

    def _load(self, tokens, ns, slot_indices, *, layerwise: bool, start_page: int = 0) -> TierTask:
        start_page = check_count("start_page", start_page, 0)
        toks = _as_tokens(tokens)
        slots = _as_slots(slot_indices)
        self._drain()
        P, B = self.page_size, self.block_tokens
        start = start_page * P  # tokens on the device already
        n = min(toks.size, start + slots.numel() // P * P) // B  # blocks the slots can take
        m = self.index.match(toks[:n * B], ns, touch=True)
        copied = max(0, m.num_pages * B - start)  # tokens to copy; those before start are on the device already
        self._stats.loads += 1
        task = self._new_task(TaskKind.LOAD_LAYERWISE if layerwise else TaskKind.LOAD, copied // P)
        if copied == 0:
            return self._finish_now(task)
        self.index.lock(m)  # the whole matched path: the copied pages hang from the prefix
        if self.ssd is not None:
            self.ssd.used(toks[:m.num_pages * B], ns)
        ids = np.array(m.block_ids[start // B:m.num_pages])
        dst = slots[:copied]

        def issue() -> LoadRecord:
            completion = self._issue_load(task, dst, ids, layerwise, skip=start % B)
            return LoadRecord(task, completion, ids, m, copied * self.geometry.token_bytes, ns=ns, reads=dst)
        try:
            self._inflight[task.id] = issue()
        except Exception as e:
            return self._failed(task, "load", e, handle=m, retry=issue)
        return task

    def _issue_load(self, task: TierTask, dst: torch.Tensor, ids: np.ndarray, layerwise: bool, skip: int):
        """Issue a load's copies (whole, or per layer with the counter's events); its completion. ``skip``: tokens
        of the first block on the device already."""
        if not layerwise:
            return self._launch("load", lambda: self._copy(False, dst, ids, skip=skip))
        self.executor.begin("load")
        stream = self.executor.stream("load")
        before = self.counter.producer_index
        task.producer_index = self.counter.update_producer(stream)
        try:
            return self._issue_layers(task, dst, ids, stream, skip)
        except BaseException:  # the next load takes this slot again, never one a forward pass waits on
            self.counter.rewind(before)
            raise

    def _issue_layers(self, task: TierTask, dst: torch.Tensor, ids: np.ndarray, stream, skip: int):
        """Issue a layerwise load's copies on ``stream``, each layer's event of the task's counter slot recorded
        behind its copy; its completion."""
        ex = self.executor
        path = self.policy.path(CopyPlan(to_host=False, block_ids=ids, layers=1))
        # checked, indices uploaded (on the stream) and planned once for all layers, launched per layer
        check = _range_check(dst)
        if path is Path.DIRECT:
            copy = DirectCopy(self.kv, self.pool.host, dst, torch.from_numpy(ids), to_host=False,
                              layout=self.layout, num_programs=self.config.num_programs, stream=stream,
                              check=check, skip_tokens=skip)
        else:
            copy = StagedCopy(self._staged(), dst, torch.from_numpy(ids), to_host=False, stream=stream,
                              check=check, skip_tokens=skip)
        copy_layer = functools.partial(copy.launch, stream=stream)
        for layer in range(self.geometry.num_layers):
            ex.run("load", functools.partial(copy_layer, layer), own_stream=True)
            # Recorded at issue time, behind the layer's copy in stream order. With the DeferredExecutor
            # (tests) the host event is set before the deferred copy runs: layerwise bytes are checked there
            # after wait(task), not through wait_until.
            self.counter.complete(layer, slot=task.producer_index, stream=stream)
        return ex.fence("load")

    def _failed(self, task: TierTask, stream: str, error: Exception, *, ids: Optional[np.ndarray] = None,
                handle=None, retry: Optional[Callable[[], CopyRecord]] = None) -> TierTask:
        """Unwind a copy whose issue raised: wait for whatever of it reached the stream (it may still read or
        write the slots and blocks), give its blocks back, unlock its path, count it; the task fails.

        ``finalize="ordered"``: the blocks and the lock are kept, as for a copy in flight, until the engine
        finalizes the task (which then discards it): TP ranks whose copies failed and succeeded alike hold the same
        blocks until they agree, so their host pools and indexes evolve identically."""
        try:
            self.executor.fence(stream).wait()
        except Exception:  # the stream itself is broken: nothing more can be waited for
            logger.exception("kvtier: waiting for the %s stream after a failed copy failed too", stream)
        if stream == "store":
            self._stats.failed_stores += 1
        else:
            self._stats.failed_loads += 1
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

    def _staged(self) -> StagedTransfer:
        if self._staged_transfer is None:
            self._staged_transfer = StagedTransfer(self.kv, self.pool.host, layout=self.layout)
        return self._staged_transfer

    def _copy(self, to_host: bool, slots: torch.Tensor, ids: np.ndarray, skip: int = 0) -> None:
        """Issue one copy of every layer on the executor's stream (runs inside ``executor.run``), by the policy's
        path; ``skip``: tokens of the first block not moved."""
        stream = self.executor.stream("store" if to_host else "load")
        block_ids = torch.from_numpy(ids)
        check = _range_check(slots)
        layers = self.store_layers if to_host else range(self.geometry.num_layers)
        if not layers:  # a store whose layers other processes sharing the pool copy
            return
        whole = len(layers) == self.geometry.num_layers
        path = self.policy.path(CopyPlan(to_host=to_host, block_ids=ids, layers=len(layers)))
        if path is Path.STAGED:
            st = self._staged()
            fn = st.store if to_host else st.load
            ev = fn(slots, block_ids, layers=None if whole else layers, stream=stream, check=check,
                    skip_tokens=skip)
            if ev is not None:
                stream.wait_event(ev)  # the task's completion is fenced on this stream
        elif path is Path.DIRECT_LAYERS:  # a load: checked once, launched per layer
            copy = DirectCopy(self.kv, self.pool.host, slots, block_ids, to_host=to_host, layout=self.layout,
                              num_programs=self.config.num_programs, stream=stream, check=check, skip_tokens=skip)
            for layer in range(self.geometry.num_layers):
                copy.launch(layer, stream=stream)
        else:
            fn = store_pages if to_host else load_pages
            fn(self.kv, self.pool.host, slots, block_ids, layout=self.layout, layers=None if whole else layers,
               num_programs=self.config.num_programs, stream=stream, check=check, skip_tokens=skip)

    def _evict_blocks(self, n: int) -> int:
        """Evict up to ``n`` unlocked blocks, chosen by the eviction policy, and free them; returns how many."""
        ids = self.eviction.evict(n)
        if self._observers and ids.size:
            self._notify("blocks_evicted", ids)
        self._release(ids)
        self._stats.pages_evicted += ids.size * self._pages_per_block
        return int(ids.size)

    def _release(self, ids: np.ndarray) -> None:
        """Blocks evicted from the index go back to the pool (through the SSD tier's write policy, if any), once
        no lower-tier IO uses them."""
        if self.ssd is not None:
            self.ssd.evicted(ids)
        self.holds.release(ids)

    def _alloc(self, n: int) -> np.ndarray:
        """Up to ``n`` free blocks, evicting unlocked pages (by the eviction policy) for room; fewer when not enough
        can be evicted, or when the evicted blocks are held by their SSD writes (write_back: blocks are then evicted
        ahead of the next allocation, :meth:`SsdLink.to_reclaim`)."""
        ids = self.pool.alloc(n)
        if ids is None:
            if self.ssd is not None:
                self.ssd.drain()  # finished writes give their blocks back (perhaps all that is missing)
            self._evict_blocks(max(0, n - self.pool.num_free))
            ids = self.pool.alloc(min(n, self.pool.num_free))
            if ids is None:
                ids = np.empty(0, np.int64)
            if ids.size < n and self.ssd is not None:
                self.ssd.came_short(n, held=self.holds.num_deferred)
        if self.ssd is not None and self.ssd.free_target:
            ahead = self.ssd.to_reclaim(self.pool.num_free, self.holds.num_deferred)
            if ahead:
                try:
                    self._evict_blocks(ahead)
                except BaseException:
                    self.pool.free(ids)
                    raise
        return ids

    def _alloc_under(self, handle, n: int) -> np.ndarray:
        """:meth:`_alloc` for new blocks hanging from the prefix ``handle`` (locked; None: no prefix), which is
        unlocked again if making room fails (an eviction policy that raises)."""
        try:
            return self._alloc(n)
        except BaseException:
            if handle is not None:
                self.index.unlock(handle)
            raise

    def _drain(self) -> None:
        if not self._auto_finalize:
            return
        if self.ssd is not None:
            self.ssd.drain()
        if self.remote is not None:
            self.remote.drain()
        for rec in list(self._inflight.values()):
            if rec.task.kind == TaskKind.FETCH and rec.completion.awaiting_blocks():
                self._advance_fetch(rec)
            if rec.task.kind == TaskKind.FETCH and self.remote.medium.expired(rec.completion):
                self.remote.medium.abandon(rec.completion)  # polled, never waited for: the same deadline
            if rec.completion.done():
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
            self._notify("blocks_entered", entered, toks, rec.ns, positions)
        if self.ssd is not None:
            self.ssd.entered(entered, toks, rec.ns, positions)
        if self.remote is not None and rec.task.kind != TaskKind.FETCH:  # a fetched block is on the remote already
            self.remote.entered(entered, toks, rec.ns, positions)
        return owned

    def _finalize_read(self, rec: InsertRecord, cancelled: bool) -> None:
        """A promotion's or a fetch's verified leading blocks enter the index; the others go back to the pool,
        once no call uses them (an abandoned fetch's still may: its link holds them)."""
        job, G = rec.completion, self._pages_per_block
        if rec.task.kind == TaskKind.PROMOTE:
            self.ssd.end_promotion(job)
            ok = 0 if cancelled else job.ok
        else:
            self.remote.end_fetch(job)
            ok = 0 if cancelled or job.discarded else job.ok
        self.holds.release(rec.block_ids[ok:])
        inserted = int(self._insert(rec, ok).sum()) * G if ok else 0
        failed = 0 if cancelled else (rec.block_ids.size - ok) * G
        if rec.task.kind == TaskKind.PROMOTE:
            self._stats.pages_promoted += inserted
            self._stats.pages_promote_failed += failed
        else:
            self._stats.pages_fetched += inserted
            self._stats.pages_fetch_failed += failed
        if self._observers and ok:
            self._notify("transfer_done", Transfer("ssd" if rec.task.kind == TaskKind.PROMOTE else "remote", "load",
                                                   ok * G, ok * self.pool.block_bytes, job.seconds()))

    def _finalize(self, rec: CopyRecord, *, cancelled: bool) -> None:
        """The copy of ``rec`` has completed: insert / free / unlock, and account (a failed copy is discarded
        and stays failed)."""
        task = rec.task
        del self._inflight[task.id]
        failed = task.status == TaskStatus.FAILED
        cancelled = cancelled or failed
        secs = rec.completion.seconds()
        if task.kind == TaskKind.STORE:
            self._stats.bytes_d2h += rec.nbytes
            self._stats.seconds_d2h += secs or 0.0
            if cancelled:
                self.pool.free(rec.block_ids)
            else:
                owned = self._insert(rec, rec.block_ids.size)
                self._stats.pages_stored += int(owned.sum()) * self._pages_per_block
                self._stats.pages_store_duplicate += int((~owned).sum()) * self._pages_per_block
        elif task.kind.reads_lower_tier:
            self._finalize_read(rec, cancelled)
        else:
            self._stats.bytes_h2d += rec.nbytes
            self._stats.seconds_h2d += secs or 0.0
            if not cancelled:
                self._stats.pages_loaded += task.num_pages
        if rec.handle is not None:
            self.index.unlock(rec.handle)
        if cancelled and not failed:
            self._stats.cancelled += 1
        if self._observers and not cancelled and not task.kind.reads_lower_tier and task.num_pages:
            self._notify("transfer_done", Transfer("cpu", "store" if task.kind == TaskKind.STORE else "load",
                                                   task.num_pages, rec.nbytes, secs))
        task.status = TaskStatus.FAILED if failed else TaskStatus.CANCELLED if cancelled else TaskStatus.DONE
        self._finished.append(task.id)
