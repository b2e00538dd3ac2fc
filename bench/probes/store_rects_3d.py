"""Probe (issue 17): a fragmented ``layer_first`` store as 3-D copies, one per run of blocks.

The copy engine writes a pitched rectangle of 32 KiB rows (a run of one block's 72 (layer, K/V) planes) at ~41 GB/s,
and the same rows as separate copies at PCIe speed, but separate rows cost the host 0.45-1.05 us each to issue
(bench/results/probes/store_row_issue_h200.json). ``cuMemcpy3DBatchAsync`` also takes a depth: a run's planes as
``depth`` slices of one row each (row pitch the row, a slice ``num_blocks`` rows of the pool), so the driver, not the
caller, splits the rectangle. This probe times the D2H of 1024 and 8192 tokens of Qwen3-8B KV into a layer_first
pool, host blocks in shuffled runs of one and two blocks, from a device buffer laid out as the staging buffer:

* ``pitched_2d``: a rectangle per run, ``height`` = 72 planes (kvtier's pitched store today);
* ``depth_3d``: a copy per run, ``height`` = the run's blocks (rows contiguous), ``depth`` = 72 planes;
* ``rows_1024``: the runs' plane rows as ``cuMemcpyBatchAsync`` batches of 1024 rows;
* ``one_run``: the bound, 72 plane rows of one run.

Wall ms from the first issue to the copies' end (synchronized before and after, median of ``--reps``) and GPU ms
(CUDA events behind a 1 ms spin).

Run (GPU machine): ``python3 bench/probes/store_rects_3d.py --out $OUT/store_rects_3d_h200.json``
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
from bench.common import env_info, write_json  # noqa: E402
from bench.probes.store_row_issue import wall_ms  # noqa: E402
from bench.probes.store_rows_locality import GEO, PLANES, ROW, plane_rows, rows_of, time_ms  # noqa: E402
from kvtier.kernels import batch_copy  # noqa: E402
from kvtier.kernels.staged import block_runs  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402


def copies_3d(dst, dst_pitch, dst_layer_height, src, src_pitch, src_layer_height, width, height, depth,
              stream: int) -> None:
    """One ``cuMemcpy3DBatchAsync`` of 3-D copies with pointer operands (arrays, one entry per copy)."""
    n = np.asarray(width).size
    ops = np.zeros(n, dtype=batch_copy._BATCH_OP)
    ops["src_type"] = ops["dst_type"] = batch_copy._OPERAND_POINTER
    ops["src_ptr"], ops["dst_ptr"] = src, dst
    ops["src_pitch"], ops["dst_pitch"] = src_pitch, dst_pitch
    ops["src_height"], ops["dst_height"] = src_layer_height, dst_layer_height
    ops["width"], ops["height"], ops["depth"] = width, height, depth
    ops["order"] = batch_copy._SRC_ACCESS_ORDER_STREAM
    batch_copy._call(batch_copy._driver_3d(), f"cuMemcpy3DBatchAsync of {n}", [n, ops.ctypes.data, 0], stream)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "rows": []}
    num_blocks = 2 * 8192 // GEO.page_size + 64
    pool = HostBlockPool(GEO, num_blocks, layout="layer_first")
    hp = pool.host.data_ptr()
    stream = torch.cuda.Stream()
    s = stream.cuda_stream
    rng = np.random.default_rng(0)
    u = lambda v: np.asarray(v, dtype=np.uint64)  # noqa: E731
    for tokens in (1024, 8192):
        n = tokens // GEO.page_size
        nbytes = n * GEO.block_bytes
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dp = dev.data_ptr()
        planes = plane_rows(num_blocks, n, hp, dp)
        for run in (1, 2):
            ids = fragmented_ids(n, run, num_blocks, rng)
            runs = np.array(block_runs(ids), dtype=np.int64).reshape(-1, 2)
            first, length = runs[:, 0], runs[:, 1]
            k = first.size
            full = lambda v: np.full(k, v, dtype=np.uint64)  # noqa: E731
            host0 = u(ids[first]) * u(ROW) + u(hp)  # a run's first block, plane 0
            dev0 = u(first) * u(ROW) + u(dp)  # the staging buffer holds plane p's n pages from p * n * ROW
            width = u(length) * u(ROW)
            h, d = rows_of(ids, num_blocks)
            h, d = h + u(hp), d + u(dp)
            w = np.full(h.size, ROW, dtype=np.uint64)

            def rows_1024():
                for a in range(0, h.size, 1024):
                    batch_copy.memcpy_batch(h[a:a + 1024], d[a:a + 1024], w[a:a + 1024], s)
            cases = {
                "pitched_2d": lambda: batch_copy.memcpy_rects(host0, full(num_blocks * ROW), dev0, full(n * ROW),
                                                              width, full(PLANES), s),
                "depth_3d": lambda: copies_3d(host0, full(ROW), full(num_blocks), dev0, full(ROW), full(n),
                                              full(ROW), u(length), full(PLANES), s),
                "rows_1024": rows_1024,
                "one_run": lambda: batch_copy.memcpy_batch(*planes, s),
            }
            # check the 3-D copies land where the rows do: fill the device buffer, copy, compare the host rows
            dev.random_(0, 256)
            for name in ("depth_3d",):
                pool.host.view(torch.uint8).zero_()
                with torch.cuda.stream(stream):
                    cases[name]()
                stream.synchronize()
                host_u8 = pool.host.view(torch.uint8).reshape(-1).numpy()
                dev_u8 = dev.cpu().numpy()
                hh, dd = h - u(hp), d - u(dp)
                sample = rng.choice(hh.size, size=min(hh.size, 512), replace=False)
                ok = all(np.array_equal(host_u8[int(hh[i]):int(hh[i]) + ROW], dev_u8[int(dd[i]):int(dd[i]) + ROW])
                         for i in sample)
                res["rows"].append(dict(tokens=tokens, run=run, case=name, exact=ok))
                print(tokens, run, name, "exact" if ok else "WRONG BYTES", flush=True)
            for name, fn in cases.items():
                with torch.cuda.stream(stream):
                    wall = wall_ms(fn, args.reps)
                    gpu = time_ms(fn, args.reps)
                row = dict(tokens=tokens, run=run, case=name, wall_ms=wall, gpu_ms=gpu, gbps=nbytes / wall / 1e6)
                res["rows"].append(row)
                print(tokens, run, f"{name:14s} wall {wall:7.2f} ms gpu {gpu:7.2f} ms {row['gbps']:.1f} GB/s",
                      flush=True)
        del dev
    pool.destroy()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
