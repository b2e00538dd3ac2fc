"""The SSD store against the same disk's raw bandwidth, in one run (issue 18, part 9; the tier's data path is next).

For each directory (a disk, and a RAM-backed one for the software's own ceiling):
* raw: sequential O_DIRECT writes then reads of one file in 16 MiB requests from ``--io-threads`` threads (each
  thread its own region), fdatasync at the end of the writes; buffered where the file system refuses O_DIRECT;
* store: :class:`kvtier.storage.SsdStore` puts of Qwen3-8B-sized blocks (16 tokens x 36 layers x 8 KV heads x 128 x
  bf16 = 2.25 MiB) in batches of ``--batch`` (payloads, sync, records, headers, sync: durable on return), then gets of
  every block (checksums verified), on the same number of IO threads;
* recovery: the SSD tier's restart path (open the store, replay its journal: one sequential read, fill the slot
  index) over ``--recovery-blocks`` records, per million blocks (median of ``--reps``).
Summary: ``ssd_write_over_raw``, ``ssd_read_over_raw`` (the disk), ``ram_write_over_raw``, ``ram_read_over_raw``,
``recovery_s_per_million_blocks``.

Run: ``python bench/bench_ssd.py --dir /var/tmp/kvtier-ssd --ram-dir /dev/shm/kvtier-ssd --out bench/results/ssd_cpu.json``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kvtier.storage import Block, SsdStore, fingerprint  # noqa: E402
from kvtier.storage.ssd_store import FILE_NAME  # noqa: E402
from kvtier.storage.aligned_io import aligned as _aligned  # noqa: E402
from kvtier.storage.block_format import ALIGN, padded  # noqa: E402
from kvtier.storage.journal import BLOCK, Record  # noqa: E402
from kvtier.tier.slot_index import SlotIndex  # noqa: E402
from bench import progress  # noqa: E402

MiB = 1 << 20
BLOCK_BYTES = 16 * 36 * 2 * 8 * 128 * 2  # 2.25 MiB


def raw_bandwidth(directory: str, nbytes: int, threads: int, request: int = 16 * MiB) -> dict:
    """Sequential write then read GB/s of one file, O_DIRECT where taken, ``threads`` regions at once."""
    path = os.path.join(directory, "raw.bin")
    per = nbytes // threads // request * request
    bufs = [_aligned(request) for _ in range(threads)]
    for b in bufs:
        b[:] = np.random.default_rng(0).integers(0, 256, request, np.uint8)
    direct = True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        os.pwritev(fd, [bufs[0][:ALIGN]], 0)
    except OSError:
        direct = False
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, per * threads)

    def run(write: bool) -> float:
        def part(i: int) -> None:
            for off in range(i * per, (i + 1) * per, request):
                (os.pwritev if write else os.preadv)(fd, [bufs[i]], off)
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            list(ex.map(part, range(threads)))
        if write:
            os.fdatasync(fd)
        return per * threads / (time.perf_counter() - t) / 1e9
    if not direct:  # buffered: drop the file's pages so reads come from the medium where there is one
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    w = run(True)
    if not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    r = run(False)
    os.close(fd)
    os.unlink(path)
    return {"direct": direct, "bytes": per * threads, "write_gbps": w, "read_gbps": r}


def store_bandwidth(directory: str, nbytes: int, threads: int, batch: int) -> dict:
    n = max(batch, nbytes // BLOCK_BYTES // batch * batch)
    fp = fingerprint(model="bench", block_bytes=BLOCK_BYTES)
    slot_bytes = ALIGN + padded(BLOCK_BYTES)
    payloads = [_aligned(BLOCK_BYTES) for _ in range(batch)]
    for i, p in enumerate(payloads):
        p[:] = np.random.default_rng(i).integers(0, 256, BLOCK_BYTES, np.uint8)
    toks = np.arange(16, dtype=np.int64)
    with SsdStore(directory, capacity_bytes=n * slot_bytes, block_bytes=BLOCK_BYTES, fingerprint=fp,
                  io_threads=threads, wipe_mismatch=True, tokens_per_block=16) as s:
        t = time.perf_counter()
        for first in range(0, n, batch):
            s.put(range(first, first + batch), [Block(0, first + i, toks, payloads[i]) for i in range(batch)])
        w = n * BLOCK_BYTES / (time.perf_counter() - t) / 1e9
        outs = [_aligned(padded(BLOCK_BYTES)) for _ in range(batch)]
        t = time.perf_counter()
        bad = 0
        for first in range(0, n, batch):
            got = s.get(range(first, first + batch), outs)
            bad += sum(h is None for h in got)
        r = n * BLOCK_BYTES / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        found = len(s.recover())
        scan_s = time.perf_counter() - t
        direct = s.direct
    for name in ("kvtier_blocks.bin", "kvtier_blocks.bin.journal"):
        os.unlink(os.path.join(directory, name))
    return {"direct": direct, "blocks": n, "write_gbps": w, "read_gbps": r, "read_misses": bad,
            "recovered": found, "recovery_s": scan_s, "recovery_s_per_million_blocks": scan_s / n * 1e6}


def recovery(directory: str, n: int) -> dict:
    """Seconds of the SSD tier's restart path over a store whose journal holds ``n`` block records, per million:
    open the store, :meth:`SsdStore.recover_hashes`, fill a :class:`SlotIndex` (4 KiB blocks, so that ``n`` slots fit
    the disk; a record's size does not depend on its block's)."""
    directory = os.path.join(directory, "recovery")
    os.makedirs(directory, exist_ok=True)
    kw = dict(capacity_bytes=n * (ALIGN + ALIGN), block_bytes=ALIGN, fingerprint=fingerprint(model="bench-recovery"),
              tokens_per_block=16, wipe_mismatch=True)
    toks = np.arange(16, dtype=np.int64)
    with SsdStore(directory, **kw) as s:
        s.files[0].journal.rewrite(Record(BLOCK, i, 0, i * 0x9E3779B97F4A7C15 % 2**64, ALIGN, i, toks)
                                   for i in range(n))
    t0 = time.perf_counter()
    s = SsdStore(directory, **kw)
    t1 = time.perf_counter()
    slots, hashes = s.recover_hashes()
    t2 = time.perf_counter()
    held = SlotIndex(s.num_slots).recover(slots, hashes)
    t3 = time.perf_counter()
    s.close()
    size = os.path.getsize(os.path.join(directory, FILE_NAME + ".journal"))
    shutil.rmtree(directory)
    assert held == n
    return {"records": n, "journal_bytes": size, "open_s": t1 - t0, "recover_hashes_s": t2 - t1, "index_s": t3 - t2,
            "restart_s": t3 - t0, "s_per_million_blocks": (t3 - t0) / n * 1e6}


def median_recovery(directory: str, n: int, reps: int) -> dict:
    """The median of ``reps`` :func:`recovery` runs, with every run's seconds per million."""
    runs = sorted((recovery(directory, n) for _ in range(reps)), key=lambda r: r["s_per_million_blocks"])
    return {**runs[len(runs) // 2], "s_per_million_blocks_runs": [r["s_per_million_blocks"] for r in runs]}


def measure(directory: str, args) -> dict:
    os.makedirs(directory, exist_ok=True)
    raws, stores = [], []
    for _ in range(args.reps):  # alternating, medians: the disk's speed drifts
        raws.append(raw_bandwidth(directory, args.bytes, args.io_threads))
        progress.step(f"{directory}: raw")
        stores.append(store_bandwidth(directory, args.bytes, args.io_threads, args.batch))
        progress.step(f"{directory}: store")
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    out = {"dir": directory, "raw": raws, "store": stores,
           "raw_write_gbps": med(raws, "write_gbps"), "raw_read_gbps": med(raws, "read_gbps"),
           "store_write_gbps": med(stores, "write_gbps"), "store_read_gbps": med(stores, "read_gbps"),
           "recovery": median_recovery(directory, args.recovery_blocks, args.reps)}
    progress.step(f"{directory}: recovery")
    out["recovery_s_per_million_blocks"] = out["recovery"]["s_per_million_blocks"]
    out["write_over_raw"] = out["store_write_gbps"] / out["raw_write_gbps"]
    out["read_over_raw"] = out["store_read_gbps"] / out["raw_read_gbps"]
    print(f"{directory}: raw write {out['raw_write_gbps']:.3f} read {out['raw_read_gbps']:.3f} GB/s; store write "
          f"{out['store_write_gbps']:.3f} ({out['write_over_raw']:.3f}) read {out['store_read_gbps']:.3f} "
          f"({out['read_over_raw']:.3f}); recovery {out['recovery_s_per_million_blocks']:.2f} s per 1M blocks",
          flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--ram-dir", default="", help="a RAM-backed directory (e.g. under /dev/shm)")
    ap.add_argument("--bytes", type=int, default=1 << 30, help="bytes per measurement")
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="blocks per durable put")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--recovery-blocks", type=int, default=200_000, help="journal records for the recovery time")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "ssd_cpu.json"))
    args = ap.parse_args(argv)
    progress.plan((2 * args.reps + 1) * (2 if args.ram_dir else 1))
    res = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "block_bytes": BLOCK_BYTES,
           "args": vars(args), "disk": measure(args.dir, args)}
    if args.ram_dir:
        res["ram"] = measure(args.ram_dir, args)
        shutil.rmtree(args.ram_dir, ignore_errors=True)
    d = res["disk"]
    res["summary"] = {"ssd_write_over_raw": d["write_over_raw"], "ssd_read_over_raw": d["read_over_raw"],
                      "recovery_s_per_million_blocks": d["recovery_s_per_million_blocks"],
                      "raw_write_gbps": d["raw_write_gbps"], "raw_read_gbps": d["raw_read_gbps"]}
    if "ram" in res:
        res["summary"].update(ram_write_over_raw=res["ram"]["write_over_raw"],
                              ram_read_over_raw=res["ram"]["read_over_raw"])
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
