"""Probe (issue 17): is the staged store of runs of two pages slowed by its gathers?

The staged ``layer_first`` store of 8k tokens in runs of two pages takes 23.9-24.2 ms against 22.0 for one run, on
every machine and staging knob tried (fragmentation_h200.json, probes/staged_store_knobs_h200.json), while the same
rows alone, queued from one device buffer, take 22.0 (probes/store_row_order_h200_*.json). This probe times the
store as it is and with its gather launches replaced by nothing (the copies then move whatever the staging buffers
hold: the time of the copy pipeline, its events and buffers, without the SM work), alternating, ``--rounds`` rounds;
then (``--gather-programs``) the store with its gather on that many programs (``Tuning.gather_programs``) and
``--gather-warps`` warps each.

Run (GPU machine): ``python3 bench/probes/store_without_gather.py --out $OUT/store_without_gather_h200.json``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.common import env_info, finish_probe, time_gpu_ms  # noqa: E402
from bench.probes.store_affinity import store_cases  # noqa: E402
from kvtier.kernels import StagedTransfer, Tuning  # noqa: E402
from kvtier.kernels.transfer import KernelLaunch  # noqa: E402

CASES = ((8192, 1), (8192, 2), (8192, 4), (8192, 0), (1024, 1), (1024, 2), (1024, 0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gather-programs", type=int, nargs="*", default=[])
    ap.add_argument("--gather-warps", type=int, default=Tuning().gather_warps)
    args = ap.parse_args()
    t0 = time.time()
    kv, pool, cases = store_cases(CASES)
    stager = StagedTransfer(kv, pool.host, layout="layer_first")
    fire = KernelLaunch.fire
    res = {"env": env_info(), "rows": []}
    for tokens, run, slots, ids in cases:
        row = dict(tokens=tokens, run=run, store=[], no_gather=[])
        for _ in range(args.rounds):
            for name in ("store", "no_gather"):
                KernelLaunch.fire = (lambda self, *a, **k: None) if name == "no_gather" else fire
                try:
                    row[name].append(time_gpu_ms(lambda: stager.store(slots, ids, check=False),
                                                 reps=args.reps)["median_ms"])
                finally:
                    KernelLaunch.fire = fire
        res["rows"].append(row)
        print(f"{tokens:5d} R={run or 'one':>3}: store " + " ".join(f"{m:.2f}" for m in row["store"])
              + " | no gather " + " ".join(f"{m:.2f}" for m in row["no_gather"]), flush=True)
    for programs in args.gather_programs:
        stager = StagedTransfer(kv, pool.host, layout="layer_first",
                                tuning=Tuning(gather_programs=programs, gather_warps=args.gather_warps))
        for tokens, run, slots, ids in cases:
            ms = time_gpu_ms(lambda: stager.store(slots, ids, check=False), reps=args.reps)["median_ms"]
            res["rows"].append(dict(tokens=tokens, run=run, gather_programs=programs, gather_warps=args.gather_warps,
                                    store=[ms]))
            print(f"{tokens:5d} R={run or 'one':>3}: gather on {programs} programs of {args.gather_warps} warps "
                  f"{ms:.2f}", flush=True)
    finish_probe(res, pool, args.out, t0)


if __name__ == "__main__":
    main()
