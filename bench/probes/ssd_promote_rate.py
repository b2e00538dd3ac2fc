"""Probe: the SSD tier's read rate inside a promotion (``KVTier.lookup_tiers`` -> ``wait``), without a model, next to
``bench_ssd``'s tier read on the same directory: where the TTFT bench's promotions read slower than ``bench_ssd``.

Instance A (Qwen3-8B blocks, store copies skipped: its CPU blocks hold random bytes) stores ``--prefixes`` prefixes
of ``--pages`` pages and writes them to an SSD tier that holds one prefix (later ones take the slots evicted from
earlier ones); then, ``--reps`` times, a restarted instance B with an empty CPU pool (every page touched first with
``--touch``, as a pinned pool is) looks the last prefix up and waits for its promotion. Reported: B's SSD read GB/s
(the tier's own figure, which admission uses), the promotion's wall-clock GB/s, and ``bench_ssd.tier_bandwidth``'s
write and read GB/s for the same bytes.

Run: ``python bench/probes/ssd_promote_rate.py --dir /dev/shm/kvtier-promote --touch --out probe.json``
"""

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import bench_ssd  # noqa: E402
from bench.bench_remote import SkipStoreCopy  # noqa: E402
from kvtier.config import TierConfig  # noqa: E402
from kvtier.tier import HostBlockPool, KVTier  # noqa: E402
from tests.kv_helpers import make_kv  # noqa: E402

GEO = bench_ssd.GEOMETRY
BLOCK = GEO.page_bytes * GEO.num_layers  # one 16-token page of every layer
IDENTITY = {"model": "kvtier-probe-promote"}


def make_tier(kv, args) -> KVTier:
    slot = BLOCK + 8192  # a header and a padded payload, with room to spare
    config = TierConfig(page_size=GEO.page_size, tokens_per_block=GEO.page_size, host_layout=args.layout,
                        cpu_cache_gb=(2 * args.pages + 8) * BLOCK / 2**30, ssd_cache_gb=args.pages * slot / 2**30,
                        ssd_cache_dir=args.dir, ssd_admission="always")
    pool = HostBlockPool(GEO, 2 * args.pages + 8, layout=args.layout)
    return KVTier(kv, config, pool=pool, executor=SkipStoreCopy(), model_identity=IDENTITY)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layout", default="layer_first")
    ap.add_argument("--pages", type=int, default=200, help="pages of a prefix (about 2.36 MB each)")
    ap.add_argument("--prefixes", type=int, default=1)
    ap.add_argument("--touch", action="store_true", help="touch instance B's pool before the lookup")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    kv = make_kv(GEO, 2 * GEO.page_size, "cpu", torch.Generator().manual_seed(0))
    a = make_tier(kv, args)
    a.pool.host.view(torch.uint8).random_(0, 256)
    toks = None
    for k in range(args.prefixes):
        toks = np.arange(args.pages * GEO.page_size, dtype=np.int64) + 10_000_000 * (k + 1)
        a.wait(a.store(toks, None, torch.zeros(toks.size, dtype=torch.int64)))
        a.flush_ssd()
    written = a.stats()["ssd_blocks_written"]
    a.destroy()
    runs = []
    for _ in range(args.reps):
        b = make_tier(kv, args)
        if args.touch:
            b.pool.host.zero_()
        t = time.perf_counter()
        hit = b.lookup_tiers(toks)
        b.wait(hit.promotion)
        wall = time.perf_counter() - t
        s = b.ssd.medium.snapshot()
        runs.append({"pages": hit.ssd_pages, "read_gbps": s["read_gbps"],
                     "wall_gbps": hit.ssd_pages * BLOCK / wall / 1e9})
        b.destroy()
    bench = bench_ssd.tier_bandwidth(args.dir, args.pages * BLOCK, 4, args.layout)
    out = {"args": vars(args), "blocks_written": written, "promotions": runs, "bench_ssd_tier": bench}
    print(f"{args.dir} {args.layout} prefixes {args.prefixes} touch {args.touch}: promotion read "
          f"{[round(r['read_gbps'], 2) for r in runs]} GB/s ({runs[0]['pages']} pages), wall "
          f"{[round(r['wall_gbps'], 2) for r in runs]}; bench_ssd tier read {bench['read_gbps']:.2f} "
          f"write {bench['write_gbps']:.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
