"""Transfer benchmark on one GPU: kvtier direct and staged vs SGLang's HiCache kernel, torch and the copy engine.

One process, one run, CUDA events, warm-up first, medians over repeated timings. Writes a JSON (with a ``summary``)
and a PNG. Sections (``--sections``, default all):

* ``sweep``   direct kernel: programs x warps x tile bytes, per-layer 64 MiB, Qwen3-8B, page 16
* ``sizes``   GB/s vs bytes per layer, every method, geometries x page sizes x layouts
* ``gemm``    an 8192^3 bf16 GEMM alone and with a full-speed H2D alongside (kvtier, HiCache)
* ``bidir``   a store and a load at once (staged; direct for reference)
* ``staged_sweep`` staging buffer size x count on the bidir workload
* ``latency`` one 16-token page x 36 layers through the all-layer call

Run on the GPU machine: ``python bench/bench_transfer.py --out $OUT/transfer_h200.json`` (needs sglang 0.5.23
importable for the HiCache peer; see shared/probe/README.md; without it the peer is skipped and recorded so).
``--pool-hicache`` (any machine) pools the ``hicache`` rounds of every committed result instead (see
:func:`pool_hicache`).
"""

from __future__ import annotations

import argparse
import glob
import importlib.abc
import importlib.machinery
import math
import os
import statistics
import sys
import traceback
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (ROOT, env_info, gbps, gemm_beside, host_us_per_call, make_pool, png_beside,  # noqa: E402
                          pyplot, random_slots, read_json, save_png, time_gpu_ms, write_json)
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import StagedTransfer, Tuning, copy_pages_ref, load_pages, store_pages  # noqa: E402

TUNED = Tuning()  # the kernels' defaults

MiB = 1 << 20
GEOMETRIES = {  # name -> (heads, head_dim, dtype, is_mla)
    "qwen3_8b": (8, 128, torch.bfloat16, False),
    "tp_1x128": (1, 128, torch.bfloat16, False),
    "mla_bf16": (1, 576, torch.bfloat16, True),
    "mla_fp8": (1, 576, torch.uint8, True),
}
PAGES = (1, 16, 64)
PROGRAMS = (1, 2, 4, 8, 16)
REPS = 20
GEMM_METHODS = ["kvtier_direct_default", "kvtier_staged_contig", "sglang_hicache"]
GEMM_EXTRA: list = []  # direct configs (see _parse_variant) to put beside the GEMM too; set by --gemm-configs


# --- peers ---

_STUB = {"IPython", "jedi", "httpx2", "httpcore2", "truststore", "decorator", "pexpect", "prompt_toolkit",
         "stack_data", "matplotlib_inline"}


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stub heavy optional imports of sglang that the kernel module never uses (as in shared/probe)."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in _STUB:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = mock.MagicMock()
        m.__name__, m.__path__, m.__spec__ = spec.name, [], spec
        return m

    def exec_module(self, m):
        pass


def load_hicache():
    """SGLang 0.5.23's HiCache transfer ops, or (None, reason)."""
    sys.meta_path.append(_StubFinder())
    try:
        from sglang.kernels.ops.kvcache import hicache
        return hicache, None
    except Exception as e:  # recorded in the JSON
        return None, repr(e)[:500]


class Setup:
    """A device pool, pinned host memory and indices for one (geometry, page size, layout)."""

    def __init__(self, name: str, num_layers: int, page: int, num_slots: int, host_tokens: int,
                 host_bytes: torch.Tensor):
        heads, hd, dt, mla = GEOMETRIES[name]
        self.geo = KVGeometry(num_layers, heads, hd, dt, page_size=page, is_mla=mla)
        self.kv = make_pool(self.geo, num_slots)
        self.num_blocks = host_tokens // page
        self.host_bytes = host_bytes
        self.num_slots = num_slots

    def host(self, layout: str) -> torch.Tensor:
        shape = self.geo.host_shape(self.num_blocks, layout)
        n = self.geo.block_bytes * self.num_blocks
        return self.host_bytes[:n].view(self.geo.dtype).view(shape)


