"""Probe (issue 17): what the copy engines take for the rows of a fragmented layer_first copy, issued as row batches
(``cuMemcpyBatchAsync``) or pitched batches (``cuMemcpy3DBatchAsync``), split over 1-4 copy streams.

The rows are those of a staged copy of all 36 Qwen3-8B layers of 1024 or 8192 tokens whose host blocks lie in
shuffled runs of R pages (R = 1, 2, 4, 16, one run), between a device buffer holding the whole copy and a pinned
layer_first pool. Each cell: median GPU ms over reps (CUDA events around the split and join), both directions, and
GB/s; nothing else runs.

Run (GPU machine): ``python bench/probes/copy_engine_rows.py --out $OUT/copy_engine_rows_h200.json``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.bench_fragmentation import fragmented_ids  # noqa: E402
from bench.common import env_info, make_pool, time_gpu_ms, write_json  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import StagedTransfer, batch_copy  # noqa: E402
from kvtier.kernels.checks import layer_span  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402

GEO = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)


def plan(kind: str, rects, host_ptr: int, dev_ptr: int, to_host: bool, streams) -> list:
    """The driver calls of ``rects`` split in ``len(streams)`` even parts, one batched call per stream (prepared
    apart, so the timed issue is the driver calls alone)."""
    calls = []
    for s, idx in zip(streams, np.array_split(np.arange(rects.width.size), len(streams))):
        r = rects.select(np.isin(np.arange(rects.width.size), idx))
        if kind == "pitched":
            h, d = r.host_off + np.uint64(host_ptr), r.stg_off + np.uint64(dev_ptr)
            a = (h, r.host_pitch, d, r.stg_pitch) if to_host else (d, r.stg_pitch, h, r.host_pitch)
            calls.append((s, batch_copy.memcpy_rects, a + (r.width, r.height, s.cuda_stream)))
        else:
            rows = r.rows()
            h, d = rows.host_off + np.uint64(host_ptr), rows.stg_off + np.uint64(dev_ptr)
            dst, src = (h, d) if to_host else (d, h)
            calls.append((s, batch_copy.memcpy_batch, (dst, src, rows.width, s.cuda_stream)))
    return calls


def issue(calls, main) -> None:
    """Issue prepared calls on their streams after ``main``'s work so far, and join them on ``main``."""
    start = torch.cuda.Event()
    start.record(main)
    for s, call, a in calls:
        s.wait_event(start)
        call(*a)
        ev = torch.cuda.Event()
        ev.record(s)
        main.wait_event(ev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "rows": []}
    num_blocks = 2 * 8192 // GEO.page_size + 64
    kv = make_pool(GEO, 64 * GEO.page_size)
    pool = HostBlockPool(GEO, num_blocks, layout="layer_first")
    stager = StagedTransfer(kv, pool.host, layout="layer_first")
    host_ptr = pool.host.data_ptr()
    rng = np.random.default_rng(0)
    streams = [torch.cuda.Stream() for _ in range(4)]
    main_stream = torch.cuda.current_stream()
    for tokens in (1024, 8192):
        n = tokens // GEO.page_size
        dev = torch.empty(n * GEO.block_bytes, dtype=torch.uint8, device="cuda")
        for run in (1, 2, 4, 16, 0):
            ids = fragmented_ids(n, run, num_blocks, rng)
            rects = stager.run_rects(ids, layer_span(None, GEO.num_layers))
            for to_host in (True, False):
                for kind in ("rows", "pitched"):
                    for k in (1, 2, 4):
                        calls = plan(kind, rects, host_ptr, dev.data_ptr(), to_host, streams[:k])
                        ms = time_gpu_ms(lambda: issue(calls, main_stream), reps=args.reps, warmup=1,
                                         hide_host_us=2000.0)["median_ms"]
                        row = dict(tokens=tokens, run=run, to_host=to_host, kind=kind, streams=k, ms=ms,
                                   copies=int(rects.width.size if kind == "pitched" else rects.height.sum()),
                                   gbps=n * GEO.block_bytes / ms / 1e6)
                        res["rows"].append(row)
                        print(f"{tokens:5d} R={run or 'one':>3} {'D2H' if to_host else 'H2D'} {kind:7s} "
                              f"streams {k} copies {row['copies']:6d} {ms:8.3f} ms {row['gbps']:6.1f} GB/s",
                              flush=True)
    pool.destroy()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
