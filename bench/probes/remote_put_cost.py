"""Probe (issue 19): what each part of the remote put worker's own CPU work costs the put on this machine.

The remote tier's put (``bench_remote``'s kvtier put: A.store of 256 fresh blocks, then the put job to the end)
against Mooncake's raw ``batch_put_from`` of the same values, alternating, with the worker's per-block work
switched off in turn: ``base`` (as shipped), ``no_hash`` (no payload checksum: the header carries 0),
``no_copy`` (staged blocks are not copied into the staging buffer; ``layer_first`` only), ``neither``. The values
put without a hash or a copy are wrong on purpose and never read back: the probe measures cost, not correctness.

Median kvtier and raw GB/s per variant over ``--reps`` (after one warm-up), both host layouts.

Run: ``python bench/probes/remote_put_cost.py --out bench/results/probes/remote_put_cost_cpu.json``
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("GLOG_minloglevel", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import bench.bench_remote as br  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.tier import remote_tier  # noqa: E402

VARIANTS = ("base", "no_hash", "no_copy", "neither")


class _NoCopy(np.ndarray):
    """A staging view whose item assignment does nothing (the staging copy switched off)."""

    def __setitem__(self, key, value) -> None:
        pass


def switch(variant: str, saved: tuple) -> None:
    checksum, staging = saved
    remote_tier._checksum = (lambda rows: 0) if variant in ("no_hash", "neither") else checksum
    remote_tier.RemoteTier._staging = ((lambda self, buf, i, rows: staging(self, buf, i, rows).view(_NoCopy))
                                       if variant in ("no_copy", "neither") else staging)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=256)
    args = ap.parse_args()
    t0 = time.time()
    geo = KVGeometry(28, 8, 128, torch.float16, page_size=16)
    bench_args = argparse.Namespace(remote_timeout_s=30.0)
    stores = br.Stores.start(tempfile.mkdtemp(prefix="kvtier-put-cost-"), 4 << 30)
    saved = (remote_tier._checksum, remote_tier.RemoteTier._staging)
    res = {"cpus": os.cpu_count(), "blocks": args.blocks, "value_bytes": None, "rows": [], "summary": {}}
    try:
        for layout in ("layer_first", "page_first"):
            b = br.Bench(bench_args, stores, geo, layout, args.blocks)
            res["value_bytes"] = V = b.V
            try:
                for rep in range(args.reps + 1):
                    for variant in VARIANTS:
                        if variant == "no_copy" and not b.staged or variant == "neither" and not b.staged:
                            continue
                        switch(variant, saved)
                        toks = b.fresh_tokens(args.blocks)
                        kv = b.kvtier_put(toks)
                        b.remove_kvtier(toks)
                        switch("base", saved)
                        keys = [f"rawcost/{layout}/{rep}/{variant}/{i}" for i in range(args.blocks)]
                        ptrs = [b.src.ctypes.data + i * V for i in range(args.blocks)]
                        s, _ = b._calls(stores.raw.batch_put_from, keys, ([ptrs, [V] * args.blocks]))
                        stores.raw.batch_remove(keys, True)
                        row = dict(layout=layout, rep=rep, variant=variant, warmup=rep == 0,
                                   kvtier_gbps=kv["gbps"], raw_gbps=args.blocks * V / s / 1e9)
                        res["rows"].append(row)
                        print(f"{layout:11s} rep {rep} {variant:8s} kvtier {row['kvtier_gbps']:.2f} "
                              f"raw {row['raw_gbps']:.2f} GB/s", flush=True)
            finally:
                switch("base", saved)
                b.close()
            for variant in VARIANTS:
                rows = [r for r in res["rows"] if r["layout"] == layout and r["variant"] == variant
                        and not r["warmup"]]
                if rows:
                    k = statistics.median(r["kvtier_gbps"] for r in rows)
                    r_ = statistics.median(r["raw_gbps"] for r in rows)
                    res["summary"][f"{layout}/{variant}/put_over_raw"] = k / r_
                    print(f"{layout} {variant}: {k / r_:.3f}", flush=True)
    finally:
        stores.close()
    res["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
