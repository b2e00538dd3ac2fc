"""Continuous batching over SGLang 0.5.23's scheduler objects: the serving-under-load harness's server.

:class:`BatchServer` serves many requests at once over one mode's pools (:class:`Engine`), a step at a time in the
order of SGLang's ``Scheduler.event_loop_normal`` (no overlap scheduling):

1. arrivals join the waiting queue; with a storage gate (an L3 backend: ``hicache_file``; ``--enable-lmcache``:
   the kvtier modes, :mod:`kvtier.sglang.prefetch`) each is matched and its prefetch starts (``_prefetch_kvcache``);
2. HiCache modes and gated ones: ``tree_cache.check_hicache_events()`` (SGLang calls it only with hierarchical
   caching or a storage gate; kvtier also drains its transfers in the calls below);
3. the chunked request of the last step is checkpointed (``checkpoint_kv_cache``); the last extend batch, less the
   chunked request, joins the running batch (``filter_batch`` / ``merge_batch``); finished requests leave it;
4. a prefill batch, when one can be made (``_get_new_batch_prefill_raw``): ``SchedulePolicy.calc_priority`` orders
   the waiting queue; a ``PrefillAdder`` under the token budgets (``max_prefill_tokens``, the chunk size, the free
   device pool, ``max_running_requests``) takes the chunked request first (``add_chunked_req``), then waiting
   requests in order: with a storage gate, one whose prefetch is not done is skipped (``check_prefetch_progress``),
   what a finished one loaded is popped (``pop_prefetch_loaded_span``); each is matched again
   (``init_next_round_input``: the device match and the host hit) and offered to ``add_one_req``, which calls
   ``init_load_back`` for a host hit, until one does not fit (the one that fits only in part is chunked); then
   ``ScheduleBatch.init_new``, HiCache's ``ready_to_load_host_cache`` (the layer counter's consumer for this
   batch), ``prepare_for_extend`` (device slots, ``req_to_token`` rows);
5. else a decode step of the running batch (``update_running_batch``): ``check_decode_mem``, ``retract_decode``
   when the pool is short (the retracted requests go back to the waiting queue), ``prepare_for_decode``;
6. the batch's forward: :meth:`~kvtier.e2e.model.PagedDecoder.forward_batch` (the GEMMs over every request of the
   batch at once, attention per request, K/V written to and read from SGLang's pool through its getters, where a
   layerwise load is waited for);
7. the results as ``process_batch_result_prefill`` / ``_decode`` take them: a request's next token appended and
   ``update_finish_state``; a finished request released (``release_kv_cache``, checkpointed); one that goes on to
   decode checkpointed after its prefill (``checkpoint_kv_cache``); the chunked request's middle chunk commits
   nothing;
8. ``tree_cache.flush_pending_backups()``.

Run for real: ``Req``, ``SchedulePolicy``, ``PrefillAdder``, ``ScheduleBatch`` (``init_new``,
``prepare_for_extend``, ``prepare_for_decode``, ``filter_batch``, ``merge_batch``, ``check_decode_mem``,
``retract_decode``), ``NewTokenRatioTracker``, ``release_kv_cache``, ``checkpoint_kv_cache``, the pools, the
allocator and the tree caches (``RadixCache``, ``UnifiedRadixCache``, ``UnifiedRadixCache`` with HiCache's
controller and host pool, :class:`~kvtier.sglang.radix_cache.KVTierRadixCache`). Mirrored, not run: the ``Scheduler``
object (it needs a model runner, the tokenizer's sockets and process groups), the model runner's ``ForwardBatch``
and sampling (greedy here); and left out: overlap scheduling, mixed chunked prefill, logprobs, grammars,
speculative decoding, LoRA, DP attention, aborts, the prefill delayer.

Times are wall-clock (``time.perf_counter``): a request's TTFT runs from its arrival to the end of the step that
produced its first token (the device synchronized), its queueing delay from arrival to its first prefill batch.
"""

from __future__ import annotations

import dataclasses
import time
import types
from array import array
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
import xxhash

