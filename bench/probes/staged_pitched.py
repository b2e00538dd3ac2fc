"""Probe (issue 17): staged copies of fragmented host blocks with a pitched copy per run (``cuMemcpy3DBatchAsync``)
against a copy per row (``cuMemcpyBatchAsync``), and how short runs group their layers.

Modes, per (layout, tokens, R): ``rows`` (row batches only: the path before pitched batches, short layer_first runs
staged in layer groups), ``pitched`` (the default: a pitched copy per run, short runs stage the whole span) and
``pitched_grouped`` (pitched copies, short runs in layer groups). Paths: the staged store and load of all layers, and
a StagedCopy load launched per layer. GPU time (CUDA events, medians) and host issue time; every store and load is
checked byte for byte once per mode. Then an 8192^3 bf16 GEMM beside the staged store and load at R = 1 and one run
(8k tokens, both layouts) for each gather program count in ``--gather-programs``.

Run (GPU machine): ``python bench/probes/staged_pitched.py --out $OUT/staged_pitched_h200.json``
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.bench_fragmentation import _check_load, fragmented_ids  # noqa: E402
from bench.common import env_info, gemm_beside, host_us_per_call, make_pool, random_slots, time_gpu_ms  # noqa: E402
from bench.common import write_json  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import StagedTransfer, batch_copy, copy_pages_ref  # noqa: E402
from kvtier.kernels.checks import layer_span  # noqa: E402
from kvtier.kernels.staged_copy import StagedCopy  # noqa: E402
from kvtier.kernels.tuning import Tuning  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402

GEO = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)
MODES = ("rows", "pitched", "pitched_grouped")


@contextlib.contextmanager
def mode(name: str):
    """Patch the staged path into ``name``'s behaviour for the duration."""
    saved = (batch_copy.rects_available, StagedTransfer.layer_groups)
    if name == "rows":
        batch_copy.rects_available = lambda: False
    elif name == "pitched_grouped":  # layer groups chosen as without pitched copies; the copies stay pitched
        def grouped(self, span, host_ids, to_host):
            batch_copy.rects_available = lambda: False
            try:
                return saved[1](self, span, host_ids, to_host)
            finally:
                batch_copy.rects_available = saved[0]
        StagedTransfer.layer_groups = grouped
    try:
        yield
    finally:
        batch_copy.rects_available, StagedTransfer.layer_groups = saved


def check_store(kv, host, layout, slots, ids, fn) -> None:
    """One store into zeroed host blocks leaves exactly the reference's bytes there."""
    host.view(torch.uint8).zero_()
    want = host.clone()
    copy_pages_ref(kv, want, slots, ids, to_host=True, layout=layout)
    ev = fn()
    if isinstance(ev, torch.cuda.Event):
        torch.cuda.current_stream().wait_event(ev)
    torch.cuda.synchronize()
    if not torch.equal(host.view(torch.uint8), want.view(torch.uint8)):
        raise AssertionError(f"a fragmented store differs from the reference ({layout})")


def paths(stager, slots, ids):
    copy = StagedCopy(stager, slots, ids, to_host=False, check=False)

    def per_layer():
        for layer in range(GEO.num_layers):
            copy.launch(layer)
    return {"store": lambda: stager.store(slots, ids, check=False),
            "load": lambda: stager.load(slots, ids, check=False),
            "load_per_layer": per_layer}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 2, 4, 16, 0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--host-reps", type=int, default=15)
    ap.add_argument("--gather-programs", type=int, nargs="+", default=[16, 8, 4])
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "rects_available": batch_copy.rects_available(), "rows": [], "gemm": []}
    print("rects available:", res["rects_available"], flush=True)
    max_tokens = max(args.tokens)
    num_blocks = 2 * max_tokens // GEO.page_size + 64
    kv = make_pool(GEO, 2 * max_tokens + 64 * GEO.page_size)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rng = np.random.default_rng(0)
    for layout in ("layer_first", "page_first"):
        pool = HostBlockPool(GEO, num_blocks, layout=layout)
        host = pool.host
        stager = StagedTransfer(kv, host, layout=layout)
        for tokens in args.tokens:
            n = tokens // GEO.page_size
            for run in args.runs:
                ids = torch.from_numpy(fragmented_ids(n, run, num_blocks, rng))
                slots = random_slots(n, GEO.page_size, kv.num_slots, "cuda", gen)
                for m in MODES:
                    with mode(m):
                        fns = paths(stager, slots, ids)
                        check_store(kv, host, layout, slots, ids, fns["store"])
                        for p in ("load", "load_per_layer"):
                            _check_load(kv, host, layout, slots, ids, fns[p])
                        groups = len(stager.layer_groups(layer_span(None, GEO.num_layers), ids.numpy(), True))
                        for p, fn in fns.items():
                            row = dict(layout=layout, tokens=tokens, run=run, mode=m, path=p, groups=groups,
                                       gpu_ms=time_gpu_ms(fn, reps=args.reps)["median_ms"],
                                       host_ms=host_us_per_call(fn, reps=args.host_reps) / 1e3)
                            res["rows"].append(row)
                            print(f"{layout:11s} {tokens:5d} R={run or 'one':>3} {m:15s} {p:14s} groups {groups:2d} "
                                  f"gpu {row['gpu_ms']:8.3f} host {row['host_ms']:8.3f} ms", flush=True)
        # GEMM beside the staged store and load, 8k tokens, R = 1 and one run, per gather program count
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        n = max_tokens // GEO.page_size
        for gp in args.gather_programs:
            st = StagedTransfer(kv, host, layout=layout, tuning=dataclasses.replace(Tuning(), gather_programs=gp))
            for run in (1, 0):
                ids = torch.from_numpy(fragmented_ids(n, run, num_blocks, rng))
                slots = random_slots(n, GEO.page_size, kv.num_slots, "cuda", gen)
                for p, fn in paths(st, slots, ids).items():
                    if p == "load_per_layer":
                        continue
                    g = gemm_beside(fn, max_tokens * GEO.token_bytes, a, b, side, n_copy=8)
                    res["gemm"].append(dict(layout=layout, run=run, gather_programs=gp, path=p,
                                            **{k: v for k, v in g.items() if k != "rounds"}))
                    print(f"gemm {layout:11s} R={run or 'one':>3} gather {gp:2d} {p:6s} {g['slowdown_pct']:+6.2f}%",
                          flush=True)
            del st
        del stager
        pool.destroy()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
