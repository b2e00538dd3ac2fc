"""Probe: can the CPU pool's allocator or eviction keep a request's blocks in longer runs under LRU churn, and at
what cost in hits? The churn simulation of ``bench/bench_fragmentation.py`` (64 multi-turn conversations, a pool of
4096 blocks of 16 tokens, LRU) run with these tiers, per workload seed:

* ``lru``: the tier as shipped. Once the pool is full a store's blocks are exactly the blocks it evicts, so its runs
  are the pieces of the victims' runs it takes.
* ``reserve_K``: the tier keeps ``K`` blocks free (it evicts ahead, down to ``K`` free), and a store that finds no
  free run long enough takes the longest free runs first (the last piece from the shortest run that fits).
* ``run_completion``: LRU eviction that, having freed what was asked, goes on freeing the evictable leaf that holds
  the block just below the last one freed (the rest of the run one store allocated: its pages are a parent chain),
  at most as many pages again, so that no store leaves the head of a victim's run behind.

Run lengths of the block ids each load and store sees after the pool filled (median, p10, runs per copy) and the
hit rate (pages the index held of each request) over the whole run and after the fill. The allocation does not
depend on the device: this runs on the CPU (the copies through the Triton interpreter, 2 layers of 64 dims).

Run: ``TRITON_INTERPRET=1 python bench/probes/churn_allocator.py --jobs 2 --out probe.json`` (about 10 minutes on 2
cores)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import numba
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.bench_fragmentation import churn  # noqa: E402
from bench.common import env_info, write_json  # noqa: E402
from kvtier.index import eviction  # noqa: E402
from kvtier.index._heap import hp_push, hp_remove  # noqa: E402
from kvtier.index._state import BLOCK, HEAP, LOCK, M_HEAP, NCHILD, PARENT  # noqa: E402
from kvtier.index.trie_jit import _free  # noqa: E402
from kvtier.kernels.staged import block_runs  # noqa: E402
from kvtier.tier import HostBlockPool, KVTier  # noqa: E402


@numba.njit
def _complete_run(i32, i64, i8, table, meta, below, extra):
    """Free up to ``extra`` more pages after an eviction whose last page held block ``below + 1``: while an
    evictable leaf holds the block just below the last one freed (the rest of the run one store allocated, whose
    pages are a parent chain). Returns their block ids."""
    out = np.empty(extra, dtype=np.int64)
    block = i64[BLOCK]
    k = 0
    while k < extra:
        x = -1
        for i in range(meta[M_HEAP]):
            if block[i32[HEAP, i]] == below:
                x = i32[HEAP, i]
                break
        if x < 0:
            break
        hp_remove(i32, i64, meta, x)
        out[k] = below
        k += 1
        below -= 1
        parent = i32[PARENT, x]
        _free(i32, i64, i8, table, meta, x)
        if parent >= 0 and i32[NCHILD, parent] == 0 and i32[LOCK, parent] == 0:
            hp_push(i32, i64, meta, parent)
    return out[:k]


class RunCompletingLru(eviction.EvictionPolicy):
    """LRU, then the rest of the last victim's run (at most as many pages again as asked)."""

    def evict(self, n: int) -> np.ndarray:
        ids = self.index.evict(n)
        if ids.size == 0:
            return ids
        st = self.index._st
        return np.concatenate([ids, _complete_run(st.i32, st.i64, st.i8, st.table, st.meta, ids[-1] - 1, n)])


class LongestRunsFirstPool(HostBlockPool):
    """A pool whose fallback (no free run of ``n``) takes the longest free runs first, the last piece from the
    shortest run that fits it."""

    def alloc(self, n: int):
        with self._lock:
            if n == 0 or n > self._num_free or self._find_run(n) is not None:
                return super().alloc(n)
            free = np.flatnonzero(self._free)
            at, lengths = (np.array(x, dtype=np.int64) for x in zip(*block_runs(free)))
            starts = free[at]  # block_runs gives positions in ``free``
            parts, left = [], n
            for k in np.lexsort((starts, -lengths)):
                fit = np.flatnonzero(lengths >= left)
                if fit.size:
                    j = fit[np.argmin(lengths[fit])]
                    parts.append(np.arange(starts[j], starts[j] + left))
                    break
                parts.append(np.arange(starts[k], starts[k] + lengths[k]))
                left -= int(lengths[k])
                lengths[k] = 0
            ids = np.sort(np.concatenate(parts)).astype(np.int64)
            self._free[ids] = False
            self._num_free -= n
            self._cursor = (int(ids[-1]) + 1) % self.num_blocks
            return ids


class ReserveTier(KVTier):
    """A tier that evicts ahead to keep ``reserve`` blocks free."""

    reserve = 0

    def _alloc(self, n: int) -> np.ndarray:
        if self.pool.num_free - n < self.reserve:
            self._evict_blocks(n + self.reserve - self.pool.num_free)
        ids = self.pool.alloc(min(n, self.pool.num_free))
        return ids if ids is not None else np.empty(0, np.int64)


def run_cell(seed: int, name: str) -> dict:
    """One variant's churn over one workload seed."""
    if name == "run_completion":
        if "lru_run_completion" not in eviction.eviction_policy_names():
            eviction.register_eviction_policy("lru_run_completion", RunCompletingLru)
        kinds = dict(eviction_policy="lru_run_completion")
    elif name.startswith("reserve_"):
        tier_cls = type(f"ReserveTier_{name}", (ReserveTier,), {"reserve": int(name.split("_")[1])})
        kinds = dict(pool_cls=LongestRunsFirstPool, tier_cls=tier_cls)
    else:
        kinds = {}  # lru: the tier as shipped
    c = churn(64, 2048, 4096, 400, seed=seed, **kinds)
    c["variant"] = name
    print(f"seed {seed} {name:15s} stores median/p10 R {c['stores']['median_R']}/{c['stores']['p10_R']} "
          f"runs/copy {c['stores']['runs_per_copy_median']}  loads {c['loads']['median_R']}/{c['loads']['p10_R']}  "
          f"hits {c['hit_rate']:.4f} (after the fill {c['hit_rate_full']:.4f})", flush=True)
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="3,7,11")
    ap.add_argument("--reserves", default="32,64,128,256")
    ap.add_argument("--jobs", type=int, default=1, help="cells run in this many processes at once")
    ap.add_argument("--variants", default="", help="only these (comma-separated names); default: all")
    args = ap.parse_args()
    names = ["lru", "run_completion"] + [f"reserve_{k}" for k in args.reserves.split(",")]
    names = [n for n in names if not args.variants or n in args.variants.split(",")]
    cells = [(int(seed), name) for seed in args.seeds.split(",") for name in names]
    t0 = time.time()
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run_cell, *zip(*cells)))
    write_json(args.out, {"env": env_info(), "command": " ".join(sys.argv), "cells": results,
                          "seconds": time.time() - t0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
