"""The SSD write policies side by side: ``write_through`` against ``write_back`` on one workload (issue 18, part 2).

FlexKV-style long prompts go through a KVTier (CPU pool a quarter of the workload, the SSD all of it) one request at
a time, on a cold tier, then again after a clean restart over the same directory. Per policy: the host hit fraction
of each pass, the SSD bytes written, the stores and writes dropped, the time from the restart to the first SSD hit.

Run: ``python bench/bench_ssd_policy.py --dir /var/tmp/kvtier-policy --out bench/results/ssd_policy_cpu.json``
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import env_info, write_json  # noqa: E402
from kvtier.config import TierConfig  # noqa: E402
from kvtier.e2e.workloads import long_prompts  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import PagedKV  # noqa: E402
from kvtier.tier import KVTier  # noqa: E402

PAGE = 16
GEO = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_size=PAGE)


def make_tier(directory: str, policy: str, cpu_blocks: int, ssd_blocks: int, slots: int) -> KVTier:
    bufs = [torch.zeros(slots, GEO.num_kv_heads, GEO.head_dim, dtype=GEO.dtype) for _ in range(2 * GEO.num_layers)]
    kv = PagedKV.mha(bufs[0::2], bufs[1::2], page_size=PAGE)
    slot = 4096 + -(-GEO.block_bytes // 4096) * 4096
    config = TierConfig(page_size=PAGE, cpu_cache_gb=cpu_blocks * GEO.block_bytes / 2**30,
                        ssd_cache_gb=ssd_blocks * slot / 2**30, ssd_cache_dir=directory, ssd_write_policy=policy,
                        ssd_admission="always", transfer_mode="direct")
    return KVTier(kv, config, model_identity={"bench": "ssd_policy"})


def serve_pass(tier: KVTier, prompts: list[list[int]]) -> dict:
    slots = torch.arange(max(len(p) for p in prompts), dtype=torch.int64)
    hit = total = 0
    t0 = time.perf_counter()
    for p in prompts:
        toks = np.asarray(p, dtype=np.int64)
        found = tier.lookup_tiers(toks, None)
        if found.read is not None:
            tier.wait(found.read)
        task = tier.load(toks, None, slots)
        tier.wait(task)
        hit += task.num_pages * PAGE
        total += toks.size // PAGE * PAGE
        tier.wait(tier.store(toks, None, slots))
    tier.flush_lower()
    return {"host_hit_fraction": hit / total, "tokens": total, "seconds": time.perf_counter() - t0}


def run(policy: str, prompts: list[list[int]], args) -> dict:
    blocks = sum(len(p) for p in prompts) // PAGE
    d = os.path.join(args.dir, policy)
    shutil.rmtree(d, ignore_errors=True)
    slots = max(len(p) for p in prompts)
    tier = make_tier(d, policy, blocks // 4, blocks * 2, slots)
    first = serve_pass(tier, prompts)
    s1 = tier.stats()
    tier.destroy()
    t0 = time.perf_counter()  # the restart: a new tier over the directory, then the first prompt's SSD hit
    tier = make_tier(d, policy, blocks // 4, blocks * 2, slots)
    found = tier.lookup_tiers(np.asarray(prompts[0], dtype=np.int64), None)
    if found.read is not None:
        tier.wait(found.read)
    first_hit_s = time.perf_counter() - t0
    recovered = tier.stats()["ssd_blocks_recovered"]
    second = serve_pass(tier, prompts)
    s2 = tier.stats()
    tier.destroy()
    shutil.rmtree(d, ignore_errors=True)
    out = {"policy": policy, "cpu_blocks": blocks // 4, "workload_blocks": blocks, "pass1": first, "pass2": second,
           "ssd_bytes_written": s1["ssd_bytes_written"] + s2["ssd_bytes_written"],
           "ssd_blocks_written_pass1": s1["ssd_blocks_written"], "ssd_blocks_recovered": recovered,
           "ssd_write_dropped": s1["ssd_blocks_write_dropped"] + s2["ssd_blocks_write_dropped"],
           "cpu_store_dropped_pages": s1["pages_store_dropped"] + s2["pages_store_dropped"],
           "pages_promoted": s1["pages_promoted"] + s2["pages_promoted"], "start_to_first_hit_s": first_hit_s,
           "first_hit_pages": found.lower_pages}
    print(f"{policy}: hit {first['host_hit_fraction']:.3f} / after restart {second['host_hit_fraction']:.3f}, "
          f"SSD written {out['ssd_bytes_written'] / 2**20:.1f} MiB, recovered {recovered} blocks, CPU stores "
          f"dropped {out['cpu_store_dropped_pages']} pages, SSD writes dropped {out['ssd_write_dropped']}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--median", type=int, default=600)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    prompts = long_prompts(args.prompts, vocab=30000, median=args.median, max_len=4 * args.median,
                           min_len=args.median // 4, groups=6, group_size=5)
    rows = [run(policy, prompts, args) for policy in ("write_through", "write_back")]
    by = {r["policy"]: r for r in rows}
    summary = {}
    for p in by:
        summary[f"ssd_bytes_written_{p}"] = by[p]["ssd_bytes_written"]
        summary[f"ssd_blocks_recovered_{p}"] = by[p]["ssd_blocks_recovered"]
        summary[f"start_to_first_hit_s_{p}"] = by[p]["start_to_first_hit_s"]
        summary[f"host_hit_pass1_{p}"] = by[p]["pass1"]["host_hit_fraction"]
        summary[f"host_hit_after_restart_{p}"] = by[p]["pass2"]["host_hit_fraction"]
    write_json(args.out, {"env": env_info(), "args": vars(args), "summary": summary, "rows": rows})
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
