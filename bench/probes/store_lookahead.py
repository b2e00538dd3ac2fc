"""Probe (issue 17): a staged store's gathers issued a chunk ahead of its copies, against in order; and where the
host issue of a fragmented store goes.

``issue_chunks`` queues the gather of chunk c + 1 before the copies of chunk c ("ahead"). Issued in order (gather c,
copies c, gather c + 1, ...), the copy engine reaches chunk c + 1 only after the host has issued all of chunk c's
rows and then launched the next gather. The variants alternate, ``--rounds`` rounds of ``--reps`` stores each, for
``layer_first`` 1k and 8k tokens in runs of one and two pages and as one run. Then, with the device asleep (so no
call waits for queue space), one store's host time split into the driver's batched copies, the gather launches and
the rest.

Run (GPU machine): ``python3 bench/probes/store_lookahead.py --out $OUT/store_lookahead_h200.json``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.common import _sm_clock_hz, env_info, host_us_per_call, time_gpu_ms, write_json  # noqa: E402
from bench.probes.store_affinity import store_cases  # noqa: E402
from kvtier.kernels import StagedTransfer, batch_copy, staged  # noqa: E402
from kvtier.kernels.transfer import KernelLaunch  # noqa: E402

CASES = ((1024, 1), (1024, 2), (1024, 0), (8192, 1), (8192, 2), (8192, 0))  # (tokens, run of pages; 0: one run)


def in_order(d, work, to_host, chunks):
    """``issue_chunks`` with no chunk ahead: each chunk's two steps back to back."""
    done = None
    for chunk in chunks:
        staged._first_step(d, work, to_host, chunk)
        done = staged._second_step(d, work, to_host, chunk)
    return done


@contextlib.contextmanager
def variant(name: str):
    ahead = staged.issue_chunks
    if name == "in_order":
        staged.issue_chunks = in_order
    try:
        yield
    finally:
        staged.issue_chunks = ahead


class Timed:
    """Accumulates the host time of calls to ``owner.attr`` while installed."""

    def __init__(self, owner, attr: str) -> None:
        self.owner, self.attr, self.ms, self.calls = owner, attr, 0.0, 0
        self.inner = getattr(owner, attr)

    def __enter__(self):
        inner = self.inner

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.ms += (time.perf_counter() - t) * 1e3
                self.calls += 1
        setattr(self.owner, self.attr, timed)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.attr, self.inner)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--split-stores", type=int, default=10)
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "rows": [], "split": []}
    kv, pool, cases = store_cases(CASES)
    stager = StagedTransfer(kv, pool.host, layout="layer_first")
    for tokens, run, slots, ids in cases:
        row = dict(tokens=tokens, run=run, ahead=[], in_order=[], host_ahead=[], host_in_order=[])
        for _ in range(args.rounds):
            for name in ("ahead", "in_order"):
                with variant(name):
                    fn = lambda: stager.store(slots, ids, check=False)  # noqa: E731
                    row[name].append(time_gpu_ms(fn, reps=args.reps)["median_ms"])
                    row["host_" + name].append(host_us_per_call(fn, reps=args.reps) / 1e3)
        res["rows"].append(row)
        print(f"{tokens:5d} R={run or 'one':>3}: ahead " + " ".join(f"{m:.2f}" for m in row["ahead"])
              + " | in order " + " ".join(f"{m:.2f}" for m in row["in_order"])
              + f" | host {statistics.median(row['host_ahead']):.2f} / {statistics.median(row['host_in_order']):.2f}",
              flush=True)
    spin = int(0.2 * _sm_clock_hz())
    for tokens, run, slots, ids in cases:
        if run != 1:
            continue
        wall = []
        with Timed(batch_copy, "memcpy_batch") as drv, Timed(KernelLaunch, "fire") as fire:
            for _ in range(args.split_stores):
                torch.cuda.synchronize()
                torch.cuda._sleep(spin)
                t = time.perf_counter()
                stager.store(slots, ids, check=False)
                wall.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        n = args.split_stores
        split = dict(tokens=tokens, run=run, issue_ms=statistics.median(wall), driver_ms=drv.ms / n,
                     driver_calls=drv.calls / n, fire_ms=fire.ms / n, fires=fire.calls / n)
        res["split"].append(split)
        print(f"{tokens:5d} R=1 asleep: issue {split['issue_ms']:.2f} ms, driver {split['driver_ms']:.2f} "
              f"({split['driver_calls']:.0f} calls), fire {split['fire_ms']:.2f} ({split['fires']:.0f})", flush=True)
    stager = None
    pool.destroy()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
