"""Builders for the SGLang backend tests: real sglang 0.5.23 pools, allocator, Req (on CPU by default, or on a CUDA
device: ``build(device="cuda")``); a driver that runs the scheduler's sequence (match_prefix -> init_load_back ->
forward writes KV -> checkpoint/release)."""

from __future__ import annotations

import dataclasses
import os
from array import array
from typing import Callable, Optional

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
from kvtier.sglang.serving import InjectedCache


@dataclasses.dataclass
class Setup:
    cache: KVTierRadixCache
    allocator: PagedTokenToKVPoolAllocator
    req_to_token_pool: ReqToTokenPool
    kv_pool: object
    page_size: int
    mla: bool
    device: torch.device
    start_layer: int = 0  # a pipeline stage's first layer: the pool holds layers start_layer.. (KV values use it)


def build(*, mla: bool = False, page_size: int = 4, kv_size: int = 64, layers: int = 2, host_blocks_kb: float = 64,
          layerwise: bool = False, max_reqs: int = 8, max_context: int = 64, device="cpu",
          transfer_mode: Optional[str] = None, tokens_per_block: Optional[int] = None, ssd_dir: Optional[str] = None,
          remote_master: Optional[str] = None, kv_events: bool = False, start_layer: int = 0,
          **cache_kw) -> Setup:
    """Real sglang pools, allocator and req-to-token pool on ``device`` ("cpu", "cuda", "cuda:1", ...) and a
    KVTierRadixCache over them (pinned host pool and CUDA streams when the device is CUDA). Host blocks of
    ``tokens_per_block`` tokens (default: one engine page; 0: the config's default for the page size). With
    ``ssd_dir``, an SSD tier of 1 MiB there (every hit admitted); with ``remote_master``, a remote tier on that
    Mooncake master (a 64 MiB segment, every hit admitted). ``start_layer``: a pipeline stage's pool, holding
    ``layers`` layers from that one."""
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float16
    if mla:
        kv_pool = MLATokenToKVPool(size=kv_size, page_size=page_size, dtype=dtype, kv_lora_rank=8, qk_rope_head_dim=8,
                                   layer_num=layers, device=str(dev), enable_memory_saver=False,
                                   start_layer=start_layer)
    else:
        kv_pool = MHATokenToKVPool(size=kv_size, page_size=page_size, dtype=dtype, head_num=2, head_dim=8,
                                   layer_num=layers, device=str(dev), enable_memory_saver=False,
                                   start_layer=start_layer)
    allocator = PagedTokenToKVPoolAllocator(size=kv_size, page_size=page_size, dtype=dtype, device=str(dev),
                                            kvcache=kv_pool, need_sort=False)
    r2t = ReqToTokenPool(size=max_reqs, max_context_len=max_context, device=str(dev), enable_memory_saver=False)
    params = CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=allocator,
                             page_size=page_size, enable_kv_cache_events=kv_events)
    extra = {} if transfer_mode is None else {"transfer_mode": transfer_mode}
    extra["tokens_per_block"] = page_size if tokens_per_block is None else tokens_per_block or None
    if ssd_dir is not None:
        extra.update(ssd_cache_gb=1 / 1024, ssd_cache_dir=ssd_dir, ssd_admission="always")
        cache_kw.setdefault("model_identity", {"model": "sglang-helpers", "mla": mla})
    if remote_master is not None:
        extra.update(remote_backend="mooncake", remote_master=remote_master, remote_local_hostname="127.0.0.1",
                     remote_segment_gb=1 / 16, remote_admission="always", remote_timeout_s=2.0)
        cache_kw.setdefault("model_identity", {"model": "sglang-helpers", "mla": mla})
    config = TierConfig(cpu_cache_gb=host_blocks_kb / (1 << 20), page_size=page_size, layerwise=layerwise, **extra)
    injected = {"executor", "counter_backend", "pool"} & cache_kw.keys()  # a test's: InjectedCache passes them on
    cache = (InjectedCache if injected else KVTierRadixCache)(params, config, **cache_kw)
    return Setup(cache, allocator, r2t, kv_pool, page_size, mla, dev, start_layer)


