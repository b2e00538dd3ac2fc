"""Probe (issue 17): why the copy engine writes the 32 KiB rows of a fragmented ``layer_first`` store slower than
one run, and what a host-side scatter would cost instead.

Part 1, the copy engine alone (D2H, 8192 tokens of Qwen3-8B KV, one ``cuMemcpyBatchAsync`` of 32 KiB rows, or one
pitched rectangle per block): the same number of rows with their host addresses one run in order, one run in
shuffled order, runs of one block shuffled, runs of one block sorted; and 16 MiB plane rows of one run. On the pool
as kvtier allocates it, and on a pool of transparent huge pages (``madvise(MADV_HUGEPAGE)``, then
``cudaHostRegister``). Part 2, a host bounce: the copy engine writes one contiguous pinned buffer, numba threads
scatter its 32 KiB rows into the pool's runs of one block (GB/s alone, per thread count, and beside a D2H copy).

Run (GPU machine): ``python3 bench/probes/store_rows_locality.py --out $OUT/store_rows_locality_h200.json``
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.bench_fragmentation import fragmented_ids  # noqa: E402
from bench.common import env_info, time_gpu_ms, write_json  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import batch_copy  # noqa: E402
from kvtier.tier import HostBlockPool  # noqa: E402

GEO = KVGeometry(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)
ROW = GEO.page_size * GEO.row_bytes  # one (layer, K/V) plane of one block: 32 KiB
PLANES = GEO.num_layers * GEO.kv_count
MADV_HUGEPAGE = 14


def thp_memory(nbytes: int):
    """A page-aligned anonymous mapping advised to use transparent huge pages, touched, as a uint8 tensor."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = (ctypes.c_char * nbytes).from_buffer(m)
    addr = ctypes.addressof(buf)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    rc = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(1)
    del buf
    return m, t, rc


def anon_huge_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonHugePages"):
                return int(line.split()[1])
    return -1


def rows_of(ids: np.ndarray, num_blocks: int, order: np.ndarray | None = None):
    """(host offsets, device offsets) of every (plane, block) 32 KiB row of a store of ``ids`` into a layer_first
    pool of ``num_blocks`` blocks; the device side holds plane p's pages in staging order."""
    n = ids.size
    p = np.arange(PLANES, dtype=np.uint64)[:, None]
    i = np.arange(n, dtype=np.uint64)[None, :]
    host = p * np.uint64(num_blocks * ROW) + ids.astype(np.uint64)[None, :] * np.uint64(ROW)
    dev = p * np.uint64(n * ROW) + i * np.uint64(ROW)
    host, dev = host.reshape(-1), dev.reshape(-1)
    if order is not None:
        host, dev = host[order], dev[order]
    return host, dev


def time_ms(fn, reps: int) -> float:
    """Median GPU ms of ``fn`` after one untimed call, the GPU spinning ~1 ms before each rep so that the host
    queues the rep's copies before the start event fires."""
    return time_gpu_ms(fn, reps=reps, warmup=1, hide_host_us=1000.0)["median_ms"]


def block_rects(ids: np.ndarray, num_blocks: int, n: int, host_ptr: int, dev_ptr: int) -> tuple:
    """``memcpy_rects`` arguments (dst, dst pitch, src, src pitch, width, height) of a D2H pitched rectangle per
    block of ``ids``: its PLANES rows in a layer_first pool of ``num_blocks`` blocks, from a device buffer holding
    ``n`` blocks plane by plane."""
    k = ids.size
    full = lambda v: np.full(k, v, dtype=np.uint64)  # noqa: E731
    return (ids.astype(np.uint64) * np.uint64(ROW) + np.uint64(host_ptr), full(num_blocks * ROW),
            np.arange(k, dtype=np.uint64) * np.uint64(ROW) + np.uint64(dev_ptr), full(n * ROW), full(ROW),
            full(PLANES))


def plane_rows(num_blocks: int, n: int, host_ptr: int, dev_ptr: int) -> tuple:
    """``memcpy_batch`` arguments (dst, src, width) of the one-run store: a row per plane, ``n`` blocks from block
    64 on."""
    planes = np.arange(PLANES, dtype=np.uint64)
    return (planes * np.uint64(num_blocks * ROW) + np.uint64(64 * ROW + host_ptr),
            planes * np.uint64(n * ROW) + np.uint64(dev_ptr), np.full(PLANES, n * ROW, dtype=np.uint64))


