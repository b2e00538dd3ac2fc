"""A serving loop that drives SGLang 0.5.23's scheduler sequence on real objects, for the end-to-end harness.

:class:`Server` owns one mode's KV pool (``MHATokenToKVPool`` / ``MLATokenToKVPool``), SGLang's paged allocator,
``ReqToTokenPool`` and tree cache, and serves one request at a time through the calls the scheduler makes:

1. ``Req.init_next_round_input(tree_cache)``: ``match_prefix`` (device match, and kvtier's host hit);
2. ``init_load_back`` under a lock on the matched node (kvtier modes, when there is a host hit), as
   ``PrefillAdder`` does; the request's prefix grows by what was loaded;
3. the prefill of the uncached suffix: slots from the allocator (evicting the tree when it is full), the request's
   ``req_to_token`` row, and a :class:`~kvtier.e2e.model.PagedDecoder` forward that writes and reads the pool;
4. greedy decode, one token per step, a slot per token (a page from the allocator at each page boundary);
5. ``release_kv_cache(req, tree_cache, checkpoint=True)``: the tree inserts the request (kvtier stores it to the
   host), the row goes back.

Modes: ``recompute`` (radix cache disabled), ``device`` (SGLang's ``RadixCache``), ``kvtier_whole`` and
``kvtier_layerwise`` (:class:`~kvtier.sglang.radix_cache.KVTierRadixCache`, whole or layer-by-layer loads).
TTFT runs from the match to the first token on the host (the device synchronized), so it includes kvtier's host
work and any load the forward waits for.
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from typing import Optional

import torch

from kvtier.config import TierConfig
from kvtier.e2e.model import PagedDecoder, greedy
from kvtier.sglang.radix_cache import KVTierRadixCache
from kvtier.tier import KVTier

from sglang.srt.managers.schedule_batch import Req  # noqa: E402  (kvtier.sglang.radix_cache checked the version)
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

__all__ = ["MODES", "Served", "Server"]

MODES: tuple[str, ...] = ("recompute", "device", "kvtier_whole", "kvtier_layerwise")


@dataclasses.dataclass
class Served:
    """One request's result.

    Attributes:
        output: the greedy output tokens.
        ttft_s: match to first token, seconds.
        prompt_len: prompt tokens.
        device_len: prompt tokens matched on the device.
        host_hit: tokens past the device match that kvtier reported.
        loaded: tokens kvtier loaded (``init_load_back``).
        computed: prompt tokens the prefill computed.
        total_s: match to the release of the last output token, seconds.
        logits: every step's logits on the CPU (``serve(..., keep_logits=True)`` only).
    """

    output: list[int]
    ttft_s: float
    prompt_len: int
    device_len: int
    host_hit: int
    loaded: int
    computed: int
    total_s: float = 0.0
    logits: Optional[list] = None



class InjectedCache(KVTierRadixCache):
    """:class:`KVTierRadixCache` whose host tier takes a harness's or test's executor (e.g. a
    :class:`~kvtier.tier.executor.DeferredExecutor`), layer counter backend or host pool; those left None are the
    cache's own."""

    def __init__(self, params, config=None, *, executor=None, counter_backend: Optional[str] = None, pool=None,
                 **kw) -> None:
        given = {"executor": executor, "counter_backend": counter_backend, "pool": pool}
        self._injected = {k: v for k, v in given.items() if v is not None}
        super().__init__(params, config, **kw)

    def _make_tier(self, kv, **options) -> KVTier:
        return super()._make_tier(kv, **{**options, **self._injected})