def kv_value(token: int, pos: int, layer: int, ns_tag: int, kind: int) -> float:
    """The KV a fake forward writes for one token: a function of what a real forward depends on (small ints, exact in
    fp16)."""
    return float((token * 31 + pos * 7 + layer * 3 + ns_tag * 11 + kind * 5) % 1021)


def layer_buffers(s: Setup, *, via_pool: bool = False) -> list[list[torch.Tensor]]:
    """Per layer, the K and V buffers (MHA) or the latent buffer (MLA). ``via_pool``: read them through the pool's
    ``get_key_buffer`` / ``get_value_buffer``, as attention does, so a layerwise load's per-layer wait runs."""
    if via_pool:
        layers = range(s.start_layer, s.start_layer + s.kv_pool.layer_num)  # the pool's getters take global ids
        if s.mla:
            return [[s.kv_pool.get_key_buffer(layer)] for layer in layers]
        return [[s.kv_pool.get_key_buffer(layer), s.kv_pool.get_value_buffer(layer)] for layer in layers]
    if s.mla:
        return [[b] for b in s.kv_pool.kv_buffer]
    return [[k, v] for k, v in zip(s.kv_pool.k_buffer, s.kv_pool.v_buffer)]


def kv_values(tokens, start: int, n: int, layer: int, ns_tag: int, kind: int) -> torch.Tensor:
    """:func:`kv_value` of ``tokens[start:start+n]`` at positions ``start..``, as a float64 CPU tensor."""
    tok = torch.tensor([int(t) for t in tokens[start:start + n]], dtype=torch.int64)
    pos = torch.arange(start, start + n, dtype=torch.int64)
    return ((tok * 31 + pos * 7 + layer * 3 + ns_tag * 11 + kind * 5) % 1021).to(torch.float64)


def _as_rows(vals: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    return vals.to(device=buf.device, dtype=buf.dtype).view(-1, *([1] * (buf.dim() - 1)))


def kv_writer(s: Setup, slots: torch.Tensor, tokens, start: int, ns_tag: int) -> Callable[[], None]:
    """The fake forward's KV of ``tokens[start:start+len(slots)]``, prepared on the pool's device now; the returned
    call writes it into ``slots`` on the current stream with device work only (no host copy that would make the
    host wait for that stream)."""
    if len(slots) == 0:
        return lambda: None
    idx = slots.to(device=s.device, dtype=torch.int64)
    writes = [(buf, _as_rows(kv_values(tokens, start, len(slots), s.start_layer + layer, ns_tag, kind), buf))
              for layer, bufs in enumerate(layer_buffers(s)) for kind, buf in enumerate(bufs)]

    def write() -> None:
        for buf, rows in writes:
            buf[idx] = rows
    return write


def write_kv(s: Setup, slots: torch.Tensor, tokens, start: int, ns_tag: int) -> None:
    """Fake forward: write the KV of ``tokens[start:start+len(slots)]`` into ``slots`` (on the current stream)."""
    kv_writer(s, slots, tokens, start, ns_tag)()


def check_kv(s: Setup, slots: torch.Tensor, tokens, start: int, ns_tag: int, *, via_pool: bool = False) -> None:
    """Assert every element of every slot's KV (all layers, K and V) equals what the fake forward wrote for its
    token (read on the current stream; ``via_pool``: through the pool's per-layer getters)."""
    if len(slots) == 0:
        return
    idx = slots.to(device=s.device, dtype=torch.int64)
    for layer, bufs in enumerate(layer_buffers(s, via_pool=via_pool), start=s.start_layer):
        for kind, buf in enumerate(bufs):
            want = _as_rows(kv_values(tokens, start, len(slots), layer, ns_tag, kind), buf)
            got = buf[idx]
            bad = (got != want).reshape(len(slots), -1).any(dim=1)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise AssertionError(
                    f"KV mismatch at token {start + i} (slot {int(idx[i])}) layer {layer} kind {kind}: "
                    f"{got[i].flatten()[:4].tolist()} != {float(want[i].flatten()[0])} "
                    f"({int(bad.sum())} of {len(slots)} tokens wrong)")


def kv_digest(s: Setup, slots: torch.Tensor) -> list[float]:
    """Per layer and K/V, the float64 sum of the slots' KV: equal across TP ranks that hold the same pages."""
    idx = slots.to(device=s.device, dtype=torch.int64)
    return [float(buf[idx].double().sum()) for bufs in layer_buffers(s) for buf in bufs]


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
    new = s.allocator.alloc(aligned) if aligned else torch.empty(0, dtype=torch.int64, device=s.device)
    if new is None:
        return None
    new = new[:need]  # a partial last page stays owned through its first slots (freed whole by free_segment)
    row = torch.cat((prefix.to(device=s.device, dtype=torch.int32), new.to(device=s.device, dtype=torch.int32)))
    s.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, n)), row)
    req.kv.kv_committed_len = n
    req.kv.kv_allocated_len = n
    req.extend_end = n
    write_kv(s, new, tokens, pre, ns_tag)
    return new


