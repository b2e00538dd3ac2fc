"""Probe: what the end-to-end harness's forward (``PagedDecoder.forward``) costs by new tokens and cached context,
without any tier: where a short prefill past a long cached prefix spends its time.

For each (context, new tokens): ``--reps`` synchronized forwards after two warm-ups (median ms); then one profiled
forward of ``--profile`` (context,new) with the top operators by self CPU and self CUDA time.

Run (GPU machine): ``python bench/probes/forward_cost.py --out p.json``
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from kvtier.e2e.engine import PagedPool  # noqa: E402
from kvtier.e2e.model import PagedDecoder, qwen3_config  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def forward_ms(model, pool, context: int, new: int, reps: int) -> float:
    dev = model.device
    slots = torch.arange(context + new, device=dev)
    toks = torch.randint(1, 1000, (new,), device=dev)
    times = []
    for i in range(reps + 2):
        sync()
        t = time.perf_counter()
        model.forward(pool, toks, context, slots[context:], slots)
        sync()
        if i >= 2:
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--cells", default="0:32,0:64,0:2080,2048:32,8192:32,2048:1,8192:1")
    ap.add_argument("--profile", default="2048:32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = qwen3_config(num_layers=args.layers)
    model = PagedDecoder.from_config(cfg, seed=0, device="cuda" if torch.cuda.is_available() else "cpu")
    pool = PagedPool(model, 8192 + 2080 + 64, 16)
    cells = {}
    for cell in args.cells.split(","):
        c, n = map(int, cell.split(":"))
        cells[cell] = forward_ms(model, pool, c, n, args.reps)
        print(f"context {c} new {n}: {cells[cell]:.2f} ms", flush=True)
    c, n = map(int, args.profile.split(":"))
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        forward_ms(model, pool, c, n, 1)
    by_device = "self_cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    tables = {key: prof.key_averages().table(sort_by=key, row_limit=18) for key in ("self_cpu_time_total", by_device)}
    for t in tables.values():
        print(t)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "forward_ms": cells, "profile": tables}, f, indent=1)


if __name__ == "__main__":
    main()
