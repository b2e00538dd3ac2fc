"""A/B of the index's own cost on bench_index.py's multi_turn workload (page 16), one kvtier checkout per process.

SGLang's side of bench_index's speedups does not depend on kvtier's code, so the ratio of two checkouts' speedups is
the inverse ratio of their kvtier times: this times kvtier alone, in alternating processes, to compare checkouts
under the same machine state. Usage (one process per checkout and repetition, alternating):

    python bench/probes/ab_index.py --kvtier-root /path/to/checkout --out result.json
"""
import argparse
import json
import os
import sys
import time
from array import array

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvtier-root", required=True, help="the checkout whose kvtier package is timed")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path[:0] = [os.path.abspath(args.kvtier_root), ROOT]  # that checkout's kvtier; this one's bench
    from bench import bench_index as bi
    import kvtier

    seqs = bi.multi_turn()
    arrs = [array("q", s) for s in seqs]
    warm = bi.KvtierLib(16)  # compile (or load numba's cache) outside the timing
    for a, v in zip(arrs[:8], warm.values(seqs[:8])):
        warm.insert(a[:], v)
        warm.match(a[:])
    t = time.time()
    res, _ = bi.run_library(bi.KvtierLib, 16, seqs, arrs, args.reps, evict_chunk_pages=256)
    out = {"kvtier_from": os.path.dirname(kvtier.__file__), "seconds": time.time() - t,
           "insert_us_median": res["insert_us_median"], "match_us_median": res["match_us_median"],
           "match_us_cold_loop": res["match_us_cold_loop"], "evict_us_per_page": res["evict_us_per_page"]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
