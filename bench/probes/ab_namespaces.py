"""What registering the n-th namespace costs (a first insert under a new cache_salt / LoRA id), one kvtier checkout
per process: the insert of one page under each of ``--count`` new namespaces, timed per insert; reported, for
windows of registrations, the median insert time (a first insert registers its namespace).

    python bench/probes/ab_namespaces.py --kvtier-root /path/to/checkout --out result.json
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvtier-root", required=True, help="the checkout whose kvtier package is timed")
    ap.add_argument("--count", type=int, default=5000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.kvtier_root))
    import kvtier
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
    windows = {}
    for lo in (1, 100, 1000, args.count - 100):
        w = times[lo - 1:lo + 99]
        windows[f"{lo}-{lo + 99}"] = statistics.median(w) * 1e6
    out = {"kvtier_from": os.path.dirname(kvtier.__file__), "count": args.count,
           "insert_us_median_by_registration": windows, "last_us": times[-1] * 1e6}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
