"""Can TMA (Hopper's bulk tensor copies) move pinned host memory faster than SM loads and stores?

The SM path tops out near 52.4 GB/s D2H and 51.1 GB/s H2D on an H200 (kvtier's kernel and SGLang's HiCache kernel
alike), the copy engine near 55. This probe copies one contiguous 64 MiB buffer between pinned host memory and the
device with a persistent Triton kernel in four ways: plain pointer loads and stores, a TMA load (tensor descriptor
built in the kernel) with a plain store, a plain load with a TMA store, and TMA both ways; beside it the copy
engine. Rows are 2 KiB (one Qwen3-8B K or V row), tiles ``rows x 2 KiB``.

Run on the GPU machine: ``python bench/probes/probe_tma.py --out $OUT/probe_tma.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import env_info, gbps, time_gpu_ms, write_json  # noqa: E402

ROW_WORDS = 256  # int64 words per 2 KiB row; a TMA box dimension holds at most 256 elements


@triton.jit
def _copy_kernel(src, dst, n_rows, ROWS: tl.constexpr, WORDS: tl.constexpr, SRC_TMA: tl.constexpr,
                 DST_TMA: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    if SRC_TMA:
        sdesc = tl.make_tensor_descriptor(src, shape=[n_rows, WORDS], strides=[WORDS, 1], block_shape=[ROWS, WORDS])
    if DST_TMA:
        ddesc = tl.make_tensor_descriptor(dst, shape=[n_rows, WORDS], strides=[WORDS, 1], block_shape=[ROWS, WORDS])
    r = tl.arange(0, ROWS)[:, None]
    w = tl.arange(0, WORDS)[None, :]
    for t in tl.range(pid, n_tiles, nprog, num_stages=STAGES):
        row0 = t * ROWS
        if SRC_TMA:
            x = sdesc.load([row0, 0])
        else:
            x = tl.load(src + (row0 + r).to(tl.int64) * WORDS + w)
        if DST_TMA:
            ddesc.store([row0, 0], x)
        else:
            tl.store(dst + (row0 + r).to(tl.int64) * WORDS + w, x)


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


VARIANTS = [  # (name, src_tma, dst_tma, programs, warps, rows, stages)
    ("plain_p4_w32_r32", False, False, 4, 32, 32, 1),
    ("tma_src_p4_w4_r32_s2", True, False, 4, 4, 32, 2),
    ("tma_src_p4_w4_r32_s3", True, False, 4, 4, 32, 3),
    ("tma_src_p4_w8_r16_s4", True, False, 4, 8, 16, 4),
    ("tma_src_p8_w4_r16_s4", True, False, 8, 4, 16, 4),
    ("tma_src_p2_w4_r32_s3", True, False, 2, 4, 32, 3),
    ("tma_dst_p4_w8_r32_s1", False, True, 4, 8, 32, 1),
    ("tma_dst_p4_w32_r32_s1", False, True, 4, 32, 32, 1),
    ("tma_both_p4_w4_r32_s3", True, True, 4, 4, 32, 3),
    ("tma_both_p8_w4_r16_s4", True, True, 8, 4, 16, 4),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/probe_tma.json")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    triton.set_allocator(_alloc)
    nbytes = 64 * 1024 * 1024
    n_rows = nbytes // (ROW_WORDS * 8)
    host = torch.empty(n_rows, ROW_WORDS, dtype=torch.int64, pin_memory=True)  # h2d source
    host.view(torch.uint8).copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(n_rows, -1))
    host_out = torch.empty_like(host, pin_memory=True)  # d2h destination
    dev = torch.empty(n_rows, ROW_WORDS, dtype=torch.int64, device="cuda")
    res = {"env": env_info(), "bytes": nbytes, "rounds": args.rounds, "variants": {}}
    fns = {"copy_engine_h2d": lambda: dev.copy_(host, non_blocking=True),
           "copy_engine_d2h": lambda: host_out.copy_(dev, non_blocking=True)}
    for name, s_tma, d_tma, p, w, rows, stages in VARIANTS:
        for direction, src, dst in (("h2d", host, dev), ("d2h", dev, host_out)):
            key = f"{name}_{direction}"
            fn = (lambda src=src, dst=dst, s_tma=s_tma, d_tma=d_tma, p=p, w=w, rows=rows, stages=stages:
                  _copy_kernel[(p,)](src, dst, n_rows, ROWS=rows, WORDS=ROW_WORDS, SRC_TMA=s_tma, DST_TMA=d_tma,
                                     STAGES=stages, num_warps=w))
            try:  # compile and check the bytes once: the destination is zeroed, the source holds host's bytes
                dev.copy_(host) if direction == "d2h" else dev.zero_()
                host_out.zero_()
                fn()
                torch.cuda.synchronize()
                exact = torch.equal((dev.cpu() if direction == "h2d" else host_out), host)
                if not exact:
                    raise AssertionError("copy is not byte-exact")
                fns[key] = fn
                res["variants"][key] = {"exact": exact}
            except Exception:
                res["variants"][key] = {"error": traceback.format_exc()[-1500:]}
                print(key, "error", res["variants"][key]["error"][-300:], flush=True)
    times = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            times[k].append(time_gpu_ms(fn, reps=20)["median_ms"])
    for k, v in times.items():
        res["variants"].setdefault(k, {})["gbps"] = gbps(nbytes, statistics.median(v))
        res["variants"][k]["round_gbps"] = [gbps(nbytes, t) for t in v]
        print(k, res["variants"][k]["gbps"], flush=True)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