def admit_checked(s: Setup, tokens, *, extra_key=None, ns_tag: int = 0) -> tuple[Optional[Req], Admitted]:
    """Admit a request (state machines): check what match_prefix and init_load_back report and, after the copies
    complete, the prefix's KV; run the forward. The request is None when there is no room for it (not admitted,
    as the scheduler would not)."""
    req = make_req(s, tokens, extra_key=extra_key)
    a = admit(s, req)
    assert a.host_hit % s.page_size == 0 and a.loaded in (0, a.host_hit)
    assert req.prefix_len == a.device_len + a.loaded
    if req.prefix_len:
        s.cache.wait_all()
        check_kv(s, s.cache.path_device_indices(req.last_node)[:req.prefix_len], tokens, 0, ns_tag)
    if run_forward(s, req, ns_tag) is None:
        s.cache.unlock(req.lock)
        req.lock = None
        s.req_to_token_pool.free(req)
        return None, a
    return req, a


def release(s: Setup, req: Req, *, checkpoint: bool = True) -> None:
    """Finish (or abort, ``checkpoint=False``) the request through SGLang's own release path."""
    release_kv_cache(req, s.cache, checkpoint=checkpoint)


def flush_device(s: Setup) -> None:
    """Evict every unlocked device page (what kvtier holds stays on the host)."""
    s.cache.wait_all()
    s.cache.evict(EvictParams(num_tokens=10**9))


def assert_clean(s: Setup, free0: int) -> None:
    """Nothing in flight, no lock held, and every slot back in the allocator once the device tree is flushed."""
    s.cache.wait_all()
    assert s.cache.num_inflight == 0
    assert s.cache.protected_size() == 0
    flush_device(s)
    assert s.cache.total_size() == 0
    assert s.allocator.available_size() == free0


def serve(s: Setup, tokens, *, ns_tag: int = 0, extra_key=None, cache_salt=None, check: bool = True,
          host_wait: bool = True) -> Admitted:
    """One request end to end: admit, check the prefix KV, forward, release with checkpoint.

    ``host_wait=False`` checks the prefix without first blocking the host on the load: the read is ordered after it
    only through the stream wait (whole loads) or the pool's per-layer counter wait (layerwise loads), as in a real
    forward pass."""
    req = make_req(s, tokens, extra_key=extra_key, cache_salt=cache_salt)
    a = admit(s, req)
    if check and req.prefix_len:
        if host_wait:
            s.cache.wait_all()
        check_kv(s, s.cache.path_device_indices(req.last_node)[:req.prefix_len], tokens, 0, ns_tag,
                 via_pool=not host_wait)
    assert run_forward(s, req, ns_tag) is not None
    release(s, req)
    return a