def method_fns(s: Setup, tokens: int, layout: str, to_host: bool, hicache, gen: torch.Generator) -> dict:
    """name -> (fn, bytes) moving ``tokens`` tokens of layer 0 in one direction."""
    geo, kv = s.geo, s.kv
    pages = tokens // geo.page_size
    slots = random_slots(pages, geo.page_size, s.num_slots, generator=gen)
    blocks = torch.randperm(s.num_blocks, generator=torch.Generator().manual_seed(pages))[:pages].to(torch.int64)
    blocks_dev = blocks.cuda()
    host = s.host(layout)
    nbytes = tokens * geo.row_bytes * geo.kv_count
    op = store_pages if to_host else load_pages
    fns = {}
    for p in PROGRAMS:
        fns[f"kvtier_direct_p{p}"] = (lambda p=p: op(kv, host, slots, blocks_dev, layout=layout, layers=0,
                                                     num_programs=p, check=False), nbytes)
    staged = StagedTransfer(kv, host, layout=layout)
    sop = staged.store if to_host else staged.load
    contig = torch.arange(pages, dtype=torch.int64)
    fns["kvtier_staged_contig"] = (lambda: sop(slots, contig, layers=0, check=False), nbytes)
    if pages <= 1024:  # random blocks: one copy per block; host-bound beyond
        fns["kvtier_staged_random"] = (lambda: sop(slots, blocks, layers=0, check=False), nbytes)
    # torch: gather into a device buffer, one copy to pinned host (and the reverse), layer 0's buffers
    bufs = kv.layer_buffers(0)
    flat_host = torch.empty((len(bufs), tokens, geo.num_kv_heads, geo.head_dim), dtype=geo.dtype,
                            pin_memory=True)
    stage = torch.empty_like(flat_host, device="cuda")
    if to_host:
        def torch_gather_copy():
            for i, b in enumerate(bufs):
                torch.index_select(b, 0, slots, out=stage[i])
            flat_host.copy_(stage, non_blocking=True)
    else:
        def torch_gather_copy():
            stage.copy_(flat_host, non_blocking=True)
            for i, b in enumerate(bufs):
                b.index_copy_(0, slots, stage[i])
    fns["torch_gather_copy"] = (torch_gather_copy, nbytes)
    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_flat = flat_host.view(-1).view(torch.uint8)
    fns["copy_engine_contiguous"] = ((lambda: host_flat.copy_(dev_flat, non_blocking=True)) if to_host else
                                     (lambda: dev_flat.copy_(host_flat, non_blocking=True)), nbytes)
    if hicache is not None and not geo.is_mla and layout == "layer_first":
        fns["sglang_hicache"] = (hicache_fn(hicache, s, host, slots, blocks, to_host), nbytes)
    return fns


def hicache_fn(hicache, s: Setup, host: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor, to_host: bool):
    """SGLang's HiCache kernel (its default block quota) moving layer 0 of the same pages between the same device
    slots and the same host bytes as kvtier: layer 0 of kvtier's ``layer_first`` host tensor is a flat array of
    token rows, a block's page of K then its page of V; HiCache's host K buffer is that array, its V buffer the same
    array a page further on, and its host indices the K rows of ``blocks``' tokens."""
    geo = s.geo
    rows = host[0].reshape(-1, geo.num_kv_heads, geo.head_dim)
    hk, hv = rows[:-geo.page_size], rows[geo.page_size:]  # as many rows each (HiCache checks the shapes)
    host_idx = (blocks.cuda()[:, None] * (geo.kv_count * geo.page_size)
                + torch.arange(geo.page_size, device="cuda")).reshape(-1)
    k, v = s.kv.layer_buffers(0)
    el = geo.num_kv_heads * geo.head_dim
    if to_host:
        return lambda: hicache.transfer_hicache_one_layer(hk, hv, host_idx, k, v, slots, element_dim=el,
                                                          page_size=geo.page_size)
    return lambda: hicache.transfer_hicache_one_layer(k, v, slots, hk, hv, host_idx, element_dim=el,
                                                      page_size=geo.page_size)


