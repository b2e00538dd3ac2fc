"""Probe (issue 17): the copy engine's time for device-to-host rows by row width, and for wide rows split into
64 KiB pieces.

A fragmented ``layer_first`` store copies one row per layer and run of blocks, as wide as the run (64 KiB a 16-token
Qwen3-8B page). Stores of runs of two pages (128 KiB rows) took 24.1-24.2 ms at 8k tokens against 22.5 for runs of
one (64 KiB rows) and 22.0 for one run, whether the copies were queued ahead or not
(probes/store_issue_bound_kv_adjacent_h200.json, store_lookahead_h200.json). Here the rows alone: 1k and 8k tokens'
bytes from one device buffer to rows of a width at shuffled 64 KiB-aligned places of a pinned host pool, queued behind
a spin (so the host issue is not timed) in batched calls of ``--batch`` rows; each width also issued as its 64 KiB
pieces (the same bytes, twice or more the rows). Median GPU ms over ``--reps``.

Run (GPU machine): ``python3 bench/probes/store_row_width.py --out $OUT/store_row_width_h200.json``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.common import _sm_clock_hz, env_info, finish_probe  # noqa: E402
from kvtier.kernels import batch_copy  # noqa: E402
from bench.probes.staged_store_chunks import GEO  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
PIECE = 64 * KiB


def rows_for(total: int, width: int, host_bytes: int, rng) -> np.ndarray:
    """Host offsets of ``total // width`` rows of ``width`` bytes at shuffled, distinct ``width``-aligned places."""
    n = total // width
    return rng.permutation(host_bytes // width)[:n].astype(np.uint64) * np.uint64(width)


def time_calls(calls, stream, reps: int, spin: int) -> list[float]:
    """GPU ms of the batched calls ``calls`` ((dst, src, size) arrays each) queued behind a spin, ``reps`` times
    after a warm-up."""
    out = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(spin)
            start.record(stream)
            for dst, src, size in calls:
                batch_copy.memcpy_batch(dst, src, size, stream.cuda_stream)
            end.record(stream)
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out[1:]


def time_rows(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, batch: int, stream, reps: int, spin: int) -> list:
    """GPU ms of the rows, in calls of ``batch``, queued behind a spin, ``reps`` times."""
    calls = [(dst[a:a + batch], src[a:a + batch], sizes[a:a + batch]) for a in range(0, sizes.size, batch)]
    return time_calls(calls, stream, reps, spin)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=512)
    args = ap.parse_args()
    t0 = time.time()
    rng = np.random.default_rng(0)
    pool = HostBlockPool(GEO, 4 * 8192 // GEO.page_size, layout="layer_first")  # pinned as kvtier pins it
    host = pool.host
    host_bytes = host.numel() * host.element_size()
    dev = torch.empty(8192 // GEO.page_size * GEO.block_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    spin = int(0.3 * _sm_clock_hz())
    res = {"env": env_info(), "batch": args.batch, "rows": []}
    for tokens in (1024, 8192):
        total = tokens // GEO.page_size * GEO.block_bytes
        for width in (PIECE, 2 * PIECE, 4 * PIECE, 8 * PIECE, total):
            for split in ((False, True) if PIECE < width < total else (False,)):
                if width == total:
                    h = np.zeros(1, dtype=np.uint64)
                else:
                    h = rows_for(total, width, host_bytes, rng)
                d = np.arange(h.size, dtype=np.uint64) * np.uint64(width)
                z = np.full(h.size, width, dtype=np.uint64)
                if split:
                    k = width // PIECE
                    h = (h[:, None] + np.arange(k, dtype=np.uint64) * np.uint64(PIECE)).reshape(-1)
                    d = (d[:, None] + np.arange(k, dtype=np.uint64) * np.uint64(PIECE)).reshape(-1)
                    z = np.full(h.size, PIECE, dtype=np.uint64)
                ms = time_rows(h + np.uint64(host.data_ptr()), d + np.uint64(dev.data_ptr()), z, args.batch, stream,
                               args.reps, spin)
                row = dict(tokens=tokens, width=width, split=split, rows=int(z.size), ms=ms,
                           median_ms=statistics.median(ms), gbps=total / statistics.median(ms) / 1e6)
                res["rows"].append(row)
                print(f"{tokens:5d} width {width // KiB:7d} KiB {'as 64 KiB' if split else '         '} "
                      f"rows {row['rows']:6d}: {row['median_ms']:7.3f} ms ({row['gbps']:.1f} GB/s) "
                      + " ".join(f"{m:.2f}" for m in ms), flush=True)
    torch.cuda.synchronize()
    finish_probe(res, pool, args.out, t0)


if __name__ == "__main__":
    main()
