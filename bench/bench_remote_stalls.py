"""How long the remote tier holds the engine: engine-facing calls under a hung master, and a heartbeat thread's
stalls beside a tier under master and peer chaos on a loaded machine, with and without the remote tier.

Both parts run a real ``mooncake_master`` on loopback and a tier whose copies are skipped (index, allocation,
finalize and the remote tier all run), ``remote_timeout_s`` ``--timeout``.

* ``hung``: per round, a fresh tier with puts landed and a probed fetch; the master is stopped (SIGSTOP) and every
  engine call is timed (store, lookup, poll, load, stats, wait, wait_all, reset, destroy) while a second thread
  calls ``stats``. Target: the longest call <= ``remote_timeout_s`` + 0.5 s. Then a tier is built in a child
  process while the master is stopped, killed past ``--build-limit-s``.
* ``chaos``: busy processes load the cores, peer processes store and fetch, a seeded chaos thread stops and kills
  the master and the peers; engine threads drive one tier while a heartbeat thread records how late it wakes
  (runnable but not running, or waiting for the GIL or a lock). Phases alternate without and with the remote tier
  (ABBA, ``--order`` to choose). Target: the heartbeat's worst stall with the remote tier <= 2x without it.

Run: ``python bench/bench_remote_stalls.py --phases 8 --phase-s 30 --out bench/results/remote_stalls_cpu.json`` (about
7 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's INFO and WARNING lines off (a chaos run logs plenty)

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import gil_trace  # noqa: E402
from bench.common import ROOT, SkipCopies, command, kill, machine, send_signal, write_json  # noqa: E402
from kvtier.config import TierConfig  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.tier import HostBlockPool, KVTier, remote_tier  # noqa: E402
from tests.kv_helpers import make_kv  # noqa: E402
from tests.mooncake_master import Master  # noqa: E402

GEO = KVGeometry(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, page_size=16)  # 32 KiB blocks
IDENTITY = {"model": "bench-remote-stalls", "revision": "0", "tp_rank": 0, "tp_size": 1}
PAGES = 8  # pages (= blocks) of every prefix
HEARTBEAT_S = 0.005
STALL_LOG_S = 0.03  # heartbeat ticks later than this are listed with their times (``heartbeat_stalls``)
SLACK_S = 0.5  # the hung-master target's slack over remote_timeout_s


def make_tier(master: Optional[str], timeout_s: float, num_blocks: int = 128, prefix: str = "stalls",
              required: bool = True) -> KVTier:
    """A tier over a small KV pool, copies skipped; a remote tier on ``master`` unless None (``required``:
    ``remote_required``)."""
    kv = make_kv(GEO, 2 * PAGES * GEO.page_size, "cpu", torch.Generator().manual_seed(0))
    remote = {} if master is None else dict(
        remote_backend="mooncake", remote_master=master, remote_local_hostname="127.0.0.1",
        remote_segment_gb=1 / 16, remote_timeout_s=timeout_s, remote_admission="always", remote_key_prefix=prefix,
        remote_required=required)
    cfg = TierConfig(page_size=GEO.page_size, tokens_per_block=GEO.page_size, cpu_cache_gb=1.0, **remote)
    pool = HostBlockPool(GEO, num_blocks, layout="layer_first")
    return KVTier(kv, cfg, pool=pool, executor=SkipCopies(), model_identity=IDENTITY)


def tokens(owner: int, seq: int) -> np.ndarray:
    """The prefix ``seq`` of ``owner`` (0: this process, 1..: the peers): PAGES pages, distinct per (owner, seq)."""
    return np.arange(PAGES * GEO.page_size, dtype=np.int64) + owner * 10_000_000 + seq * 10_000


SLOTS = torch.arange(PAGES * GEO.page_size, dtype=torch.int64)


class Calls:
    """Engine-facing calls, timed: each call's name and seconds (wall clock)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float]] = []
        self._lock = threading.Lock()

    def __call__(self, name: str, fn: Callable, *args):
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            dt = time.monotonic() - t0
            with self._lock:
                self.rows.append((name, dt))

    def worst(self) -> dict:
        by: dict[str, float] = {}
        for name, dt in self.rows:
            by[name] = max(by.get(name, 0.0), dt)
        top = max(self.rows, key=lambda r: r[1]) if self.rows else ("", 0.0)
        return {"worst_call": top[0], "worst_s": round(top[1], 4), "calls": len(self.rows),
                "worst_by_call_s": {k: round(v, 4) for k, v in sorted(by.items())}}


