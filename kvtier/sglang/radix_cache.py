"""KVTierRadixCache: SGLang 0.5.23's ``RadixCache`` with kvtier as its host tier.

What the subclass adds to ``RadixCache`` (every override calls ``super()`` first):

* ``match_prefix``: the device match, plus ``host_hit_length`` = tokens past the device match that kvtier holds
  (full pages, only when ``params.req`` is given, i.e. a scheduler match). The hit is remembered per request for
  ``init_load_back``. No collective for the CPU hit: with TP every rank's host index evolves identically (below);
  one at a request's first match when lower tiers run and the CPU hit falls short (the read agreement, below).
* Several ranks (TP, attention CP, pipeline stages; :mod:`kvtier.sglang.agreement`): every store and load is
  tracked in issue order and its node stays locked, whatever this rank's outcome, until the ranks agree that it has
  completed (``_sync``: the MIN of the completed count and the MAX of failure flags, in ``flush_pending_backups``,
  which SGLang calls once per batch on every rank, in ``evict`` and in ``wait_all``); then each rank finalizes
  exactly those, in order (a store failed on a deciding rank is dropped on all). With pools of one block count
  (agreed at construction) host indexes, locks and device trees stay identical on every rank whatever each GPU's
  timing. A load that fails on one rank only is caught by the one agreement of ``init_load_back``. Under PP the
  first stage decides and later stages follow; a later stage whose own copy failed where the first stage's
  succeeded issues it again, synchronously, and raises if that fails too (its KV would differ from what every
  other stage serves). Lower-tier reads are agreed too: a request's first scheduler match offers, per lower tier,
  the blocks this rank would read, and every rank reads the MIN (``KVTier.lookup_tiers``' ``agree``); reads end in
  a queue of their own in ``_sync``, each rank inserting the MIN of the blocks every rank verified.
* ``init_load_back``: allocates slots for the host hit (evicting device pages if needed), loads through
  ``KVTier.load`` / ``load_layerwise``, grafts a ``TreeNode`` holding the new slots under the device match and
  returns ``(loaded_len, node)``. SGLang 0.5.23 requires all promised tokens or none: when fewer pages arrive
  (the host evicted some since the match, or a TP rank got fewer), the pages that did arrive are still grafted as a
  cached node, the tail slots are freed, and ``(0, last_node)`` is returned (the request recomputes them).
* ``checkpoint``: after the base insert, stores the tree-owned, page-aligned prefix to kvtier asynchronously and
  keeps the request's node locked until that store completes.
* Completions are drained (node locks dropped) in ``match_prefix``, ``checkpoint``, ``evict`` and
  ``check_hicache_events`` (the scheduler calls the latter only under other backends' flags).
* ``reset``: waits for every in-flight transfer, then resets the tree and the tier.
* Layerwise mode (``TierConfig.layerwise``): the tier's ``LayerDoneCounter`` is registered on the KV pool
  (``register_layer_transfer_counter``) and ``init_load_back`` sets it as consumer; otherwise the forward stream
  waits for the whole load.
* Namespaces: ``RadixKey.extra_key`` (SGLang appends the LoRA id to it) and ``cache_salt`` seed the page hashes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Optional

import torch

from kvtier import sglang as _kvtier_sglang
from kvtier.config import TierConfig
from kvtier.index import Namespace
from kvtier.kernels import PagedKV
from kvtier.observe.attach import Observability, attach
from kvtier.tier import CudaExecutor, KVTier, TaskStatus, TierTask
from kvtier.tier.lower import asked_for
from kvtier.tier.tier_stats import TierHit

_kvtier_sglang.check_sglang_version()

from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    EvictResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode  # noqa: E402

from kvtier.sglang.agreement import RankAgreement  # noqa: E402
from kvtier.sglang.shared_pool import SharedPool, share_pool  # noqa: E402
from kvtier.sglang.kv_events import HostKvEvents  # noqa: E402
from kvtier.sglang.prefetch import PrefetchWaits  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["KVTierRadixCache", "paged_kv_from_pool"]


def paged_kv_from_pool(kv_pool, page_size: int) -> PagedKV:
    """Wrap an SGLang MHA or MLA token-to-KV pool's per-layer buffers (this rank's layers) as a :class:`PagedKV`."""
    layout = getattr(kv_pool, "kv_cache_layout", "nhd")
    scales = [k for k in dir(kv_pool) if k.endswith("scale_buffer") and getattr(kv_pool, k, None) is not None]
    if scales:  # k_scale_buffer (MHA FP4), kv_scale_buffer (MLA FP4), ...: a loaded prefix would keep stale scales
        raise ValueError(f"kvtier does not move per-token KV scale buffers yet ({', '.join(scales)} of "
                         f"{type(kv_pool).__name__}: quantized KV with scales)")
    if getattr(kv_pool, "k_buffer", None) is not None and getattr(kv_pool, "v_buffer", None) is not None:
        if layout != "nhd":
            raise ValueError(f"kvtier supports the 'nhd' MHA KV layout only, the pool uses {layout!r} "
                             "(unset SGLANG_USE_HND_KVCACHE / the AITER layout)")
        return PagedKV.mha(list(kv_pool.k_buffer), list(kv_pool.v_buffer), page_size=page_size)
    if getattr(kv_pool, "kv_buffer", None) is not None:
        return PagedKV.mla(list(kv_pool.kv_buffer), page_size=page_size)
    raise ValueError(f"kvtier supports MHATokenToKVPool and MLATokenToKVPool, not {type(kv_pool).__name__}")


def _namespace(extra_key, cache_salt) -> Optional[Namespace]:
    if extra_key is None and cache_salt is None:
        return None
    return Namespace(extra_key=extra_key, cache_salt=cache_salt)


class _LoadMarker:
    """What ``match_prefix`` found for a request, for its ``init_load_back``: a snapshot of the matched tokens (the
    live key aliases the request's growing fill ids), the namespace and the device match length."""

    __slots__ = ("tokens", "ns", "device_len", "host_len")

    def __init__(self, tokens, ns, device_len: int, host_len: int) -> None:
        self.tokens, self.ns, self.device_len, self.host_len = tokens, ns, device_len, host_len


class KVTierRadixCache(RadixCache):
    """RadixCache whose evicted-from-device prefixes survive in kvtier's host tier (see the module docstring).

    Args:
        params: SGLang's ``CacheInitParams`` (its allocator's KV pool must be an MHA or MLA pool).
        config: kvtier settings (default :meth:`TierConfig.from_env`); ``page_size`` must equal ``params.page_size``.
        tp_group: the TP CPU (gloo) process group when TP > 1, else None (shorthand for an ``agreement`` over it).
        agreement: how this cache's ranks agree (TP, attention CP, pipeline stages); the factory builds it from
            SGLang's cache groups. Default: over ``tp_group``.
        forward_stream: the CUDA stream the forward pass runs on: stores and loads are ordered after it, whole
            loads make it wait; None: the current stream only.
        host_budget_bytes: this rank's share of host memory (the factory asks SGLang's host-memory budget: what
            is available, less SGLang's reserve, split between the ranks of the host); the pinned pool must fit.
        model_identity: what the KV belongs to, for the SSD tier's blocks (the factory's
            :func:`kvtier.sglang.model_identity`).
        metrics_labels: constant labels of kvtier's metrics (the factory's: ``model_name``, ``tp_rank``). The
            metrics are on with ``params.enable_metrics`` (SGLang's ``--enable-metrics``: its multiprocess
            collection) or the config's ``metrics_port``; KV events with ``params.enable_kv_cache_events``.
    """

    def __init__(self, params: CacheInitParams, config: Optional[TierConfig] = None, *, tp_group=None,
                 forward_stream=None, host_budget_bytes: Optional[int] = None, model_identity: Optional[dict] = None,
                 metrics_labels: Optional[dict] = None, agreement: Optional[RankAgreement] = None) -> None:
        super().__init__(params)
        self.tier_config = config if config is not None else TierConfig.from_env()
        self.agreement = agreement if agreement is not None else RankAgreement([tp_group])
        self.multi_rank = self.agreement.active
        self.forward_stream = forward_stream
        self._markers: dict[Any, _LoadMarker] = {}  # cache_request_handle -> host hit found by match_prefix
        self._reads: dict[Any, TierHit] = {}  # cache_request_handle -> the lower-tier read its last match started
        self.prefetch = PrefetchWaits(self.tier_config)  # requests held back for their read (the prefetch policy)
        if self.multi_rank:  # a deadline passed on any rank admits the request on every rank
            self.prefetch.agree_late = lambda late: self.agreement.min(int(not late)) == 0
        self._prefilled: set[str] = set()  # requests whose prefill was reported to the tier (_report_prefill)
        # task id -> (node locked for the task, the device slot tensor its copy reads, a call issuing the same copy
        # again). The slot tensor is kept referenced until the copy completes: on CUDA it was allocated on the
        # engine's stream and the copy reads it on kvtier's stream, so dropping it early would let the caching
        # allocator hand its memory to the next allocation on the engine's stream while the copy may not have read
        # it yet.
        self._inflight: dict[int, tuple[TreeNode, Optional[torch.Tensor]]] = {}
        # Chunked prefill checkpoints a request several times: one store per request in flight at a time.
        self._store_of_req: dict[str, int] = {}  # request id -> its store in flight
        self._req_of_store: dict[int, str] = {}  # the reverse
        self._held_store: dict[str, tuple] = {}  # request id -> (tokens, ns, slots, locked node) of a later checkpoint
        # several ranks: every store and load in issue order, released only as far as the ranks agree (_sync)
        self._order: collections.deque[TierTask] = collections.deque()
        self._read_order: collections.deque[TierTask] = collections.deque()  # lower-tier reads, in agreed order
        self._read_asked: set = set()  # requests whose one read agreement (their first match) has run
        self._uncounted: collections.deque[TierTask] = collections.deque()  # reads whose count is agreed later
        self.tier: Optional[KVTier] = None
        self.observability = Observability()
        self.layerwise = False
        self.repairs = 0  # copies this later pipeline stage issued again (failed here only)
        self.shared: Optional[SharedPool] = None  # the stage's one pool when its ranks' KV is the same (MLA)
        if self.disable:
            return
        self.kv_pool = self.token_to_kv_pool_allocator.get_kvcache()
        kv = paged_kv_from_pool(self.kv_pool, self.page_size)
        executor = pool = store_layers = None
        if kv.is_cuda and forward_stream is not None:
            executor = CudaExecutor(kv.device, order_after=[forward_stream])  # copies fenced on the forward stream
        if self.multi_rank:  # every rank's pool holds as many blocks: the host indexes evolve identically
            self.tier_config = self._agreed_pool(kv)
            if kv.geometry.is_mla and not asked_for(self.tier_config):  # lower-tier IO frees blocks at each rank's
                self.shared = self._share_pool(kv, host_budget_bytes)  # own moments: a pool of its own per rank
            if self.shared is not None:
                pool, store_layers = self.shared.pool, self.shared.store_layers
        self.tier = self._make_tier(kv, executor=executor, pool=pool, host_budget_bytes=host_budget_bytes,
                                    finalize="ordered" if self.multi_rank else "auto", model_identity=model_identity,
                                    store_layers=store_layers)
        if self.multi_rank:
            self.agreement.check_same([self.tier.pool.num_blocks], "the host pool's block count")
        self.rank_labels = dict(metrics_labels or {})
        logger.info("kvtier: %s", self.describe_ranks())
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.observability = attach(self.tier, labels=metrics_labels, multiprocess=bool(params.enable_metrics),
                                    port_offset=rank)
        if self.kv_events.enabled:  # --kv-events-config: the CPU tier's blocks are published too
            self.tier.add_observer(HostKvEvents(self.kv_events, self.page_size, self.tier.block_tokens))
        self.set_layerwise(self.tier_config.layerwise)

    def describe_ranks(self) -> str:
        """This rank's place and whom it agrees with, in one line (the start-up log, beside the tier's)."""
        a = self.agreement
        where = ", ".join(f"{k} {v}" for k, v in self.rank_labels.items() if k != "model_name") or "one rank"
        parts = [where]
        if a.pp_size > 1:
            parts.append(f"pipeline stage {a.pp_rank} of {a.pp_size} (layers from {self.kv_pool.start_layer})")
        if a.active:
            parts.append(f"agrees with {a.world - 1} other rank(s) ({a.stage_size} per stage)")
        if self.shared is not None:
            parts.append(f"host pool shared by the stage's {self.shared.ranks} ranks, stores copy layers "
                         f"{self.shared.store_layers.start}..{self.shared.store_layers.stop - 1}")
        return "; ".join(parts)

    def _agreed_pool(self, kv: PagedKV) -> TierConfig:
        """The config with a pool of as many blocks as the smallest of every rank's (pipeline stages hold other
        layers, so their blocks differ in bytes: the block count is what must agree)."""
        config = self.tier_config
        block_bytes = kv.with_page_size(config.block_tokens).geometry.block_bytes
        local = config.cpu_cache_bytes // block_bytes
        agreed = self.agreement.startup_reduce([local], torch.distributed.ReduceOp.MIN)[0]
        if agreed >= local:
            return config
        return dataclasses.replace(config, cpu_cache_gb=(agreed * block_bytes + 1) / (1 << 30))

    def _share_pool(self, kv: PagedKV, budget: Optional[int]) -> Optional[SharedPool]:
        config = self.tier_config
        geo = kv.with_page_size(config.block_tokens).geometry
        return share_pool(self.agreement, geo, config.host_layout, config.cpu_cache_bytes // geo.block_bytes, budget)

    def _make_tier(self, kv: PagedKV, **options) -> KVTier:
        """The host tier over ``kv`` with the cache's ``options`` (a harness's subclass adds its own executor, layer
        counter backend or host pool: :class:`kvtier.sglang.serving.InjectedCache`)."""
        return KVTier(kv, self.tier_config, **options)

    def set_layerwise(self, enabled: bool) -> None:
        """Load host hits layer by layer (the tier's counter registered on the KV pool) or whole (none registered).
        Takes effect from the next ``init_load_back``."""
        assert self.tier is not None  # called on an enabled backend
        self.tier.wait_all()  # a registered counter may still be waited on by an in-flight layerwise load
        self.layerwise = bool(enabled)
        self.tier.counter.set_consumer(-1)
        self.kv_pool.register_layer_transfer_counter(self.tier.counter if self.layerwise else None)

    # --- lifecycle ---

    def reset(self) -> None:
        """Fence: wait for every in-flight transfer, then reset the tree and drop everything kvtier holds."""
        tier = getattr(self, "tier", None)  # reset() runs inside RadixCache.__init__ before our fields exist
        if tier is not None:
            tier.wait_all()
        super().reset()
        if tier is not None:
            tier.poll()
            tier.reset()
            tier.counter.set_consumer(-1)
        if hasattr(self, "_inflight"):
            self._inflight.clear()  # the tree their locks were on is gone
            self._markers.clear()
            self._reads.clear()
            self.prefetch.clear()
            self._prefilled.clear()
            self._store_of_req.clear()
            self._req_of_store.clear()
            self._held_store.clear()
            self._order.clear()
            self._read_order.clear()  # the tier's reset ended them
            self._uncounted.clear()
            self._read_asked.clear()

    # --- match ---

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        base = super().match_prefix(params)
        if self.disable or self.tier is None:
            return base
        self._drain()
        req = params.req
        if req is None or not params.key:
            return base
        key = params.key.page_aligned(self.page_size)
        if key.is_bigram:
            return base
        tokens = key.raw_token_ids()[:len(key)]
        device_len = base.device_prefix_len
        if device_len >= len(tokens):
            self._markers.pop(req.cache_request_handle, None)
            return base
        ns = _namespace(key.extra_key, key.cache_salt)
        hit = self.tier.lookup_tiers(tokens, ns, self._read_agreement(req.cache_request_handle))
        if hit.read is not None:
            self._reads[req.cache_request_handle] = hit  # prefetch_from_storage (on arrival) may wait for it
            if self.multi_rank:
                self._read_order.append(hit.read)
                source = self.tier.lower_tier(hit.read.source)
                if source is not None and not source.count_at_plan:  # a probe learns it: agreed later
                    self._uncounted.append(hit.read)
        host_len = hit.cpu_pages * self.page_size - device_len
        if host_len <= 0:
            self._markers.pop(req.cache_request_handle, None)
            return base
        snapshot = tokens[:device_len + host_len]  # a copy: the live key aliases the request's fill ids
        self._markers[req.cache_request_handle] = _LoadMarker(snapshot, ns, device_len, host_len)
        return base._replace(host_hit_length=host_len)

    def _read_agreement(self, handle):
        """One rank: None (a lookup starts its read alone). Several: the ranks' MIN of their read offers at the
        request's first match (every rank matches it at the same point; the collective runs only when the CPU hit
        falls short and lower tiers run, the same on every rank), None at later matches (the CPU index only)."""
        if not self.multi_rank or handle in self._read_asked:
            return None
        self._read_asked.add(handle)
        return self.agreement.mins

    # --- load back ---

    def init_load_back(self, params: InitLoadBackParams):
        last_node: TreeNode = params.best_match_node
        req = params.req
        marker = self._markers.pop(req.cache_request_handle, None) if req is not None else None
        if self.disable or marker is None or params.host_hit_length <= 0:
            return 0, last_node
        assert self.tier is not None  # a marker comes from an enabled backend's match
        device_slots = self.path_device_indices(last_node)
        if len(device_slots) != marker.device_len or (last_node.evicted and last_node is not self.root_node):
            return 0, last_node  # the device tree changed since the match: recompute
        if marker.device_len % self.page_size:
            return 0, last_node  # host pages start on a page boundary (device matches are page aligned)
        need = min(params.host_hit_length, marker.host_len)
        if params.mem_quota is not None:
            need = min(need, params.mem_quota // self.page_size * self.page_size)
        if need < marker.host_len:
            return 0, last_node
        tokens = marker.tokens[:marker.device_len + need]
        key = RadixKey(tokens, req.extra_key, cache_salt=req.cache_salt)
        # A request admitted since this one's match may have grafted (part of) the same host range: the device
        # tree holds it now. Extend from there; a second child under the same key would orphan the first.
        values, parent = self._match_prefix_helper(last_node, key[marker.device_len:])
        start = marker.device_len + sum(len(v) for v in values)
        rest = marker.device_len + need - start
        if rest == 0:
            return need, parent
        new_slots = self._alloc_slots(rest, parent)  # device trees and allocators are identical on every rank
        if new_slots is None:
            return 0, last_node
        new_slots = new_slots.to(torch.int64)
        new_slots_all = new_slots  # the copy writes through these (see _inflight)
        start_page = start // self.page_size  # the device-held pages are not copied again
        ns = marker.ns
        if self.layerwise:
            task = self.tier.load_layerwise(tokens, ns, new_slots, start_page=start_page)
        else:
            task = self.tier.load(tokens, ns, new_slots, start_page=start_page)
        local = min(rest, task.num_pages * self.page_size)
        loaded = self.agreement.min(local)  # a load can fail on one rank only: every rank grafts the same length
        if local < loaded and task.status is TaskStatus.FAILED:  # a later stage: the first loaded what failed here
            self._repair(task, "load")
            local = min(rest, task.num_pages * self.page_size)
        if local < loaded:  # this stage's host index holds less than the first stage's
            raise RuntimeError(f"kvtier: pipeline stage {self.agreement.pp_rank} loaded {local} tokens where "
                               f"the first stage loaded {loaded}: its host tier no longer matches the others'")
        if local > loaded:
            self.tier.wait(task)  # the slots past `loaded` are being written: free them only after the copy
        if loaded < rest:
            self.token_to_kv_pool_allocator.free(new_slots[loaded:])
            new_slots = new_slots[:loaded]
        if self.layerwise and task.producer_index >= 0:  # a zero-page load keeps the batch's earlier loads' waits
            self.tier.counter.set_consumer(task.producer_index)
        elif not self.layerwise and not task.done:
            self._fence_forward(task)
        node = parent
        if loaded > 0:
            node = self._graft(parent, key, start, new_slots)
        self._track(task, node, new_slots_all)
        if loaded < rest:  # SGLang 0.5.23: all promised tokens or none
            return 0, last_node
        return need, node

    def _alloc_slots(self, need: int, last_node: TreeNode) -> Optional[torch.Tensor]:
        alloc = self.token_to_kv_pool_allocator
        if alloc.available_size() < need:
            self.inc_lock_ref(last_node)  # never evict the prefix we hang the new node from
            try:
                self.evict(EvictParams(num_tokens=need - alloc.available_size()))
            finally:
                self.dec_lock_ref(last_node)
        return alloc.alloc(need)

    def _graft(self, parent: TreeNode, key: RadixKey, start: int, slots: torch.Tensor) -> TreeNode:
        """A new child of ``parent`` holding ``key[start:start + len(slots)]`` in ``slots`` (no child of ``parent``
        starts with that page: :meth:`init_load_back` matched past any first)."""
        node = TreeNode(priority=parent.priority)
        node.key = key[start:start + len(slots)]
        node.value = slots
        node.parent = parent
        parent.children[node.key.child_key(self.page_size)] = node
        self.evictable_size_ += len(slots)
        self._update_leaf_status(parent)
        self._update_leaf_status(node)
        self.kv_events.record_store(node)
        return node

    def _fence_forward(self, task) -> None:
        """Make the forward pass wait for a whole load, GPU-side. SGLang runs the forward on the model runner's
        forward stream with overlap scheduling or pipeline stages, and on the scheduler's current stream without
        (``--disable-overlap-schedule``): both streams wait."""
        assert self.tier is not None  # a load's task
        self.tier.wait_on_current_stream(task)
        if self.forward_stream is not None and torch.cuda.is_available() \
                and self.forward_stream != torch.cuda.current_stream():
            with torch.cuda.stream(self.forward_stream):
                self.tier.wait_on_current_stream(task)

    # --- store ---

    def checkpoint(self, req, *, up_to: int):
        super().checkpoint(req, up_to=up_to)
        if self.disable or self.tier is None:
            return
        self._drain()
        self._report_prefill(req, up_to)
        if self.is_eagle:
            return
        n = req.kv.cache_protected_len  # tree-owned, page-aligned prefix (the base checkpoint just set it)
        if n < self.page_size:
            return
        tokens = req.full_untruncated_fill_ids[:n]
        slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64, copy=True)
        ns = _namespace(req.extra_key, req.cache_salt)
        if req.rid in self._store_of_req:
            # Its previous checkpoint's store is in flight: those pages are not in the host index yet, so storing
            # now would copy them again. Hold this one (its path locked) until that store completes.
            held = self._held_store.pop(req.rid, None)
            if held is not None:
                self.dec_lock_ref(held[3])
            self.inc_lock_ref(req.last_node)
            self._held_store[req.rid] = (tokens, ns, slots, req.last_node)
            return
        self._store(req.rid, tokens, ns, slots, req.last_node)

    def _report_prefill(self, req, up_to: int) -> None:
        """The checkpoint that ends a request's prefill reports it to the tier (``KVTier.note_prefill``: tokens
        computed past those cached, seconds since its first forward): the lower tiers' admission by cost weighs a
        read against it."""
        t0 = getattr(getattr(req, "time_stats", None), "forward_entry_time", 0.0)
        if req.rid in self._prefilled or up_to < len(req.origin_input_ids) or t0 <= 0 or req.retracted_stain:
            return
        assert self.tier is not None  # an enabled backend's checkpoint
        self._prefilled.add(req.rid)
        cached = min(req.cached_tokens, up_to)
        self.tier.note_prefill(up_to - cached, time.perf_counter() - t0, cached)

    def _store(self, rid, tokens, ns, slots: torch.Tensor, node: TreeNode) -> None:
        assert self.tier is not None  # a store runs on an enabled backend
        task = self.tier.store(tokens, ns, slots)
        if self._track(task, node, slots):
            self._store_of_req[rid] = task.id
            self._req_of_store[task.id] = rid

    # --- completions / eviction ---

    def _track(self, task: TierTask, node: TreeNode, slots: Optional[torch.Tensor]) -> bool:
        """Keep ``node`` locked (and ``slots`` referenced) until ``task`` is released; True when it is tracked.
        One rank alone: only tasks still in flight. Several ranks: every task, in issue order, whatever this rank's
        outcome (a copy may be done or failed here and in flight on another rank: the locks must not differ)."""
        if not self.multi_rank and task.done:
            return False
        self.inc_lock_ref(node)
        self._inflight[task.id] = (node, slots)
        if self.multi_rank:
            self._order.append(task)
        return True

    def _repair(self, task: TierTask, what: str) -> None:
        """A later pipeline stage: the first stage completed a copy that failed here, and every stage acts on its
        verdict. Issue the same copy again (the CPU blocks and device slots it was given, still held and locked:
        every stage's host pool and index stay as the first stage's) and wait for it; raise if it fails again:
        this stage's KV would differ from the other stages'."""
        assert self.tier is not None  # a task's
        if self.tier.retry(task):
            self.tier.wait(task)
        if task.status is TaskStatus.FAILED:
            raise RuntimeError(f"kvtier: a host-tier {what} failed on pipeline stage {self.agreement.pp_rank} and "
                               f"again when issued a second time, where the first stage's succeeded: this stage can "
                               f"no longer hold the same KV as the others")
        self.repairs += 1
        logger.warning("kvtier: a %s failed on pipeline stage %d only; issued again and completed",
                       what, self.agreement.pp_rank)

    def _release(self, task_id: int) -> None:
        """``task_id`` is finalized: unlock its node; a held checkpoint of its request is stored now."""
        rec = self._inflight.pop(task_id, None)
        if rec is not None:
            self.dec_lock_ref(rec[0])
        rid = self._req_of_store.pop(task_id, None)
        if rid is not None:
            del self._store_of_req[rid]
            held = self._held_store.pop(rid, None)
            if held is not None:  # the request's next checkpoint: its earlier pages are held now
                self._store(rid, *held)
                self.dec_lock_ref(held[3])

    def _drain(self) -> None:
        """One rank: release what has completed. Several: nothing (completions are released by :meth:`_sync`)."""
        if self.tier is None or self.multi_rank:
            return
        for tid in self.tier.poll():
            self._release(tid)

    def _sync(self) -> None:
        """Release completed transfers. Several ranks: they agree on how many of the oldest transfers every rank
        has completed (an all-reduce MIN) and on which of those failed on any rank (an all-reduce MAX); each rank
        then finalizes exactly those, in issue order (a store failed anywhere is dropped everywhere), so host
        indexes, locks and device trees stay identical whatever each GPU's timing. SGLang's HiCache drains the same
        way. Under PP the first stage decides; a later stage waits for its own copies of what was decided
        (``finalize`` blocks) and issues again what failed only here (:meth:`_repair`)."""
        if self.tier is None:
            return
        if not self.multi_rank:
            self._drain()
            return
        if self.shared is not None:  # one pool's memory: every rank must have handed out the same blocks
            self.agreement.check_stage_same([self.tier.pool.block_digest], "the shared host pool's blocks")
        order = self._order
        local = self._leading(order, self.tier.completed)
        n, failed = self.agreement.completed(
            local, lambda k: [int(order[i].status is TaskStatus.FAILED) for i in range(k)])
        self._check_tracked(n, len(order), "copies")
        if n and self.shared is not None and not self.agreement.decides:
            self._stage_copies_done(n, failed)
        for bad in failed:
            task = order.popleft()
            self._repair_if_failed_here_only(task, bad)
            self.tier.finalize(task, keep=not bad)
            self._release(task.id)
        self._sync_reads()
        self.tier.poll()  # the tier's reports: every finalized task was released above

    def _sync_reads(self) -> None:
        """Several ranks: reads whose count comes from a probe get it first, the MIN over the ranks of the blocks
        each would read, for the oldest whose probe every rank has back (no CPU block is given before); then the
        ranks agree on how many of the oldest reads every rank has completed and, for each, on the MIN of its
        verified leading blocks; each rank inserts exactly that many. No collective while no read is tracked (the
        same on every rank: reads start by agreement)."""
        reads = self._read_order
        if not reads:
            return
        assert self.tier is not None  # reads in flight
        tier, pending = self.tier, self._uncounted
        if pending:
            n, counts = self.agreement.counted_reads(self._leading(pending, tier.below.count_known),
                                                     lambda k: [tier.below.wanted(pending[i]) for i in range(k)])
            self._check_tracked(n, len(pending), "reads to count")
            for k in counts:
                tier.below.count(pending.popleft(), k)
        uncounted = pending[0] if pending else None  # the oldest read still to count: none after it has ended
        n, kept = self.agreement.completed_reads(self._leading(reads, lambda t: t is not uncounted and
                                                               tier.completed(t)),
                                                 lambda k: [tier.below.verified(reads[i]) for i in range(k)])
        self._check_tracked(n, len(reads), "reads")
        for k in kept:
            tier.finalize(reads.popleft(), keep=k)

    def _leading(self, tasks, done) -> int:
        """How many of ``tasks``, oldest first, are ``done`` before the first that is not (the first stage's
        offer of a completion agreement; 0 elsewhere: a later stage's own count is not asked)."""
        if not self.agreement.decides:
            return 0
        n = 0
        for task in tasks:
            if not done(task):
                break
            n += 1
        return n

    def _check_tracked(self, n: int, tracked: int, what: str) -> None:
        """Raise unless the ``n`` tasks the first stage finalized are among the ``tracked`` this stage tracks."""
        if n > tracked:
            raise RuntimeError(f"kvtier: pipeline stage {self.agreement.pp_rank} tracks {tracked} {what}, the first "
                               f"stage finalized {n}: the stages' scheduling sequences drifted apart")

    def _repair_if_failed_here_only(self, task, failed_anywhere: int) -> None:
        """A later pipeline stage: issue ``task`` again if it failed on this rank while the ranks' agreement keeps
        it (``failed_anywhere`` 0: it failed here only)."""
        if not failed_anywhere and task.status is TaskStatus.FAILED:
            self._repair(task, task.kind)

    def _stage_copies_done(self, n: int, failed: list[int]) -> None:
        """A later pipeline stage sharing one pool between its ranks: wait until every rank of the stage has
        completed its share of the ``n`` oldest copies before any finalizes them (a rank that finalized its own
        share alone let a stored page into its index, or a loaded block go back to the pool, while another rank's
        share was still being copied: a load of that page read the other share's layers unwritten)."""
        assert self.tier is not None  # tasks in flight
        for task, bad in zip(list(self._order)[:n], failed):
            self._repair_if_failed_here_only(task, bad)
            self.tier.wait(task)
        self.agreement.stage_barrier()  # every rank of the stage is past its waits

    def flush_pending_backups(self) -> None:
        """SGLang calls this once per processed batch, on every rank: the round's completion agreement."""
        super().flush_pending_backups()
        self._sync()

    def check_hicache_events(self) -> None:
        """SGLang calls this once per scheduler round, before admission. With requests waiting for their reads and
        none holding device KV (nothing to run), it first blocks up to ``prefetch_idle_poll_s`` for the oldest read:
        the loop would otherwise spin and take the GIL from the IO threads the read runs on."""
        poll_s = self.tier_config.prefetch_idle_poll_s
        if poll_s > 0 and self.tier is not None and self.protected_size() == 0:
            read = self.prefetch.oldest_read()
            if read is not None:
                self.tier.wait_progress(read, poll_s)
        self._drain()
        if self.multi_rank and self.tier is not None:
            self._sync_reads()  # an idle server runs no batch: its reads end here

    def evict(self, params: EvictParams) -> EvictResult:
        self._sync()  # TP: every rank evicts when the same (identical) allocator is short, so all reach this
        return super().evict(params)

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self._forget(req.cache_request_handle)

    def release_aborted_request(self, handle) -> None:
        super().release_aborted_request(handle)
        self._forget(handle)

    def _forget(self, handle) -> None:
        self._prefilled.discard(handle.rid)
        self._markers.pop(handle, None)
        self._reads.pop(handle, None)
        self._read_asked.discard(handle)
        self.prefetch.drop(handle)

    # --- the prefetch gate (kvtier.sglang.prefetch): SGLang 0.5.23 calls these under --enable-lmcache ---

    hicache_storage_pass_prefix_keys = False  # _prefetch_kvcache: no per-page hash keys to hand over

    def is_backuped(self, node) -> bool:
        return True  # kvtier looks pages up by their tokens: any device node anchors a prefetch

    def is_root(self, node) -> bool:
        return node is self.root_node

    def get_last_hash_value(self, node) -> Optional[str]:
        return None  # no hash chain in the tree: the tiers hash the tokens themselves

    def prefetch_from_storage(self, handle, last_host_node, new_input_tokens, last_hash=None, prefix_keys=None,
                              matched_prefix_tokens=None, extra_key=None, cache_salt=None, storage_hit_end=None):
        """A request joined the waiting queue, just matched (``_prefetch_kvcache``): if that match started a read
        from a lower tier, the prefetch policy may hold the request back until it is done."""
        hit = self._reads.pop(handle, None)
        if hit is not None:  # several ranks: the same read on every rank (agreed), so the same wait
            self.prefetch.start(handle, hit)

    def check_prefetch_progress(self, handle) -> bool:
        """Whether the waiting request may be admitted this round (the scheduler skips it otherwise). The round's
        ``check_hicache_events``, which SGLang calls before admission under the same flag, has drained the tier."""
        return self.prefetch.ready(handle)

    def pop_prefetch_loaded_span(self, handle) -> tuple[int, Optional[int]]:
        return self.prefetch.pop_loaded(handle)

    def has_pending_cache_operations(self) -> bool:
        """The scheduler is not idle while a request waits for its read or a copy is in flight."""
        return self.prefetch.pending or bool(self._inflight)

    def clear_storage_backend(self) -> bool:
        logger.warning("kvtier: /clear_hicache_storage_backend does nothing here; /flush_cache drops the blocks of "
                       "every kvtier tier")
        return False

    def release_host_resources(self) -> None:
        """SGLang's graceful shutdown: wait for kvtier's copies, then unpin and free the host pool (idempotent)."""
        super().release_host_resources()
        self.observability.close()
        self.agreement.close()
        if self.tier is not None:
            self.tier.destroy()

    def wait_all(self) -> None:
        """Block until every in-flight transfer completes and drop its locks (tests, shutdown); after
        :meth:`release_host_resources` nothing is in flight (the tier waited for its copies)."""
        while self.tier is not None and not self.tier.pool.destroyed:
            self.tier.wait_all()
            self._sync()  # may issue a held checkpoint's store
            if not self._held_store and not self.tier.inflight_ids and not self._order and not self._read_order:
                break

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def num_reads(self) -> int:
        """Lower-tier reads tracked until the ranks agree that they ended (several ranks)."""
        return len(self._read_order)

    @property
    def num_held_checkpoints(self) -> int:
        """Chunked-prefill checkpoints waiting for their request's store in flight."""
        return len(self._held_store)



_kvtier_sglang.register()  # importing the backend registers it too (idempotent), as SGLang's own backends do
