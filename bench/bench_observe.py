"""Overhead of kvtier's observers (metrics, transfer log) on the tier's engine-facing paths (issue 20).

Two KVTiers over one device KV pool: ``bare`` (no observers) and ``observed`` (``attach``: the transfer log at INFO
into a stream handler, Prometheus metrics with their HTTP endpoint). Each cycle serves one request of ``--pages``
pages: ``store`` (issue), wait, ``lookup``, ``load`` (issue), wait; the requests cycle through more prefixes than the
pool holds, so stores evict. Timed on the host: the issue calls (store + load), the lookup, the whole cycle (copies
included). Repeats alternate bare / observed; figures are medians over repeats of per-cycle medians, as ratios
observed / bare. A scrape (the metrics' sync, which takes the tier's lock) is timed apart.

The index benchmark (``bench/bench_index.py``) runs ``PageTrie`` alone, which no observer touches: its overhead is
nil by construction; the lookup here is the index through the tier.

Run on the GPU machine: ``python bench/bench_observe.py --out $OUT/observe_h200.json``; ``--smoke`` on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import os
import statistics
import sys
import time
import urllib.request

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import env_info, make_pool, write_json  # noqa: E402
from kvtier.config import TierConfig  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.observe.attach import attach  # noqa: E402
from kvtier.observe.transfer_log import LOGGER_NAME  # noqa: E402
from kvtier.tier import KVTier  # noqa: E402


def cycle(tier: KVTier, toks: np.ndarray, src: torch.Tensor, dst: torch.Tensor) -> dict:
    t0 = time.perf_counter()
    task = tier.store(toks, None, src)
    t1 = time.perf_counter()
    tier.wait(task)
    t2 = time.perf_counter()
    tier.lookup(toks, None)
    t3 = time.perf_counter()
    load = tier.load(toks, None, dst)
    t4 = time.perf_counter()
    tier.wait(load)
    tier.poll()
    t5 = time.perf_counter()
    return {"issue_us": (t1 - t0 + t4 - t3) * 1e6, "lookup_us": (t3 - t2) * 1e6, "cycle_us": (t5 - t0) * 1e6}


def run(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        geo = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float16, page_size=16)
    else:
        geo = KVGeometry(num_layers=28, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)
    P, n = geo.page_size, args.pages
    kv = make_pool(geo, 2 * n * P + P, device)
    src = torch.arange(0, n * P, dtype=torch.int64, device=device)
    dst = torch.arange(n * P, 2 * n * P, dtype=torch.int64, device=device)
    block = geo.token_bytes * P
    gb = args.pool_requests * n * block / (1 << 30) * 1.001
    config = TierConfig(cpu_cache_gb=gb, page_size=P, layerwise=False)
    bare = KVTier(kv, config)
    observed = KVTier(kv, config)
    sink = io.StringIO()
    log = logging.getLogger(LOGGER_NAME)
    log.addHandler(logging.StreamHandler(sink))
    log.setLevel(logging.INFO)
    log.propagate = False
    obs = attach(observed, dataclasses.replace(config, metrics_port=0), labels={"tp_rank": "0"})
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, n * P).astype(np.int64) for _ in range(args.pool_requests * 2)]
    runs = {"bare": [], "observed": []}
    for tier in (bare, observed):  # warm-up (kernels compiled, pools touched)
        for p in prompts[:3]:
            cycle(tier, p, src, dst)
    for rep in range(args.repeats):
        for name, tier in (("bare", bare), ("observed", observed)) if rep % 2 == 0 else (
                ("observed", observed), ("bare", bare)):
            cells = [cycle(tier, prompts[i % len(prompts)], src, dst) for i in range(args.cycles)]
            runs[name].append({k: statistics.median(c[k] for c in cells) for k in cells[0]})
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    ratios = {k: med["observed"][k] / med["bare"][k] for k in med["bare"]}
    scrape = []
    for _ in range(20):
        t0 = time.perf_counter()
        obs.metrics.sync()
        scrape.append((time.perf_counter() - t0) * 1e6)
    with urllib.request.urlopen(f"http://127.0.0.1:{obs.port}/metrics", timeout=10) as r:
        exposition = r.read().decode()
    assert "kvtier_transfer_tokens_total" in exposition
    lines = sink.getvalue().count("\n")
    obs.close()
    stats = observed.stats()
    bare.destroy()
    observed.destroy()
    return {"device": device, "geometry": str(geo), "pages_per_request": n, "request_mb": n * block / 1e6,
            "pool_requests": args.pool_requests, "repeats": args.repeats, "cycles": args.cycles,
            "median_us": med, "observed_over_bare": ratios, "worst_ratio": max(ratios.values()),
            "sync_us_median": statistics.median(scrape), "log_lines": lines,
            "evicted_pages_observed": stats["pages_evicted"], "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "observe_h200.json"))
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--pool-requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--cycles", type=int, default=40)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.pages, args.repeats, args.cycles = 4, 2, 4
    out = run(args)
    out["env"] = env_info()
    out["command"] = "python bench/bench_observe.py" + (" --smoke" if args.smoke else "")
    write_json(args.out, out)
    print({k: out[k] for k in ("observed_over_bare", "worst_ratio", "sync_us_median", "log_lines")})


if __name__ == "__main__":
    main()