# --- part (a): a hung master ---

def hung_round(master: Master, timeout_s: float, rnd: int) -> dict:
    """One round: a fresh tier with puts landed and a probed fetch, then the master stopped (see the docstring)."""
    tier = make_tier(master.addr, timeout_s, prefix=f"stalls-hung-{rnd}-{os.getpid()}")
    calls = Calls()
    try:
        for seq in range(3):
            tier.wait(tier.store(tokens(0, seq), None, SLOTS))
        tier.lower_tier("remote").drain(wait=True)
        tier.reset()  # the CPU pool empty; the store holds prefixes 0..2
        fetch = tier.lookup_tiers(tokens(0, 0), None).read
        job = tier.in_flight()[fetch.id].completion
        job.wait(30)  # its probe has returned: the next drain starts its get
        stop = threading.Event()

        def stats_loop() -> None:
            while not stop.is_set():
                calls("stats (other thread)", tier.stats)
                time.sleep(0.01)
        other = threading.Thread(target=stats_loop, daemon=True)
        master.pause()
        other.start()
        try:
            calls("store", lambda: tier.wait(tier.store(tokens(0, 10), None, SLOTS)))
            calls("lookup", tier.lookup_tiers, tokens(0, 1), None)
            calls("poll", tier.poll)  # the fetch's get starts: it hangs
            calls("load", lambda: tier.wait(tier.load(tokens(0, 10), None, SLOTS)))
            calls("stats", tier.stats)
            calls("wait (fetch)", tier.wait, fetch)
            calls("lookup", tier.lookup_tiers, tokens(0, 2), None)
            calls("wait_all", tier.wait_all)
            calls("reset", tier.reset)
            calls("store", lambda: tier.wait(tier.store(tokens(0, 11), None, SLOTS)))
            calls("lookup", tier.lookup_tiers, tokens(0, 0), None)
            calls("stats", tier.stats)
            calls("destroy", tier.destroy)
        finally:
            stop.set()
            other.join(60)
            master.resume()
    finally:
        tier.destroy()
    return {"round": rnd, **calls.worst(), "sequence_s": [[n, round(s, 4)] for n, s in calls.rows
                                                           if n != "stats (other thread)"]}


BUILD = """
import json, sys, threading, time
sys.path.insert(0, {root!r})
from bench.bench_remote_stalls import make_tier
make_tier(None, 1.0).destroy()  # the index's code loaded: what follows times the remote tier
worst, stop = [0.0], threading.Event()

def beat():
    last = time.monotonic()
    while not stop.is_set():
        time.sleep(0.005)
        now = time.monotonic()
        worst[0], last = max(worst[0], now - last - 0.005), now
threading.Thread(target=beat, daemon=True).start()
t0 = time.monotonic()
tier = make_tier({master!r}, {timeout!r}, required=False)
print(json.dumps({{"build_s": round(time.monotonic() - t0, 3), "remote": tier.lower_tier("remote") is not None,
                  "heartbeat_worst_s": round(worst[0], 3)}}), flush=True)
"""


def build_while_stopped(master: Master, timeout_s: float, limit_s: float) -> dict:
    """A tier built (``remote_required: false``) in a child process while the master is stopped, beside a heartbeat
    thread: how long the build takes and the heartbeat's worst stall; the child is killed past ``limit_s``."""
    master.pause()
    try:
        r = subprocess.run([sys.executable, "-c", BUILD.format(root=ROOT, master=master.addr, timeout=timeout_s)],
                           cwd=ROOT, capture_output=True, text=True, timeout=limit_s)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {"error": r.stderr[-500:]}
    except subprocess.TimeoutExpired:
        return {"froze_s": limit_s, "note": "no answer: killed (the set-up holds the GIL while it retries)"}
    finally:
        master.resume()