def part1(res, pool_name, host_ptr, num_blocks, dev, n, reps, rng, stream):
    nbytes = n * GEO.block_bytes
    cases = {}
    one = np.arange(64, 64 + n, dtype=np.int64)
    r1 = fragmented_ids(n, 1, num_blocks, rng)
    cases["one_run_rows"] = rows_of(one, num_blocks)
    cases["one_run_rows_shuffled"] = rows_of(one, num_blocks, rng.permutation(n * PLANES))
    cases["r1_rows"] = rows_of(r1, num_blocks)
    cases["r1_sorted_rows"] = rows_of(np.sort(r1), num_blocks)
    cases["r1_rows_shuffled"] = rows_of(r1, num_blocks, rng.permutation(n * PLANES))
    widths = np.full(n * PLANES, ROW, dtype=np.uint64)
    hp, dp = np.uint64(host_ptr), np.uint64(dev.data_ptr())
    for name, (h, d) in cases.items():
        hh, dd = h + hp, d + dp
        ms = time_ms(lambda: batch_copy.memcpy_batch(hh, dd, widths, stream.cuda_stream), reps)
        res.append(dict(pool=pool_name, case=name, copies=int(h.size), ms=ms, gbps=nbytes / ms / 1e6))
        print(pool_name, name, f"{ms:.2f} ms {nbytes / ms / 1e6:.1f} GB/s", flush=True)
    # pitched: a rectangle of PLANES rows per block (runs of one), and 72 plane rows of one run
    rects, planes = block_rects(r1, num_blocks, n, host_ptr, dev.data_ptr()), plane_rows(num_blocks, n, host_ptr,
                                                                                          dev.data_ptr())
    for name, fn, copies in (
            ("r1_pitched", lambda: batch_copy.memcpy_rects(*rects, stream.cuda_stream), r1.size),
            ("one_run_planes", lambda: batch_copy.memcpy_batch(*planes, stream.cuda_stream), PLANES)):
        ms = time_ms(fn, reps)
        res.append(dict(pool=pool_name, case=name, copies=copies, ms=ms, gbps=nbytes / ms / 1e6))
        print(pool_name, name, f"{ms:.2f} ms {nbytes / ms / 1e6:.1f} GB/s", flush=True)


def part2(res, pool_bytes: np.ndarray, num_blocks, dev, n, reps, rng, stream):
    """Host bounce: D2H into one pinned buffer, then numba threads scatter its rows into the pool."""
    import numba

    @numba.njit(parallel=True, nogil=True, cache=False)
    def scatter(dst, src, dst_off, src_off, width):
        for r in numba.prange(dst_off.size):
            d, s = dst_off[r], src_off[r]
            dst[d:d + width] = src[s:s + width]

    nbytes = n * GEO.block_bytes
    bounce = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    bnp = bounce.numpy()
    r1 = fragmented_ids(n, 1, num_blocks, rng)
    h, d = rows_of(r1, num_blocks)
    h, d = h.astype(np.int64), d.astype(np.int64)
    scatter(pool_bytes, bnp, h[:8], d[:8], ROW)  # compile
    ms_d2h = time_ms(lambda: bounce.copy_(dev[:nbytes], non_blocking=True), reps)
    res.append(dict(case="bounce_d2h_contiguous", ms=ms_d2h, gbps=nbytes / ms_d2h / 1e6))
    print("bounce D2H", f"{ms_d2h:.2f} ms", flush=True)
    for threads in (1, 2, 4, 8, 12, 16):
        if threads > numba.config.NUMBA_NUM_THREADS:
            continue
        numba.set_num_threads(threads)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            scatter(pool_bytes, bnp, h, d, ROW)
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        # beside a D2H copy of the same size into another pinned buffer (DRAM shared with the DMA)
        other = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        beside = []
        for _ in range(max(3, reps // 2)):
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                e0.record()
                other.copy_(dev[:nbytes], non_blocking=True)
                e1.record()
            t0 = time.perf_counter()
            scatter(pool_bytes, bnp, h, d, ROW)
            t_sc = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            beside.append((t_sc, e0.elapsed_time(e1)))
        del other
        sc_b = statistics.median(b[0] for b in beside)
        d2h_b = statistics.median(b[1] for b in beside)
        res.append(dict(case="scatter_rows", threads=threads, ms=ms, gbps=nbytes / ms / 1e6,
                        beside_d2h_scatter_ms=sc_b, beside_d2h_copy_ms=d2h_b))
        print(f"scatter threads {threads}: {ms:.2f} ms {nbytes / ms / 1e6:.1f} GB/s; beside D2H: scatter "
              f"{sc_b:.2f} ms, D2H {d2h_b:.2f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    t0 = time.time()
    out = {"env": env_info(), "rows": [], "scatter": []}
    out["env"]["cpus"] = os.cpu_count()
    n = 8192 // GEO.page_size
    num_blocks = 2 * n + 64
    dev = torch.empty(n * GEO.block_bytes, dtype=torch.uint8, device="cuda")
    dev.random_(0, 256)
    stream = torch.cuda.Stream()
    rng = np.random.default_rng(0)
    with torch.cuda.stream(stream):
        pool = HostBlockPool(GEO, num_blocks, layout="layer_first")
        part1(out["rows"], "kvtier", pool.host.data_ptr(), num_blocks, dev, n, args.reps, rng, stream)
        before = anon_huge_kb()
        nbytes = num_blocks * GEO.block_bytes
        m, mem, rc = thp_memory(nbytes + (1 << 21))
        start = (-mem.data_ptr()) % (1 << 21)
        huge = HostBlockPool(GEO, num_blocks, layout="layer_first", memory=mem[start:start + nbytes])
        out["thp"] = dict(madvise_rc=rc, anon_huge_kb_before=before, anon_huge_kb_after=anon_huge_kb())
        print("THP", out["thp"], flush=True)
        part1(out["rows"], "thp", huge.host.data_ptr(), num_blocks, dev, n, args.reps, rng, stream)
        part2(out["scatter"], pool.host.reshape(-1).view(torch.uint8).numpy(), num_blocks, dev, n, args.reps, rng,
              stream)
        huge.destroy()
        pool.destroy()
    out["seconds"] = time.time() - t0
    write_json(args.out, out)


if __name__ == "__main__":
    main()