def tree_digest(s: Setup) -> list:
    """The device tree as every TP rank must hold it: sizes, then each node's (depth, key length, lock count), and
    the host tier's page count."""
    cache = s.cache
    nodes, stack = [], [(cache.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        for child in node.children.values():
            nodes.append((depth + 1, len(child.key), child.lock_ref, child.evicted))
            stack.append((child, depth + 1))
    return [cache.total_size(), cache.evictable_size(), cache.protected_size(), sorted(nodes),
            cache.tier.index.total_pages]


def tp_skew_worker(rank: int, world: int, init_file: str, out_dir: str, device: str = "cpu",
                   page_size: int = 4, tp: Optional[int] = None, pp: int = 1, mla: bool = False,
                   no_shm_stage: int = -1) -> None:
    """One rank (torch.multiprocessing.spawn target) whose copies complete at other moments than the others':
    rank 0's finish at once, the last rank's only later. After each scheduling round (flush_pending_backups) and
    eviction every rank must hold the same tree. Writes ``rank<r>.json`` (the digests, the host hit, what was
    loaded, the KV check, no leak, the shared pool's inode, or the error); the parent compares them.
    ``device="cuda"``: rank r on cuda:r, or every rank on cuda:0 when there is one GPU. The ranks are ``tp`` TP
    ranks (default: all) of ``pp`` pipeline stages (:class:`tests.tp_ranks.Topology`), MHA or MLA pools.
    ``no_shm_stage``: the pipeline stage whose ranks cannot create a shared segment (a full /dev/shm)."""
    import json
    import traceback

    import torch.distributed as dist

    from kvtier.tier.executor import DeferredExecutor
    from tests.tp_ranks import Topology, _agreement

    seen = {"rank": rank, "device": device, "digests": []}
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # tests talk over loopback only
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    s = None
    try:
        topo = Topology(tp=tp or world // pp, pp=pp, mla=mla)
        start, layers = topo.stage_layers(topo.coords(rank)[0])
        if topo.coords(rank)[0] == no_shm_stage:
            from kvtier.tier import shared_memory
            made = shared_memory.SharedSegment.__init__

            def full_shm(self, name, nbytes, *, create):
                if create:
                    raise OSError(28, "No space left on device (injected)", name)
                made(self, name, nbytes, create=create)
            shared_memory.SharedSegment.__init__ = full_shm
        if device.startswith("cuda"):
            gpu = rank % torch.cuda.device_count()
            torch.cuda.set_device(gpu)
            device = f"cuda:{gpu}"
        ex = DeferredExecutor() if device == "cpu" else None
        s = build(kv_size=16 * page_size, page_size=page_size, device=device, agreement=_agreement(topo, rank),
                  executor=ex, mla=mla, layers=layers, start_layer=start)
        shared = s.cache.shared
        seen["shared_inode"] = list(shared.segment.inode()) if shared is not None else None
        free0 = s.allocator.available_size()
        P = page_size
        late = rank == world - 1
        if ex is None and late:  # CUDA: the last rank's copies start 50 ms late on its copy streams
            executor = s.cache.tier.executor
            begin = executor.begin

            def late_begin(name: str) -> None:
                begin(name)
                with torch.cuda.stream(executor.stream(name)):
                    torch.cuda._sleep(100_000_000)

            executor.begin = late_begin

        def skewed_round(first_rank_done: bool) -> None:
            if ex is not None and (not late) == first_rank_done:
                ex.release_all()
            s.cache.flush_pending_backups()  # the round's agreement
            s.cache.evict(EvictParams(num_tokens=10**6))
            seen["digests"].append(tree_digest(s))

        toks = list(range(3, 3 + 3 * P + 1))
        serve(s, toks, check=False)  # its store is in flight on both ranks
        skewed_round(True)  # done on rank 0 only: nothing may be released anywhere
        skewed_round(False)  # now on rank 1 too: released, evicted on both
        req = make_req(s, toks)
        a = admit(s, req)  # a host hit: the load is in flight
        seen.update(host_hit=a.host_hit, loaded=a.loaded)
        skewed_round(True)
        skewed_round(False)
        s.cache.wait_all()
        slots = s.cache.path_device_indices(req.last_node)[:req.prefix_len]
        try:
            check_kv(s, slots, toks, 0, 0)
            seen["kv_ok"] = True
        except AssertionError as e:
            seen.update(kv_ok=False, kv_error=str(e))
        assert run_forward(s, req) is not None
        release(s, req)
        skewed_round(True)
        skewed_round(False)
        s.cache.wait_all()
        flush_device(s)
        seen["no_leak"] = s.allocator.available_size() == free0 and s.cache.protected_size() == 0
    except BaseException:
        seen["error"] = traceback.format_exc()
        raise
    finally:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(seen, f, indent=1)
        if s is not None:
            s.cache.release_host_resources()  # lets the next stage receive what this one sent before the group goes
        dist.destroy_process_group()