def run_hung(args, log_dir: str) -> dict:
    master = Master(log_dir)
    try:
        rounds = [hung_round(master, args.timeout, r) for r in range(args.rounds)]
        build = build_while_stopped(master, args.timeout, args.build_limit_s)
    finally:
        master.resume()
        master.kill()
    worst = max(rounds, key=lambda r: r["worst_s"])
    return {"rounds": rounds, "worst_call": worst["worst_call"], "worst_s": worst["worst_s"],
            "remote_timeout_s": args.timeout, "target_s": args.timeout + SLACK_S,
            "within_target": worst["worst_s"] <= args.timeout + SLACK_S, "build_while_stopped": build}


# --- part (b): chaos on a loaded machine ---

def _schedstat_wait_ns(tid: int) -> int:
    """Nanoseconds thread ``tid`` has spent runnable but not running (the kernel's run-queue delay)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class Heartbeat:
    """A thread sleeping :data:`HEARTBEAT_S` at a time, recording how late it wakes while :attr:`phase` is set."""

    def __init__(self) -> None:
        self.phase: Optional[str] = None
        self.ticks: dict[str, list[tuple[float, float]]] = {}  # phase -> (late s, of which runnable not running)
        self.stalls: dict[str, list[tuple[float, float, float]]] = {}  # phase -> (slept at, late s, runnable s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()
        self.native_id = self._thread.native_id

    def _run(self) -> None:
        tid = threading.get_native_id()
        last, rq = time.monotonic(), _schedstat_wait_ns(tid)
        while not self._stop.is_set():
            time.sleep(HEARTBEAT_S)
            now, rq_now = time.monotonic(), _schedstat_wait_ns(tid)
            phase = self.phase
            if phase is not None:
                late, runnable = now - last - HEARTBEAT_S, (rq_now - rq) / 1e9
                self.ticks.setdefault(phase, []).append((late, runnable))
                if late > STALL_LOG_S:
                    self.stalls.setdefault(phase, []).append((last, late, runnable))
            last, rq = now, rq_now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def summary(self, phase: str) -> dict:
        ticks = self.ticks.get(phase, [])
        if not ticks:
            return {}
        late = np.array([t[0] for t in ticks])
        cpu = np.array([t[1] for t in ticks])
        i = int(late.argmax())
        other = late - np.minimum(cpu, late)  # late, not runnable: waiting for the GIL (or a lock)
        return {"ticks": len(ticks), "worst_s": round(float(late[i]), 4),
                "worst_runnable_s": round(float(min(cpu[i], late[i])), 4),
                "worst_not_runnable_s": round(float(other.max()), 4),
                "not_runnable_over_50ms": int((other > 0.05).sum()),
                "p99_s": round(float(np.quantile(late, 0.99)), 4), "p999_s": round(float(np.quantile(late, 0.999)), 4),
                "late_total_s": round(float(late.clip(0).sum()), 3),
                "runnable_total_s": round(float(np.minimum(cpu, late.clip(0)).sum()), 3),
                "stalls": [[round(at, 4), round(late_s, 4), round(runnable, 4)]
                           for at, late_s, runnable in self.stalls.get(phase, [])]}


PEER = """
import os, sys, time
sys.path.insert(0, {root!r})
from bench.bench_remote_stalls import make_tier, tokens, SLOTS
me, master, peers = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tier = make_tier(master, 1.0, prefix="stalls-chaos")
print("ready", flush=True)
seq = 0
while True:  # killed by pid
    tier.wait(tier.store(tokens(me, seq % 200), None, SLOTS))
    other = 1 + (me + seq) % peers
    task = tier.lookup_tiers(tokens(other, (seq * 7) % 200), None).read
    if task is not None:
        tier.wait(task)
    if seq % 20 == 19:
        tier.reset()
    seq += 1
    time.sleep(0.05)
