"""Probe (issue 17): does the order of a fragmented store's rows within each batched call set the copy engine's time?

The staged ``layer_first`` store of runs of two pages (128 KiB rows) takes 24.1 ms at 8k tokens and 3.14 at 1k,
queued ahead or not, against 22.0 / 2.81 for one run (store_lookahead_h200.json); yet 128 KiB rows at shuffled places
of the pool, one call per 512, took 22.9 / 2.87 (store_row_width_h200.json), and 64 KiB rows 24.8 / 3.12 there
against 22.5 / 3.05 in the store. The rows here are the store's own (``StagedTransfer``'s plan: its layer groups,
chunks and rows, each chunk one call), from one device buffer holding the whole store, queued behind a spin so the
host issue is not timed; within each call in the store's order (layer by layer, runs in the chunk's order), sorted by
host address, shuffled, and run by run (a run's layers one after the other). Median GPU ms over ``--reps``. Then (unless
``--stores 0``) a cProfile of ``--stores`` 1k stores in runs of one page, the device asleep.

Run (GPU machine): ``python3 bench/probes/store_row_order.py --out $OUT/store_row_order_h200.json``
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
from bench.probes.store_affinity import store_cases  # noqa: E402
from bench.probes.store_issue_profile import profile_stores  # noqa: E402
from bench.probes.store_row_width import time_calls  # noqa: E402
from kvtier.kernels import StagedTransfer  # noqa: E402
from kvtier.kernels.checks import LayerSpan  # noqa: E402
from kvtier.kernels.staged import ChunkRuns, block_runs  # noqa: E402

CASES = ((1024, 1), (1024, 2), (1024, 4), (1024, 0), (8192, 1), (8192, 2), (8192, 4), (8192, 0))
ORDERS = ("store", "sorted", "shuffled", "run_major")


def store_calls(stager: StagedTransfer, ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The store's rows, one (host offset, device offset, width) triple per chunk, the device offsets into one
    buffer holding the chunks one after the other."""
    span = LayerSpan(0, stager.kv.geometry.num_layers)
    calls, base = [], 0
    for i, sub in enumerate(stager.layer_groups(span, ids, True)):
        for c in stager.chunks(ids.size, sub.count, True, short_edge=i == 0):
            chunk_ids = ids[c.first:c.first + c.pages]
            rows = stager.span_rows(ChunkRuns(block_runs(chunk_ids)), chunk_ids, sub, to_host=True)
            calls.append((rows.host_off, rows.stg_off + np.uint64(base), rows.width))
            base += int(rows.width.sum())
    return calls


def reorder(call, order: str, rng, pitch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A chunk's rows in ``order``; ``pitch``: host bytes from a layer's rows to the next layer's."""
    h, d, z = call
    if order == "store":
        idx = np.arange(h.size)
    elif order == "sorted":
        idx = np.argsort(h, kind="stable")
    elif order == "shuffled":
        idx = rng.permutation(h.size)
    else:  # run_major: a run's rows (one per layer, a pitch apart) one after the other
        idx = np.lexsort((h, h % np.uint64(pitch)))
    return h[idx], d[idx], z[idx]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stores", type=int, default=10)
    args = ap.parse_args()
    t0 = time.time()
    rng = np.random.default_rng(0)
    kv, pool, cases = store_cases(CASES)
    stager = StagedTransfer(kv, pool.host, layout="layer_first")
    host_ptr = pool.host.data_ptr()
    dev = torch.empty(8192 // kv.geometry.page_size * kv.geometry.block_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    spin = int(0.3 * _sm_clock_hz())
    res = {"env": env_info(), "rows": [], "profile": None}
    for tokens, run, _, ids in cases:
        calls = store_calls(stager, ids.numpy())
        row = dict(tokens=tokens, run=run, calls=len(calls), rows=int(sum(c[2].size for c in calls)))
        for order in ORDERS:
            calls_o = [reorder(c, order, rng, stager.layer_pitch) for c in calls]
            ms = time_calls([(h + np.uint64(host_ptr), d + np.uint64(dev.data_ptr()), z) for h, d, z in calls_o],
                            stream, args.reps, spin)
            row[order] = statistics.median(ms)
            row[order + "_ms"] = ms
        res["rows"].append(row)
        print(f"{tokens:5d} R={run or 'one':>3} ({row['calls']} calls, {row['rows']} rows): "
              + " ".join(f"{o} {row[o]:.3f}" for o in ORDERS), flush=True)
    if args.stores:
        _, _, slots, ids = next(c for c in cases if c[:2] == (1024, 1))
        wall, text = profile_stores(stager, slots, ids, args.stores, int(0.1 * _sm_clock_hz()), 35)
        res["profile"] = dict(tokens=1024, run=1, issue_ms=wall, text=text)
        print(text[:7000])
    finish_probe(res, pool, args.out, t0)


if __name__ == "__main__":
    main()
