"""Crash loop for the SSD store: SIGKILL a storing process at random points, restart, check every block.

A writer process (:data:`WRITER`) stores batches of 1-4 blocks to random slots of a journaled, striped
:class:`~kvtier.storage.SsdStore`, reusing slots in place, and logs ``begin`` / ``done`` per block around each put.
The loop kills it after a random number of lines and delay, reopens the store as a restart would and counts
``durable_lost`` (an acknowledged block, not being replaced, missing or not read back exactly) and
``corrupt_served`` (a read returning bytes other than the block its header names, or a block never begun there).
SIGKILL tests the process dying, not the machine losing power.

Run: ``python bench/ssd_crash.py --dir /var/tmp/kvtier-crash --kills 200 --out bench/results/ssd_cpu.json``
(merges a ``crash`` section and ``crash_*`` summary keys into the file).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kvtier.storage import SsdStore, fingerprint  # noqa: E402
from kvtier.storage.block_format import ALIGN  # noqa: E402

BLOCK_BYTES = 16 * ALIGN + 100  # 64 KiB and a bit: a padded payload, a bounce through the aligned buffer
SLOTS_PER_DIR = 6
TOKENS = 16
FP = fingerprint(model="kvtier-crash-loop")

WRITER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    from bench.ssd_crash import block, open_store
    store = open_store(sys.argv[2])
    rng = np.random.default_rng(int(sys.argv[3]))
    chain = int(sys.argv[3]) * 100_000
    while True:
        slots = rng.choice(store.num_slots, size=int(rng.integers(1, 5)), replace=False).tolist()
        chains = list(range(chain + 1, chain + 1 + len(slots)))
        chain += len(slots)
        os.write(1, "".join(f"begin {s} {c}\\n" for s, c in zip(slots, chains)).encode())
        store.put(slots, [block(c) for c in chains])
        os.write(1, "".join(f"done {s} {c}\\n" for s, c in zip(slots, chains)).encode())
""")


def payload_for(chain: int) -> np.ndarray:
    return np.random.default_rng(chain).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def block(chain: int):
    from kvtier.storage import Block

    return Block(chain % 7, chain, np.arange(TOKENS, dtype=np.int64) + chain, payload_for(chain))


def open_store(base: str) -> SsdStore:
    dirs = [os.path.join(base, "a"), os.path.join(base, "b")]
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    slot = ALIGN + -(-BLOCK_BYTES // ALIGN) * ALIGN
    return SsdStore(dirs, capacity_bytes=len(dirs) * SLOTS_PER_DIR * slot, block_bytes=BLOCK_BYTES, fingerprint=FP,
                    io_threads=2, tokens_per_block=TOKENS)


def apply_writer_log(out: bytes, acked: dict, begun: dict) -> tuple[dict, int]:
    """Apply a killed writer's complete ``begin``/``done`` lines to ``acked`` (slot -> durable block, not being
    replaced) and ``begun`` (slot -> every block begun there); returns the slots being replaced at the kill
    (slot -> (old block or -1, new block)) and how many blocks were acknowledged."""
    lines = out.decode().splitlines()
    replacing: dict[int, tuple[int, int]] = {}
    done = 0
    for line in lines if out.endswith(b"\n") else lines[:-1]:
        what, slot, chain = line.split()
        slot, chain = int(slot), int(chain)
        if what == "begin":
            replacing[slot] = (acked.pop(slot, -1), chain)
            begun.setdefault(slot, set()).add(chain)
        else:
            acked[slot] = chain
            replacing.pop(slot, None)
            done += 1
    return replacing, done


def crash_loop(base: str, kills: int, seed: int = 0, max_lines: int = 24, max_delay_s: float = 0.03) -> dict:
    """Run ``kills`` writer processes over ``base``, killing each; the figures (see the module docstring)."""
    rng = np.random.default_rng(seed)
    acked: dict[int, int] = {}  # slot -> its durable block, not being replaced
    begun: dict[int, set] = {}  # slot -> every block a writer began there
    acked_total, lost, corrupt, recovered_total = 0, 0, 0, 0
    t0 = time.perf_counter()
    for kill in range(kills):
        p = subprocess.Popen([sys.executable, "-c", WRITER, ROOT, base, str(seed * 10_000 + kill + 1)],
                             stdout=subprocess.PIPE)
        seen = [p.stdout.readline() for _ in range(int(rng.integers(1, max_lines)))]
        time.sleep(float(rng.uniform(0, max_delay_s)))
        p.send_signal(signal.SIGKILL)
        out = b"".join(seen) + p.stdout.read()  # the same buffered reader as readline (it reads ahead)
        p.wait(timeout=60)
        replacing, done = apply_writer_log(out, acked, begun)
        acked_total += done
        with open_store(base) as store:
            # A restarted tier reads a slot only for the block recovery lists there, and a header naming another
            # block is a miss; so "served" is a read that returns the listed block.
            listed = {slot: h.chain_hash for slot, h in store.recover()}
            recovered_total += len(listed)
            slots = sorted(listed)
            outs = [np.empty(BLOCK_BYTES, np.uint8) for _ in slots]
            served = {}
            for slot, h, data in zip(slots, store.get(slots, outs), outs):
                if h is None or h.chain_hash != listed[slot]:
                    continue
                allowed = {acked[slot]} if slot in acked else set(replacing.get(slot, ()))
                if h.chain_hash not in allowed or h.chain_hash not in begun.get(slot, ()) or not np.array_equal(
                        data, payload_for(h.chain_hash)):
                    corrupt += 1
                else:
                    served[slot] = h.chain_hash
            lost += sum(1 for slot, chain in acked.items() if served.get(slot) != chain)
            acked = served  # what the next writer finds (it may evict any of it)
    return {"kills": kills, "blocks_acknowledged": acked_total, "blocks_recovered": recovered_total,
            "durable_lost": lost, "corrupt_served": corrupt, "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to crash on (emptied first)")
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "ssd_cpu.json"))
    args = ap.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    res = crash_loop(args.dir, args.kills, args.seed)
    res["dir"] = args.dir
    shutil.rmtree(args.dir, ignore_errors=True)
    print(json.dumps(res, indent=1))
    doc = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            doc = json.load(f)
    doc["crash"] = res
    doc.setdefault("summary", {}).update(crash_kills=res["kills"], crash_durable_lost=res["durable_lost"],
                                         crash_corrupt_served=res["corrupt_served"])
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0 if res["durable_lost"] == 0 and res["corrupt_served"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
