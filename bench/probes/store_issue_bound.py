"""Probe (issue 17): is a fragmented staged store bound by its host issue or by the copy engine?

``time_gpu_ms`` times a store as the benchmark does: the GPU starts as the host issues, so a store whose issue is
slower than its copies takes its issue's time. Here each store is also timed with all of it queued first (the GPU
spins 150 ms, the store is issued meanwhile, CUDA events bracket it behind the spin): that is the device's own
time for the same copies, and the issue's wall time is recorded beside it. Variants: pitched rectangles, rows from
one thread, rows from two; Qwen3-8B KV, ``layer_first``, 8k tokens in runs of 1 and 2 pages and one run, 1k in runs
of 1 and 2; the whole sweep three times (the row mode is fast or slow per measurement).

Run (GPU machine): ``python3 bench/probes/store_issue_bound.py --out $OUT/store_issue_bound_h200.json``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.common import _sm_clock_hz, env_info, finish_probe, time_gpu_ms  # noqa: E402
from bench.probes.store_affinity import store_cases  # noqa: E402
from kvtier.kernels import StagedTransfer, Tuning  # noqa: E402

CASES = ((8192, 1), (8192, 2), (8192, 0), (1024, 1), (1024, 2))  # (tokens, run of pages; 0: one run)
VARIANTS = {
    "pitched": Tuning(store_rows_min_bytes=1 << 40),
    "rows_1thread": Tuning(store_rows_min_bytes=1, store_row_threads=1),
    "rows_2threads": Tuning(store_rows_min_bytes=1, store_row_threads=2),
    "rows_1thread_batch1024": Tuning(store_rows_min_bytes=1, store_row_threads=1, row_batch=1024),
}


def queued(stager: StagedTransfer, slots, ids, times: int) -> dict:
    """Median device time of the store with all of it queued behind a spin, and median issue wall time."""
    spin = int(0.15 * _sm_clock_hz())
    dev, issue = [], []
    for _ in range(times):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin)
        e0.record()
        t = time.perf_counter()
        ev = stager.store(slots, ids, check=False)
        issue.append((time.perf_counter() - t) * 1e3)
        torch.cuda.current_stream().wait_event(ev)
        e1.record()
        torch.cuda.synchronize()
        dev.append(e0.elapsed_time(e1))
    return dict(queued_ms=statistics.median(dev), issue_ms=statistics.median(issue), queued_all=dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "rows": []}
    kv, pool, cases = store_cases(CASES)
    stagers = {name: StagedTransfer(kv, pool.host, layout="layer_first", tuning=t) for name, t in VARIANTS.items()}
    for rnd in range(args.rounds):
        for name, stager in stagers.items():
            for tokens, run, slots, ids in cases:
                g = time_gpu_ms(lambda: stager.store(slots, ids, check=False), reps=10)["median_ms"]
                q = queued(stager, slots, ids, 5)
                res["rows"].append(dict(round=rnd, variant=name, tokens=tokens, run=run, gpu_ms=g, **q))
                print(f"{rnd} {name:24s} {tokens:5d} R={run or 'one':>3}: gpu {g:6.2f}  queued {q['queued_ms']:6.2f}"
                      f"  issue {q['issue_ms']:6.2f}", flush=True)
    stagers.clear()
    torch.cuda.synchronize()
    finish_probe(res, pool, args.out, t0)


if __name__ == "__main__":
    main()