from kvtier.config import TierConfig
from kvtier.e2e.arrivals import Arrival, Feed
from kvtier.e2e.model import PagedDecoder, Segment
from kvtier.sglang.radix_cache import KVTierRadixCache

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402  (radix_cache checked the version)
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy  # noqa: E402
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

__all__ = ["MODES", "CUDA_MODES", "EngineConfig", "Engine", "BatchServer", "Record", "Arrival"]

# recompute: no prefix cache; radix: SGLang's RadixCache (kvtier's base class); unified: UnifiedRadixCache (what
# SGLang 0.5.23 builds by default); hicache / hicache_file: UnifiedRadixCache with HiCache (a host pool of
# host_gb), and its file L3 backend; kvtier / kvtier_layerwise: KVTierRadixCache (a CPU pool of host_gb), loads
# whole or layer by layer; kvtier_ssd: with an SSD tier in ssd_dir.
MODES: tuple[str, ...] = ("recompute", "radix", "unified", "hicache", "hicache_file", "kvtier", "kvtier_layerwise",
                          "kvtier_ssd")
CUDA_MODES = frozenset({"hicache", "hicache_file"})  # HiCache's host pool is registered with CUDA


@dataclasses.dataclass
class EngineConfig:
    """One mode's server: its device KV pool, scheduler limits and host tier sizes."""

    mode: str
    kv_tokens: int  # device KV pool, tokens
    page_size: int = 16
    max_running_requests: int = 32
    max_context: int = 32768
    chunked_prefill_size: Optional[int] = 16384  # None: no chunking
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    host_gb: float = 1.0  # kvtier's cpu_cache_gb; HiCache's --hicache-size
    ssd_dir: Optional[str] = None  # kvtier_ssd: ssd_cache_dir; hicache_file: file_storage_path
    ssd_gb: float = 0.0
    transfer_mode: str = "auto"
    tier_overrides: dict = dataclasses.field(default_factory=dict)  # more TierConfig keys for the kvtier modes
    # kvtier modes: --enable-lmcache, which turns on SGLang's prefetch gate (kvtier.sglang.prefetch)
    prefetch_gate: bool = True

    def server_args(self) -> ServerArgs:
        hi = self.mode in CUDA_MODES
        kw = dict(model_path="dummy", page_size=self.page_size, schedule_policy=self.schedule_policy,
                  chunked_prefill_size=self.chunked_prefill_size or -1, max_prefill_tokens=self.max_prefill_tokens,
                  max_running_requests=self.max_running_requests, disable_radix_cache=self.mode == "recompute")
        if hi:
            kw.update(enable_hierarchical_cache=True, hicache_size=max(1, round(self.host_gb)))
        if self.mode == "hicache_file":
            kw.update(hicache_storage_backend="file", file_storage_path=self.ssd_dir)
        if self.mode.startswith("kvtier") and self.prefetch_gate:
            kw.update(enable_lmcache=True)
        return ServerArgs(**kw)


