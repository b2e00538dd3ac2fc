"""Probe (issue 17): the fragmented layer_first store's copy-engine rows, issue included.

``cuMemcpyBatchAsync`` costs the host about 0.6 us a row, about what the copy engine takes to write a 32 KiB row
to the host (0.63 us at 52 GB/s), so a store of 8k tokens in runs of one block (36,864 rows) is bound by its issue
when one thread issues it. This probe times, wall clock from the first issue to the last copy's end (synchronized
before), the D2H of every (plane, block) row of a store of 1k and 8k tokens of Qwen3-8B KV into a layer_first pool,
host blocks in shuffled runs of one: as one batch; in batches of M rows on one stream; rows split over T threads
each issuing batches on its own stream; pitched rectangles on one stream; half pitched and half rows on two
streams; and, as the bound, the one-run copy (72 plane rows).

Run (GPU machine): ``python3 bench/probes/store_row_issue.py --out $OUT/store_row_issue_h200.json``
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
from bench.probes.store_rows_locality import GEO, ROW, block_rects, plane_rows, rows_of  # noqa: E402
from kvtier.kernels import batch_copy  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402


def wall_ms(fn, reps: int) -> float:
    """Median wall ms of ``fn`` from its first issue to the end of its copies (the device synchronized before and
    after), after one untimed call: the issue counts, which the CUDA events of ``time_gpu_ms`` partly hide."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "rows": []}
    num_blocks = 2 * 8192 // GEO.page_size + 64
    pool = HostBlockPool(GEO, num_blocks, layout="layer_first")
    hp = np.uint64(pool.host.data_ptr())
    streams = [torch.cuda.Stream() for _ in range(4)]
    pool_threads = concurrent.futures.ThreadPoolExecutor(4)
    rng = np.random.default_rng(0)
    for tokens in (1024, 8192):
        n = tokens // GEO.page_size
        nbytes = n * GEO.block_bytes
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dp = np.uint64(dev.data_ptr())
        ids = fragmented_ids(n, 1, num_blocks, rng)
        h, d = rows_of(ids, num_blocks)
        h, d = h + hp, d + dp
        w = np.full(h.size, ROW, dtype=np.uint64)

        def batches(hh, dd, ww, m, stream):
            torch.cuda.set_device(0)  # a worker thread: make the device's context current for the driver calls
            for a in range(0, hh.size, m):
                batch_copy.memcpy_batch(hh[a:a + m], dd[a:a + m], ww[a:a + m], stream.cuda_stream)

        def threaded(t, m):
            def run():
                parts = np.array_split(np.arange(h.size), t)
                futs = [pool_threads.submit(batches, h[p[0]:p[-1] + 1], d[p[0]:p[-1] + 1], w[p[0]:p[-1] + 1], m,
                                            streams[i]) for i, p in enumerate(parts)]
                for f in futs:
                    f.result()
            return run

        k = ids.size
        rects = block_rects(ids, num_blocks, n, pool.host.data_ptr(), dev.data_ptr())

        def pitched(lo, hi, stream):
            torch.cuda.set_device(0)
            batch_copy.memcpy_rects(*(a[lo:hi] for a in rects), stream.cuda_stream)

        def mixed(frac):
            cut = int(k * frac)  # blocks [0, cut) pitched, the rest as rows

            sel = np.isin(((h - hp) % np.uint64(num_blocks * ROW)) // np.uint64(ROW), ids[cut:].astype(np.uint64))
            hs, ds, ws = h[sel], d[sel], w[sel]

            def run():
                f = pool_threads.submit(pitched, 0, cut, streams[0])
                batches(hs, ds, ws, 2048, streams[1])
                f.result()
            return run

        planes = plane_rows(num_blocks, n, pool.host.data_ptr(), dev.data_ptr())
        cases = {
            "one_run_planes": lambda: batch_copy.memcpy_batch(*planes, streams[0].cuda_stream),
            "rows_one_batch": lambda: batch_copy.memcpy_batch(h, d, w, streams[0].cuda_stream),
            "rows_batches_128": lambda: batches(h, d, w, 128, streams[0]),
            "rows_batches_256": lambda: batches(h, d, w, 256, streams[0]),
            "rows_batches_512": lambda: batches(h, d, w, 512, streams[0]),
            "rows_batches_1024": lambda: batches(h, d, w, 1024, streams[0]),
            "rows_batches_2048": lambda: batches(h, d, w, 2048, streams[0]),
            "rows_2threads_512": threaded(2, 512),
            "rows_2threads_2048": threaded(2, 2048),
            "rows_4threads_512": threaded(4, 512),
            "rows_4threads_2048": threaded(4, 2048),
            "pitched": lambda: pitched(0, k, streams[0]),
            "pitched_2streams": lambda: [pitched(0, k // 2, streams[0]), pitched(k // 2, k, streams[1])],
            "mixed_half": mixed(0.5),
            "mixed_two_thirds_pitched": mixed(2 / 3),
        }
        for name, fn in cases.items():
            ms = wall_ms(fn, args.reps)
            row = dict(tokens=tokens, case=name, ms=ms, gbps=nbytes / ms / 1e6)
            res["rows"].append(row)
            print(tokens, name, f"{ms:.2f} ms {row['gbps']:.1f} GB/s", flush=True)
        for m in (512, 4096):
            hh, dd, ww = h[:m], d[:m], w[:m]
            times = []
            for _ in range(20):
                torch.cuda.synchronize()
                with torch.cuda.stream(streams[0]):
                    torch.cuda._sleep(int(2e7))
                t1 = time.perf_counter()
                batch_copy.memcpy_batch(hh, dd, ww, streams[0].cuda_stream)
                times.append((time.perf_counter() - t1) * 1e6)
            torch.cuda.synchronize()
            us = statistics.median(times)
            res["rows"].append(dict(tokens=tokens, case=f"issue_only_{m}_rows", us=us, us_per_row=us / m))
            print(tokens, f"issue {m} rows: {us:.0f} us, {us / m:.3f} us/row", flush=True)
        del dev
    pool.destroy()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
