"""Probe (issue 17): the staged store of a fragmented pool against its staging size and copy kind.

The staged store of a fragmented ``layer_first`` chunk ends in one batched driver call per staging chunk; alone,
the copy engine moves the same rows in fewer ms (``probes/copy_engine_rows_h200.json``). This probe times
``StagedTransfer.store`` (Qwen3-8B KV, 1k and 8k tokens, host blocks in shuffled runs of R) with staging buffers of
32 / 64 / 128 MiB, pitched rectangles or rows (rows issued from 1-4 threads), the default, and the default with one
knob moved (staging size, buffers, rows per call, threads); every variant's
R=1 store is checked byte for byte once. ``--variants`` and ``--layouts`` pick a subset.

Run (GPU machine): ``python3 bench/probes/staged_store_chunks.py --out $OUT/staged_store_chunks_h200.json``
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
from bench.common import env_info, make_pool, random_slots, time_gpu_ms, write_json  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import StagedTransfer, Tuning, copy_pages_ref  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402

GEO = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)
MiB = 1 << 20
ROWS = {"pitched_min_rows": 1 << 20}  # every fragmented layer_first run as rows, not one pitched rectangle
PITCHED = {"store_rows_min_bytes": 1 << 40}  # every fragmented layer_first store run as one pitched rectangle
VARIANTS = {
    "32MiB_pitched": Tuning(**PITCHED),
    "32MiB_rows": Tuning(**ROWS),
    "32MiB_default": Tuning(),
    "64MiB_pitched": Tuning(staging_bytes=64 * MiB, **PITCHED),
    "64MiB_rows": Tuning(staging_bytes=64 * MiB, **ROWS),
    "128MiB_pitched": Tuning(staging_bytes=128 * MiB, **PITCHED),
    "128MiB_rows": Tuning(staging_bytes=128 * MiB, **ROWS),
    # rows issued from 1-4 threads (Tuning.store_row_threads), every store run as rows
    **{f"32MiB_rows_{t}threads": Tuning(store_rows_min_bytes=1, store_row_threads=t) for t in (1, 2, 3, 4)},
    # the default with one knob moved: bigger staging, a third buffer, calls of 128 rows (from one or two threads)
    "64MiB_default": Tuning(staging_bytes=64 * MiB),
    "32MiB_3buffers": Tuning(num_buffers=3),
    "32MiB_batch128": Tuning(row_batch=128),
    "32MiB_batch128_2threads": Tuning(row_batch=128, store_row_threads=2),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--layouts", nargs="*", default=["layer_first", "page_first"])
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "rows": []}
    num_blocks = 2 * 8192 // GEO.page_size + 64
    kv = make_pool(GEO, 2 * 8192 + 64 * GEO.page_size)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for layout in args.layouts:
        pool = HostBlockPool(GEO, num_blocks, layout=layout)
        for name in args.variants:
            tuning = VARIANTS[name]
            stager = StagedTransfer(kv, pool.host, layout=layout, tuning=tuning)
            rng = np.random.default_rng(0)
            for tokens in (1024, 8192):
                n = tokens // GEO.page_size
                slots = random_slots(n, GEO.page_size, kv.num_slots, generator=gen)
                for run in (1, 2, 4, 8, 16, 0):
                    ids = torch.from_numpy(fragmented_ids(n, run, num_blocks, rng))
                    if run == 1:
                        ev = stager.store(slots, ids)
                        ev.synchronize()
                        want = torch.empty_like(pool.host)
                        want.copy_(pool.host)
                        copy_pages_ref(kv, want, slots, ids, to_host=True, layout=layout)
                        exact = bool(torch.equal(want.view(torch.uint8), pool.host.view(torch.uint8)))
                        del want
                    t = time_gpu_ms(lambda: stager.store(slots, ids, check=False), reps=args.reps)
                    row = dict(layout=layout, variant=name, tokens=tokens, run=run, ms=t["median_ms"],
                               p20=t["p20_ms"], p80=t["p80_ms"], **({"exact": exact} if run == 1 else {}))
                    res["rows"].append(row)
                    print(layout, name, tokens, f"R={run or 'one'}", f"{t['median_ms']:.2f} ms",
                          row.get("exact", ""), flush=True)
            stager = None
            torch.cuda.synchronize()
        pool.destroy()
    # worst R over one run, per (layout, variant, tokens)
    summary = {}
    for r in res["rows"]:
        if r["run"] == 0:
            key = f"{r['layout']}/{r['variant']}/{r['tokens']}"
            worst = max(x["ms"] for x in res["rows"] if x["layout"] == r["layout"] and x["variant"] == r["variant"]
                        and x["tokens"] == r["tokens"])
            summary[key] = dict(one_run_ms=r["ms"], worst_over_one_run=worst / r["ms"])
    res["summary"] = summary
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