class Engine:
    """One mode's pools, allocator, request rows and tree cache over ``model`` (see :data:`MODES`)."""

    def __init__(self, model: PagedDecoder, cfg: EngineConfig) -> None:
        if cfg.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {cfg.mode!r}")
        if cfg.mode in CUDA_MODES and model.device.type != "cuda":
            raise ValueError(f"mode {cfg.mode!r} needs a CUDA model (HiCache registers its host pool with CUDA)")
        self.model, self.cfg, self.mode = model, cfg, cfg.mode
        self.server_args = cfg.server_args()
        self.activate()
        dev, dtype, shape, P = model.device, model.dtype, model.kv_shape, cfg.page_size
        device = "cpu" if dev.type == "cpu" else f"cuda:{dev.index if dev.index is not None else 0}"
        if shape.is_mla:
            self.kv_pool = MLATokenToKVPool(size=cfg.kv_tokens, page_size=P, dtype=dtype,
                                            kv_lora_rank=shape.kv_lora_rank, qk_rope_head_dim=shape.qk_rope_head_dim,
                                            layer_num=shape.num_layers, device=device, enable_memory_saver=False)
        else:
            self.kv_pool = MHATokenToKVPool(size=cfg.kv_tokens, page_size=P, dtype=dtype, head_num=shape.kv_heads,
                                            head_dim=shape.head_dim, layer_num=shape.num_layers, device=device,
                                            enable_memory_saver=False)
        self.allocator = PagedTokenToKVPoolAllocator(size=cfg.kv_tokens, page_size=P, dtype=dtype, device=device,
                                                     kvcache=self.kv_pool, need_sort=False)
        self.req_to_token_pool = ReqToTokenPool(size=cfg.max_running_requests + 1, max_context_len=cfg.max_context,
                                                device=device, enable_memory_saver=False)
        params = CacheInitParams(disable=cfg.mode == "recompute", req_to_token_pool=self.req_to_token_pool,
                                 token_to_kv_pool_allocator=self.allocator, page_size=P)
        self.layer_counter = None  # HiCache's: the batch's consumer is set on it before the forward
        if cfg.mode.startswith("kvtier"):
            extra = dict(cfg.tier_overrides)
            if cfg.mode == "kvtier_ssd":
                extra.update(ssd_cache_gb=cfg.ssd_gb, ssd_cache_dir=cfg.ssd_dir)
            config = TierConfig(**{"cpu_cache_gb": cfg.host_gb, "page_size": P, "transfer_mode": cfg.transfer_mode,
                                   "layerwise": cfg.mode == "kvtier_layerwise", **extra})
            self.cache = KVTierRadixCache(params, config, model_identity={"model": "kvtier-batch-server",
                                                                          "layers": shape.num_layers})
        elif cfg.mode in ("unified",) + tuple(CUDA_MODES):
            from sglang.srt.mem_cache.unified_cache.components import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            params.tree_components = (ComponentType.FULL,)
            self.cache = UnifiedRadixCache(params)
            if cfg.mode in CUDA_MODES:
                self.cache.init_hicache(self.server_args, params)
                self.layer_counter = self.cache.cache_controller.layer_done_counter
        else:
            self.cache = RadixCache(params)
        self.free_at_start = self.allocator.available_size()

    def activate(self) -> None:
        """Make this engine's server arguments SGLang's process-wide ones (the scheduler objects read them), and
        this process rank 0 of every parallel group (HiCache's storage backends ask for their ranks)."""
        set_global_server_args_for_scheduler(self.server_args)
        get_parallel().override_permanently(**{f"{g}_rank": 0 for g in ("tp", "pp", "attn_tp", "attn_cp",
                                                                         "attn_dcp", "attn_dp")})

    @property
    def tier(self):
        """kvtier's host tier (None in the other modes)."""
        return getattr(self.cache, "tier", None)

    @property
    def hicache(self) -> bool:
        return self.mode in CUDA_MODES

    @property
    def storage_gate(self) -> bool:
        """SGLang's scheduler runs its storage-prefetch steps (``enable_hicache_storage or enable_lmcache``)."""
        return bool(self.server_args.hicache_storage_backend or self.server_args.enable_lmcache)

    def flush_device(self) -> None:
        """Drop every device-cached page (host copies stay): wait for host copies, then evict the whole tree."""
        self.wait_host_copies()
        self.cache.evict(EvictParams(num_tokens=1 << 62))

    def wait_host_copies(self) -> None:
        """Wait until every store to the host tier has completed and been accounted."""
        if self.tier is not None:
            self.cache.wait_all()
        elif self.hicache:
            self.cache.writing_check(write_back=True)  # submits what is queued, waits for every acknowledgement

    def leaked_slots(self) -> int:
        """Device slots neither free nor in the tree after a flush (0 when nothing leaked)."""
        self.flush_device()
        return self.free_at_start - self.allocator.available_size()

    def close(self) -> None:
        if self.tier is not None:
            self.cache.wait_all()
            self.tier.destroy()
        elif self.hicache:
            self.wait_host_copies()
            self.cache.shutdown()  # detaches an L3 storage backend
            self.cache.reset()
        self.kv_pool = self.allocator = self.req_to_token_pool = self.cache = None  # type: ignore[assignment]  # closed


