"""Probe (issue 17): what about a staged store's gathers slows its copies of runs of two to four pages?

With its gather launches replaced by nothing, the staged ``layer_first`` store of 8k tokens in runs of two pages takes
22.0 ms (one run 21.9); with them 23.9, whatever the gather's programs, the staging size, the buffers or the rows per
call (``probes/store_without_gather_h200.json``, ``store_gather_programs_h200.json``, ``staged_store_knobs_h200.json``).
Variants, alternating, ``--rounds`` rounds of ``--reps`` stores each:

* ``store``: as it is.
* ``no_gather``: the gather launches replaced by nothing (the copies move whatever the staging buffers hold).
* ``tiny_kernel``: each gather replaced by a kernel that does nothing for ~0.1 us (a launch and a cross-stream event
  without the gather's memory traffic).
* ``side_stream``: each gather on a stream of its own, joined back to the work stream (the copy stream waits on it
  through the work stream, as before).
* ``split_64k``: with gathers, every copy row wider than 64 KiB issued as 64 KiB pieces (the same bytes).
* ``all_gathers_first``: as many staging buffers as chunks, so every gather is issued (and runs) before the copies
  need them; the copies then run with no gather beside them after the first few.
* ``evict_l2``: each gather followed, on the work stream, by a 64 MiB memset of a scratch buffer, which pushes the
  gathered chunk out of the L2 (50 MiB on an H200) before the copy engine reads it.

Run (GPU machine): ``python3 bench/probes/store_gather_interference.py --out $OUT/store_gather_interference_h200.json``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.common import env_info, finish_probe, time_gpu_ms  # noqa: E402
from bench.probes.store_affinity import store_cases  # noqa: E402
from kvtier.kernels import StagedTransfer, Tuning  # noqa: E402
from kvtier.kernels.row_issue import RowIssuer  # noqa: E402
from kvtier.kernels.transfer import KernelLaunch  # noqa: E402

CASES = ((8192, 1), (8192, 2), (8192, 4), (8192, 0), (1024, 1), (1024, 2), (1024, 0))
VARIANTS = ("store", "no_gather", "tiny_kernel", "side_stream", "split_64k", "all_gathers_first", "evict_l2")
PIECE = 64 << 10


def split_rows(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows wider than 64 KiB as 64 KiB pieces (row widths here are whole multiples of it), in order."""
    k = np.maximum(sizes // np.uint64(PIECE), np.uint64(1)).astype(np.int64)
    row = np.repeat(np.arange(sizes.size), k)
    piece = (np.arange(row.size) - np.repeat(np.cumsum(k) - k, k)).astype(np.uint64) * np.uint64(PIECE)
    return dsts[row] + piece, srcs[row] + piece, np.minimum(sizes[row] - piece, np.uint64(PIECE))


@contextlib.contextmanager
def variant(name: str, side: torch.cuda.Stream, scratch: torch.Tensor):
    """Patches of ``name``'s variant, undone on exit."""
    fire, issue = KernelLaunch.fire, RowIssuer.issue
    if name == "no_gather":
        KernelLaunch.fire = lambda self, *a, **k: None
    elif name == "tiny_kernel":
        KernelLaunch.fire = lambda self, *a, **k: torch.cuda._sleep(100)
    elif name == "side_stream":
        def on_side(self, span, programs, stream, blocks_layer0=None):
            work = torch.cuda.current_stream()
            side.wait_stream(work)
            with torch.cuda.stream(side):
                fire(self, span, programs, None, blocks_layer0=blocks_layer0)
            work.wait_stream(side)
        KernelLaunch.fire = on_side
    elif name == "evict_l2":
        def then_evict(self, *a, **k):
            fire(self, *a, **k)
            scratch.zero_()
        KernelLaunch.fire = then_evict
    elif name == "split_64k":
        RowIssuer.issue = lambda self, dsts, srcs, sizes, stream: issue(self, *split_rows(dsts, srcs, sizes), stream)
    try:
        yield
    finally:
        KernelLaunch.fire, RowIssuer.issue = fire, issue


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args()
    t0 = time.time()
    kv, pool, cases = store_cases(CASES)
    stager = StagedTransfer(kv, pool.host, layout="layer_first")
    many = StagedTransfer(kv, pool.host, layout="layer_first", tuning=Tuning(num_buffers=48))  # > 8k's 37 chunks
    side = torch.cuda.Stream()
    scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    res = {"env": env_info(), "rows": []}
    for tokens, run, slots, ids in cases:
        row = dict(tokens=tokens, run=run, **{name: [] for name in args.variants})
        for _ in range(args.rounds):
            for name in args.variants:
                s = many if name == "all_gathers_first" else stager
                with variant(name, side, scratch):
                    row[name].append(time_gpu_ms(lambda: s.store(slots, ids, check=False), reps=args.reps)["median_ms"])
        res["rows"].append(row)
        print(f"{tokens:5d} R={run or 'one':>3}: " + "  ".join(
            f"{name} {statistics.median(row[name]):.2f}" for name in args.variants), flush=True)
    finish_probe(res, pool, args.out, t0)


if __name__ == "__main__":
    main()
