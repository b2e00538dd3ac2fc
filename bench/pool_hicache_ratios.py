"""Pool the kvtier-direct / HiCache rounds of every committed H200 run: is the gap between the kernels real?

Each run's ``hicache_alternating`` section alternates kvtier's default direct kernel (4 programs x 32 warps x 64 KiB
tiles, ``kvtier_p4_w32_t64``) with SGLang's HiCache kernel on identical work, round by round. This script pairs
round i of the one with round i of the other, over all runs that hold both, and prints per case (direction, page
size, random or consecutive host pages) the median paired ratio with a distribution-free 95% confidence interval
(order statistics of the binomial sign test: one slow round of either kernel cannot move it), the share of rounds
kvtier wins, and the range of the per-run ratios of medians.

Usage: ``python bench/pool_hicache_ratios.py [--json out.json]`` (reads ``bench/results/**/*.json``).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVTIER = "kvtier_p4_w32_t64"
HICACHE = "sglang_hicache"


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median: the widest symmetric pair of order statistics whose binomial
    (n, 1/2) coverage is at least ``level``."""
    xs, n = sorted(values), len(values)
    tail, k = 0.0, 0
    while k < n // 2:
        p = math.comb(n, k) / 2 ** n  # P(exactly k of n below the median)
        if 2 * (tail + p) > 1 - level:
            break
        tail, k = tail + p, k + 1
    return xs[k], xs[n - 1 - k]


def collect(paths: list[str], kvtier: str = KVTIER) -> dict[tuple, dict]:
    """``{(direction, page, pattern): {"pairs": [(kvtier, hicache), ...], "runs": {file: ratio of medians}}}``."""
    cases: dict[tuple, dict] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        section = data.get("hicache_alternating") if isinstance(data, dict) else None
        if not isinstance(section, dict):
            continue
        for entry in section.get("entries", []):
            rounds = entry.get("round_gbps", {})
            for pattern in ("random", "consecutive"):
                kv, hc = rounds.get(f"{kvtier}_{pattern}"), rounds.get(f"{HICACHE}_{pattern}")
                if not kv or not hc or len(kv) != len(hc):
                    continue
                case = cases.setdefault((entry["direction"], entry["page"], pattern), {"pairs": [], "runs": {}})
                case["pairs"].extend(zip(kv, hc))
                case["runs"][os.path.relpath(path, ROOT)] = statistics.median(kv) / statistics.median(hc)
    return cases


def summarize(case: dict) -> dict:
    ratios = [k / h for k, h in case["pairs"]]
    low, high = median_ci(ratios)
    runs = list(case["runs"].values())
    return {"rounds": len(ratios), "runs": len(runs), "ratio": statistics.median(ratios), "ci_low": low,
            "ci_high": high, "kvtier_wins": sum(r > 1 for r in ratios) / len(ratios),
            "run_ratio_min": min(runs), "run_ratio_max": max(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvtier", default=KVTIER, help=f"the kvtier variant's key prefix (default {KVTIER})")
    ap.add_argument("--json", help="also write the table as JSON here")
    args = ap.parse_args()
    paths = sorted(glob.glob(os.path.join(ROOT, "bench", "results", "**", "*.json"), recursive=True))
    rows = {f"{d}_p{p}_{pat}": summarize(c) for (d, p, pat), c in sorted(collect(paths, args.kvtier).items())}
    print("| case | runs | rounds | median paired ratio (95% CI) | kvtier wins | per-run ratio of medians |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['runs']} | {r['rounds']} | {r['ratio']:.4f} ({r['ci_low']:.4f}-{r['ci_high']:.4f}) "
              f"| {r['kvtier_wins']:.0%} | {r['run_ratio_min']:.4f}-{r['run_ratio_max']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