def check_direct(s: Setup, layout: str, gen: torch.Generator) -> bool:
    """Byte-exact round trip of the direct and staged paths on this setup (all layers, both directions)."""
    geo, kv = s.geo, s.kv
    pages = min(64, s.num_blocks // 2)
    slots = random_slots(2 * pages, geo.page_size, s.num_slots, generator=gen)
    src, dst = slots[:pages * geo.page_size], slots[pages * geo.page_size:]
    blocks = torch.randperm(s.num_blocks)[:pages]
    host = s.host(layout)
    ok = True
    staged = lambda: StagedTransfer(kv, host, layout=layout)  # noqa: E731  (a fresh one each call, as before)
    paths = ((lambda: store_pages(kv, host, src, blocks, layout=layout),
              lambda: load_pages(kv, host, dst, blocks, layout=layout)),
             (lambda: staged().store(src, blocks), lambda: staged().load(dst, blocks)))
    for store, load in paths:  # the direct kernel, then the staged path
        host.view(torch.uint8).fill_(0xA5)
        store()
        torch.cuda.synchronize()
        expect = host.clone()
        expect.view(torch.uint8).fill_(0xA5)
        copy_pages_ref(kv, expect, src, blocks, to_host=True, layout=layout)
        ok &= torch.equal(host.view(torch.uint8), expect.view(torch.uint8))
        load()
        torch.cuda.synchronize()
        for b in kv.buffers:
            ok &= torch.equal(b[dst].view(torch.uint8), b[src].view(torch.uint8))
    return bool(ok)


# --- sections ---

# direct configs, programs:warps:tile_kib (see _parse_variant)
SWEEP_CONFIGS = ["2:16:128", "3:8:64", "3:16:128", "4:8:64", "4:8:128", "4:16:128", "4:32:128", "4:16:256",
                 "6:8:64", "8:8:64", "8:16:128"]


def run_sweep(res: dict, host_bytes: torch.Tensor, gen) -> None:
    """Programs x warps x tile KiB on the realistic host layouts: 36 layers, per-layer 64 MiB, pages 1/16/64."""
    rows = []
    tokens = 16384
    for page in PAGES:
        s = Setup("qwen3_8b", 36, page, 200_000, tokens, host_bytes)
        slots = random_slots(tokens // page, page, s.num_slots, generator=gen)
        blocks = torch.randperm(s.num_blocks)[:tokens // page].cuda()
        nbytes = tokens * s.geo.row_bytes * 2
        for layout in ("page_first", "layer_first"):
            host = s.host(layout)
            for v in map(_parse_variant, SWEEP_CONFIGS):
                row = {"page": page, "layout": layout, "config": v["name"], "programs": v["programs"],
                       "warps": v["warps"], "tile_kib": v["tile_kib"]}
                for name, op in (("d2h", store_pages), ("h2d", load_pages)):
                    t = time_gpu_ms(_direct_variant_fn(op, s, host, slots, blocks, v, layout), reps=10)
                    row[f"{name}_gbps"] = gbps(nbytes, t["median_ms"])
                rows.append(row)
    res["sweep"] = rows
    for name in dict.fromkeys(r["config"] for r in rows):
        sel = [r for r in rows if r["config"] == name]
        print(f"sweep {name}: d2h min {min(r['d2h_gbps'] for r in sel)} h2d min "
              f"{min(r['h2d_gbps'] for r in sel)}", flush=True)


def run_sizes(res: dict, host_bytes: torch.Tensor, hicache, gen) -> None:
    out = []
    for name in GEOMETRIES:
        layers = 36 if name == "qwen3_8b" else 4
        heads, hd, dt, mla = GEOMETRIES[name]
        max_tokens = 64 * MiB // (heads * hd * dt.itemsize * (1 if mla else 2))
        num_slots = max(200_000, 4 * max_tokens)
        for page in PAGES:
            s = Setup(name, layers, page, num_slots, max_tokens, host_bytes)
            for layout in ("page_first", "layer_first"):
                entry = {"geometry": name, "page": page, "layout": layout,
                         "roundtrip_exact": check_direct(s, layout, gen)}
                sizes = sorted({max(page, t // page * page) for t in (page, 64, 256, 1024, 4096, max_tokens)})
                for to_host in (True, False):
                    for tokens in sizes:
                        for meth, (fn, nbytes) in method_fns(s, tokens, layout, to_host, hicache, gen).items():
                            t = time_gpu_ms(fn, reps=REPS)
                            out.append({**entry, "direction": "d2h" if to_host else "h2d", "tokens": tokens,
                                        "bytes": nbytes, "method": meth, "gbps": gbps(nbytes, t["median_ms"]),
                                        **t})
                print(f"sizes {name} page {page} {layout}: roundtrip_exact={entry['roundtrip_exact']}", flush=True)
            del s
            torch.cuda.empty_cache()
    res["sizes"] = out


def run_gemm(res: dict, host_bytes: torch.Tensor, hicache, gen) -> None:
    """GEMM time alone and with back-to-back 64 MiB H2D transfers on a side stream, alternating, 3 rounds."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    s = Setup("qwen3_8b", 2, 16, 200_000, 16384, host_bytes)
    fns = method_fns(s, 16384, "layer_first", False, hicache, gen)
    out = {}
    side = torch.cuda.Stream()
    s36 = Setup("qwen3_8b", 36, 16, 200_000, 16384, host_bytes)
    slots36 = random_slots(1024, 16, s36.num_slots, generator=gen)
    blocks36 = torch.randperm(1024)[:1024].cuda()
    for v in map(_parse_variant, GEMM_EXTRA):
        fns[f"kvtier_{v['name']}"] = (_direct_variant_fn(load_pages, s36, s36.host("layer_first"), slots36, blocks36,
                                                         v), 16384 * s36.geo.row_bytes * 2)
    fns["kvtier_direct_default"] = (lambda: load_pages(s36.kv, s36.host("layer_first"), slots36, blocks36,
                                                       layout="layer_first", layers=0, check=False),
                                    16384 * s36.geo.row_bytes * 2)
    methods = GEMM_METHODS + [f"kvtier_{_parse_variant(c)['name']}" for c in GEMM_EXTRA]
    alone_all = []
    for meth in methods:
        if meth not in fns:
            continue
        fn, nbytes = fns[meth]
        out[meth] = gemm_beside(fn, nbytes, a, b, side, n_copy=30)
        alone_all.extend(r["alone_ms"] for r in out[meth]["rounds"])
        print("gemm", meth, {k: v for k, v in out[meth].items() if k != "rounds"},
              [r["h2d_gbps_during"] for r in out[meth]["rounds"]], flush=True)
    out["gemm_alone_ms"] = sorted(alone_all)[len(alone_all) // 2]
    res["gemm"] = out


def run_overhead(res: dict, host_bytes: torch.Tensor, gen) -> None:
    """Host time to issue one call (the GPU kept busy): what a scheduler thread pays per transfer."""
    s = Setup("qwen3_8b", 36, 16, 100_000, 1024, host_bytes)
    host = s.host("page_first")
    slots = random_slots(1, 16, s.num_slots, generator=gen)
    slots_cpu, blocks_cpu = slots.cpu(), torch.tensor([5])
    blocks = blocks_cpu.cuda()
    out = {
        "store_pages_check_false_us": host_us_per_call(lambda: store_pages(s.kv, host, slots, blocks, check=False)),
        "store_pages_cpu_indices_check_true_us": host_us_per_call(
            lambda: store_pages(s.kv, host, slots_cpu, blocks_cpu)),
        "store_pages_one_layer_us": host_us_per_call(
            lambda: store_pages(s.kv, host, slots, blocks, layers=3, check=False)),
        "torch_index_select_us": host_us_per_call(lambda: torch.index_select(s.kv.buffers[0], 0, slots)),
    }
    res["overhead"] = out
    print("overhead", out, flush=True)


def _bidir_setup(host_bytes: torch.Tensor, gen):
    """Qwen3-8B, 36 layers, page 16, 1024 tokens each way, page_first host, consecutive blocks: the store reads
    ``src`` into blocks 0..63 while the load fills ``dst`` from blocks 64..127 (which hold ``src``'s bytes)."""
    s = Setup("qwen3_8b", 36, 16, 200_000, 2048, host_bytes)
    tokens = 1024
    pages = tokens // 16
    slots = random_slots(2 * pages, 16, s.num_slots, generator=gen)
    src, dst = slots[:tokens], slots[tokens:]
    host = s.host("page_first")
    st_blocks, ld_blocks = torch.arange(pages), torch.arange(pages, 2 * pages)
    store_pages(s.kv, host, src, ld_blocks)  # give the load side real bytes
    torch.cuda.synchronize()
    return s, host, src, dst, st_blocks, ld_blocks, tokens * s.geo.token_bytes


def _on_stream(stream, fn):
    """``fn`` issued on ``stream`` after the current stream's work; returns an event marking its end there."""
    def run():
        cur = torch.cuda.current_stream()
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            ev = fn()
        if ev is None:
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev
    return run


def _both(st, ld, s_store, s_load):
    """A store on ``s_store`` and a load on ``s_load`` at once; the current stream waits for both."""
    def run():
        e1, e2 = _on_stream(s_store, st)(), _on_stream(s_load, ld)()
        torch.cuda.current_stream().wait_event(e1)
        return e2
    return run


def _time_store_load_both(st, ld, s_store, s_load, nbytes: int, reps: int = 20) -> dict:
    """GB/s of ``st`` alone, ``ld`` alone and both at once, each on its own stream."""
    # the GPU spins 3 ms before each rep so that both directions are queued before the start event: this
    # measures the copy engines, not the order in which one Python thread issues the two transfers
    t_st = time_gpu_ms(_on_stream(s_store, st), reps=reps, hide_host_us=3000)["median_ms"]
    t_ld = time_gpu_ms(_on_stream(s_load, ld), reps=reps, hide_host_us=3000)["median_ms"]
    t_both = time_gpu_ms(_both(st, ld, s_store, s_load), reps=reps, hide_host_us=3000)["median_ms"]
    return {"store_gbps": gbps(nbytes, t_st), "load_gbps": gbps(nbytes, t_ld),
            "combined_gbps": gbps(2 * nbytes, t_both), "bytes_each_way": nbytes}


def _ce_contiguous(host, nbytes: int):
    """The copy engines' bound on the bidir workload: one contiguous store and one contiguous load of ``nbytes``
    each, between device buffers and the first ``2 * nbytes`` of ``host``."""
    dev_a, dev_b = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    host_flat = host.view(-1).view(torch.uint8)

    def copy(dst, src):
        return lambda: (dst.copy_(src, non_blocking=True), None)[1]  # no event: the stream's own work
    return copy(host_flat[:nbytes], dev_a), copy(dev_b, host_flat[nbytes:2 * nbytes])


BIDIR_ROUNDS = 5


def run_bidir(res: dict, host_bytes: torch.Tensor, gen) -> None:
    out = {}
    s, host, src, dst, st_blocks, ld_blocks, nbytes = _bidir_setup(host_bytes, gen)
    s_store, s_load = torch.cuda.Stream(), torch.cuda.Stream()
    stager = StagedTransfer(s.kv, host)
    staged = (lambda: stager.store(src, st_blocks, stream=s_store, check=False),
              lambda: stager.load(dst, ld_blocks, stream=s_load, check=False))
    bd = st_blocks.cuda(), ld_blocks.cuda()
    direct = (lambda: store_pages(s.kv, host, src, bd[0], stream=s_store, check=False),
              lambda: load_pages(s.kv, host, dst, bd[1], stream=s_load, check=False))
    for mode, (st, ld) in (("staged", staged), ("direct", direct)):
        out[mode] = _time_store_load_both(st, ld, s_store, s_load, nbytes)
        torch.cuda.synchronize()
        ok = all(torch.equal(b[dst].view(torch.uint8), b[src].view(torch.uint8)) for b in s.kv.buffers)
        out[mode]["load_exact"] = ok
        print("bidir", mode, out[mode], flush=True)
    # Store + load at once moves with the host's state from run to run (92.8-98 GB/s over full runs) while each
    # direction alone holds steady: rounds alternate the staged pair with the copy engines' contiguous bound on
    # the same host blocks (its store overwrites blocks 0..63, which the staged store writes too; its load reads
    # blocks 64..127), so a dip shows in both or in the staged path only.
    ce = _ce_contiguous(host, nbytes)
    fns = {"staged": _both(*staged, s_store, s_load), "copy_engine_contiguous": _both(*ce, s_store, s_load)}
    rounds = {k: [] for k in fns}
    for _ in range(BIDIR_ROUNDS):
        for k, fn in fns.items():
            rounds[k].append(gbps(2 * nbytes, time_gpu_ms(fn, reps=20, hide_host_us=3000)["median_ms"]))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    out["alternating"] = {"rounds": BIDIR_ROUNDS, "reps_per_round": 20, "combined_gbps_by_round": rounds,
                          "combined_gbps_median": med,
                          "staged_over_copy_engine": round(med["staged"] / med["copy_engine_contiguous"], 4)}
    print("bidir alternating", out["alternating"], flush=True)
    res["bidir"] = out


STAGED_CONFIGS = [(16, 2), (16, 3), (32, 2), (32, 3), (8, 4), (64, 2)]  # (staging MiB, buffers per direction)


def run_staged_sweep(res: dict, host_bytes: torch.Tensor, gen) -> None:
    """Staging buffer size x count on the bidir workload, with the copy engine's contiguous bound beside it."""
    s, host, src, dst, st_blocks, ld_blocks, nbytes = _bidir_setup(host_bytes, gen)
    s_store, s_load = torch.cuda.Stream(), torch.cuda.Stream()
    rows = []
    ce = _time_store_load_both(*_ce_contiguous(host, nbytes), s_store, s_load, nbytes)
    rows.append({"method": "copy_engine_contiguous", **ce})
    print("staged_sweep copy engine", ce, flush=True)
    for mib, nbuf in STAGED_CONFIGS:
        stager = StagedTransfer(s.kv, host, tuning=Tuning(staging_bytes=mib * MiB, num_buffers=nbuf))
        r = _time_store_load_both(lambda stager=stager: stager.store(src, st_blocks, stream=s_store, check=False),
                                  lambda stager=stager: stager.load(dst, ld_blocks, stream=s_load, check=False),
                                  s_store, s_load, nbytes)
        torch.cuda.synchronize()
        r["load_exact"] = all(torch.equal(b[dst].view(torch.uint8), b[src].view(torch.uint8)) for b in s.kv.buffers)
        rows.append({"method": "kvtier_staged", "staging_mib": mib, "buffers": nbuf, **r})
        print("staged_sweep", rows[-1], flush=True)
    res["staged_sweep"] = rows


HICACHE_ROUNDS = 7
HICACHE_VARIANTS: list = []  # extra direct configs for the alternating comparison; set by --hicache-variants


def _parse_variant(text: str) -> dict:
    """``programs:warps:tile_kib`` -> the kwargs of one direct config, and its name."""
    p, w, t = (int(x) for x in text.split(":"))
    return {"programs": p, "warps": w, "tile_kib": t, "name": f"p{p}_w{w}_t{t}"}


def _direct_variant_fn(op, s: Setup, host, slots, blocks_dev, v: dict, layout: str = "layer_first"):
    """One call of ``op`` (store_pages / load_pages) on layer 0 with config ``v``."""
    return lambda: op(s.kv, host, slots, blocks_dev, layout=layout, layers=0, num_programs=v["programs"],
                      tuning=Tuning(tile_bytes=v["tile_kib"] * 1024, num_warps=v["warps"]), check=False)


def same_host_bytes(host: torch.Tensor, store_a, store_b) -> bool:
    """Whether two stores of layer 0 write the same host bytes (each into layer 0 filled with one byte first)."""
    out = []
    layer0 = host[0].view(torch.uint8)
    for store in (store_a, store_b):
        layer0.fill_(0x5A)
        store()
        torch.cuda.synchronize()
        out.append(layer0.clone())
    return bool(torch.equal(*out))


def run_hicache(res: dict, host_bytes: torch.Tensor, hicache, gen) -> None:
    """kvtier direct vs SGLang HiCache on identical work: one layer of 64 MiB, the same device slots, the same host
    bytes (layer 0 of a ``layer_first`` host tensor) and the same host pages, random or consecutive. Methods
    alternate over HICACHE_ROUNDS rounds of 20 timed reps each (drift hits all alike); GB/s from the median round."""
    if hicache is None:
        return
    out = []
    default = _parse_variant(f"{TUNED.programs}:{TUNED.num_warps}:{TUNED.tile_bytes // 1024}")
    variants = [default] + [v for v in map(_parse_variant, HICACHE_VARIANTS) if v["name"] != default["name"]]
    tokens = 16384
    for page in PAGES:
        s = Setup("qwen3_8b", 36, page, 200_000, tokens, host_bytes)
        host = s.host("layer_first")
        pages = tokens // page
        nbytes = tokens * s.geo.row_bytes * 2
        slots = random_slots(pages, page, s.num_slots, generator=gen)
        patterns = {"random": torch.randperm(s.num_blocks, generator=torch.Generator().manual_seed(page))[:pages],
                    "consecutive": torch.arange(pages)}
        for to_host in (True, False):
            op = store_pages if to_host else load_pages
            fns = {}
            for pat, blocks in patterns.items():
                blocks_dev = blocks.to(torch.int64).cuda()
                for v in variants:
                    fns[f"kvtier_{v['name']}_{pat}"] = _direct_variant_fn(op, s, host, slots, blocks_dev, v)
                fns[f"sglang_hicache_{pat}"] = hicache_fn(hicache, s, host, slots, blocks_dev, to_host)
            same = {pat: same_host_bytes(host, fns[f"sglang_hicache_{pat}"], fns[f"kvtier_{default['name']}_{pat}"])
                    for pat in patterns} if to_host else None
            times = {k: [] for k in fns}
            for _ in range(HICACHE_ROUNDS):
                for k, fn in fns.items():
                    times[k].append(time_gpu_ms(fn, reps=20)["median_ms"])
            entry = {"page": page, "direction": "d2h" if to_host else "h2d", "rounds": HICACHE_ROUNDS,
                     "default": default["name"],
                     "gbps": {k: gbps(nbytes, sorted(v)[len(v) // 2]) for k, v in times.items()},
                     "round_gbps": {k: [gbps(nbytes, t) for t in v] for k, v in times.items()},
                     **({"same_host_bytes": same} if same is not None else {})}
            entry["ratio"] = {k[len("kvtier_"):]: round(g / entry["gbps"][f"sglang_hicache_{k.rsplit('_', 1)[1]}"], 4)
                              for k, g in entry["gbps"].items() if k.startswith("kvtier_")}
            out.append(entry)
            print("hicache", page, entry["direction"], entry["gbps"], entry["ratio"], flush=True)
        del s
        torch.cuda.empty_cache()
    res["hicache_alternating"] = {"entries": out}


def run_latency(res: dict, host_bytes: torch.Tensor, gen) -> None:
    out = {}
    for name in GEOMETRIES:
        s = Setup(name, 36, 16, 100_000, 1024, host_bytes)
        host = s.host("page_first")
        slots = random_slots(1, 16, s.num_slots, generator=gen)
        blocks = torch.tensor([5], device="cuda")
        nbytes = 16 * s.geo.token_bytes
        entry = {"bytes": nbytes, "pcie_floor_us": round(nbytes / 55e9 * 1e6, 2)}
        for p in (None, 2, 4, 8, 16, 36):
            for d, op in (("d2h", store_pages), ("h2d", load_pages)):
                t = time_gpu_ms(lambda op=op, s=s, host=host, slots=slots, blocks=blocks, p=p: op(
                    s.kv, host, slots, blocks, num_programs=p, check=False), reps=50,
                                hide_host_us=500)
                entry[f"{d}_p{p or 'default'}_us"] = round(t["median_ms"] * 1e3, 2)
        entry["default_programs"] = TUNED.programs_for(nbytes)
        out[name] = entry
        print("latency", name, entry, flush=True)
    res["latency"] = out


def summarize(res: dict) -> dict:
    summ = {"direct_programs": TUNED.programs}
    sizes = res.get("sizes", [])
    default = f"kvtier_direct_p{TUNED.programs}"

    def pick(method, direction, page=None, layout=None, geometry="qwen3_8b"):
        return [r for r in sizes if r["method"] == method and r["direction"] == direction and
                r["geometry"] == geometry and r["bytes"] == 64 * MiB and (page is None or r["page"] == page)
                and (layout is None or r["layout"] == layout)]

    if sizes:
        for d in ("d2h", "h2d"):
            # layer_first is the host layout for per-layer traffic; page_first reported beside it
            for suffix, layout in (("", "layer_first"), ("_page_first", "page_first")):
                rows = pick(default, d, layout=layout)
                summ[f"direct_{d}_gbps_min{suffix}"] = min(r["gbps"] for r in rows)
                summ[f"direct_{d}_gbps_by_page{suffix}"] = {p: min(r["gbps"] for r in rows if r["page"] == p)
                                                            for p in PAGES}
            rows = [r for p in (1, 2, 4) for r in pick(f"kvtier_direct_p{p}", d, layout="layer_first")]
            summ[f"direct_{d}_gbps_min_le4_programs"] = min(
                max(r["gbps"] for r in rows if r["page"] == page) for page in PAGES) if rows else None
            rows = pick("kvtier_staged_contig", d, layout="layer_first")
            summ[f"staged_{d}_gbps_per_layer_min"] = min(r["gbps"] for r in rows) if rows else None
        ratios = [min(r["gbps"] for r in kt) / hc[0]["gbps"] for d in ("d2h", "h2d") for p in PAGES
                  if (hc := pick("sglang_hicache", d, p, "layer_first")) and (kt := pick(default, d, p, "layer_first"))]
        summ["hicache_ratio_min"] = round(min(ratios), 3) if ratios else None
        summ["roundtrips_exact"] = all(r["roundtrip_exact"] for r in sizes)
    if "hicache_alternating" in res:
        alt = res["hicache_alternating"]
        for pat in ("random", "consecutive"):
            summ[f"hicache_ratio_by_case_{pat}"] = {
                f"{e['direction']}_p{e['page']}": e["ratio"][f"{e['default']}_{pat}"] for e in alt["entries"]}
        # the bar: identical work (same slots, host bytes and random host pages), alternating rounds
        summ["hicache_ratio_min_sizes"] = summ.get("hicache_ratio_min")
        summ["hicache_ratio_min"] = min(summ["hicache_ratio_by_case_random"].values())
        summ["hicache_ratio_min_consecutive"] = min(summ["hicache_ratio_by_case_consecutive"].values())
    if "bidir" in res:
        st = res["bidir"]["staged"]
        summ.update(staged_d2h_gbps=st["store_gbps"], staged_h2d_gbps=st["load_gbps"],
                    bidirectional_gbps=st["combined_gbps"])
        alt = res["bidir"].get("alternating")
        if alt:  # medians over the alternating rounds, beside the copy engines' bound in the same rounds
            summ["bidirectional_gbps_alternating"] = round(alt["combined_gbps_median"]["staged"], 2)
            summ["bidirectional_copy_engine_gbps"] = round(alt["combined_gbps_median"]["copy_engine_contiguous"], 2)
            summ["bidirectional_over_copy_engine"] = alt["staged_over_copy_engine"]
    if "gemm" in res:
        summ["gemm_slowdown_pct"] = res["gemm"].get("kvtier_direct_default", {}).get("slowdown_pct")
        summ["gemm_slowdown_hicache_pct"] = res["gemm"].get("sglang_hicache", {}).get("slowdown_pct")
    if "latency" in res:
        lat = res["latency"]["qwen3_8b"]
        summ["one_page_all_layers_us"] = max(lat["h2d_pdefault_us"], lat["d2h_pdefault_us"])
        summ["one_page_all_layers_us_detail"] = res["latency"]
        # the bar is stated without a geometry: every geometry's figure beside its PCIe floor (55 GB/s)
        summ["one_page_all_layers_us_by_geometry"] = {
            name: {"us": max(e["h2d_pdefault_us"], e["d2h_pdefault_us"]), "pcie_floor_us": e["pcie_floor_us"]}
            for name, e in res["latency"].items()}
    return summ


def plot(res: dict, path: str) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in _STUB]:
        del sys.modules[name]  # stubs from load_hicache confuse matplotlib's IPython hook
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _StubFinder)]
    plt = pyplot()
    rows = [r for r in res.get("sizes", []) if r["geometry"] == "qwen3_8b" and r["page"] == 16
            and r["layout"] == "layer_first"]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, d in zip(axes, ("d2h", "h2d")):
        for meth in sorted({r["method"] for r in rows}):
            pts = sorted((r["bytes"], r["gbps"]) for r in rows if r["method"] == meth and r["direction"] == d)
            ax.plot([p[0] / MiB for p in pts], [p[1] for p in pts], marker="o", label=meth)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("MiB per layer (K+V)")
        ax.set_title(f"{d.upper()} one layer, Qwen3-8B (8x128 bf16), page 16, H200")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=8)
    save_png(fig, path)


# --- kvtier's default kernel against HiCache's, pooled over every committed run (--pool-hicache) ---

POOL_KVTIER = "kvtier_p4_w32_t64"  # the default direct kernel's key prefix in the committed runs


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median: the widest symmetric pair of order statistics whose binomial
    (n, 1/2) coverage is at least ``level``."""
    xs, n = sorted(values), len(values)
    tail, k = 0.0, 0
    while k < n // 2:
        p = math.comb(n, k) / 2 ** n  # P(exactly k of n below the median)
        if 2 * (tail + p) > 1 - level:
            break
        tail, k = tail + p, k + 1
    return xs[k], xs[n - 1 - k]


def pool_hicache(kvtier: str = POOL_KVTIER) -> dict:
    """Round i of ``kvtier`` paired with round i of HiCache in every committed JSON's ``hicache_alternating``, per
    case (direction, page size, random or consecutive host pages): the median paired ratio with its 95% interval
    (one slow round of either kernel cannot move it), the share of rounds kvtier wins, the per-run ratios' range."""
    cases: dict[tuple, dict] = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "bench", "results", "**", "*.json"), recursive=True)):
        data = read_json(path)
        section = data.get("hicache_alternating") if isinstance(data, dict) else None
        for entry in section.get("entries", []) if isinstance(section, dict) else []:
            rounds = entry.get("round_gbps", {})
            for pattern in ("random", "consecutive"):
                kv, hc = rounds.get(f"{kvtier}_{pattern}"), rounds.get(f"sglang_hicache_{pattern}")
                if kv and hc and len(kv) == len(hc):
                    case = cases.setdefault((entry["direction"], entry["page"], pattern), {"ratios": [], "runs": {}})
                    case["ratios"] += [k / h for k, h in zip(kv, hc)]
                    case["runs"][path] = statistics.median(kv) / statistics.median(hc)
    rows = {}
    for (d, page, pattern), case in sorted(cases.items()):
        ratios, runs = case["ratios"], list(case["runs"].values())
        low, high = median_ci(ratios)
        rows[f"{d}_p{page}_{pattern}"] = {
            "rounds": len(ratios), "runs": len(runs), "ratio": statistics.median(ratios), "ci_low": low,
            "ci_high": high, "kvtier_wins": sum(r > 1 for r in ratios) / len(ratios),
            "run_ratio_min": min(runs), "run_ratio_max": max(runs)}
    return rows


def print_pooled(rows: dict) -> None:
    print("| case | runs | rounds | median paired ratio (95% CI) | kvtier wins | per-run ratio of medians |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['runs']} | {r['rounds']} | {r['ratio']:.4f} ({r['ci_low']:.4f}-{r['ci_high']:.4f}) "
              f"| {r['kvtier_wins']:.0%} | {r['run_ratio_min']:.4f}-{r['run_ratio_max']:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/transfer_h200.json")
    ap.add_argument("--sections", default="sizes,gemm,bidir,latency,overhead")
    ap.add_argument("--sweep-configs", default="",
                    help="direct configs for the sweep: p:w:t,p:w:t (tile KiB)")
    ap.add_argument("--gemm-configs", default="", help="extra direct configs beside the GEMM, as --sweep-configs")
    ap.add_argument("--hicache-variants", default="",
                    help="extra direct configs against HiCache, as --sweep-configs")
    ap.add_argument("--hicache-rounds", type=int, default=7)
    ap.add_argument("--pool-hicache", action="store_true",
                    help="only pool the hicache rounds of every committed result and print the table")
    ap.add_argument("--pool-kvtier", default=POOL_KVTIER, help="with --pool-hicache: the kvtier variant's key prefix")
    ap.add_argument("--pool-json", help="with --pool-hicache: also write the table as JSON here")
    args = ap.parse_args()
    if args.pool_hicache:
        rows = pool_hicache(args.pool_kvtier)
        print_pooled(rows)
        if args.pool_json:
            write_json(args.pool_json, rows)
        return
    globals()["HICACHE_ROUNDS"] = args.hicache_rounds
    HICACHE_VARIANTS.extend(c for c in args.hicache_variants.split(",") if c)
    GEMM_EXTRA.extend(c for c in args.gemm_configs.split(",") if c)
    if args.sweep_configs:
        SWEEP_CONFIGS[:] = [c for c in args.sweep_configs.split(",") if c]
    sections = args.sections.split(",")
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"env": env_info(), "defaults": {"programs": TUNED.programs, "tile_bytes": TUNED.tile_bytes,
                                           "num_warps": TUNED.num_warps}}
    hicache, why = load_hicache()
    res["hicache"] = {"loaded": hicache is not None, "error": why,
                      "tma_env": os.environ.get("SGLANG_HICACHE_TMA_TRANSFER")}
    print("hicache loaded:", hicache is not None, why or "", flush=True)
    host_bytes = torch.empty(2700 * MiB, dtype=torch.uint8, pin_memory=True)
    host_bytes.fill_(0x5A)
    for name, fn in (("sweep", lambda: run_sweep(res, host_bytes, gen)),
                     ("sizes", lambda: run_sizes(res, host_bytes, hicache, gen)),
                     ("gemm", lambda: run_gemm(res, host_bytes, hicache, gen)),
                     ("bidir", lambda: run_bidir(res, host_bytes, gen)),
                     ("staged_sweep", lambda: run_staged_sweep(res, host_bytes, gen)),
                     ("latency", lambda: run_latency(res, host_bytes, gen)),
                     ("hicache", lambda: run_hicache(res, host_bytes, hicache, gen)),
                     ("overhead", lambda: run_overhead(res, host_bytes, gen))):
        if name in sections:
            try:
                fn()
            except Exception:
                res[f"{name}_error"] = traceback.format_exc()[-3000:]
                print(res[f"{name}_error"], flush=True)
            write_json(args.out, res)
    res["summary"] = summarize(res)
    write_json(args.out, res)
    plot(res, png_beside(args.out))
    print("SUMMARY", res["summary"], flush=True)


if __name__ == "__main__":
    main()
