"""Probe (issue 17): where a fragmented staged store's host issue goes (cProfile), ``layer_first``, runs of one page.

Each store is issued with the device asleep (a 100 ms spin first, drained before), so no wait for queue space is
timed; the profile covers ``--stores`` stores of 1k and of 8k tokens at the default tuning.

Run (GPU machine): ``python3 bench/probes/store_issue_profile.py --out $OUT/store_issue_profile_h200.json``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.common import _sm_clock_hz, env_info, write_json  # noqa: E402
from bench.probes.store_affinity import store_cases  # noqa: E402
from kvtier.kernels import StagedTransfer  # noqa: E402


def profile_stores(stager: StagedTransfer, slots, ids, stores: int, spin: int, lines: int) -> tuple[list, str]:
    """Issue ``stores`` stores under cProfile, each with the device asleep (a ``spin`` first, drained before) after
    three warm-ups; returns each store's issue wall ms and the profile's ``lines`` costliest lines by own time."""
    for _ in range(3):
        stager.store(slots, ids, check=False)
    prof, wall = cProfile.Profile(), []
    for _ in range(stores):
        torch.cuda.synchronize()
        torch.cuda._sleep(spin)
        t = time.perf_counter()
        prof.enable()
        stager.store(slots, ids, check=False)
        prof.disable()
        wall.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(lines)
    return wall, text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stores", type=int, default=10)
    args = ap.parse_args()
    res = {"env": env_info(), "cases": []}
    kv, pool, cases = store_cases(((1024, 1), (8192, 1)))
    stager = StagedTransfer(kv, pool.host, layout="layer_first")
    spin = int(0.1 * _sm_clock_hz())
    for tokens, _, slots, ids in cases:
        wall, text = profile_stores(stager, slots, ids, args.stores, spin, 25)
        res["cases"].append(dict(tokens=tokens, issue_ms=wall, issue_ms_median=statistics.median(wall),
                                 profile=text))
        print(f"== {tokens} tokens, runs of one page: issue {statistics.median(wall):.2f} ms (median of {len(wall)})")
        print(text[:6000], flush=True)
    stager = None
    pool.destroy()
    write_json(args.out, res)


if __name__ == "__main__":
    main()
