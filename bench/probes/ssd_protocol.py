"""Probe: what the SSD tier's durability protocol costs on a disk, interleaved with the raw ``slots`` pattern.

Units (``--units``): ``raw_slots``; ``LAYOUT:tier`` (the tier as it is: headers and payloads in one request per run,
fdatasync, journal records, journal fdatasync); ``LAYOUT:headers_apart`` (the protocol before: each header also
written on its own after the payloads' sync, and one more sync, as when the headers followed the records);
``LAYOUT:nosync`` (no fdatasync at all: the ceiling of the protocol's flushes, not durable); ``LAYOUT:batchN`` (the
tier with durable batches of N MiB instead of ``ssd_tier.BATCH_BYTES``). Medians of ``--reps``,
units shuffled in each repetition.

Run: ``python bench/probes/ssd_protocol.py --dir /var/tmp/kvtier-ssd --reps 3 --out probe.json``
"""

import argparse
import json
import os
import random
import statistics
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import bench_ssd  # noqa: E402
from kvtier.storage.aligned_io import scratch, write_all  # noqa: E402
from kvtier.storage.block_file import BlockFile  # noqa: E402
from kvtier.storage.block_format import ALIGN, pack_block_header  # noqa: E402
from kvtier.tier import ssd_tier  # noqa: E402

_commit = BlockFile.commit


def _headers_apart(self, entries):
    os.fdatasync(self._fd)
    self.record(entries)
    buf = scratch("header", ALIGN)
    for slot, h in entries:
        buf[:] = np.frombuffer(pack_block_header(h), dtype=np.uint8)
        write_all(self._fd, buf, self._slot_offset(slot))
    self.sync()


def _nosync(self, entries):
    self.record(entries)


def run(unit: str, args) -> dict:
    if unit.startswith("raw_"):
        return bench_ssd.raw_bandwidth(args.dir, args.bytes, args.io_threads, unit[4:])
    layout, mode = unit.split(":")
    batch = ssd_tier.BATCH_BYTES
    if mode.startswith("batch"):
        ssd_tier.BATCH_BYTES, mode = int(mode[5:]) << 20, "tier"
    BlockFile.commit = {"tier": _commit, "headers_apart": _headers_apart, "nosync": _nosync}[mode]
    try:
        return bench_ssd.tier_bandwidth(args.dir, args.bytes, args.io_threads, layout)
    finally:
        BlockFile.commit, ssd_tier.BATCH_BYTES = _commit, batch


def unit_parser(units: str, reps: int) -> argparse.ArgumentParser:
    """The arguments every probe of :func:`run_units` takes (``--units`` defaults to ``units``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--bytes", type=int, default=1 << 30)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--units", default=units, type=lambda v: v.split(","))
    ap.add_argument("--out", required=True)
    return ap


def main() -> None:
    ap = unit_parser("raw_slots,page_first:tier,page_first:headers_apart,page_first:nosync", 3)
    args = ap.parse_args()
    run_units(args, run, "")


def run_units(args, run, label: str) -> None:
    """``run(unit, args)`` for every unit of ``args.units``, ``args.reps`` times in a shuffled order each; prints
    (after ``label``) and writes to ``args.out`` each unit's median write and read GB/s, and every run."""
    os.makedirs(args.dir, exist_ok=True)
    rows: dict = {u: [] for u in args.units}
    rng = random.Random(0)
    for _ in range(args.reps):
        for u in rng.sample(args.units, len(args.units)):
            rows[u].append(run(u, args))
    out = {u: {d: statistics.median(r[f"{d}_gbps"] for r in rs) for d in ("write", "read")} for u, rs in rows.items()}
    for u, m in out.items():
        print(f"{label}{u:26s} write {m['write']:.3f} read {m['read']:.3f} GB/s", flush=True)
    with open(args.out, "w") as f:
        json.dump({"medians": out, "runs": rows, "args": vars(args)}, f, indent=1)

if __name__ == "__main__":
    main()
