"""Builders for the SGLang backend tests: real sglang 0.5.23 pools, allocator, Req, on CPU; a driver that runs the
scheduler's sequence (match_prefix -> init_load_back -> forward writes KV -> checkpoint/release)."""

from __future__ import annotations

import dataclasses
from array import array
from typing import Optional

import torch

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from kvtier.config import TierConfig
from kvtier.sglang.radix_cache import KVTierRadixCache


@dataclasses.dataclass
class Setup:
    cache: KVTierRadixCache
    allocator: PagedTokenToKVPoolAllocator
    req_to_token_pool: ReqToTokenPool
    kv_pool: object
    page_size: int
    mla: bool


def build(*, mla: bool = False, page_size: int = 4, kv_size: int = 64, layers: int = 2, host_blocks_kb: float = 64,
          layerwise: bool = False, max_reqs: int = 8, max_context: int = 64, **cache_kw) -> Setup:
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
    dtype = torch.float16
    if mla:
        kv_pool = MLATokenToKVPool(size=kv_size, page_size=page_size, dtype=dtype, kv_lora_rank=8, qk_rope_head_dim=8,
                                   layer_num=layers, device="cpu", enable_memory_saver=False)
    else:
        kv_pool = MHATokenToKVPool(size=kv_size, page_size=page_size, dtype=dtype, head_num=2, head_dim=8,
                                   layer_num=layers, device="cpu", enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(size=kv_size, page_size=page_size, dtype=dtype, device="cpu",
                                            kvcache=kv_pool, need_sort=False)
    r2t = ReqToTokenPool(size=max_reqs, max_context_len=max_context, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=allocator,
                             page_size=page_size)
    config = TierConfig(cpu_cache_gb=host_blocks_kb / (1 << 20), page_size=page_size, layerwise=layerwise)
    cache = KVTierRadixCache(params, config, **cache_kw)
    return Setup(cache, allocator, r2t, kv_pool, page_size, mla)


def kv_value(token: int, pos: int, layer: int, ns_tag: int, kind: int) -> float:
    """The KV a fake forward writes for one token: a function of what a real forward depends on (small ints, exact in
    fp16)."""
    return float((token * 31 + pos * 7 + layer * 3 + ns_tag * 11 + kind * 5) % 1021)


def layer_buffers(s: Setup) -> list[list[torch.Tensor]]:
    if s.mla:
        return [[b] for b in s.kv_pool.kv_buffer]
    return [[k, v] for k, v in zip(s.kv_pool.k_buffer, s.kv_pool.v_buffer)]


def write_kv(s: Setup, slots: torch.Tensor, tokens, start: int, ns_tag: int) -> None:
    """Fake forward: write the KV of ``tokens[start:start+len(slots)]`` into ``slots``."""
    for layer, bufs in enumerate(layer_buffers(s)):
        for kind, buf in enumerate(bufs):
            for i, slot in enumerate(slots.tolist()):
                pos = start + i
                buf[slot].fill_(kv_value(int(tokens[pos]), pos, layer, ns_tag, kind))


def check_kv(s: Setup, slots: torch.Tensor, tokens, start: int, ns_tag: int) -> None:
    for layer, bufs in enumerate(layer_buffers(s)):
        for kind, buf in enumerate(bufs):
            for i, slot in enumerate(slots.tolist()):
                pos = start + i
                want = kv_value(int(tokens[pos]), pos, layer, ns_tag, kind)
                got = buf[slot]
                assert torch.all(got == want), (f"KV mismatch at token {pos} (slot {slot}) layer {layer} kind {kind}: "
                                                f"{got.flatten()[:4].tolist()} != {want}")


_RID = [0]


def make_req(s: Setup, tokens, *, extra_key: Optional[str] = None, cache_salt: Optional[str] = None) -> Req:
    _RID[0] += 1
    req = Req(rid=f"r{_RID[0]}", origin_input_text="", origin_input_ids=array("q", tokens),
              sampling_params=SamplingParams(temperature=0, max_new_tokens=1), extra_key=extra_key,
              cache_salt=cache_salt)
    s.req_to_token_pool.alloc([req])
    req.full_untruncated_fill_ids = array("q", tokens)
    req.kv.cache_protected_len = 0
    req.lock = None
    return req


@dataclasses.dataclass
class Admitted:
    req: Req
    device_len: int  # matched on device
    host_hit: int  # reported by match_prefix
    loaded: int  # returned by init_load_back


def admit(s: Setup, req: Req) -> Admitted:
    """The scheduler's admission: match_prefix, init_load_back under a temporary lock, lock the prefix."""
    cache = s.cache
    tokens = req.full_untruncated_fill_ids
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), req.extra_key,
                                                          cache_salt=req.cache_salt), req=req))
    req.prefix_len = m.device_prefix_len
    req.last_node, req.best_match_node, req.host_hit_length = m.last_device_node, m.best_match_node, m.host_hit_length
    loaded = 0
    if req.host_hit_length > 0:
        tmp = cache.lock(req.last_node)
        try:
            loaded, node = cache.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node,
                                                                   host_hit_length=req.host_hit_length, req=req))
        finally:
            cache.unlock(tmp)
        req.last_node = node
        req.prefix_len += loaded
    req.kv.cache_protected_len = req.prefix_len  # as Req.init_next_round_input does for the device prefix
    req.lock = cache.lock(req.last_node)
    return Admitted(req, m.device_prefix_len, m.host_hit_length, loaded)


