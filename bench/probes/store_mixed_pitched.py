"""Probe (issue 17): a fragmented ``layer_first`` store with a fraction of its runs as pitched rectangles.

A store of single pages is 18,432 copy-engine rows at 8k tokens of Qwen3-8B KV: as separate rows the copy engine runs
at the one-run speed but each row costs the host 0.45-1.8 us to issue (the store is paced by its issue on a slow
host); as one pitched rectangle per run (36 rows) the host issues little but the copy engine runs ~1.3x slower. Here a
fraction ``f`` of each chunk's runs goes as rectangles (``cuMemcpy3DBatchAsync``) and the rest as rows
(``cuMemcpyBatchAsync``), the whole span staged at once. Cells: 1k and 8k tokens, runs of 1 and 2 pages and one
run; ``f`` in ``--fractions``. GPU time (CUDA events, medians of 10 reps in 3 rounds) and host issue (one issue at a
time on a drained device), and each cell's stored bytes read back by a plain staged load and compared.

Run (GPU machine): ``python3 bench/probes/store_mixed_pitched.py --out $OUT/store_mixed_pitched_h200.json``
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
from bench.common import env_info, finish_probe, host_us_per_call, make_pool, random_slots, time_in_rounds  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import StagedTransfer  # noqa: E402
from kvtier.kernels.staged import Rects  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402

GEO = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)


def mixed(rects: Rects, fraction: float) -> Rects:
    """Every run's rectangle where ``fraction`` of them (spread evenly) stay rectangles and the rest become their
    rows (one-row rectangles, which the batched copy sends as rows)."""
    n = rects.width.size
    keep = np.zeros(n, dtype=bool)
    if fraction > 0:
        keep[np.unique(np.floor(np.arange(0, n, 1 / fraction)).astype(np.int64).clip(0, n - 1))] = True
    rows = rects.select(~keep).rows()
    one = np.ones(rows.width.size, dtype=np.uint64)
    as_rows = Rects(rows.host_off, rows.stg_off, rows.width, one, rows.width, rows.width)
    kept = rects.select(keep)
    return Rects(*(np.concatenate([a, b]) for a, b in zip(kept, as_rows)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--fractions", default="0,0.1,0.2,0.3,1")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "rows": []}
    tokens_list = (1024, 8192)
    num_blocks = 2 * max(tokens_list) // GEO.page_size + 64
    kv = make_pool(GEO, 2 * max(tokens_list) + 64 * GEO.page_size, "cuda")
    pool = HostBlockPool(GEO, num_blocks, layout="layer_first")
    stager = StagedTransfer(kv, pool.host, layout="layer_first")
    base_rects = StagedTransfer.span_rects
    fraction = {"f": None}

    def span_rects(self, plan, host_ids, span):
        r = base_rects(self, plan, host_ids, span)
        return r if fraction["f"] is None else mixed(r, fraction["f"])
    StagedTransfer.span_rects = span_rects
    stager.pitched = lambda span, host_ids, to_host, runs=None: span.count >= 8  # every store chunk as rectangles
    gen = torch.Generator(device="cuda").manual_seed(0)
    rng = np.random.default_rng(0)
    cells = []
    for tokens in tokens_list:
        n = tokens // GEO.page_size
        for run in (1, 2, 0):
            ids = torch.from_numpy(fragmented_ids(n, run, num_blocks, rng))
            both = random_slots(2 * n, GEO.page_size, kv.num_slots, "cuda", gen)
            slots, back = both[:n * GEO.page_size], both[n * GEO.page_size:]
            for f in (float(x) for x in args.fractions.split(",")):
                def fn(ids=ids, slots=slots, f=f):
                    fraction["f"] = f  # the fraction of this cell's runs that go pitched
                    return stager.store(slots, ids, check=False)
                pool.host.view(torch.uint8)[:8].zero_()  # (the load below checks every stored byte)
                torch.cuda.current_stream().wait_event(fn())
                stager.load(back, ids, check=False)  # the plain staged load, read back to other slots
                torch.cuda.synchronize()
                exact = all(torch.equal(b.view(torch.uint8)[back], b.view(torch.uint8)[slots]) for b in kv.buffers)
                row = dict(tokens=tokens, run=run, pitched_fraction=f, exact=exact,
                           host_ms=host_us_per_call(fn, reps=10) / 1e3)
                cells.append((row, fn))
    time_in_rounds(cells, args.rounds, reps=10)
    for row, _ in cells:
        res["rows"].append(row)
        print(f"{row['tokens']:5d} R={row['run'] or 'one':>3} f={row['pitched_fraction']:.1f} gpu {row['gpu_ms']:7.3f} "
              f"ms {[round(x, 2) for x in row['gpu_ms_rounds']]} host {row['host_ms']:6.2f} ms exact {row['exact']}",
              flush=True)
    torch.cuda.synchronize()
    finish_probe(res, pool, args.out, t0)


if __name__ == "__main__":
    main()
