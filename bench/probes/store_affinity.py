"""Probe (issue 17): does where the issuing threads run decide a fragmented store's mode?

The staged ``layer_first`` store of 8k tokens in runs of two pages, its rows issued from two threads, took 22.6-22.8
ms in 3 of 5 measurements and 28.6-30.5 in 2, each measurement tight within itself (p20-p80 within 1.5 ms), minutes
apart on the same machine (bench/results/probes/staged_store_threads_h200.json and staged_store_default64k_h200.json).
A row's issue costs the host about what the copy engine takes to write it, so the store follows how fast the
issuing threads run; one hypothesis is the cores they land on (the machine is a VM whose vCPUs sit on host cores
nearer or farther from the GPU). This probe records the CPU topology (``lscpu``, ``nvidia-smi topo -m``), then for
the process pinned to no core set and to pairs of cores across the machine, times the staged store (8k tokens,
runs of one and two pages, and one run; 1k tokens, runs of two) five times each, a fresh stager per core set so its
issuing thread starts there.

Run (GPU machine): ``python3 bench/probes/store_affinity.py --out $OUT/store_affinity_h200.json``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.bench_fragmentation import fragmented_ids  # noqa: E402
from bench.common import env_info, make_pool, random_slots, time_gpu_ms, write_json  # noqa: E402
from bench.probes.staged_store_chunks import GEO  # noqa: E402
from kvtier.kernels import StagedTransfer  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402

CASES = ((8192, 1), (8192, 2), (8192, 0), (1024, 2))  # (tokens, run of pages; 0: one run)


def command_text(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable: {e}"


def core_sets() -> list[tuple[str, set[int] | None]]:
    """No pinning, then pairs of cores spread over the machine."""
    cores = sorted(os.sched_getaffinity(0))
    picks = sorted({cores[i] for i in np.linspace(0, len(cores) - 2, min(4, len(cores) // 2)).astype(int)})
    return [("all", None)] + [(f"cores {c},{c + 1}", {c, c + 1}) for c in picks if c + 1 in cores]


def store_cases(specs) -> tuple:
    """A Qwen3-8B device pool, a ``layer_first`` host pool of twice 8k tokens' blocks and, per (tokens, run of
    pages; 0: one run) of ``specs``, (tokens, run, device slots, host block ids in shuffled runs), seeded."""
    num_blocks = 2 * 8192 // GEO.page_size + 64
    kv = make_pool(GEO, 2 * 8192 + 64 * GEO.page_size)
    pool = HostBlockPool(GEO, num_blocks, layout="layer_first")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rng = np.random.default_rng(0)
    cases = []
    for tokens, run in specs:
        n = tokens // GEO.page_size
        cases.append((tokens, run, random_slots(n, GEO.page_size, kv.num_slots, generator=gen),
                      torch.from_numpy(fragmented_ids(n, run, num_blocks, rng))))
    return kv, pool, cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    t0 = time.time()
    res = {"env": env_info(), "lscpu": command_text(["lscpu"]), "topo": command_text(["nvidia-smi", "topo", "-m"]),
           "rows": []}
    all_cores = os.sched_getaffinity(0)
    kv, pool, cases = store_cases(CASES)
    for name, cores in core_sets():
        os.sched_setaffinity(0, cores or all_cores)  # this thread; the stager's issuing thread inherits it
        stager = StagedTransfer(kv, pool.host, layout="layer_first")
        for tokens, run, slots, ids in cases:
            ms = [time_gpu_ms(lambda: stager.store(slots, ids, check=False), reps=args.reps)["median_ms"]
                  for _ in range(args.repeats)]
            res["rows"].append(dict(cores=name, tokens=tokens, run=run, ms=ms))
            print(f"{name:12s} {tokens:5d} R={run or 'one':>3}: " + " ".join(f"{m:.2f}" for m in ms), flush=True)
        stager = None
        torch.cuda.synchronize()
    os.sched_setaffinity(0, all_cores)
    pool.destroy()
    res["seconds"] = time.time() - t0
    write_json(args.out, res)


if __name__ == "__main__":
    main()
