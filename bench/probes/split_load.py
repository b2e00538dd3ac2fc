"""Probe (issue 17): a whole load of scattered host blocks split by layers between the copy engine and the SMs.

A whole load of blocks in runs of one or two pages is paced by the copy engine's rows or its host issue when staged,
and by the SM path's bandwidth when direct (one run staged: 21.9 ms at 8k tokens; direct per layer 23.7-24.8). Here
layers ``[0, k)`` go staged (``StagedTransfer.load``: copy engine, then scatter on the work stream) while layers
``[k, L)`` go through a ``DirectCopy`` launched per layer on a side stream that starts with the work stream; the work
stream waits for both. Cells: ``layer_first`` and ``page_first``, 1k and 8k tokens of Qwen3-8B KV, R in 1, 2 and one
run; ``k`` in ``--splits`` (0: all direct per layer; L: all staged). GPU time (CUDA events, medians of 10 reps in 3
rounds) and host issue; every split's bytes checked once; for 8k R=1, a GEMM beside each split.

Run (GPU machine): ``python3 bench/probes/split_load.py --out $OUT/split_load_h200.json``
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
from bench.bench_fragmentation import _check_load, fragmented_ids  # noqa: E402
from bench.common import (env_info, gemm_beside, host_us_per_call, make_pool, random_slots,  # noqa: E402
                          time_in_rounds, write_json)
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import DirectCopy, StagedTransfer  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402

GEO = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)


def split_load(stager: StagedTransfer, direct: DirectCopy, slots, ids, k: int, side: torch.cuda.Stream):
    """An issue function: layers [0, k) staged on the current stream, [k, L) direct per layer on ``side``."""
    L = GEO.num_layers
    begin, end = torch.cuda.Event(), torch.cuda.Event()

    def run():
        work = torch.cuda.current_stream()
        if k < L:
            begin.record(work)
            side.wait_event(begin)
            for layer in range(k, L):
                direct.launch(layer, stream=side)
            end.record(side)
        if k:
            ev = stager.load(slots, ids, layers=range(0, k), check=False)
            if ev is not None:
                work.wait_event(ev)
        if k < L:
            work.wait_event(end)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--splits", default="0,12,16,20,24,36")
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--runs", default="1,2,0")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "rows": [], "gemm": []}
    tokens_list = [int(t) for t in args.tokens.split(",")]
    n_max = max(tokens_list) // GEO.page_size
    num_blocks = 2 * n_max + 64
    kv = make_pool(GEO, 2 * max(tokens_list) + 64 * GEO.page_size, "cuda")
    side = torch.cuda.Stream()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rng = np.random.default_rng(0)
    splits = [int(k) for k in args.splits.split(",")]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for layout in ("layer_first", "page_first"):
        pool = HostBlockPool(GEO, num_blocks, layout=layout)
        pool.host.view(torch.uint8).random_(0, 256)
        stager = StagedTransfer(kv, pool.host, layout=layout)
        cells = []
        for tokens in tokens_list:
            n = tokens // GEO.page_size
            for run in (int(r) for r in args.runs.split(",")):
                ids = torch.from_numpy(fragmented_ids(n, run, num_blocks, rng))
                slots = random_slots(n, GEO.page_size, kv.num_slots, "cuda", gen)
                direct = DirectCopy(kv, pool.host, slots, ids.cuda(), to_host=False, layout=layout, check=False)
                for k in splits:
                    fn = split_load(stager, direct, slots, ids, k, side)
                    _check_load(kv, pool.host, layout, slots, ids, fn)
                    row = dict(layout=layout, tokens=tokens, run=run, staged_layers=k,
                               host_ms=host_us_per_call(fn, reps=10) / 1e3)
                    cells.append((row, fn))
                    if tokens == max(tokens_list) and run == 1:
                        g = gemm_beside(fn, tokens * GEO.token_bytes, a, b, side=torch.cuda.Stream(), n_copy=4)
                        res["gemm"].append(dict(layout=layout, tokens=tokens, run=run, staged_layers=k,
                                                **{x: y for x, y in g.items() if x != "rounds"}))
                        print(f"gemm {layout} R={run} k={k}: {g['slowdown_pct']:+.2f}%", flush=True)
        time_in_rounds(cells, args.rounds, reps=10)
        for row, _ in cells:
            res["rows"].append(row)
            print(f"{layout:11s} {row['tokens']:5d} R={row['run'] or 'one':>3} k={row['staged_layers']:2d} "
                  f"gpu {row['gpu_ms']:7.3f} ms {[round(x, 2) for x in row['gpu_ms_rounds']]} host "
                  f"{row['host_ms']:6.2f} ms", flush=True)
        torch.cuda.synchronize()
        del stager, cells
        pool.destroy()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
