"""Probe (issue 17): does issuing a fragmented store's copy-engine rows from several threads keep it at PCIe speed?

A ``layer_first`` store of blocks in runs of one is a 32 KiB row per (layer, K/V) plane and block: 36,864 rows at
8192 tokens of Qwen3-8B KV. One thread issues ``cuMemcpyBatchAsync`` rows at 0.45-1.05 us each, about the copy
engine's time for a row, so the store is bound by the issue on a slow host (25-57 ms against 22 from one run,
bench/results/probes/store_row_issue_h200.json). This probe measures, for 1024 and 8192 tokens in runs of one:

* the issue alone: rows split over T threads, each issuing batches of B rows on its own stream while the GPU
  sleeps (nothing executes), wall time from the start to the last thread's return, in us per row overall;
* the store: the same split, wall ms from the first issue to the copies' end, over ``--samples`` samples
  (min, median, max: the spread is the point), against the one-run copy (72 plane rows).

Run (GPU machine): ``python3 bench/probes/store_rows_threads.py --out $OUT/store_rows_threads_h200.json``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.bench_fragmentation import fragmented_ids  # noqa: E402
from bench.common import env_info, write_json  # noqa: E402
from bench.probes.store_rows_locality import GEO, ROW, plane_rows, rows_of  # noqa: E402
from kvtier.kernels import batch_copy  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402

THREADS = (1, 2, 3, 4)
BATCHES = (256, 1024)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=9)
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "rows": []}
    num_blocks = 2 * 8192 // GEO.page_size + 64
    pool = HostBlockPool(GEO, num_blocks, layout="layer_first")
    hp = np.uint64(pool.host.data_ptr())
    streams = [torch.cuda.Stream() for _ in range(max(THREADS))]
    workers = concurrent.futures.ThreadPoolExecutor(max(THREADS))
    rng = np.random.default_rng(0)
    sleep_cycles = int(0.2 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # 200 ms

    def issue(h, d, w, b, stream):
        torch.cuda.set_device(0)  # a worker thread: make the device's context current for the driver calls
        for a in range(0, h.size, b):
            batch_copy.memcpy_batch(h[a:a + b], d[a:a + b], w[a:a + b], stream.cuda_stream)

    def split_issue(h, d, w, t, b):
        """Rows split into t contiguous parts, each issued by its own thread on its own stream; returns when all
        are issued (one thread: the caller issues)."""
        if t == 1:
            issue(h, d, w, b, streams[0])
            return
        parts = np.array_split(np.arange(h.size), t)
        futs = [workers.submit(issue, h[p[0]:p[-1] + 1], d[p[0]:p[-1] + 1], w[p[0]:p[-1] + 1], b, streams[i])
                for i, p in enumerate(parts)]
        for f in futs:
            f.result()

    for tokens in (1024, 8192):
        n = tokens // GEO.page_size
        nbytes = n * GEO.block_bytes
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dp = np.uint64(dev.data_ptr())
        ids = fragmented_ids(n, 1, num_blocks, rng)
        h, d = rows_of(ids, num_blocks)
        h, d = h + hp, d + dp
        w = np.full(h.size, ROW, dtype=np.uint64)
        planes = plane_rows(num_blocks, n, pool.host.data_ptr(), dev.data_ptr())

        def wall_samples(fn):
            fn()
            torch.cuda.synchronize()
            out = []
            for _ in range(args.samples):
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                out.append((time.perf_counter() - t1) * 1e3)
            return out

        one = wall_samples(lambda: batch_copy.memcpy_batch(*planes, streams[0].cuda_stream))
        res["rows"].append(dict(tokens=tokens, case="one_run", ms=one))
        print(tokens, "one_run", f"median {statistics.median(one):.2f} ms", flush=True)
        for t in THREADS:
            for b in BATCHES:
                # the issue alone, every stream behind a 200 ms sleep; 4096 rows overall
                m = min(4096, h.size)
                issue_us = []
                for _ in range(3):
                    torch.cuda.synchronize()
                    for s in streams[:t]:
                        with torch.cuda.stream(s):
                            torch.cuda._sleep(sleep_cycles)
                    t1 = time.perf_counter()
                    split_issue(h[:m], d[:m], w[:m], t, b)
                    issue_us.append((time.perf_counter() - t1) * 1e6 / m)
                torch.cuda.synchronize()
                ms = wall_samples(lambda: split_issue(h, d, w, t, b))
                row = dict(tokens=tokens, case="rows", threads=t, batch=b, ms=ms, issue_us_per_row=issue_us)
                res["rows"].append(row)
                print(tokens, f"threads={t} batch={b}: issue {min(issue_us):.3f}-{max(issue_us):.3f} us/row; store "
                      f"min {min(ms):.2f} median {statistics.median(ms):.2f} max {max(ms):.2f} ms", flush=True)
        del dev
    pool.destroy()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
