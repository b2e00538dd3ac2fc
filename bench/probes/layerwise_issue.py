"""Probe (issue 17): where a layerwise load's host issue time goes, and whether the bench's measure of it holds.

``bench_fragmentation`` times a layerwise load's issue with ``host_us_per_call``: 15 issues back to back, the GPU
never drained between them, so hundreds of milliseconds of copies pile up in the streams' queues and an issue can
wait for queue space. This probe times the 36-layer load of 8192 tokens of Qwen3-8B KV (``layer_first``, one run
of host blocks through a :class:`StagedCopy`; runs of one through a :class:`DirectCopy`) both ways: the bench's,
and one issue at a time after a synchronize, the GPU spinning 40 ms (longer than the issue) so that the copies
queue behind it. Then, the second way, the issue's host time split by the functions it calls (wrapped with
timers: the layer groups, the chunk plan, the copy-engine copies, the gather/scatter launch, event records and
stream waits, raw events and the one-chunk copy; the rest is the loop itself). Paths: ``staged_copy`` (a load of one
chunk of one run issues through raw handles), ``staged_copy_generic`` (the same copy forced through
``issue_chunks``), ``direct_copy``; ``--layouts`` and ``--runs`` choose the cells.

Run (GPU machine): ``python3 bench/probes/layerwise_issue.py --out $OUT/layerwise_issue_h200.json``
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.bench_fragmentation import fragmented_ids  # noqa: E402
from bench.common import env_info, host_us_per_call, make_pool, random_slots, write_json  # noqa: E402
from bench.probes.store_rows_locality import GEO  # noqa: E402
from kvtier.kernels import DirectCopy, StagedTransfer, raw_events, staged, transfer  # noqa: E402
from kvtier.kernels.staged_copy import StagedCopy  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402

SPIN_MS = 40.0


def one_at_a_time_us(fn, reps: int) -> list[float]:
    """Host us of each of ``reps`` issues of ``fn``, each after a synchronize and a 40 ms GPU spin."""
    cycles = int(SPIN_MS * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return times


class Timers:
    """Accumulating wall-clock timers wrapped around methods (class attributes), removed by :meth:`restore`."""

    def __init__(self) -> None:
        self.us: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._saved = []
        self._depth = 0

    def wrap(self, owner, attr: str, name: str) -> None:
        orig = getattr(owner, attr)
        timers = self

        @functools.wraps(orig)
        def timed(*a, **k):
            outer = timers._depth == 0  # count only outermost timed calls: nested time is the caller's
            timers._depth += 1
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                timers._depth -= 1
                if outer:
                    timers.us[name] += (time.perf_counter() - t) * 1e6
                    timers.calls[name] += 1
        self._saved.append((owner, attr, orig))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, orig in reversed(self._saved):
            setattr(owner, attr, orig)
        self._saved.clear()


def breakdown(fn, reps: int) -> dict:
    t = Timers()
    t.wrap(StagedTransfer, "layer_groups", "layer_groups")
    t.wrap(StagedCopy, "_plan", "plan")
    t.wrap(StagedTransfer, "copy_runs", "copy_runs")
    t.wrap(transfer.KernelLaunch, "fire", "fire")
    t.wrap(torch.cuda.Event, "record", "event_record")
    t.wrap(torch.cuda.Stream, "wait_event", "wait_event")
    t.wrap(torch.cuda.Stream, "wait_stream", "wait_stream")
    t.wrap(staged.StagingBuffers, "take_buffer", "take_buffer")
    t.wrap(raw_events.RawEvent, "record", "raw_record")
    t.wrap(raw_events.RawEvent, "wait", "raw_wait")
    t.wrap(staged.SingleCopy, "issue", "single_copy")
    try:
        fn()
        t.us.clear()
        t.calls.clear()
        total = sum(one_at_a_time_us(fn, reps))
    finally:
        t.restore()
    out = {k: dict(us_per_issue=v / reps, calls_per_issue=t.calls[k] / reps) for k, v in t.us.items()}
    out["total_us_per_issue"] = total / reps
    out["rest_us_per_issue"] = (total - sum(t.us.values())) / reps
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--runs", default="0,1,4", help="host block run lengths (0: one run)")
    ap.add_argument("--layouts", default="layer_first")
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "spin_ms": SPIN_MS, "rows": []}
    tokens = 8192
    n = tokens // GEO.page_size
    num_blocks = 2 * n + 64
    kv = make_pool(GEO, 2 * tokens + 64 * GEO.page_size, "cuda")
    for layout, run in ((lo, int(r)) for lo in args.layouts.split(",") for r in args.runs.split(",")):
        pool = HostBlockPool(GEO, num_blocks, layout=layout)
        stager = StagedTransfer(kv, pool.host, layout=layout)
        gen = torch.Generator(device="cuda").manual_seed(0)
        slots = random_slots(n, GEO.page_size, kv.num_slots, "cuda", gen)
        rng = np.random.default_rng(0)
        ids = torch.from_numpy(fragmented_ids(n, run, num_blocks, rng))
        generic = StagedCopy(stager, slots, ids, to_host=False, check=False)
        generic._one_chunk[1] = None  # every layer through issue_chunks, as before the one-chunk path
        copies = {"staged_copy": StagedCopy(stager, slots, ids, to_host=False, check=False),
                  "staged_copy_generic": generic,
                  "direct_copy": DirectCopy(kv, pool.host, slots, ids.cuda(), to_host=False, layout=layout,
                                            check=False)}
        for name, copy in copies.items():
            def fn(copy=copy):
                for layer in range(GEO.num_layers):
                    copy.launch(layer)
            bench_way = [host_us_per_call(fn, reps=args.reps) for _ in range(3)]
            single = one_at_a_time_us(fn, args.reps)
            row = dict(layout=layout, run=run, path=name, bench_method_us=bench_way, one_at_a_time_us=single,
                       one_at_a_time_median_us=statistics.median(single), breakdown=breakdown(fn, args.reps))
            res["rows"].append(row)
            print(f"{layout} R={run or 'one'} {name}: bench method {[round(x) for x in bench_way]} us, one at a "
                  f"time median {row['one_at_a_time_median_us']:.0f} us (min {min(single):.0f}, max "
                  f"{max(single):.0f})", flush=True)
            for k, v in row["breakdown"].items():
                print("   ", k, v, flush=True)
        torch.cuda.synchronize()
        del stager, copies, generic
        pool.destroy()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