"""


class Cluster:
    """The master, the peers and the burners of the chaos part; every process stopped by its pid."""

    def __init__(self, args, log_dir: str) -> None:
        self.args, self.log_dir = args, log_dir
        self.master = Master(log_dir)
        self.burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
        self.late_peers = 0  # peers not ready within wait_peers' time
        self.peers: list[Optional[subprocess.Popen]] = [None] * args.peers
        for j in range(args.peers):
            self.start_peer(j)
        self.stopped: set = set()

    def start_peer(self, j: int) -> None:
        log = open(os.path.join(self.log_dir, f"peer{j}.log"), "ab")
        p = subprocess.Popen([sys.executable, "-c", PEER.format(root=ROOT), str(j + 1), self.master.addr,
                              str(self.args.peers)], stdout=subprocess.PIPE, stderr=log, cwd=ROOT)
        log.close()
        self.peers[j] = p

    def wait_peers(self, timeout_s: float = 300.0) -> None:
        """Until every peer printed ready (it built its tier); one that did not by then is counted and left to
        start (a saturated machine)."""
        for p in self.peers:
            if p is not None and getattr(p, "_ready", False) is False:
                line = _readline(p, timeout_s)
                if line != "ready":
                    self.late_peers += 1
                    print(f"a peer was not ready within {timeout_s:g} s ({line!r}); going on", flush=True)
                p._ready = True  # type: ignore[attr-defined]

    def heal(self) -> None:
        """Everything running again: stopped processes resumed, dead ones restarted."""
        for pid in list(self.stopped):
            send_signal(pid, signal.SIGCONT)
        self.stopped.clear()
        if self.master.proc is None or self.master.proc.poll() is not None:
            self.master.start()
        for j, p in enumerate(self.peers):
            if p is None or p.poll() is not None:
                self.start_peer(j)
        self.wait_peers()

    def act(self, rng: random.Random, stop_event: threading.Event) -> str:
        """One chaos action (it returns once the process is resumed or restarted); its name."""
        what = rng.choice(["stop_master", "kill_master", "stop_peer", "kill_peer"])
        hold = rng.uniform(0.5, 6.0)
        j = rng.randrange(len(self.peers)) if self.peers else 0
        if what == "stop_master":
            self._stop_for(self.master.proc.pid, hold, stop_event)
        elif what == "kill_master":
            self.master.kill()
            stop_event.wait(min(hold, 1.0))
            self.master.start()
        elif what == "stop_peer" and self.peers:
            self._stop_for(self.peers[j].pid, hold, stop_event)
        elif what == "kill_peer" and self.peers:
            kill(self.peers[j])
            self.start_peer(j)  # ready in the background: it builds its tier meanwhile
        return what

    def _stop_for(self, pid: int, seconds: float, stop_event: threading.Event) -> None:
        send_signal(pid, signal.SIGSTOP)
        self.stopped.add(pid)
        stop_event.wait(seconds)
        send_signal(pid, signal.SIGCONT)
        self.stopped.discard(pid)

    def close(self) -> None:
        for pid in list(self.stopped):
            send_signal(pid, signal.SIGCONT)
        for p in self.peers + self.burners:
            if p is not None:
                kill(p)
        if self.master.proc is not None:
            self.master.resume()
        self.master.kill()


def _readline(p: subprocess.Popen, timeout_s: float) -> str:
    out: list = []
    t = threading.Thread(target=lambda: out.append(p.stdout.readline().decode().strip()), daemon=True)
    t.start()
    t.join(timeout_s)
    return out[0] if out else "(nothing)"


def engine_phase(tier: KVTier, seconds: float, calls: Calls, peers: int, seed: int) -> int:
    """The engine thread's loop on ``tier`` for ``seconds``; the rounds run."""
    rng = random.Random(seed)
    t_end, rnd = time.monotonic() + seconds, 0
    while time.monotonic() < t_end:
        calls("store", lambda: tier.wait(tier.store(tokens(0, rng.randrange(1_000_000)), None, SLOTS)))
        if peers:
            toks = tokens(1 + rng.randrange(peers), rng.randrange(200))
            hit = calls("lookup", tier.lookup_tiers, toks, None)
            if hit.read is not None and rnd % 2 == 0:
                calls("wait (fetch)", tier.wait, hit.read)
            calls("load", lambda toks=toks: tier.wait(tier.load(toks, None, SLOTS)))
        calls("poll", tier.poll)
        calls("stats", tier.stats)
        if rnd % 20 == 19:
            calls("reset", tier.reset)
        rnd += 1
        time.sleep(0.01)
    return rnd


