"""Which thread holds the GIL, sampled from outside the process, which runs on: a sampler process (niceness -5
where allowed) reads the interpreter's GIL state (``_PyRuntime.ceval.gil``: last holder, locked, switch number)
through ``/proc/<pid>/mem`` every ``--period-ms``, with the holder's scheduler counters and a watched thread's
(the bench's heartbeat): its cpu time, wait channel and state. While the watched thread has not run for 12 ms, and
again at 30 ms, it snapshots every thread (state, wait channel, syscall and its first argument: a futex's address,
to tell the GIL's mutex from its condition). While one holder keeps the GIL past ``--dump-after-ms`` without a
switch, it runs ``py-spy dump --nonblocking`` (at most every ``--dump-every-s``) for the holder's stack.

CPython 3.11 only (:func:`layout` finds the fields in the traced process). Used by ``bench_remote_stalls.py
--gil-trace``; :func:`holders` summarizes a trace over a time window.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Optional

import numpy as np


def _words(addr: int, n: int) -> np.ndarray:
    with open("/proc/self/mem", "rb", buffering=0) as f:
        f.seek(addr)
        return np.frombuffer(f.read(n), np.uint64)


def layout() -> dict:
    """This process's GIL fields: the address of ``gil.last_holder`` (the one word of ``_PyRuntime`` equal to the
    thread state of whichever thread holds the GIL, from two threads), ``locked`` after it, ``switch_number`` after
    that, and the offset of a thread state's native thread id."""
    rt = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    get = ctypes.pythonapi.PyThreadState_Get
    get.restype = ctypes.c_void_p

    def candidates() -> tuple[int, set]:
        ts = get()
        return ts, set(np.nonzero(_words(rt, 1 << 12) == ts)[0].tolist())
    ts0, c0 = candidates()
    out: list = []
    t = threading.Thread(target=lambda: out.append(candidates()))
    t.start()
    t.join()
    both = sorted(c0 & out[0][1])
    if len(both) != 1 or sys.version_info[:2] != (3, 11):
        raise RuntimeError(f"gil_trace: GIL layout not found (candidates {both}, Python {sys.version_info[:2]})")
    holder = rt + 8 * both[0]
    tid_off = int(np.nonzero(_words(ts0, 1024) == threading.get_native_id())[0][0]) * 8
    return {"pid": os.getpid(), "last_holder": holder, "locked": holder + 8, "switch_number": holder + 16,
            "tid_offset": tid_off}


