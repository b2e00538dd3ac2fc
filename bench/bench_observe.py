"""Overhead of kvtier's observers (metrics, transfer log) on the tier's engine-facing paths (issue 20).

Two KVTiers over one device KV pool, one observed and one bare (the observed instance alternates every repeat), run
one cycle each in turn, the order alternating; each cycle (store, wait, lookup, load, wait of a ``--pages`` request,
stores evicting) is timed on the host, and each observed figure is divided by its neighbouring bare one. Observer
sets: ``metrics``, ``log``, ``metrics+log``; figures: the median over repeats of each repeat's median paired ratio.
A scrape (the metrics' sync) is timed apart.

Run on the GPU machine: ``python bench/bench_observe.py --out $OUT/observe_h200.json``; ``--smoke`` on a CPU.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import statistics
import sys
import time
import urllib.request

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import progress  # noqa: E402
from bench.common import ROOT, call_us, env_info, make_pool, write_json  # noqa: E402
from kvtier.config import TierConfig  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.observe.metrics import TierMetrics, serve  # noqa: E402
from kvtier.observe.transfer_log import LOGGER_NAME, TransferLog  # noqa: E402
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
    tiers = [KVTier(kv, config), KVTier(kv, config)]
    sink = io.StringIO()
    log = logging.getLogger(LOGGER_NAME)
    log.addHandler(logging.StreamHandler(sink))
    log.setLevel(logging.INFO)
    log.propagate = False
    # what attach() adds with log_transfers and metrics_port, one set per instance (added and removed per repeat)
    watchers = []
    for i, t in enumerate(tiers):
        metrics = TierMetrics(t.stats, labels={"tp_rank": str(i)})
        server, _ = serve(metrics, 0, addr="127.0.0.1")
        watchers.append((TransferLog(), metrics, server))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, n * P).astype(np.int64) for _ in range(args.pool_requests * 2)]
    sets = {"metrics": (1,), "log": (0,), "metrics+log": (0, 1)}  # indices into a watcher: (log, metrics)
    for i, t in enumerate(tiers):  # warm-up (kernels compiled, pools touched), bare and observed
        for watched in ((), (0, 1)):
            _watch(t, watchers[i], watched, True)
            for p in prompts[:3]:
                cycle(t, p, src, dst)
            _watch(t, watchers[i], watched, False)
    keys = ("issue_us", "lookup_us", "cycle_us")
    runs = {name: [] for name in sets}
    progress.plan(args.repeats * len(sets), "repeats")
    k = 0
    for name, which in sets.items():
        for rep in range(args.repeats):
            w = rep % 2  # the observed instance
            _watch(tiers[w], watchers[w], which, True)
            ratios = {key: [] for key in keys}
            for c in range(args.cycles):
                pair = {}
                for i in ((w, 1 - w) if c % 2 == 0 else (1 - w, w)):
                    pair[i] = cycle(tiers[i], prompts[k % len(prompts)], src, dst)
                    k += 1
                for key in keys:
                    ratios[key].append(pair[w][key] / pair[1 - w][key])
            _watch(tiers[w], watchers[w], which, False)
            runs[name].append({"observed_instance": w, **{key: statistics.median(v) for key, v in ratios.items()}})
            progress.step(f"{name} repeat {rep + 1}")
    over = {name: {key: statistics.median(r[key] for r in rs) for key in keys} for name, rs in runs.items()}
    by_instance = {name: {f"observed_{i}": {key: statistics.median(r[key] for r in rs if r["observed_instance"] == i)
                                            for key in keys} for i in (0, 1)} for name, rs in runs.items()}
    metrics = watchers[0][1]
    _watch(tiers[0], watchers[0], (0, 1), True)
    scrape = call_us(metrics.sync, 20)
    with urllib.request.urlopen(f"http://127.0.0.1:{watchers[0][2].server_port}/metrics", timeout=10) as r:
        exposition = r.read().decode()
    assert "kvtier_transfer_tokens_total" in exposition
    lines = sink.getvalue().count("\n")
    stats = [t.stats() for t in tiers]
    for (_, m, server), t in zip(watchers, tiers):
        server.shutdown()
        server.server_close()
        m.close()
        t.destroy()
    return {"device": device, "geometry": str(geo), "pages_per_request": n, "request_mb": n * block / 1e6,
            "pool_requests": args.pool_requests, "repeats": args.repeats, "cycles": args.cycles,
            "observed_over_bare": over, "observed_over_bare_by_instance": by_instance,
            "metrics_worst_ratio": max(over["metrics"][key] for key in ("issue_us", "lookup_us")),
            "worst_ratio": max(v for r in over.values() for v in r.values()),
            "sync_us_median": statistics.median(scrape), "log_lines": lines,
            "evicted_pages": sum(s["pages_evicted"] for s in stats), "runs": runs}


def _watch(tier: KVTier, watcher: tuple, which: tuple, on: bool) -> None:
    """Add (or remove) ``watcher``'s observers ``which`` (0: the transfer log, 1: the metrics) to (from) ``tier``."""
    for i in which:
        (tier.add_observer if on else tier.remove_observer)(watcher[i])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "observe_h200.json"))
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--pool-requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=8, help="an even number observes each instance as often")
    ap.add_argument("--cycles", type=int, default=40)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.pages, args.repeats, args.cycles = 4, 4, 4
    out = run(args)
    out["env"] = env_info()
    out["command"] = "python bench/bench_observe.py" + (" --smoke" if args.smoke else "")
    write_json(args.out, out)
    print({k: out[k] for k in ("observed_over_bare", "metrics_worst_ratio", "sync_us_median", "log_lines")})


if __name__ == "__main__":
    main()