def build_phase_tier(mode: str, master: str, timeout_s: float) -> KVTier:
    """The tier of a phase: ``off`` (no remote tier), ``on``, or ``on:nice=N`` (the put threads N nicer than the
    creator instead of ``remote_tier.PUT_CALL_NICE`` / ``PUT_PREP_NICE``; threads take it when they start)."""
    if mode == "off":
        return make_tier(None, timeout_s)
    saved = remote_tier.PUT_CALL_NICE, remote_tier.PUT_PREP_NICE
    if mode.startswith("on:nice="):
        remote_tier.PUT_CALL_NICE = remote_tier.PUT_PREP_NICE = int(mode.split("=")[1])
    try:
        return make_tier(master, timeout_s, prefix="stalls-chaos")
    finally:
        remote_tier.PUT_CALL_NICE, remote_tier.PUT_PREP_NICE = saved


def run_chaos(args, log_dir: str) -> dict:
    cluster = Cluster(args, log_dir)
    beat = Heartbeat()
    lay = {**gil_trace.layout(), "watch_tid": beat.native_id} if args.gil_trace else {}
    tracer = gil_trace.start(lay, args.gil_trace) if args.gil_trace else None
    phases: list[dict] = []
    try:
        cluster.wait_peers()
        order = args.order.split(",") if args.order else ["off", "on", "on", "off"] * ((args.phases + 3) // 4)
        for k, mode in enumerate(order[:len(order) if args.order else args.phases]):
            cluster.heal()
            t0 = time.monotonic()
            tier = build_phase_tier(mode, cluster.master.addr, args.timeout)
            build_s = time.monotonic() - t0
            calls, name = Calls(), f"{k}:{mode}"
            stop = threading.Event()
            actions: list[str] = []
            chaos_rng = random.Random(args.seed + k // 2)  # the same schedule within a pair of phases

            # the loop's values bound: a chaos thread that outlives ch.join(30) keeps its own phase's
            def chaos(stop=stop, chaos_rng=chaos_rng, actions=actions) -> None:
                while not stop.is_set():
                    stop.wait(chaos_rng.uniform(0.5, 2.0))
                    if not stop.is_set():
                        actions.append(cluster.act(chaos_rng, stop))
            ch = threading.Thread(target=chaos, name="chaos", daemon=True)
            beat.phase = name
            ch.start()
            counts: list[int] = []
            engines = [threading.Thread(target=lambda i=i, tier=tier, calls=calls, counts=counts, k=k: counts.append(
                engine_phase(tier, args.phase_s, calls, args.peers, args.seed + 100 * k + i)), name=f"engine-{i}")
                for i in range(args.threads)]
            for e in engines:
                e.start()
            threads = {t.native_id: t.name for t in threading.enumerate()}
            for e in engines:
                e.join()
            rounds = sum(counts)
            beat.phase = None
            stop.set()
            ch.join(30)
            beat.phase = f"{name}:destroy"  # Mooncake's close holds the GIL while it joins the client's threads
            t0 = time.monotonic()
            tier.destroy()
            destroy_s = time.monotonic() - t0
            time.sleep(0.05)  # the heartbeat's late tick lands in this window
            beat.phase = None
            s = tier.stats()
            phases.append({"phase": name, "remote": mode != "off", "rounds": rounds, "build_s": round(build_s, 3),
                           "destroy_s": round(destroy_s, 3),
                           "heartbeat_during_destroy_s": beat.summary(f"{name}:destroy").get("worst_s"),
                           "chaos_actions": actions, "heartbeat": beat.summary(name), **calls.worst(),
                           "remote_counters": {k2: v for k2, v in s.items() if k2.startswith("remote_") and
                                               isinstance(v, (int, float)) and v}})
            if tracer is not None:
                phases[-1]["threads"] = threads
            print(json.dumps({k2: phases[-1][k2] for k2 in ("phase", "rounds", "worst_call", "worst_s",
                                                             "heartbeat")}), flush=True)
    finally:
        beat.stop()
        cluster.close()
        if tracer is not None:
            gil_trace.stop(tracer)
            for p in phases:  # each stall's GIL holders from the trace
                names = p["threads"]
                p["stall_holders"] = [{"at": at, "late_s": late, **gil_trace.holders(
                    args.gil_trace, at + HEARTBEAT_S, at + HEARTBEAT_S + late, names)}
                    for at, late, _ in p["heartbeat"].get("stalls", [])]
    off = [p for p in phases if not p["remote"]]
    on = [p for p in phases if p["remote"]]
    worst = lambda ps: max(p["heartbeat"].get("worst_s", 0.0) for p in ps) if ps else None  # noqa: E731
    w_off, w_on = worst(off), worst(on)
    p999 = lambda ps: max(p["heartbeat"].get("p999_s", 0.0) for p in ps) if ps else None  # noqa: E731
    return {"phases": phases, "heartbeat_worst_off_s": w_off, "heartbeat_worst_on_s": w_on,
            "on_over_off": round(w_on / w_off, 3) if w_on is not None and w_off else None,
            "heartbeat_p999_off_s": p999(off), "heartbeat_p999_on_s": p999(on),
            "on_over_off_p999": round(p999(on) / p999(off), 3) if on and off and p999(off) else None,
            "within_target": bool(w_on is not None and w_off and w_on <= 2 * w_off),
            "late_peers": cluster.late_peers, **({"gil_layout": lay} if lay else {}),
            "engine_worst_on": max(on, key=lambda p: p["worst_s"])["worst_call"] if on else None,
            "engine_worst_on_s": max(p["worst_s"] for p in on) if on else None,
            "engine_worst_off_s": max(p["worst_s"] for p in off) if off else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="hung,chaos", help="hung, chaos, or both")
    ap.add_argument("--timeout", type=float, default=1.0, help="remote_timeout_s")
    ap.add_argument("--rounds", type=int, default=3, help="hung-master rounds")
    ap.add_argument("--build-limit-s", type=float, default=60.0,
                    help="a tier built while the master is stopped is killed past this")
    ap.add_argument("--phases", type=int, default=4, help="chaos phases, alternating off/on (ABBA)")
    ap.add_argument("--phase-s", type=float, default=45.0)
    ap.add_argument("--order", default="", help="phase modes instead of --phases: off, on, on:nice=N (comma list)")
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--burners", type=int, default=2, help="busy processes loading the cores")
    ap.add_argument("--threads", type=int, default=4, help="engine threads driving the one tier")
    ap.add_argument("--seed", type=int, default=49)
    ap.add_argument("--machine", default="", help="what the machine is (recorded)")
    ap.add_argument("--gil-trace", default="", help="sample the GIL's holder into this .npz (bench/gil_trace.py) "
                    "and list each heartbeat stall's holders")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "remote_stalls_cpu.json"))
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    t0 = time.monotonic()
    res: dict = {"command": command(), "args": vars(args),
                 "machine": {"description": args.machine, **machine(), "loadavg_start": os.getloadavg()}}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-stalls-") as d:
        if "hung" in parts:
            res["hung_master"] = run_hung(args, d)
            h = res["hung_master"]
            print(f"hung master: worst call {h['worst_call']} {h['worst_s']:.3f} s against remote_timeout_s "
                  f"{args.timeout:g} s (target <= {h['target_s']:g} s)", flush=True)
        if "chaos" in parts:
            res["chaos"] = run_chaos(args, d)
            c = res["chaos"]
            print(f"chaos: heartbeat worst {c['heartbeat_worst_on_s']} s with the remote tier, "
                  f"{c['heartbeat_worst_off_s']} s without (ratio {c['on_over_off']}, target <= 2); engine worst "
                  f"{c['engine_worst_on']} {c['engine_worst_on_s']} s with, {c['engine_worst_off_s']} s without",
                  flush=True)
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["seconds"] = round(time.monotonic() - t0, 1)
    write_json(args.out, res, say=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
