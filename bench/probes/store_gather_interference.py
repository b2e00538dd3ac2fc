"""Probe (issue 17): what about a staged store's gathers slows its copies of runs of two to four pages?

With its gather launches replaced by nothing, the staged ``layer_first`` store of 8k tokens in runs of two pages as
whole 128 KiB rows takes 22.0 ms (one run 21.9); with them 23.9, whatever the gather's programs, the staging size, the
buffers or the rows per call (``probes/store_without_gather_h200.json``, ``store_gather_programs_h200.json``,
``staged_store_knobs_h200.json``). The store cuts such rows into shuffled pieces (``whole_rows`` keeps them whole).
Variants, alternating, ``--rounds`` rounds of ``--reps`` stores each:

* ``store``: as it is.
* ``no_gather``: the gather launches replaced by nothing (the copies move whatever the staging buffers hold).
* ``tiny_kernel``: each gather replaced by a kernel that does nothing for ~0.1 us (a launch and a cross-stream event
  without the gather's memory traffic).
* ``side_stream``: each gather on a stream of its own, joined back to the work stream (the copy stream waits on it
  through the work stream, as before).
* ``split_64k``: with gathers, every copy row wider than 64 KiB issued as 64 KiB pieces (the same bytes).
* ``all_gathers_first``: as many staging buffers as chunks, so every gather is issued (and runs) before the copies
  need them; the copies then run with no gather beside them after the first few.
* ``evict_l2``: each gather followed, on the work stream, by a 64 MiB memset of a scratch buffer, which pushes the
  gathered chunk out of the L2 (50 MiB on an H200) before the copy engine reads it.
* ``no_gather_evict_l2``: no gather, but the same memset in its place: are ``no_gather``'s copies fast because they
  read staging bytes the L2 still holds from the last copy?
* ``staging_16m``, ``staging_8m``, ``staging_4m``: with gathers, staging buffers of 16, 8 or 4 MiB (32 by default): a chunk small enough
  to stay in the L2 between its gather and its copy.
* ``pitched_256k``, ``pitched_1m``: with gathers, runs narrower than 256 KiB (1 MiB) a plane go as one pitched
  rectangle each (``Tuning.store_rows_min_bytes``; 64 KiB by default: every run of a 16-token page and up as rows).
* ``gather_plain``, ``gather_wt``, ``gather_cs``, ``gather_cg``, ``gather_evict_first``: the gather as a copy of
  kvtier's kernel launched through Triton's own launcher, its staging stores plain (the control) or with that cache
  modifier / eviction policy (``.wt`` writes through to memory, leaving no dirty lines in the L2).
* ``threads_2``, ``threads_4``: the rows issued from 2 or 4 threads (``Tuning.store_row_threads``; 1 by default).
* ``interleave_64k``, ``reverse_64k``, ``shuffle_64k``: with gathers, every row as 64 KiB pieces (one page of a
  layer), issued in each call page-index-major (every run's first page, then every run's second page, ...: no two
  consecutive pieces go to neighbouring host bytes, as with runs of one page), each run's pieces last to first
  (neighbours, descending), or shuffled: is it the neighbouring destinations of consecutive rows that make runs of
  two pages slow?
* ``shuffle_rows``: with gathers, each call's rows (not split) in a shuffled order.
* ``whole_rows``: the store with every row whole (``Tuning.store_split_max_bytes`` at 64 KiB), against ``store``,
  which cuts runs of two pages into shuffled pieces (``kvtier.kernels.staged.scattered_pieces``).
* ``l2_touch``, ``l2_touch_8m``: with gathers (32 or 8 MiB staging buffers), each chunk's copies preceded, on the copy
  stream, by a kernel that reads the chunk's staging bytes (``evict_last``): do runs of two pages copy at the one-run
  rate when the copy engine reads them from the L2 (``no_gather`` 22.0 ms at 8k: bytes the L2 holds from the last
  copy) rather than from memory (``all_gathers_first``, ``no_gather_evict_l2``: 24.0-24.2)?

The variants that cut or reorder rows (``split_64k``, ``interleave_64k``, ``reverse_64k``, ``shuffle_64k``,
``shuffle_rows``) do it to the whole rows of ``whole_rows``' store.

Run (GPU machine): ``python3 bench/probes/store_gather_interference.py --out $OUT/store_gather_interference_h200.json``
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Optional
import statistics
import sys
import time

import numpy as np
import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.common import env_info, finish_probe, host_us_per_call, time_gpu_ms  # noqa: E402
from bench.probes.store_affinity import store_cases  # noqa: E402
from kvtier.kernels import StagedTransfer, Tuning  # noqa: E402
from kvtier.kernels.row_issue import RowIssuer  # noqa: E402
from kvtier.kernels.staged import ragged  # noqa: E402
from kvtier.kernels.transfer import _CONST_NAMES, KernelLaunch  # noqa: E402

CASES = ((8192, 1), (8192, 2), (8192, 4), (8192, 0), (1024, 1), (1024, 2), (1024, 0))
VARIANTS = ("store", "no_gather", "tiny_kernel", "side_stream", "split_64k", "all_gathers_first", "evict_l2",
            "no_gather_evict_l2", "staging_16m", "staging_8m", "staging_4m", "pitched_256k", "pitched_1m",
            "threads_2", "threads_4", "gather_plain", "gather_wt", "gather_cs", "gather_cg", "gather_evict_first",
            "l2_touch", "l2_touch_8m", "interleave_64k", "reverse_64k", "shuffle_64k",
            "shuffle_rows", "whole_rows")
REORDERS = ("split_64k", "interleave_64k", "reverse_64k", "shuffle_64k", "shuffle_rows")
GATHER_STORE = {"gather_plain": ("", ""), "gather_wt": (".wt", ""), "gather_cs": (".cs", ""),
                "gather_cg": (".cg", ""), "gather_evict_first": ("", "evict_first")}
PIECE = 64 << 10


@triton.jit
def _gather_kernel(dev_base, dev_offsets, blocks, slots, block_ids, n_rows, skip_rows, layer_start, n_layers,
                   stride_block, stride_layer, stride_kv, blocks_layer0, TO_BLOCKS: tl.constexpr,
                   KV: tl.constexpr, PAGE: tl.constexpr, ROW_WORDS: tl.constexpr, CHUNK: tl.constexpr,
                   SEGS: tl.constexpr, ALIGN: tl.constexpr, CACHE: tl.constexpr, EVICT: tl.constexpr):
    """kvtier's ``_copy_pages_kernel``, slots -> blocks only, its stores with a cache modifier."""
    CHUNKS_PER_ROW: tl.constexpr = ROW_WORDS // CHUNK
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_segs = n_rows * CHUNKS_PER_ROW
    n_tiles = tl.cdiv(n_segs, SEGS)
    kv = tl.arange(0, KV)
    lane_seg = tl.arange(0, SEGS)
    word = tl.arange(0, CHUNK)
    for item in range(pid, n_layers * n_tiles, nprog):
        layer = (layer_start + item // n_tiles).to(tl.int64)
        seg = (item % n_tiles).to(tl.int64) * SEGS + lane_seg
        seg_ok = seg < n_segs
        row = seg // CHUNKS_PER_ROW
        col = (seg % CHUNKS_PER_ROW) * CHUNK
        slot = tl.load(slots + row, mask=seg_ok, other=0)
        row = row + skip_rows
        block = tl.load(block_ids + row // PAGE, mask=seg_ok, other=0)
        dev_off = tl.load(dev_offsets + layer * KV + kv) * ALIGN
        dev_word = dev_off[:, None] + (slot * ROW_WORDS + col)[None, :]
        blk_row = block * stride_block + (layer - blocks_layer0) * stride_layer + row % PAGE
        blk_row = blk_row[None, :] + (kv * stride_kv)[:, None]
        blk_word = blk_row * ROW_WORDS + col[None, :]
        dev_ptrs = dev_base + dev_word[:, :, None] + word[None, None, :]
        blk_ptrs = blocks + blk_word[:, :, None] + word[None, None, :]
        mask = seg_ok[None, :, None]
        tl.store(blk_ptrs, tl.load(dev_ptrs, mask=mask), mask=mask, cache_modifier=CACHE, eviction_policy=EVICT)


@triton.jit
def _touch_kernel(words, n_words, out, BLOCK: tl.constexpr):
    """Read ``n_words`` int64 words (kept in the L2: ``evict_last``); one XOR per program to ``out``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(pid * BLOCK, n_words, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(words + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    tl.store(out + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


TOUCH_PROGRAMS = 132


def touch_chunk(buffers: list, srcs: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream,
                out: torch.Tensor) -> None:
    """Launch on ``stream`` a read of the staging bytes a chunk's rows ``srcs``/``sizes`` come from (one of
    ``buffers``)."""
    lo, hi = int(srcs.min()), int((srcs + sizes).max())
    buf = next(b for b in buffers if b.data_ptr() <= lo and hi <= b.data_ptr() + b.numel() * b.element_size())
    a, z = (lo - buf.data_ptr()) // 8, -(-(hi - buf.data_ptr()) // 8)
    words = buf.view(torch.int64)[a:z]
    with torch.cuda.stream(stream):
        _touch_kernel[(TOUCH_PROGRAMS,)](words, words.numel(), out, BLOCK=1024, num_warps=8)


def pieces_64k(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
               order: str = "in_order") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows wider than 64 KiB as 64 KiB pieces (row widths here are whole multiples of it): ``in_order``,
    ``interleave`` (by piece index within its row, then row), ``reverse`` (each row's pieces last to first) or
    ``shuffle``."""
    row, index = ragged(np.maximum(sizes // np.uint64(PIECE), np.uint64(1)))
    piece = index.astype(np.uint64) * np.uint64(PIECE)
    pieces = dsts[row] + piece, srcs[row] + piece, np.minimum(sizes[row] - piece, np.uint64(PIECE))
    if order == "in_order":
        return pieces
    if order == "interleave":
        perm = np.lexsort((row, index))
    elif order == "reverse":
        perm = np.lexsort((-index, row))
    else:
        perm = np.random.default_rng(row.size).permutation(row.size)
    return tuple(a[perm] for a in pieces)


@contextlib.contextmanager
def variant(name: str, side: torch.cuda.Stream, scratch: torch.Tensor, stager: Optional[StagedTransfer] = None):
    """Patches of ``name``'s variant, undone on exit (``stager``: the one a ``l2_touch`` variant stores with)."""
    fire, issue = KernelLaunch.fire, RowIssuer.issue
    if name == "no_gather":
        KernelLaunch.fire = lambda self, *a, **k: None
    elif name == "tiny_kernel":
        KernelLaunch.fire = lambda self, *a, **k: torch.cuda._sleep(100)
    elif name == "side_stream":
        def on_side(self, span, programs, stream, blocks_layer0=None):
            work = torch.cuda.current_stream()
            side.wait_stream(work)
            with torch.cuda.stream(side):
                fire(self, span, programs, None, blocks_layer0=blocks_layer0)
            work.wait_stream(side)
        KernelLaunch.fire = on_side
    elif name == "no_gather_evict_l2":
        KernelLaunch.fire = lambda self, *a, **k: scratch.zero_()
    elif name == "evict_l2":
        def then_evict(self, *a, **k):
            fire(self, *a, **k)
            scratch.zero_()
        KernelLaunch.fire = then_evict
    elif name in GATHER_STORE:
        cache, evict = GATHER_STORE[name]

        def modified(self, span, programs, stream, blocks_layer0=None):
            grid = max(1, min(programs, span.count * self.tiles_per_layer))
            layer0 = self.blocks_layer0 if blocks_layer0 is None else blocks_layer0
            _gather_kernel[(grid,)](*self.pointers, self.n_rows, self.skip_rows, span.start, span.count,
                                    *self.strides, layer0, **dict(zip(_CONST_NAMES, self.consts)), CACHE=cache,
                                    EVICT=evict, num_warps=self.num_warps)
        KernelLaunch.fire = modified
    elif name in ("l2_touch", "l2_touch_8m"):
        out = torch.empty(TOUCH_PROGRAMS, dtype=torch.int64, device="cuda")

        def touched(self, dsts, srcs, sizes, stream):
            touch_chunk(stager._store.buffers, srcs, sizes, stream, out)
            issue(self, dsts, srcs, sizes, stream)
        RowIssuer.issue = touched
    elif name == "shuffle_rows":
        def shuffled(self, dsts, srcs, sizes, stream):
            perm = np.random.default_rng(sizes.size).permutation(sizes.size)
            issue(self, dsts[perm], srcs[perm], sizes[perm], stream)
        RowIssuer.issue = shuffled
    elif name.endswith("_64k"):
        order = {"split_64k": "in_order"}.get(name, name[:-len("_64k")])
        RowIssuer.issue = lambda self, dsts, srcs, sizes, stream: issue(self, *pieces_64k(dsts, srcs, sizes, order),
                                                                        stream)
    try:
        yield
    finally:
        KernelLaunch.fire, RowIssuer.issue = fire, issue


def same_bytes(name: str, stager: StagedTransfer, reference: StagedTransfer, host: torch.Tensor, slots, ids, side,
               scratch) -> bool:
    """Whether ``name``'s store (through ``stager``) writes the blocks ``ids`` of the layer_first ``host`` as
    kvtier's store (``reference``) does."""
    host[:, ids] = 0
    with variant(name, side, scratch, stager):
        stager.store(slots, ids, check=False)
    torch.cuda.synchronize()
    got = host[:, ids].clone()
    host[:, ids] = 0
    reference.store(slots, ids, check=False)
    torch.cuda.synchronize()
    got, want = got.view(torch.uint8), host[:, ids].view(torch.uint8)  # bytes: random bf16 bits hold NaNs
    return bool(got.any()) and torch.equal(got, want)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hide-host-us", type=float, default=200.0,
                    help="GPU spin before each timed store: long enough (e.g. 60000) queues the whole store first, so "
                         "the GPU time leaves out a host-paced issue")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args()
    t0 = time.time()
    kv, pool, cases = store_cases(CASES)
    stager = StagedTransfer(kv, pool.host, layout="layer_first")
    many = StagedTransfer(kv, pool.host, layout="layer_first", tuning=Tuning(num_buffers=48))  # > 8k's 37 chunks
    stagers = {"all_gathers_first": many,
               "staging_16m": StagedTransfer(kv, pool.host, layout="layer_first",
                                             tuning=Tuning(staging_bytes=16 << 20)),
               "staging_8m": StagedTransfer(kv, pool.host, layout="layer_first", tuning=Tuning(staging_bytes=8 << 20)),
               "staging_4m": StagedTransfer(kv, pool.host, layout="layer_first", tuning=Tuning(staging_bytes=4 << 20)),
               "pitched_256k": StagedTransfer(kv, pool.host, layout="layer_first",
                                              tuning=Tuning(store_rows_min_bytes=256 << 10)),
               "pitched_1m": StagedTransfer(kv, pool.host, layout="layer_first",
                                            tuning=Tuning(store_rows_min_bytes=1 << 20)),
               "threads_2": StagedTransfer(kv, pool.host, layout="layer_first", tuning=Tuning(store_row_threads=2)),
               "threads_4": StagedTransfer(kv, pool.host, layout="layer_first", tuning=Tuning(store_row_threads=4)),
               "l2_touch_8m": StagedTransfer(kv, pool.host, layout="layer_first", tuning=Tuning(staging_bytes=8 << 20)),
               "whole_rows": StagedTransfer(kv, pool.host, layout="layer_first",
                                            tuning=Tuning(store_split_max_bytes=64 << 10))}
    for name in REORDERS:  # they reorder or cut whole rows
        stagers[name] = stagers["whole_rows"]
    side = torch.cuda.Stream()
    scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    res = {"env": env_info(), "rows": []}
    for tokens, run, slots, ids in cases:
        row = dict(tokens=tokens, run=run, **{name: [] for name in args.variants})
        for _ in range(args.rounds):
            for name in args.variants:
                s = stagers.get(name, stager)
                with variant(name, side, scratch, s):
                    row[name].append(time_gpu_ms(lambda: s.store(slots, ids, check=False), reps=args.reps,
                                                hide_host_us=args.hide_host_us)["median_ms"])
        for name in [v for v in args.variants if v in GATHER_STORE or v.startswith("l2_touch") or v in REORDERS
                     or v == "whole_rows"]:  # the same bytes
            row[f"{name}_exact"] = same_bytes(name, stagers.get(name, stager), stager, pool.host, slots, ids, side,
                                              scratch)
        for name in args.variants:  # host issue of one store, the GPU busy meanwhile
            s = stagers.get(name, stager)
            with variant(name, side, scratch, s):
                row[f"{name}_host_ms"] = host_us_per_call(lambda: s.store(slots, ids, check=False), reps=5) / 1e3
        res["rows"].append(row)
        print(f"{tokens:5d} R={run or 'one':>3}: " + "  ".join(
            f"{name} {statistics.median(row[name]):.2f} (host {row[name + '_host_ms']:.2f})" for name in args.variants),
            flush=True)
    finish_probe(res, pool, args.out, t0)


if __name__ == "__main__":
    main()