def run_forward(s: Setup, req: Req, ns_tag: int = 0) -> Optional[torch.Tensor]:
    """Bind the prefix to the request's row, allocate the rest, write its KV (the fake forward). Returns the new
    slots, or None when the allocator is out of room (after evicting)."""
    cache, P = s.cache, s.page_size
    tokens = req.full_untruncated_fill_ids
    n, pre = len(tokens), req.prefix_len
    prefix = cache.path_device_indices(req.last_node)[:pre]
    need = n - pre
    aligned = -(-need // P) * P
    if s.allocator.available_size() < aligned:
        cache.evict(EvictParams(num_tokens=aligned))
    new = s.allocator.alloc(aligned) if aligned else torch.empty(0, dtype=torch.int64)
    if new is None:
        return None
    new = new[:need]  # a partial last page stays owned through its first slots (freed whole by free_segment)
    s.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, n)), torch.cat((prefix.to(torch.int32),
                                                                             new.to(torch.int32))))
    req.kv.kv_committed_len = n
    req.kv.kv_allocated_len = n
    req.extend_end = n
    write_kv(s, new, tokens, pre, ns_tag)
    return new


def release(s: Setup, req: Req, *, checkpoint: bool = True) -> None:
    """Finish (or abort, ``checkpoint=False``) the request through SGLang's own release path."""
    release_kv_cache(req, s.cache, checkpoint=checkpoint)


def flush_device(s: Setup) -> None:
    """Evict every unlocked device page (what kvtier holds stays on the host)."""
    s.cache.wait_all()
    s.cache.evict(EvictParams(num_tokens=10**9))


def serve(s: Setup, tokens, *, ns_tag: int = 0, extra_key=None, cache_salt=None, check: bool = True) -> Admitted:
    """One request end to end: admit, check the prefix KV, forward, release with checkpoint."""
    req = make_req(s, tokens, extra_key=extra_key, cache_salt=cache_salt)
    a = admit(s, req)
    if check and req.prefix_len:
        s.cache.wait_all()
        check_kv(s, s.cache.path_device_indices(req.last_node)[:req.prefix_len], tokens, 0, ns_tag)
    assert run_forward(s, req, ns_tag) is not None
    release(s, req)
    return a


def tp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One TP rank (torch.multiprocessing.spawn target): both ranks store 3 pages, rank 1's host then drops its last
    page, and both must agree on a 2-page host hit and load it. Writes ``rank<r>.txt`` with what it saw."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        s = build(kv_size=32, tp_group=dist.group.WORLD)
        free0 = s.allocator.available_size()
        toks = list(range(3, 15))  # 3 pages
        serve(s, toks)
        flush_device(s)
        if rank == 1:
            assert s.cache.tier.evict(1) == 1
        a = serve(s, toks)
        s.cache.wait_all()
        flush_device(s)
        with open(f"{out_dir}/rank{rank}.txt", "w") as f:
            f.write(f"{a.host_hit} {a.loaded} {int(s.allocator.available_size() == free0)}")
    finally:
        dist.destroy_process_group()