@dataclasses.dataclass
class Record:
    """What happened to one request."""

    tag: object
    prompt_len: int
    arrival_s: float
    admitted_s: Optional[float] = None  # its first prefill batch started
    first_token_s: Optional[float] = None
    finished_s: Optional[float] = None
    output: list = dataclasses.field(default_factory=list)
    device_hit: int = 0  # prompt tokens matched on the device at its first prefill
    host_hit: int = 0  # prompt tokens loaded from the host tier (init_load_back)
    computed: int = 0  # prompt tokens its prefill computed
    retracted: int = 0

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None  # asked of a finished request
        return self.first_token_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        assert self.admitted_s is not None  # asked of a finished request
        return self.admitted_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        assert self.finished_s is not None  # asked of a finished request
        return self.finished_s - self.arrival_s


class BatchServer:
    """Continuous batching over ``engine`` (see the module docstring).

    Args:
        engine: the mode's pools and tree cache.
        clock: seconds (default ``time.perf_counter``).
        on_step: called after each step with (the batch run or None, this server).
        verify_every: check loaded KV against stored KV on one page in this many (0: off). A page is sampled by
            its token prefix: when a request's KV is stored (checkpointed or released), each sampled page's device
            bytes are digested under its prefix; when a request's host hit has been loaded (after its prefill
            batch's forward), each sampled loaded page's device bytes must equal one of the digests stored under
            its prefix (``verified_pages``, ``loaded_mismatches``).
    """

    def __init__(self, engine: Engine, *, clock: Callable[[], float] = time.perf_counter,
                 on_step: Optional[Callable] = None, verify_every: int = 0) -> None:
        self.engine, self.clock, self.on_step = engine, clock, on_step
        self.verify_every = verify_every
        self._stored_digests: dict[int, set] = {}  # sampled page's prefix key -> digests of its stored KV
        self._loaded_now: list[Req] = []  # requests whose host hit the current prefill batch loads
        self.verified_pages = self.loaded_mismatches = 0
        engine.activate()
        self.cache, self.model = engine.cache, engine.model
        cfg = engine.cfg
        self.policy = SchedulePolicy(cfg.schedule_policy, self.cache, engine.hicache, False, False)
        self.ratio = NewTokenRatioTracker.from_config()
        self.model_config = types.SimpleNamespace(vocab_size=self.model.config.vocab_size, is_encoder_decoder=False,
                                                  hf_config=self.model.config, context_len=cfg.max_context)
        self.waiting: list[Req] = []
        self.running = ScheduleBatch(reqs=[], batch_is_full=False)
        self.chunked_req: Optional[Req] = None
        self.last_batch: Optional[ScheduleBatch] = None
        self.records: dict[str, Record] = {}
        self.finished: list[Record] = []  # in the order they finished
        self.steps = self.prefill_batches = self.decode_batches = 0
        self._rid = 0
        self._t0 = self.clock()

    # --- requests ---

    def now(self) -> float:
        """Seconds since the server was made (or :meth:`reset_clock`)."""
        return self.clock() - self._t0

    def reset_clock(self) -> None:
        self._t0 = self.clock()

    def submit(self, arrival: Arrival) -> str:
        """Queue a request now; returns its id."""
        self._rid += 1
        rid = f"{self.engine.mode}-{self._rid}"
        sp = SamplingParams(temperature=0, max_new_tokens=arrival.max_new_tokens)
        sp.normalize(None)
        req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", arrival.tokens), sampling_params=sp)
        self.records[rid] = Record(arrival.tag, len(arrival.tokens), self.now())
        self._prefetch(req)
        self.waiting.append(req)
        return rid

    def _prefetch(self, req: Req) -> None:
        """``Scheduler._prefetch_kvcache``: with a storage gate, the arriving request is matched and its prefetch
        from the lower tiers starts (a HiCache L3 backend's, or the read kvtier's match began)."""
        if not self.engine.storage_gate:
            return
        tc = self.cache
        req.init_next_round_input(tc, cow_mamba=False)
        matched = req.prefix_len + req.host_hit_length
        anchor = req.last_host_node
        if not (tc.is_backuped(anchor) or tc.is_root(anchor)):
            return
        ids = req.full_untruncated_fill_ids
        end = req._compute_max_prefix_len(len(ids))
        keys = tc.get_prefix_hash_values(anchor) if tc.hicache_storage_pass_prefix_keys else None
        tc.prefetch_from_storage(req.cache_request_handle, anchor, ids[matched:end], tc.get_last_hash_value(anchor),
                                 keys, matched_prefix_tokens=ids[:matched], extra_key=req.extra_key,
                                 cache_salt=req.cache_salt)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or not self.running.is_empty() or self.chunked_req is not None
                    or (self.last_batch is not None and not self.last_batch.is_empty()))

    def run(self, feed: Union[Feed, list[Arrival]], *, timeout_s: float = 3600.0) -> list[Record]:
        """Serve what ``feed`` sends (a list: every request now) until it is done and nothing is in flight; the
        records of the requests that finished, in the order they finished."""
        if isinstance(feed, list):
            feed = _Given(feed)
        self.reset_clock()
        first = seen = len(self.finished)
        while True:
            now = self.now()
            for a in feed.take(now, self.finished[seen:]):
                self.submit(a)
            seen = len(self.finished)
            if not self.busy:
                if feed.done():
                    break
                due = feed.next_s()
                if due is None:
                    raise RuntimeError("the feed waits for a request to finish, and none is in flight")
                time.sleep(max(0.0, min(due - self.now(), 0.05)))
                continue
            self.step()
            if now > timeout_s:
                raise TimeoutError(f"{self.engine.mode}: {len(self.waiting)} waiting, "
                                   f"{self.running.batch_size()} running after {now:.0f} s")
        return self.finished[first:]

    # --- one step ---

    def step(self) -> Optional[ScheduleBatch]:
        """One scheduler step (see the module docstring); the batch it ran, if any."""
        self.engine.activate()
        if self.engine.hicache or self.engine.storage_gate:
            self.cache.check_hicache_events()
        self._merge_last_batch()
        batch = self._new_prefill_batch()
        if batch is None and not self.running.is_empty():
            batch = self._update_running_batch()
        if batch is not None and not batch.is_empty():
            self._run(batch)
        elif self.engine.storage_gate:
            time.sleep(0)  # on_idle: storage workers need the GIL between their IO calls
        self.cache.flush_pending_backups()
        self.last_batch = batch
        self.steps += 1
        if self.on_step is not None:
            self.on_step(batch, self)
        return batch

    def _merge_last_batch(self) -> None:
        exclude = []
        if self.chunked_req is not None:
            exclude.append(self.chunked_req)
            if self.chunked_req.extend_end > self.chunked_req.prefix_len:
                checkpoint_kv_cache(self.chunked_req, self.cache)  # stash_chunked_request
        last = self.last_batch
        if last is not None and last.forward_mode is not None and last.forward_mode.is_extend():
            if last.chunked_req is not None:
                exclude.append(last.chunked_req)
            n = last.batch_size()
            last.filter_batch(reqs_to_exclude=exclude)
            if last.batch_size() < n:
                self.running.batch_is_full = False
            if not last.is_empty() and last is not self.running:
                if self.running.is_empty():
                    self.running = last
                else:
                    self.running.merge_batch(last)
        n = self.running.batch_size()
        self.running.filter_batch()
        if self.running.batch_size() < n:
            self.running.batch_is_full = False

    def _allocatable(self, running_bs: int, held_rows: int = 0) -> int:
        """Requests a prefill may still add (``get_num_allocatable_reqs``): within max running requests, and rows
        of ``req_to_token`` free or held by the candidates already counted (a continuing chunk)."""
        return min(self.engine.cfg.max_running_requests - running_bs,
                   self.engine.req_to_token_pool.available_size() + held_rows)

    def _new_prefill_batch(self) -> Optional[ScheduleBatch]:
        running, cfg = self.running, self.engine.cfg
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        running_bs = len(running.reqs)
        if self._allocatable(running_bs) <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting, running)
        adder = PrefillAdder(cfg.page_size, self.cache, self.engine.allocator, running, self.ratio.current,
                             cfg.max_prefill_tokens, cfg.chunked_prefill_size, 0, 0,
                             max_running_requests=cfg.max_running_requests, waiting_queue_len=len(self.waiting))
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            adder.chunked_req_limit = self.policy.shortest_prefill_chunk_limit(
                self.chunked_req, self.waiting, adder.rem_chunk_tokens or 0, cfg.page_size)
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        matched: dict[str, tuple[int, int]] = {}
        for req in self.waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self._allocatable(len(running.reqs), held):
                running.batch_is_full = True
            if running.batch_is_full:
                break
            if self.engine.storage_gate and not self._storage_ready(req):
                continue
            req.init_next_round_input(self.cache)
            matched[req.rid] = (req.prefix_len, req.host_hit_length)
            res = adder.add_one_req(req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    running.batch_is_full = len(adder.can_run_list) > 0 or not running.is_empty()
                break
        can_run = adder.can_run_list
        if not can_run:
            return None
        taken = set(can_run)
        self.waiting = [r for r in self.waiting if r not in taken]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        now = self.now()
        for req in can_run:
            req.time_stats.set_forward_entry_time()  # set_time_batch(can_run_list, "set_forward_entry_time")
            rec = self.records[req.rid]
            if rec.admitted_s is None:
                rec.admitted_s = now
                device, host = matched.get(req.rid, (req.prefix_len, 0))
                rec.device_hit, rec.host_hit = device, getattr(req, "host_loaded_length", 0) or 0
                if rec.host_hit and self.verify_every:
                    self._loaded_now.append(req)
        batch = ScheduleBatch.init_new(can_run, self.engine.req_to_token_pool, self.engine.allocator, self.cache,
                                       self.model_config, False, SpeculativeAlgorithm.NONE,
                                       chunked_req=self.chunked_req)
        if self.engine.hicache:
            batch.hicache_consumer_index = self.cache.ready_to_load_host_cache()
        batch.prepare_for_extend()
        self.prefill_batches += 1
        return batch

    def _storage_ready(self, req: Req) -> bool:
        """HiCache's L3 gate: a request waits while its prefetch from storage runs (the scheduler's check)."""
        done = self.cache.check_prefetch_progress(req.cache_request_handle)
        if done:
            loaded, start = self.cache.pop_prefetch_loaded_span(req.cache_request_handle)
            if loaded > 0:
                req.storage_hit_length, req.storage_hit_start, req.host_hit_is_storage = loaded, start, False
        return done

    def _update_running_batch(self) -> Optional[ScheduleBatch]:
        batch = self.running
        n = batch.batch_size()
        if not batch.check_decode_mem():
            retracted, ratio, aborted = batch.retract_decode()
            self.ratio.current = ratio
            for req in retracted:
                self.records[req.rid].retracted += 1
                self.waiting.append(req)
            for req in aborted:
                raise RuntimeError(f"{req.rid} was aborted by retract_decode: the device pool cannot hold it")
        else:
            self.ratio.decay_step()
        if batch.batch_size() < n:
            batch.batch_is_full = False
        if batch.is_empty():
            return None
        batch.prepare_for_decode()
        self.decode_batches += 1
        return batch

    # --- forward and results ---

    def _segments(self, batch: ScheduleBatch) -> list[Segment]:
        dev = self.model.device
        r2t = self.engine.req_to_token_pool.req_to_token
        loc = batch.out_cache_loc.to(dev, torch.int64)
        segs, at = [], 0
        extend = batch.forward_mode.is_extend()
        for i, req in enumerate(batch.reqs):
            if extend:
                start, n = batch.prefix_lens[i], batch.extend_lens[i]
                toks = req.get_fill_ids()[start:start + n]
            else:
                n = 1
                start = int(batch.seq_lens_cpu[i]) - 1
                toks = [req.output_ids[-1]]
            row = r2t[req.kv.req_pool_idx, :start + n].to(dev, torch.int64)
            segs.append(Segment(torch.tensor(list(toks), dtype=torch.int64, device=dev), start, loc[at:at + n], row))
            at += n
        return segs

    def _run(self, batch: ScheduleBatch) -> None:
        if self.layer_counter is not None and getattr(batch, "hicache_consumer_index", None) is not None:
            self.layer_counter.set_consumer(batch.hicache_consumer_index)
        logits = self.model.forward_batch(self.engine.kv_pool, self._segments(batch))
        next_ids = torch.argmax(logits, dim=-1).tolist()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        now = self.now()
        for req in self._loaded_now:
            rec = self.records[req.rid]
            self._check_loaded(req, rec.device_hit, rec.device_hit + rec.host_hit)
        self._loaded_now = []
        if batch.forward_mode.is_extend():
            self._prefill_results(batch, next_ids, now)
        else:
            self._decode_results(batch, next_ids, now)

    @property
    def layer_counter(self):
        return self.engine.layer_counter

    def _prefill_results(self, batch: ScheduleBatch, next_ids: list, now: float) -> None:
        for i, (req, tok) in enumerate(zip(batch.reqs, next_ids)):
            rec = self.records[req.rid]
            rec.computed += batch.extend_lens[i]
            if req.finished() or req.is_retracted:
                continue
            if req.inflight_middle_chunks > 0:  # a middle chunk: nothing to commit
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(tok)
            req.update_finish_state()
            if rec.first_token_s is None:
                rec.first_token_s = now
            if req.finished():
                self._finish(req, now)
            else:
                self._digest_stored(req)
                checkpoint_kv_cache(req, self.cache)

    def _decode_results(self, batch: ScheduleBatch, next_ids: list, now: float) -> None:
        for req, tok in zip(batch.reqs, next_ids):
            if req.finished() or req.is_retracted:
                continue
            req.output_ids.append(tok)
            req.update_finish_state(1)
            if req.finished():
                self._finish(req, now)

    def _finish(self, req: Req, now: float) -> None:
        self._digest_stored(req)
        release_kv_cache(req, self.cache, checkpoint=True)
        rec = self.records[req.rid]
        rec.finished_s, rec.output = now, list(req.output_ids)
        self.finished.append(rec)


    # --- loaded KV against stored KV (verify_every) ---

    def _pages(self, req: Req, first: int, end: int):
        """(prefix key, slots) of the sampled whole pages of ``req`` within tokens ``first..end``."""
        P = self.engine.cfg.page_size
        ids = np.asarray(req.get_fill_ids(), dtype=np.int64)
        row = self.engine.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        for p in range(-(-first // P), end // P):
            key = xxhash.xxh3_64_intdigest(ids[:(p + 1) * P].tobytes())
            if key % self.verify_every == 0:
                yield key, row[p * P:(p + 1) * P].to(torch.int64)

    def _digest(self, slots: torch.Tensor) -> int:
        pool = self.engine.kv_pool
        bufs = (list(pool.k_buffer) + list(pool.v_buffer) if getattr(pool, "k_buffer", None) is not None
                else list(pool.kv_buffer))
        rows = torch.stack([b[slots.to(b.device)] for b in bufs]).contiguous()
        return xxhash.xxh3_64_intdigest(rows.view(torch.uint8).cpu().numpy().tobytes())

    def _digest_stored(self, req: Req) -> None:
        if self.verify_every:
            for key, slots in self._pages(req, 0, req.kv.kv_committed_len):
                self._stored_digests.setdefault(key, set()).add(self._digest(slots))

    def _check_loaded(self, req: Req, first: int, end: int) -> None:
        for key, slots in self._pages(req, first, end):
            want = self._stored_digests.get(key)
            if want is not None:
                self.verified_pages += 1
                self.loaded_mismatches += self._digest(slots) not in want


class _Given:
    """A feed of the given requests, all sent at once."""

    def __init__(self, arrivals: list[Arrival]) -> None:
        self.arrivals = arrivals

    def take(self, now_s: float, finished: Sequence) -> list[Arrival]:
        out, self.arrivals = self.arrivals, []
        return out

    def done(self) -> bool:
        return not self.arrivals

    def next_s(self) -> Optional[float]:
        return 0.0 if self.arrivals else None

