"""The remote put call thread's scheduling priority on the CPU machine: put throughput against the raw put, and an
engine thread's wake-up lateness beside the puts.

A synchronous Mooncake call busy-waits on its calling thread (``wait_for_completion`` polls), so the put call
thread's priority decides how much of the cores the wait takes from the transfer's own threads and from the engine.
Variants (``--call``): a niceness added to the put call thread (``remote_tier.PUT_CALL_NICE``), or ``idle``: the
thread under ``SCHED_IDLE`` (it runs only when no other thread wants the core). ``--prep`` sets
``remote_tier.PUT_PREP_NICE``.

* ``--mode throughput``: one master and segment holder (:class:`bench.bench_remote.Stores`), a ``layer_first`` cell
  (:class:`bench.bench_remote.Bench`); per repetition kvtier's put of 256 fresh blocks and the raw client's
  ``batch_put_from`` of the same values, alternating which goes first; CPU seconds of the bench process (by thread),
  the holder and the master from ``/proc``. Prints ``RESULT`` with the median GB/s and their ratio.
* ``--mode engine``: a Python thread standing in for the engine (100 us of bytecode, then a 0.5 ms sleep, over and
  over) records how late each sleep returns while kvtier puts run; ``--hogs N`` starts N CPU-bound processes at
  niceness 0 beside it (a saturated host).

Run: ``python bench/probes/remote_call_priority.py --mode throughput --call idle --prep 10``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench import bench_remote as br  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.tier import queue_thread, remote_tier as rt  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
BLOCKS = 256


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        p = f.read().rsplit(")", 1)[1].split()
    return (int(p[11]) + int(p[12])) / TICK


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's threads, by ``tid:name`` (Python's name where the thread is Python's)."""
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
        except FileNotFoundError:
            continue
        p = s.rsplit(")", 1)[1].split()
        out[f"{tid}:{names.get(tid, s[s.index('(') + 1:s.rindex(')')])}"] = (int(p[11]) + int(p[12])) / TICK
    return out


def set_priority(call: str, prep: int) -> None:
    """``call``: a niceness for the put call thread, ``idle`` (SCHED_IDLE) or ``batch`` (SCHED_BATCH at niceness
    10, the shipped one)."""
    rt.PUT_PREP_NICE = prep
    if call not in ("idle", "batch"):
        rt.PUT_CALL_NICE = int(call)
        return
    lower = queue_thread.lower_priority
    rt.PUT_CALL_NICE = 7  # a marker: the call thread asks for it, and gets the policy instead

    def lower_or_policy(nice: int) -> None:
        if nice == 7 and threading.current_thread().name.endswith("-call"):
            policy = os.SCHED_IDLE if call == "idle" else os.SCHED_BATCH
            os.sched_setscheduler(threading.get_native_id(), policy, os.sched_param(0))
            if call == "batch":
                lower(10)
        else:
            lower(nice)

    queue_thread.lower_priority = lower_or_policy


def raw_put(b: br.Bench, stores: br.Stores) -> float:
    """GB/s of the raw client's ``batch_put_from`` of BLOCKS fresh values (removed after)."""
    b._tag += 1
    keys = [f"prio/{b._tag}/{i}" for i in range(BLOCKS)]
    ptrs = [b.src.ctypes.data + i * b.V for i in range(BLOCKS)]
    put_s, codes = b._calls(stores.raw.batch_put_from, keys, ([ptrs, [b.V] * BLOCKS]))
    stores.raw.batch_remove(keys, True)
    return sum(c == 0 for c in codes) * b.V / put_s / 1e9


def kvtier_put(b: br.Bench) -> float:
    toks = b.fresh_tokens(BLOCKS)
    r = b.kvtier_put(toks)
    b.remove_kvtier(toks)
    return r["gbps"]


def throughput(b: br.Bench, stores: br.Stores, reps: int, label: str) -> None:
    pids = {"bench": os.getpid(), "holder": stores.holder.pid, "master": stores.master.proc.pid}
    got: dict[str, list[float]] = {"kvtier": [], "raw": []}
    for rep in range(reps + 1):  # the first is the warm-up
        for side in (("kvtier", "raw") if rep % 2 else ("raw", "kvtier")):
            c0, t0, w0 = {k: cpu_s(p) for k, p in pids.items()}, thread_cpu_s(), time.perf_counter()
            gbps = kvtier_put(b) if side == "kvtier" else raw_put(b, stores)
            wall = time.perf_counter() - w0
            c1, t1 = {k: cpu_s(p) for k, p in pids.items()}, thread_cpu_s()
            busy = {k: round(v - t0.get(k, 0.0), 3) for k, v in t1.items() if v - t0.get(k, 0.0) > 0.005}
            print(f"{side} {gbps:.3f} GB/s wall {wall:.3f} s cpu "
                  f"{ {k: round(c1[k] - c0[k], 3) for k in c1} } threads {busy}", flush=True)
            if rep:
                got[side].append(gbps)
    kv, raw = statistics.median(got["kvtier"]), statistics.median(got["raw"])
    paired = statistics.median(k / r for k, r in zip(got["kvtier"], got["raw"]))
    print(f"RESULT {label} kv {kv:.3f} raw {raw:.3f} ratio {kv / raw:.3f} paired {paired:.3f}")


def engine(b: br.Bench, reps: int, hogs: int, label: str) -> None:
    late: list[float] = []
    state = {"stop": False, "on": False}

    def loop() -> None:
        while not state["stop"]:
            x = 0
            for i in range(3000):  # ~100 us of bytecode, holding the GIL
                x += i
            t = time.perf_counter()
            time.sleep(0.0005)
            if state["on"]:
                late.append(time.perf_counter() - t - 0.0005)

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    th = threading.Thread(target=loop, daemon=True)
    th.start()
    rates = []
    try:
        for rep in range(reps + 1):
            state["on"] = rep > 0
            gbps = kvtier_put(b)
            state["on"] = False
            if rep:
                rates.append(gbps)
    finally:
        state["stop"] = True
        th.join()
        for p in procs:
            p.kill()
    s = sorted(late)
    ms = lambda q: round(s[min(len(s) - 1, int(q * len(s)))] * 1e3, 3)  # noqa: E731
    print(f"RESULT {label} hogs={hogs} put {statistics.median(rates):.3f} GB/s; engine wake lateness n={len(s)} "
          f"p50 {ms(0.5)} p99 {ms(0.99)} p999 {ms(0.999)} max {round(s[-1] * 1e3, 3)} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("throughput", "engine"), default="throughput")
    ap.add_argument("--call", default="10", help="niceness added to the put call thread, or 'idle' (SCHED_IDLE), 'batch' (SCHED_BATCH, +10)")
    ap.add_argument("--prep", type=int, default=10, help="niceness added to the put worker's thread")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--hogs", type=int, default=0, help="engine mode: CPU-bound processes beside it")
    a = ap.parse_args()
    set_priority(a.call, a.prep)
    geo = KVGeometry(28, 8, 128, torch.float16, page_size=16)
    stores = br.Stores.start(tempfile.mkdtemp(prefix="kvtier-prio-"), 4 << 30)
    try:
        b = br.Bench(SimpleNamespace(remote_timeout_s=30.0, blocks=BLOCKS), stores, geo, "layer_first", BLOCKS)
        try:
            label = f"call={a.call} prep={a.prep}"
            if a.mode == "throughput":
                throughput(b, stores, a.reps, label)
            else:
                engine(b, a.reps, a.hogs, label)
        finally:
            b.close()
    finally:
        stores.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
