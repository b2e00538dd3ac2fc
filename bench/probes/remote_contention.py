"""Probe: how Mooncake's raw ``batch_put_from`` over loopback TCP shares the machine's cores: its GB/s alone, beside
a thread running a pure-Python loop (holding the GIL between bytecodes), and beside a thread copying and hashing
64 MiB buffers (numpy and xxhash, the GIL released): what a remote put worker's own CPU work costs the put. Each
condition with the call made from a thread at the probe's own niceness and ``--nice`` more (the order alternating by
round): the call busy-waits for its transfers on the calling thread (``perf`` shows ``wait_for_completion`` polling
the transfer status and ``clock_gettime``), so at a lower priority that wait yields to the transfer's threads and to
the thread beside it (``remote_tier.PUT_CALL_NICE``).

One ``mooncake_master`` and one segment-holder process (``bench_remote.Stores``); calls of 36 values of 1.75 MiB +
4 KiB (the bench's geometry), fresh keys each, removed after; medians of ``--calls`` per condition, ``--reps``
rounds in order.

Run: ``python bench/probes/remote_contention.py --out probe.json``
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import xxhash

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench.bench_remote import Stores  # noqa: E402
from kvtier.tier.queue_thread import lower_priority as _lower_priority  # noqa: E402

VALUE = (7 << 20) // 4 + 4096
PER_CALL = 36


def python_loop(stop: threading.Event, count: list) -> None:
    while not stop.is_set():
        x = 0
        for i in range(10000):
            x += i
        count[0] += 1


def copy_and_hash(stop: threading.Event, count: list) -> None:
    src = np.random.randint(0, 255, 64 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    while not stop.is_set():
        np.copyto(dst, src)
        xxhash.xxh3_64_intdigest(dst)
        count[0] += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--nice", type=int, default=10, help="niceness added to the caller of the low-priority rows")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    stores = Stores.start(tempfile.mkdtemp(prefix="kvtier-contention-"), 4 << 30)
    try:
        raw = stores.raw
        src = np.random.randint(0, 255, 4 * PER_CALL * VALUE, dtype=np.uint8)
        if raw.register_buffer(src.ctypes.data, src.nbytes) != 0:
            raise RuntimeError("register_buffer failed")
        tag = [0]

        def one_call(k: int) -> float:
            tag[0] += 1
            keys = [f"contention/{tag[0]}/{i}" for i in range(PER_CALL)]
            base = src.ctypes.data + (k % 4) * PER_CALL * VALUE
            t = time.perf_counter()
            codes = raw.batch_put_from(keys, [base + i * VALUE for i in range(PER_CALL)], [VALUE] * PER_CALL)
            dt = time.perf_counter() - t
            if any(c != 0 for c in codes):
                raise RuntimeError(f"put failed: {sorted(set(codes))}")
            raw.batch_remove(keys, True)
            return dt

        def calls_at(nice: int) -> tuple[list, int]:
            """``args.calls`` calls' seconds, made from a fresh thread ``nice`` nicer than this one; and its
            niceness."""
            secs: list = []
            got: list = []

            def run() -> None:
                _lower_priority(nice)
                got.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
                secs.extend(one_call(k) for k in range(args.calls))
            th = threading.Thread(target=run)
            th.start()
            th.join()
            return secs, got[0]

        rows = []
        for rep in range(args.reps):
            for name, work in (("alone", None), ("python_loop", python_loop), ("copy_and_hash", copy_and_hash)):
                for nice in (0, args.nice)[::1 if rep % 2 == 0 else -1]:
                    stop, count = threading.Event(), [0]
                    th = threading.Thread(target=work, args=(stop, count)) if work else None
                    if th:
                        th.start()
                    secs, caller_nice = calls_at(nice)
                    stop.set()
                    if th:
                        th.join()
                    med = statistics.median(secs)
                    rows.append({"rep": rep, "beside": name, "caller_nice": caller_nice,
                                 "put_gbps": PER_CALL * VALUE / med / 1e9, "call_ms": med * 1e3,
                                 "background_iterations": count[0]})
                    print(json.dumps(rows[-1]), flush=True)
        raw.unregister_buffer(src.ctypes.data)
    finally:
        stores.close()
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
