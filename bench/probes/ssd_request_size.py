"""Probe: the SSD tier's write and read GB/s by request size: a job's blocks in ascending slots, runs of up to
``ssd_store.RUN_BYTES`` per request (``ascN``: N MiB), against descending slots (``descending``: what the tier's
free list gave back after LRU eviction before ``SlotIndex.alloc`` sorted them: every block its own request), on a
directory of the disk or of RAM.

Each repetition runs every unit, in a shuffled order: one write job of ``--bytes`` of Qwen3-8B blocks from a CPU
pool (``bench_ssd``'s geometry, ``--layout``), then one read job of them into other CPU blocks, through
:class:`~kvtier.tier.ssd_tier.SsdTier`. Medians.

Run: ``python bench/probes/ssd_request_size.py --dir /dev/shm/kvtier-order --units asc3,asc16,descending --out p.json``
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import bench_ssd  # noqa: E402
from bench.probes.ssd_protocol import run_units, unit_parser  # noqa: E402
from kvtier.storage import ssd_store  # noqa: E402
from kvtier.tier.slot_index import SlotIndex  # noqa: E402

_alloc = SlotIndex.alloc


def _descending(self, n):
    return _alloc(self, n)[::-1].copy()


def run(unit: str, args) -> dict:
    run_bytes = ssd_store.RUN_BYTES
    if unit == "descending":
        SlotIndex.alloc = _descending
    else:
        ssd_store.RUN_BYTES = int(unit[3:]) << 20
    try:
        return bench_ssd.tier_bandwidth(args.dir, args.bytes, args.io_threads, args.layout)
    finally:
        SlotIndex.alloc, ssd_store.RUN_BYTES = _alloc, run_bytes


def main() -> None:
    ap = unit_parser("asc16,descending", 5)
    ap.add_argument("--layout", default="layer_first")
    args = ap.parse_args()
    run_units(args, run, f"{args.dir} {args.layout} ")

if __name__ == "__main__":
    main()
