"""Probe: where an SSD promotion's time goes inside the TTFT bench's engine flow (``bench_ssd_ttft``'s ``always``
cells), next to ``bench_ssd``'s tier read in the same process, before and after the model exists.

Stages are timed by wrapping the store's calls (thread-seconds summed over the IO threads): ``preadv`` (the
vectored read), ``checksum`` (xxh3 of each payload), ``scatter`` (a bounced payload copied into its CPU block's
rows). Each IO thread's CPU affinity is recorded (a library that binds the main thread binds every thread it starts
later). Per request: the phases of ``TierEngine.serve`` (lookup, promotion wait, load, the rest).

Run (GPU machine): ``python bench/probes/ssd_promote_engine.py --dir /dev/shm/kvtier-pe --out p.json``
"""

import argparse
import json
import os
import shutil
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from bench import bench_ssd  # noqa: E402
from bench.bench_ssd_ttft import kv_bytes_per_token  # noqa: E402
from kvtier.config import TierConfig  # noqa: E402
from kvtier.e2e.engine import TierEngine  # noqa: E402
from kvtier.e2e.model import PagedDecoder, qwen3_config  # noqa: E402
from kvtier.storage import block_file, payload  # noqa: E402

STAGES: dict = {}  # stage -> [thread-seconds, calls]
AFFINITY: set = set()  # CPUs each IO thread may run on (sizes)
_lock = threading.Lock()


def wrap_timed(owner, name: str, note) -> None:
    """Replace ``owner.name`` by a wrapper that calls ``note(seconds)`` after each call."""
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            note(time.perf_counter() - t)
    setattr(owner, name, wrapper)


def timed(module, name: str, stage: str) -> None:
    """Time ``module.name`` as ``stage`` (thread-seconds and calls, each caller's affinity noted)."""
    def note(dt: float) -> None:
        with _lock:
            s = STAGES.setdefault(stage, [0.0, 0])
            s[0] += dt
            s[1] += 1
            AFFINITY.add(len(os.sched_getaffinity(0)))
    wrap_timed(module, name, note)


def take() -> dict:
    with _lock:
        out = {"stages": {k: {"thread_s": round(v[0], 4), "calls": v[1]} for k, v in STAGES.items()},
               "thread_affinity_cpus": sorted(AFFINITY)}
        STAGES.clear()
        AFFINITY.clear()
    return out


def bench_read(args, when: str) -> dict:
    take()
    os.makedirs(args.dir, exist_ok=True)
    r = bench_ssd.tier_bandwidth(args.dir, args.bench_bytes, 4, args.layout)
    r.update(take(), when=when, main_affinity_cpus=len(os.sched_getaffinity(0)))
    print("bench_ssd tier", when, json.dumps(r), flush=True)
    return r


def engine_cells(model, cfg, args, threads: int, plen: int, layerwise: bool) -> list:
    shutil.rmtree(args.dir, ignore_errors=True)
    longest = plen + 64
    kv_gb = longest * kv_bytes_per_token(model) / 2**30
    config = TierConfig(page_size=16, cpu_cache_gb=2.5 * kv_gb, ssd_cache_gb=3 * kv_gb, ssd_cache_dir=args.dir,
                        ssd_admission="always", ssd_io_threads=threads, host_layout=args.layout,
                        layerwise=layerwise)
    engine = TierEngine(model, config, num_slots=2 * (longest + 64), model_identity={"probe": "promote"})
    tier = engine.tier
    phases: dict = {}

    for name in ("lookup_tiers", "wait", "load_layerwise", "load", "wait_on_current_stream"):
        wrap_timed(tier, name, lambda dt, name=name: phases.__setitem__(name, phases.get(name, 0.0) + dt))
    forward = model.forward

    def timed_forward(*a, **k):  # synchronized: its GPU time, layer waits included
        t = time.perf_counter()
        out = forward(*a, **k)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        phases.setdefault("forward", time.perf_counter() - t)  # the first one: the prefill
        return out
    model.forward = timed_forward
    gen = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731

    def serve(tokens, source):
        engine.drop_device_cache()
        r = engine.serve(tokens, 2, source=source)
        tier.flush_ssd()
        return r
    for source in ("none", "kvtier"):
        serve(rand(64), source)
    prefix = rand(plen)
    serve(prefix + rand(32), "none")
    rows = []
    for _ in range(args.reps):
        prompt = prefix + rand(32)
        rec = serve(prompt, "none").ttft_s
        tier.reset()
        before = tier.stats()
        take()
        phases.clear()
        r = serve(prompt, "kvtier")
        after = tier.stats()
        phases_ssd = dict(phases)
        phases.clear()
        cpu_hit = serve(prompt, "kvtier").ttft_s  # the prefix is on the CPU tier now: no promotion
        nbytes = after["ssd_bytes_read"] - before["ssd_bytes_read"]
        secs = after["ssd_seconds_read"] - before["ssd_seconds_read"]
        row = {"io_threads": threads, "layerwise": layerwise, "prefix": plen, "recompute_ms": rec * 1e3,
               "ssd_ms": r.ttft_s * 1e3, "cpu_hit_ms": cpu_hit * 1e3, "cached": r.cached, "read_bytes": nbytes,
               "read_gbps": nbytes / secs / 1e9 if secs else None, "read_ms": secs * 1e3,
               "phases_ms": {k: round(v * 1e3, 2) for k, v in phases_ssd.items()},
               "cpu_hit_phases_ms": {k: round(v * 1e3, 2) for k, v in phases.items()}, **take()}
        print("engine", json.dumps(row), flush=True)
        rows.append(row)
    model.forward = forward
    tier.destroy()
    shutil.rmtree(args.dir, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layout", default="layer_first")
    ap.add_argument("--prefix", type=lambda v: [int(x) for x in v.split(",")], default=[2048, 8192])
    ap.add_argument("--layerwise", type=lambda v: [x == "1" for x in v.split(",")], default=[True, False])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--io-threads", type=lambda v: [int(x) for x in v.split(",")], default=[4, 8])
    ap.add_argument("--bench-bytes", type=int, default=1 << 30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    timed(block_file, "read_all_v", "preadv")
    timed(block_file, "payload_checksum", "checksum")
    timed(payload, "scatter", "scatter")
    out = {"args": vars(args), "cpus": os.cpu_count(), "env": {k: v for k, v in os.environ.items()
                                                              if k.startswith(("OMP", "KMP", "GOMP", "MKL"))}}
    out["bench_before_model"] = bench_read(args, "before the model")
    cfg = qwen3_config(num_layers=args.layers)
    model = PagedDecoder.from_config(cfg, seed=0, device="cuda" if torch.cuda.is_available() else "cpu")
    out["engine"] = [r for p in args.prefix for lw in args.layerwise for t in args.io_threads
                     for r in engine_cells(model, cfg, args, t, p, lw)]
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
