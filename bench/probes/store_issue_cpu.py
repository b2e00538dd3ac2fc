"""Probe (issue 17): the Python part of a fragmented staged store's host issue, on a machine without CUDA.

The staged store of a fragmented ``layer_first`` pool is paced by its host issue on the H200 (issue 5.2 ms at 1k
tokens against 3.05 ms of copy; ``probes/store_issue_profile_h200.json``: 1.5 ms of it in the driver). This probe
times ``StagedTransfer.store``'s own Python on the CPU: the CUDA pieces are stand-ins that do nothing (the gather
launch, CuPy's runtime, the batched driver calls, which count the rows they are given) and the copy stream is a
placeholder, so what is timed is the planning, the chunk loop and the row arrays. Qwen3-8B KV, runs of one page,
1k and 8k tokens; the median of ``--reps`` stores after warm-up. An A/B of two checkouts runs it once per checkout
(``PYTHONPATH=<checkout>``).

Run (any machine): ``python3 bench/probes/store_issue_cpu.py --out /tmp/store_issue_cpu.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types

import numpy as np
import torch

from kvtier.geometry import KVGeometry
from kvtier.kernels import StagedTransfer, batch_copy
from kvtier.kernels import staged as staged_mod
from kvtier.kernels.paged_kv import PagedKV
from kvtier.kernels.transfer import KernelLaunch

GEO = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)


def stand_ins(rows_seen: list[int]) -> None:
    """The CUDA pieces of a staged store as no-ops (the row batches counted)."""
    staged_mod._cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=None))
    staged_mod._max_pitch = lambda: 1 << 31
    batch_copy.available = lambda: True
    batch_copy.rects_available = lambda: True
    batch_copy.memcpy_batch = lambda d, s, z, stream: rows_seen.append(z.size)
    batch_copy.memcpy_rects = lambda *a: rows_seen.append(a[4].size)
    KernelLaunch.fire = lambda self, *a, **k: None
    StagedTransfer.batched = property(lambda self: True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    rows_seen: list[int] = []
    stand_ins(rows_seen)
    res = {"argv": sys.argv, "torch": torch.__version__, "cases": []}
    for tokens in (1024, 8192):
        n = tokens // GEO.page_size
        slots_n = n * GEO.page_size
        kv = PagedKV.mha([torch.empty(slots_n, 8, 128, dtype=torch.bfloat16) for _ in range(GEO.num_layers)],
                         [torch.empty(slots_n, 8, 128, dtype=torch.bfloat16) for _ in range(GEO.num_layers)],
                         page_size=GEO.page_size)
        num_blocks = 2 * n
        host = torch.empty(GEO.host_shape(num_blocks, "layer_first"), dtype=GEO.dtype)
        stager = StagedTransfer(kv, host, layout="layer_first")
        stager._store.copy_stream = types.SimpleNamespace(cuda_stream=1)  # a placeholder handle
        ids = torch.from_numpy(np.random.default_rng(0).permutation(num_blocks)[:n].astype(np.int64))
        slots = torch.arange(slots_n)
        for _ in range(3):
            stager.store(slots, ids, check=False)
        rows_seen.clear()
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            stager.store(slots, ids, check=False)
            times.append((time.perf_counter() - t) * 1e3)
        rows = sum(rows_seen) // args.reps
        res["cases"].append(dict(tokens=tokens, issue_ms_median=statistics.median(times), issue_ms=times,
                                 rows_per_store=rows))
        print(f"{tokens} tokens, runs of one page: {statistics.median(times):.2f} ms of Python a store "
              f"({rows} rows)", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