class Server:
    """One mode's pools, allocator and tree cache over a shared :class:`PagedDecoder` (see the module docstring).

    Args:
        model: the decoder (its device and dtype are the pool's).
        mode: one of :data:`MODES`.
        kv_tokens: device KV pool size in tokens.
        page_size: SGLang's page size (kvtier's too).
        max_context: longest request (prompt + output) in tokens.
        cpu_cache_gb: kvtier's host pool size, when ``host_pool`` is not given.
        host_pool: a :class:`~kvtier.tier.HostBlockPool` to reuse (the kvtier modes can share one: pinning is slow).
        transfer_mode / host_layout: kvtier settings.
        executor / counter_backend: passed to the cache's host tier (:class:`InjectedCache`).
        tokens_per_block: kvtier's host block (default: the config's default for ``page_size``).
    """

    def __init__(self, model: PagedDecoder, mode: str, *, kv_tokens: int, page_size: int = 16,
                 max_context: int = 32768, max_reqs: int = 4, cpu_cache_gb: float = 1.0, host_pool=None,
                 transfer_mode: str = "auto", host_layout: str = "layer_first", executor=None,
                 counter_backend: str = "auto", tokens_per_block: Optional[int] = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
        self.model, self.mode, self.page_size = model, mode, page_size
        dev, dtype, shape = model.device, model.dtype, model.kv_shape
        device = str(dev) if dev.type == "cpu" else f"cuda:{dev.index if dev.index is not None else 0}"
        if shape.is_mla:
            self.kv_pool = MLATokenToKVPool(size=kv_tokens, page_size=page_size, dtype=dtype,
                                            kv_lora_rank=shape.kv_lora_rank,
                                            qk_rope_head_dim=shape.qk_rope_head_dim, layer_num=shape.num_layers,
                                            device=device, enable_memory_saver=False)
        else:
            self.kv_pool = MHATokenToKVPool(size=kv_tokens, page_size=page_size, dtype=dtype,
                                            head_num=shape.kv_heads, head_dim=shape.head_dim,
                                            layer_num=shape.num_layers, device=device, enable_memory_saver=False)
        self.allocator = PagedTokenToKVPoolAllocator(size=kv_tokens, page_size=page_size, dtype=dtype,
                                                     device=device, kvcache=self.kv_pool, need_sort=False)
        self.req_to_token_pool = ReqToTokenPool(size=max_reqs, max_context_len=max_context, device=device,
                                                enable_memory_saver=False)
        params = CacheInitParams(disable=mode == "recompute", req_to_token_pool=self.req_to_token_pool,
                                 token_to_kv_pool_allocator=self.allocator, page_size=page_size)
        if mode.startswith("kvtier"):
            config = TierConfig(cpu_cache_gb=cpu_cache_gb, page_size=page_size, host_layout=host_layout,
                                transfer_mode=transfer_mode, layerwise=mode == "kvtier_layerwise",
                                tokens_per_block=tokens_per_block)
            self.cache = InjectedCache(params, config, pool=host_pool, executor=executor,
                                       counter_backend=counter_backend)
        else:
            self.cache = RadixCache(params)
        self.free_slots_at_start = self.allocator.available_size()
        self._rid = 0

    @property
    def tier(self):
        """The kvtier host tier (None outside the kvtier modes)."""
        return getattr(self.cache, "tier", None)

    def set_layerwise(self, enabled: bool) -> None:
        """kvtier modes: load host hits layer by layer or whole from the next request on (the mode's name follows)."""
        self.cache.set_layerwise(enabled)
        self.mode = "kvtier_layerwise" if enabled else "kvtier_whole"

    @property
    def host_pool(self):
        return self.tier.pool if self.tier is not None else None

    # --- serving ---

    def serve(self, tokens, max_new_tokens: int, *, keep_logits: bool = False) -> Served:
        """Serve one request end to end (see the module docstring) and return what happened."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        cache = self.cache
        self._sync()
        t0 = time.perf_counter()
        req = self._new_request(tokens, max_new_tokens)
        req.init_next_round_input(cache)  # match_prefix: device match + host hit
        device_len, host_hit, loaded = req.prefix_len, req.host_hit_length, 0
        if req.host_hit_length > 0:
            with _locked(cache, req.last_node):
                loaded, req.last_node = cache.init_load_back(InitLoadBackParams(
                    best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
            req.prefix_len += loaded
            req.kv.cache_protected_len = req.prefix_len
        req.lock = cache.lock(req.last_node)

        n, pre = len(tokens), req.prefix_len
        prefix = cache.path_device_indices(req.last_node)[:pre].to(torch.int64) if pre else None
        self._tail = torch.empty(0, dtype=torch.int64, device=self.model.device)
        new = self._take_slots(n - pre)
        row = new if prefix is None else torch.cat((prefix.to(new.device), new))
        self.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, n)), row.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = req.extend_end = n
        toks = torch.tensor(list(tokens[pre:]), dtype=torch.int64, device=self.model.device)
        kept = []

        def step(logits: torch.Tensor) -> int:
            if keep_logits:
                kept.append(logits.cpu())
            return greedy(logits)

        out = [step(self.model.forward(self.kv_pool, toks, pre, new, row))]
        ttft = time.perf_counter() - t0

        for pos in range(n, n + max_new_tokens - 1):  # decode: the last output token's KV is never computed
            slot = self._take_slots(1)
            row = torch.cat((row, slot))
            self.req_to_token_pool.write((req.kv.req_pool_idx, pos), slot.to(torch.int32))
            req.kv.kv_committed_len = req.kv.kv_allocated_len = pos + 1
            last = torch.tensor([out[-1]], dtype=torch.int64, device=self.model.device)
            req.output_ids.append(out[-1])
            out.append(step(self.model.forward(self.kv_pool, last, pos, slot, row)))
        req.output_ids.append(out[-1])
        release_kv_cache(req, cache, checkpoint=True)
        if self.tier is not None:
            cache.check_hicache_events()
        return Served(out, ttft, n, device_len, host_hit, loaded, n - pre, time.perf_counter() - t0,
                      kept if keep_logits else None)

    def _new_request(self, tokens, max_new_tokens: int) -> Req:
        self._rid += 1
        req = Req(rid=f"{self.mode}-{self._rid}", origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=max_new_tokens))
        if self.req_to_token_pool.alloc([req]) is None:
            raise RuntimeError("no free req_to_token row")
        req.kv.cache_protected_len = 0
        return req

    def _take_slots(self, n: int) -> torch.Tensor:
        """``n`` slots for consecutive positions: the rest of the current last page, then whole new pages."""
        P = self.page_size
        take = self._tail[:n]
        self._tail = self._tail[take.numel():]
        need = n - take.numel()
        if need <= 0:
            return take
        pages = -(-need // P) * P
        if self.allocator.available_size() < pages:
            self.cache.evict(EvictParams(num_tokens=pages - self.allocator.available_size()))
        got = self.allocator.alloc(pages)
        if got is None:
            raise RuntimeError(f"the device KV pool is out of room for {pages} tokens after evicting "
                               f"(kv_tokens={self.free_slots_at_start}): give the server more")
        got = got.to(torch.int64)
        self._tail = got[need:]  # owned through the page's first slots (freed whole with them)
        return torch.cat((take, got[:need]))

    # --- cache control ---

    def flush_device(self) -> None:
        """Drop every device-cached page (kvtier's host copies stay): wait for stores, then evict the whole tree."""
        if self.tier is not None:
            self.cache.wait_all()
        self.cache.evict(EvictParams(num_tokens=1 << 62))

    def leaked_slots(self) -> int:
        """Device slots neither free nor in the tree after a flush (0 when nothing leaked)."""
        self.flush_device()
        return self.free_slots_at_start - self.allocator.available_size()

    def close(self) -> None:
        """Wait for kvtier's copies and drop the pools (a shared host pool is reset, not released)."""
        if self.tier is not None:
            self.cache.wait_all()
            self.tier.reset()
        self.kv_pool = self.allocator = self.req_to_token_pool = self.cache = None  # type: ignore[assignment]  # closed

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)


class _locked:
    """``with _locked(cache, node)``: the node locked for the block (the scheduler's temporary pin)."""

    def __init__(self, cache, node) -> None:
        self.cache, self.node, self.lock = cache, node, None

    def __enter__(self):
        self.lock = self.cache.lock(self.node)
        return self.lock

    def __exit__(self, *exc) -> None:
        self.cache.unlock(self.lock)

