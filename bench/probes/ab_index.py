"""A/B of the index's own costs, one kvtier checkout per process (run checkouts alternately, same machine state).

* ``--what ops``: kvtier alone on bench_index.py's multi_turn workload (page 16). SGLang's side of bench_index's
  speedups does not depend on kvtier's code, so the ratio of two checkouts' speedups is the inverse ratio of their
  kvtier times.
* ``--what namespaces``: the insert of one page under each of ``--count`` new namespaces (a first insert under a
  cache_salt / LoRA id registers it), timed per insert; medians over windows of 100 registrations.

    python bench/probes/ab_index.py --what ops --kvtier-root /path/to/checkout --out result.json
"""
import argparse
import json
import os
import statistics
import sys
import time
from array import array

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ops(args) -> dict:
    from bench import bench_index as bi

    seqs = bi.multi_turn()
    arrs = [array("q", s) for s in seqs]
    warm = bi.KvtierLib(16)  # compile (or load numba's cache) outside the timing
    for a, v in zip(arrs[:8], warm.values(seqs[:8])):
        warm.insert(a[:], v)
        warm.match(a[:])
    t = time.time()
    res, _ = bi.run_library(bi.KvtierLib, 16, seqs, arrs, args.reps, evict_chunk_pages=256)
    return {"seconds": time.time() - t, "insert_us_median": res["insert_us_median"],
            "match_us_median": res["match_us_median"], "match_us_cold_loop": res["match_us_cold_loop"],
            "evict_us_per_page": res["evict_us_per_page"]}


def namespaces(args) -> dict:
    from kvtier.index import Namespace, PageTrie

    page = 16
    trie = PageTrie(page)
    toks = np.arange(page, dtype=np.int64)
    trie.insert(toks, np.array([0]), Namespace(cache_salt="warm-up"))  # compile outside the timing
    times = []
    for i in range(args.count):
        ns = Namespace(cache_salt=f"salt-{i}")
        ns.seed  # the seed's hash is the namespace's own cost, not the registration's
        t = time.perf_counter()
        trie.insert(toks, np.array([i + 1]), ns)
        times.append(time.perf_counter() - t)
    starts = sorted({lo for lo in (1, 100, 1000, args.count - 99) if 1 <= lo and lo + 99 <= args.count})
    windows = {f"{lo}-{lo + 99}": statistics.median(times[lo - 1:lo + 99]) * 1e6 for lo in starts}
    return {"count": args.count, "insert_us_median_by_registration": windows, "last_us": times[-1] * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", choices=["ops", "namespaces"], default="ops")
    ap.add_argument("--kvtier-root", required=True, help="the checkout whose kvtier package is timed")
    ap.add_argument("--reps", type=int, default=3, help="ops: repetitions in the process")
    ap.add_argument("--count", type=int, default=5000, help="namespaces: how many to register")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path[:0] = [os.path.abspath(args.kvtier_root), ROOT]  # that checkout's kvtier; this one's bench
    import kvtier

    out = {"kvtier_from": os.path.dirname(kvtier.__file__), **(ops if args.what == "ops" else namespaces)(args)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