def start(lay: dict, out: str, period_ms: float = 0.5, dump_after_ms: float = 30.0) -> subprocess.Popen:
    """The sampler process for ``lay`` (from :func:`layout`), writing ``out`` (.npz) when sent SIGTERM."""
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--layout", json.dumps(lay), "--out", out,
                             "--period-ms", str(period_ms), "--dump-after-ms", str(dump_after_ms)])


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def sample(lay: dict, out: str, period_ms: float, dump_after_ms: float, dump_every_s: float) -> None:
    pid = lay["pid"]
    try:
        os.nice(-5)  # ahead of the loaded machine's other work, so that samples come on time
    except OSError:
        pass
    mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    stop_flag = [False]
    signal.signal(signal.SIGTERM, lambda *a: stop_flag.__setitem__(0, True))
    rows = array.array("q")  # t_ns, tid (0: none), switch number, holder's cpu ns, holder's run-queue ns,
    # the watched thread's cpu ns, its wait channel (index into chans), its state (a byte)
    watch = lay.get("watch_tid")
    wfd = os.open(f"/proc/{pid}/task/{watch}/schedstat", os.O_RDONLY) if watch else None
    wchan = os.open(f"/proc/{pid}/task/{watch}/wchan", os.O_RDONLY) if watch else None
    wstat = os.open(f"/proc/{pid}/task/{watch}/stat", os.O_RDONLY) if watch else None
    chans: dict[str, int] = {}
    snaps: list = []  # every thread's state and wait channel while the watched thread has not run for a while
    w_last_cpu, w_ran_at, snapped = -1, 0, 0
    sched: dict[int, int] = {}
    dumps: list = []
    pyspy = shutil.which("py-spy")
    dumping: Optional[tuple[float, subprocess.Popen]] = None
    last_dump = 0.0
    hold_since, hold_key = 0, (0, -1)
    period = period_ms / 1e3
    while not stop_flag[0]:
        t = time.monotonic_ns()
        try:
            holder, locked, _, switch = struct.unpack("<QiiQ", os.pread(mem, 24, lay["last_holder"]))
        except OSError:
            break  # the process ended
        tid = cpu = rq = 0
        if locked == 1 and holder:
            try:
                tid = struct.unpack("<Q", os.pread(mem, 8, holder + lay["tid_offset"]))[0]
                fd = sched.get(tid)
                if fd is None:
                    fd = sched[tid] = os.open(f"/proc/{pid}/task/{tid}/schedstat", os.O_RDONLY)
                cpu, rq = (int(x) for x in os.pread(fd, 64, 0).split()[:2])
            except (OSError, ValueError, struct.error):
                pass
        wcpu = wc = wst = 0
        if wfd is not None:
            try:
                wcpu = int(os.pread(wfd, 64, 0).split()[0])
                wc = chans.setdefault(os.pread(wchan, 64, 0).decode(), len(chans))
                wst = os.pread(wstat, 512, 0).rsplit(b")", 1)[1].split()[0][0]
            except (OSError, ValueError, IndexError):
                pass
            if wcpu != w_last_cpu:
                w_last_cpu, w_ran_at, snapped = wcpu, t, 0
            elif (t - w_ran_at) / 1e6 > (12, 30, 1e12)[snapped]:
                snaps.append({"t": t / 1e9, "stale_s": (t - w_ran_at) / 1e9, "gil_tid": tid, "threads": _threads(pid)})
                snapped += 1
        rows.extend((t, tid, switch, cpu, rq, wcpu, wc, wst))
        key = (tid, switch)
        if key != hold_key:
            hold_key, hold_since = key, t
        elif (tid and pyspy and dumping is None and (t - hold_since) / 1e6 > dump_after_ms
              and time.monotonic() - last_dump > dump_every_s):
            dumping = (t / 1e9, subprocess.Popen([pyspy, "dump", "--nonblocking", "--pid", str(pid)],
                                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            last_dump = time.monotonic()
            dumps.append({"t": t / 1e9, "holder_tid": tid, "held_s": (t - hold_since) / 1e9})
        if dumping is not None and dumping[1].poll() is not None:
            dumps[-1]["stack"], dumps[-1]["done"] = dumping[1].stdout.read(), time.monotonic()
            dumping = None
        time.sleep(period)
    a = np.frombuffer(rows, np.int64).reshape(-1, 8)
    np.savez_compressed(out, rows=a, dumps=np.array(json.dumps(dumps)), snaps=np.array(json.dumps(snaps)),
                        chans=np.array(json.dumps({v: k for k, v in chans.items()})))


def _threads(pid: int) -> list:
    """Every thread of ``pid``: [tid, state, wait channel, cpu ns, run-queue ns]."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        d = f"/proc/{pid}/task/{tid}/"
        try:
            with open(d + "stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0].decode()
            with open(d + "wchan") as f:
                chan = f.read()
            with open(d + "schedstat") as f:
                cpu, rq = (int(x) for x in f.read().split()[:2])
            with open(d + "comm") as f:
                comm = f.read().strip()
            with open(d + "syscall") as f:
                call = f.read().split()
            out.append([int(tid), state, chan, comm, cpu, rq, " ".join(call[:2])])
        except (OSError, ValueError):
            pass
    return out


def holders(trace: str, t0: float, t1: float, names: Optional[dict] = None) -> dict:
    """Over ``[t0, t1]`` (``time.monotonic()`` seconds): the share of samples per GIL holder (0: none; named from
    ``names``, native id -> thread name), the GIL switches, each holder's cpu and run-queue seconds between its
    first and last sample there, and the py-spy dumps taken in the window."""
    z = np.load(trace)
    a = z["rows"]
    names = names or {}
    w = a[(a[:, 0] >= t0 * 1e9) & (a[:, 0] <= t1 * 1e9)]
    if not len(w):
        return {"samples": 0}
    out: dict = {"samples": int(len(w)), "switches": int(w[-1, 2] - w[0, 2]), "by_tid": {}}
    for tid in np.unique(w[:, 1]):
        m = w[w[:, 1] == tid]
        d = {"share": round(len(m) / len(w), 3)}
        if tid:
            d.update(cpu_s=round((m[-1, 3] - m[0, 3]) / 1e9, 4), runqueue_s=round((m[-1, 4] - m[0, 4]) / 1e9, 4),
                     first=round(m[0, 0] / 1e9 - t0, 4), last=round(m[-1, 0] / 1e9 - t0, 4))
        out["by_tid"][f"{int(tid)} {names.get(int(tid), names.get(str(int(tid)), '?'))}"] = d
    out["dumps"] = [d for d in json.loads(str(z["dumps"])) if t0 <= d["t"] <= t1 + 0.2]
    if "snaps" in z:
        chans = json.loads(str(z["chans"]))
        out["watched_chans"] = {chans[str(c)]: round(float((w[:, 6] == c).mean()), 3) for c in np.unique(w[:, 6])}
        out["watched_states"] = {chr(c) if c else "?": round(float((w[:, 7] == c).mean()), 3)
                                 for c in np.unique(w[:, 7])}
        out["snaps"] = [{**sn, "threads": [[*r[:4], r[6], names.get(r[0], "")] for r in sn["threads"]]}
                        for sn in json.loads(str(z["snaps"])) if t0 - 0.01 <= sn["t"] <= t1 + 0.01]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--period-ms", type=float, default=0.5)
    ap.add_argument("--dump-after-ms", type=float, default=30.0)
    ap.add_argument("--dump-every-s", type=float, default=1.0)
    a = ap.parse_args()
    sample(json.loads(a.layout), a.out, a.period_ms, a.dump_after_ms, a.dump_every_s)


if __name__ == "__main__":
    main()
