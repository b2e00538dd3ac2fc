"""Probe (issue 17): the host cost of ``cuMemcpyBatchAsync`` per row, by the copy attributes it is given.

A fragmented ``layer_first`` store of 8k tokens in single pages issues 18,432 copy-engine rows; on a slow host the
driver call alone takes ~1.2 us a row, so the store is paced by its issue (``fragmentation_h200.json``). kvtier passes
one attribute set (sources read in stream order, no location hints, no flags). Here: 18,432 D2H rows of 64 KiB at
shuffled places of a pinned pool, in calls of 1024, queued behind a spin (the host time is the calls' own), with the
source access order STREAM / ANY, location hints (device source, host destination) and the
PREFER_OVERLAP_WITH_COMPUTE flag; host ms of the calls (median of ``--reps``) and the GPU ms of the copies.

Run (GPU machine): ``python3 bench/probes/batch_copy_attrs.py --out $OUT/batch_copy_attrs_h200.json``
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.common import _sm_clock_hz, env_info, finish_probe  # noqa: E402
from bench.probes.staged_store_chunks import GEO  # noqa: E402
from kvtier.kernels import batch_copy  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402

KiB = 1 << 10
# name: (srcAccessOrder, src location type, dst location type, flags); CUmemLocationType DEVICE 1, HOST 2
ATTRS = {"stream": (1, 0, 0, 0), "any": (3, 0, 0, 0), "stream_hints": (1, 1, 2, 0), "any_hints": (3, 1, 2, 0),
         "stream_overlap": (1, 0, 0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    t0 = time.time()
    pool = HostBlockPool(GEO, 2 * 8192 // GEO.page_size, layout="layer_first")
    host_bytes = pool.host.numel() * pool.host.element_size()
    width, n, batch = 64 * KiB, 18432, 1024
    dev = torch.empty(n * width, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(0)
    dst = rng.permutation(host_bytes // width)[:n].astype(np.uint64) * np.uint64(width) + np.uint64(
        pool.host.data_ptr())
    src = np.arange(n, dtype=np.uint64) * np.uint64(width) + np.uint64(dev.data_ptr())
    sizes = np.full(n, width, dtype=np.uint64)
    stream = torch.cuda.Stream()
    spin = int(0.2 * _sm_clock_hz())  # 200 ms: the calls queue behind it
    drv = batch_copy._driver()
    res = {"env": env_info(), "rows": n, "width": width, "batch": batch, "results": {k: {"host_ms": [], "gpu_ms": []}
                                                                                     for k in ATTRS}}
    for _ in range(args.rounds):
        for name, (order, src_loc, dst_loc, flags) in ATTRS.items():
            attrs = batch_copy._Attributes(order, batch_copy._Location(src_loc, 0), batch_copy._Location(dst_loc, 0),
                                           flags)
            index = (ctypes.c_size_t * 1)(0)
            if "error" in res["results"][name]:
                continue
            for rep in range(args.reps + 1):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(spin)
                    start.record(stream)
                    t = time.perf_counter()
                    try:
                        for a in range(0, n, batch):
                            d, s, z = dst[a:a + batch], src[a:a + batch], sizes[a:a + batch]
                            batch_copy._call(drv, "batch", [d.ctypes.data, s.ctypes.data, z.ctypes.data, z.size,
                                                            ctypes.addressof(attrs), ctypes.addressof(index), 1],
                                             stream.cuda_stream)
                    except RuntimeError as e:  # the driver refuses these attributes
                        res["results"][name]["error"] = str(e)
                    host = time.perf_counter() - t
                    end.record(stream)
                end.synchronize()
                if "error" in res["results"][name]:
                    break
                if rep:
                    res["results"][name]["host_ms"].append(host * 1e3)
                    res["results"][name]["gpu_ms"].append(start.elapsed_time(end))
    for name, r in res["results"].items():
        if "error" in r:
            print(f"{name:15s} {r['error']}", flush=True)
            continue
        r["host_ms_median"], r["gpu_ms_median"] = statistics.median(r["host_ms"]), statistics.median(r["gpu_ms"])
        print(f"{name:15s} host {r['host_ms_median']:.2f} ms ({r['host_ms_median'] * 1e3 / n:.2f} us a row), "
              f"gpu {r['gpu_ms_median']:.2f} ms", flush=True)
    finish_probe(res, pool, args.out, t0)


if __name__ == "__main__":
    main()
