"""Serving under load (issue 53): many requests in flight through SGLang 0.5.23's own scheduler objects
(:mod:`kvtier.sglang.batch_server`), every mode on the same prompts, device pool and model in one process.

Modes (:data:`kvtier.sglang.batch_server.MODES`): ``recompute``; ``unified`` (SGLang's default device tree);
``hicache`` (UnifiedRadixCache with HiCache: its host pool of the same GiB as kvtier's, its default write policy and
I/O backend; CUDA only) and ``hicache_file`` (with its ``file`` L3 backend); ``kvtier`` and ``kvtier_layerwise``;
``kvtier_ssd`` (kvtier with an SSD tier). ``--modes`` picks them; with ``--ssd-dir`` and ``--ram-dir`` the SSD modes
run on the machine's disk and on a RAM-backed directory.

Workloads (``--workloads``):

* ``swe``: FlexKV's table: 120 SWE-bench-Lite-like prompts (a common instruction, prompts per repository context;
  p50 ~7k tokens, max ~28k), pass 1 fills (every request at once, 24 at most in flight), the device tree is
  dropped (host tiers keep theirs), pass 2 is measured at ``--qps`` (default 2.0 and a ladder) with 24 at most in
  flight, 32 new tokens, greedy;
* ``multiturn``: SGLang's ``bench_multiturn.py``: clients x rounds, turns of fixed length, 1 new token, at most
  ``max_parallel`` in flight at ``request_rate``, a round barrier; the device pool holds about three rounds, the host
  pool about six, so later rounds need the SSD; hit tokens per round;
* ``system``: 100 requests at once on one 2,000-token system prompt;
* ``distinct``: prompts that share nothing (what a host tier costs where nothing is reused).

Per mode and workload: requests/s, input and output tokens/s, TTFT avg/p50/p90/p99, end-to-end p50/p99, queueing
delay, hit tokens (device / host), prefill tokens computed, and sampled loaded pages checked against the stored
ones (``loaded_mismatches``). Each measured run repeats ``--repeats`` times, the modes in a rotated order; ratios
are medians over repeats. ``outputs_equal_replay``: the kvtier modes' swe pass-2 outputs against a replay of the same
prompts one at a time over a warm device cache (``--replay``); under load, batching changes the GEMM shapes, so the
under-load equality is reported beside it for every mode, recompute included.

Run on the GPU machine (carry .whl-sgl): ``bash tests/gpu_sglang.sh exec python3 bench/bench_serving.py --plan gpu
--out $OUT/serving_h100.json``; ``--plan smoke`` runs tiny versions on a CPU (CI).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

import numpy as np
import torch
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import progress  # noqa: E402
from bench.common import env_info, write_json  # noqa: E402
from kvtier.e2e.arrivals import Arrival, OpenLoop, Rounds  # noqa: E402
from kvtier.e2e.model import PagedDecoder, qwen3_config  # noqa: E402
from kvtier.e2e.workloads import distinct_prompts, multi_turn_rounds, shared_system_prompt, swe_bench_like  # noqa: E402


@dataclasses.dataclass
class Plan:
    """Sizes of one run."""

    device: str
    dtype: torch.dtype
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    page: int
    # swe
    swe_prompts: int
    swe_median: int
    swe_max: int
    swe_min: int
    swe_instruction: int
    swe_qps: tuple
    swe_concurrency: int
    swe_new_tokens: int
    swe_kv_fraction: float  # device pool: this fraction of the swe working set
    # multiturn
    mt_clients: int
    mt_rounds: int
    mt_turn: int
    mt_parallel: int
    mt_rate: float
    # system / distinct
    sys_requests: int
    sys_len: int
    distinct_prompts: int
    distinct_len: tuple
    distinct_qps: float
    max_running: int
    chunk: int
    max_prefill: int
    stop_at: float = float("inf")  # time.monotonic() past which no new (repeat, mode) run starts (--deadline-s)
    on_run: Optional[Callable[[str, dict], None]] = None  # after each run: (workload, its results so far)


def gpu_plan(layers: int) -> Plan:
    return Plan("cuda", torch.bfloat16, layers, 4096, 32, 8, 128, 12288, 151936, 16,
                120, 7088, 27961, 1500, 800, (2.0, 4.0, 8.0), 24, 32, 0.25,
                20, 10, 4096, 4, 16.0,
                100, 2000, 60, (1000, 4000), 4.0, 32, 16384, 16384)


def smoke_plan() -> Plan:
    return Plan("cpu", torch.float32, 2, 64, 4, 2, 16, 128, 512, 16,
                10, 160, 400, 64, 32, (20.0,), 4, 4, 0.3,
                3, 4, 48, 2, 50.0,
                6, 64, 4, (40, 100), 50.0, 4, 128, 256)


def build_model(plan: Plan) -> PagedDecoder:
    cfg = qwen3_config(num_layers=plan.layers, hidden=plan.hidden, heads=plan.heads, kv_heads=plan.kv_heads,
                       head_dim=plan.head_dim, intermediate=plan.intermediate, vocab=plan.vocab)
    return PagedDecoder.from_config(cfg, seed=0, device=plan.device, dtype=plan.dtype)


# --- one run ---

def summarize(records, seconds: float, page: int) -> dict:
    """A run's figures from its finished requests' records."""
    ttft = np.array([r.ttft_s for r in records]) * 1e3
    e2e = np.array([r.e2e_s for r in records]) * 1e3
    queue = np.array([r.queue_s for r in records]) * 1e3
    pct = lambda a, q: float(np.percentile(a, q)) if a.size else None  # noqa: E731
    prompt = sum(r.prompt_len for r in records)
    out_tokens = sum(len(r.output) for r in records)
    cacheable = sum((r.prompt_len - 1) // page * page for r in records)
    return {"requests": len(records), "seconds": seconds, "req_per_s": len(records) / seconds,
            "ttfts_ms": [round(float(x), 3) for x in ttft],
            "input_tok_per_s": prompt / seconds, "output_tok_per_s": out_tokens / seconds,
            "ttft_avg_ms": float(ttft.mean()) if ttft.size else None, "ttft_p50_ms": pct(ttft, 50),
            "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99), "e2e_p50_ms": pct(e2e, 50),
            "e2e_p99_ms": pct(e2e, 99), "queue_p50_ms": pct(queue, 50), "queue_p99_ms": pct(queue, 99),
            "prompt_tokens": prompt, "device_hit_tokens": sum(r.device_hit for r in records),
            "host_hit_tokens": sum(r.host_hit for r in records), "computed_tokens": sum(r.computed for r in records),
            "hit_rate": sum(r.device_hit + r.host_hit for r in records) / cacheable if cacheable else 0.0,
            "retracted": sum(r.retracted for r in records)}


def tier_figures(engine) -> dict:
    """The host tier's own figures after a run: kvtier's stats, HiCache's host pool use."""
    if engine.tier is not None:
        s = engine.tier.stats()
        keep = ("pages_loaded", "pages_stored", "pages_promoted", "promotions", "gbps_h2d", "gbps_d2h",
                "pages_held", "failed_loads", "failed_stores", "ssd_blocks_held", "ssd_blocks_read")
        return {k: s.get(k) for k in keep} | {"host_bytes_held": s["blocks_used"] * s["block_bytes"]}
    if engine.hicache:
        pool = engine.cache.cache_controller.mem_pool_host
        used = pool.size - pool.available_size()
        return {"host_tokens_held": int(used), "host_bytes_held": int(used * pool.size_per_token)}
    return {}


def serve(server, feed) -> tuple[list, float]:
    t0 = time.perf_counter()
    records = server.run(feed)
    if server.model.device.type == "cuda":
        torch.cuda.synchronize()
    progress.step(server.engine.mode)
    return records, time.perf_counter() - t0


def make(model, plan: Plan, mode: str, kv_tokens: int, host_gb: float, dirs: dict, max_context: int):
    from kvtier.sglang.batch_server import BatchServer, Engine, EngineConfig

    ssd = dirs.get(mode)
    if ssd is not None:
        shutil.rmtree(ssd, ignore_errors=True)
        os.makedirs(ssd, exist_ok=True)
    base, _, variant = mode.partition("@")
    overrides = {"ssd_admission": "always"} if base == "kvtier_ssd" else {}
    if "=" in variant:  # e.g. kvtier@transfer_mode=direct: a kvtier config key set for this mode
        key, _, value = variant.partition("=")
        overrides[key] = yaml.safe_load(value)
    cfg = EngineConfig(mode=base, kv_tokens=kv_tokens, page_size=plan.page, max_running_requests=plan.max_running,
                       max_context=max_context, chunked_prefill_size=plan.chunk, max_prefill_tokens=plan.max_prefill,
                       host_gb=host_gb, ssd_dir=ssd, ssd_gb=4 * host_gb, tier_overrides=overrides)
    engine = Engine(model, cfg)
    return engine, BatchServer(engine, verify_every=16)


def warm(server, plan: Plan) -> None:
    """Compile and warm every path (kernels, the numba index, cuBLAS) with a few requests outside the figures."""
    rng = np.random.default_rng(999)
    ps = [rng.integers(1, plan.vocab, 3 * plan.page + 5).tolist() for _ in range(3)]
    server.run([Arrival(p, 2, tag=i) for i, p in enumerate(ps)])
    server.engine.flush_device()
    server.run([Arrival(p, 2, tag=i) for i, p in enumerate(ps)])
    server.engine.flush_device()
    if server.engine.tier is not None:
        server.engine.tier.reset()


def kv_bytes_per_token(model: PagedDecoder) -> int:
    return model.kv_shape.bytes_per_token(model.dtype)


# --- workloads ---

def each_mode(model, plan: Plan, modes: list, dirs: dict, repeats: int, log, out: dict, name: str, kv_tokens: int,
              host_gb: float, max_context: int, body) -> None:
    """``body(engine, server, mode, rep)`` for every repeat and mode, the modes in an order rotated each repeat, a
    fresh engine each (warmed first); a mode that raises is recorded in ``out["errors"]`` with its traceback and
    not run again; past ``plan.stop_at`` the runs not started are listed in ``out["not_run"]``."""
    failed = out.setdefault("errors", {})
    for rep in range(repeats):
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            if mode in failed:
                continue
            if time.monotonic() > plan.stop_at:
                out.setdefault("not_run", []).append(f"{mode} rep {rep}")
                continue
            engine = None
            try:
                engine, server = make(model, plan, mode, kv_tokens, host_gb, dirs, max_context)
                warm(server, plan)
                body(engine, server, mode, rep)
                if plan.on_run is not None:
                    plan.on_run(name, out)
            except Exception:  # noqa: BLE001 - recorded: a mode that cannot run says why, the others go on
                failed[mode] = traceback.format_exc()
                log(f"{name} {mode}: FAILED\n{failed[mode]}")
            finally:
                if engine is not None and engine.cache is not None:
                    try:
                        engine.close()
                    except Exception:  # noqa: BLE001
                        log(f"{name} {mode}: close failed\n{traceback.format_exc()}")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()


def run_swe(model, plan: Plan, modes: list, dirs: dict, repeats: int, log) -> dict:
    prompts = swe_bench_like(plan.swe_prompts, vocab=plan.vocab, median=plan.swe_median, max_len=plan.swe_max,
                             min_len=plan.swe_min, instruction_len=plan.swe_instruction)
    total = sum(len(p) for p in prompts)
    per_tok = kv_bytes_per_token(model)
    kv_tokens = max(plan.swe_max + 4 * plan.page, int(total * plan.swe_kv_fraction)) // plan.page * plan.page
    host_gb = 1.5 * total * per_tok / 2**30
    out = {"prompts": len(prompts), "prompt_tokens": total, "kv_tokens": kv_tokens, "host_gb": host_gb, "runs": []}
    log(f"swe: {len(prompts)} prompts, {total} tokens; device pool {kv_tokens} tokens, host pool {host_gb:.2f} GiB")

    def body(engine, server, mode, rep):
        serve(server, OpenLoop(prompts, qps=float("inf"), concurrency=plan.swe_concurrency,
                               max_new_tokens=plan.swe_new_tokens))  # pass 1 fills
        for qps in plan.swe_qps:
            engine.flush_device()
            records, secs = serve(server, OpenLoop(prompts, qps=qps, concurrency=plan.swe_concurrency,
                                                   max_new_tokens=plan.swe_new_tokens, seed=rep))
            row = {"mode": mode, "repeat": rep, "qps": qps, **summarize(records, secs, plan.page),
                   **tier_figures(engine), "verified_pages": server.verified_pages,
                   "loaded_mismatches": server.loaded_mismatches, "outputs": {r.tag: r.output for r in records}}
            out["runs"].append(row)
            log(f"swe {mode} rep {rep} qps {qps}: {row['req_per_s']:.2f} req/s, TTFT p50 {row['ttft_p50_ms']:.0f} "
                f"p99 {row['ttft_p99_ms']:.0f} ms, hit {row['hit_rate']:.2f}")
    each_mode(model, plan, modes, dirs, repeats, log, out, "swe", kv_tokens, host_gb,
              plan.swe_max + 2 * plan.swe_new_tokens, body)
    return out


def replay_outputs(model, plan: Plan, prompts: list, mode: str, host_gb: float, kv_tokens: int, dirs: dict) -> dict:
    """Each prompt served alone: ``radix`` over a warm device cache, or a kvtier mode from its host tier (the
    device tree dropped before each request)."""
    engine, server = make(model, plan, mode, kv_tokens, host_gb, dirs, plan.swe_max + 2 * plan.swe_new_tokens)
    try:
        for i, p in enumerate(prompts):
            server.run([Arrival(p, plan.swe_new_tokens, tag=i)])
        out = {}
        for i, p in enumerate(prompts):
            if mode != "radix":
                engine.flush_device()
            out[i] = server.run([Arrival(p, plan.swe_new_tokens, tag=i)])[0].output
        return out
    finally:
        engine.close()


def replay_all(model, plan: Plan, modes: list, dirs: dict, swe: dict, log) -> dict:
    """Outputs one request at a time: over a warm device cache (the reference) and from each kvtier mode's host tier;
    and how many of each mode's under-load pass-2 outputs equal the reference."""
    prompts = swe_bench_like(plan.swe_prompts, vocab=plan.vocab, median=plan.swe_median, max_len=plan.swe_max,
                             min_len=plan.swe_min, instruction_len=plan.swe_instruction)
    ref = replay_outputs(model, plan, prompts, "radix", swe["host_gb"], swe["kv_tokens"], dirs)
    out = {"replay_equal": {}, "under_load_equal": {}}
    for mode in modes:
        if mode.startswith("kvtier") and "@" not in mode:
            got = replay_outputs(model, plan, prompts, mode, swe["host_gb"], swe["kv_tokens"], dirs)
            out["replay_equal"][mode] = sum(got[i] == ref[i] for i in ref) / len(ref)
        runs = [r for r in swe["runs"] if r["mode"] == mode]
        eq = [sum(r["outputs"].get(i) == ref[i] for i in ref) / len(ref) for r in runs]
        out["under_load_equal"][mode] = min(eq) if eq else None
    log(f"replay: {out}")
    return out


def run_multiturn(model, plan: Plan, modes: list, dirs: dict, repeats: int, log) -> dict:
    turns = multi_turn_rounds(plan.mt_clients, plan.mt_rounds, turn_len=plan.mt_turn, vocab=plan.vocab)
    per_round = plan.mt_clients * plan.mt_turn  # new tokens a round adds to the working set (outputs aside)
    kv_tokens = max(3 * per_round, plan.mt_rounds * plan.mt_turn + 4 * plan.page) // plan.page * plan.page
    host_gb = 6 * per_round * kv_bytes_per_token(model) / 2**30
    out = {"kv_tokens": kv_tokens, "host_gb": host_gb, "runs": []}
    log(f"multiturn: {plan.mt_clients} clients x {plan.mt_rounds} rounds of {plan.mt_turn}; device {kv_tokens} "
        f"tokens, host {host_gb:.2f} GiB")

    def body(engine, server, mode, rep):
        records, secs = serve(server, Rounds(turns, max_new_tokens=1, max_parallel=plan.mt_parallel,
                                             request_rate=plan.mt_rate, seed=rep))
        rounds: dict = {}
        for r in records:
            rounds.setdefault(r.tag[1], []).append(r)
        row = {"mode": mode, "repeat": rep, **summarize(records, secs, plan.page), **tier_figures(engine),
               "verified_pages": server.verified_pages, "loaded_mismatches": server.loaded_mismatches,
               "rounds": {k: summarize(v, secs, plan.page) for k, v in sorted(rounds.items())}}
        out["runs"].append(row)
        log(f"multiturn {mode} rep {rep}: {row['req_per_s']:.2f} req/s, TTFT p99 {row['ttft_p99_ms']:.0f} ms, hit "
            "rate by round " + " ".join(f"{v['hit_rate']:.2f}" for v in row["rounds"].values()))
    each_mode(model, plan, modes, dirs, repeats, log, out, "multiturn", kv_tokens, host_gb,
              plan.mt_rounds * (plan.mt_turn + 2) + plan.page, body)
    return out


def run_simple(name: str, model, plan: Plan, modes: list, dirs: dict, repeats: int, log, prompts: list,
               qps: float, concurrency: int, new_tokens: int) -> dict:
    total = sum(len(p) for p in prompts)
    kv_tokens = (max(2 * total, max(len(p) for p in prompts) + 8 * plan.page) + plan.page) // plan.page * plan.page
    host_gb = 1.5 * total * kv_bytes_per_token(model) / 2**30
    out = {"prompts": len(prompts), "prompt_tokens": total, "runs": []}

    def body(engine, server, mode, rep):
        records, secs = serve(server, OpenLoop(prompts, qps=qps, concurrency=concurrency, max_new_tokens=new_tokens,
                                               seed=rep))
        row = {"mode": mode, "repeat": rep, **summarize(records, secs, plan.page), **tier_figures(engine),
               "loaded_mismatches": server.loaded_mismatches}
        out["runs"].append(row)
        log(f"{name} {mode} rep {rep}: {row['req_per_s']:.2f} req/s, TTFT p50 {row['ttft_p50_ms']:.0f} p99 "
            f"{row['ttft_p99_ms']:.0f} ms")
    each_mode(model, plan, modes, dirs, repeats, log, out, name, kv_tokens, host_gb,
              max(len(p) for p in prompts) + 64, body)
    return out


# --- summary ---

def _median(runs: list, mode: str, key: str, **match) -> Optional[float]:
    vals = [r[key] for r in runs if r["mode"] == mode and all(r.get(k) == v for k, v in match.items())
            and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summary(res: dict, modes: list) -> dict:
    s: dict = {}
    kv = [m for m in modes if m.startswith("kvtier") and "ssd" not in m and "@" not in m]  # not the @-variants
    hi = "hicache" if "hicache" in modes else None
    thr, p99 = [], []
    for name in ("swe", "multiturn", "system"):
        w = res.get(name)
        if not w or not w.get("runs") or hi is None:
            continue
        match = {"qps": w["runs"][0]["qps"]} if name == "swe" else {}
        ref_t, ref_p = _median(w["runs"], hi, "req_per_s", **match), _median(w["runs"], hi, "ttft_p99_ms", **match)
        best_t = max((_median(w["runs"], m, "req_per_s", **match) or 0) for m in kv) if kv else None
        best_p = min((_median(w["runs"], m, "ttft_p99_ms", **match) or float("inf")) for m in kv) if kv else None
        if ref_t and best_t:
            s[f"{name}_throughput_over_hicache"] = best_t / ref_t
            thr.append(best_t / ref_t)
        if ref_p and best_p:
            s[f"{name}_ttft_p99_over_hicache"] = best_p / ref_p
            p99.append(best_p / ref_p)
    if thr:
        s["throughput_over_hicache_min"] = min(thr)
    if p99:
        s["ttft_p99_over_hicache_max"] = max(p99)
    mt = res.get("multiturn")
    if mt:
        late = {}
        for m in modes:
            rates = [v["hit_rate"] for r in mt["runs"] if r["mode"] == m for k, v in r["rounds"].items()
                     if int(k) >= 6]
            late[m] = statistics.mean(rates) if rates else None
        s["multiturn_late_round_hit_rate"] = late
        ssd = [m for m in modes if "ssd" in m or m == "hicache_file"]
        never = max((v for k, v in late.items() if v is not None), default=None)
        if ssd and never:
            s["ssd_hit_rate_late_rounds"] = {m: late[m] / never for m in ssd if late.get(m) is not None}
    d = res.get("distinct")
    if d:
        dev = _median(d["runs"], "unified", "req_per_s")
        if dev:
            s["no_reuse_throughput_over_device"] = {m: (_median(d["runs"], m, "req_per_s") or 0) / dev
                                                    for m in modes if m != "unified"}
    rep = (res.get("swe") or {}).get("replay")
    if rep and rep["replay_equal"]:
        s["outputs_equal_replay"] = min(rep["replay_equal"].values())
        s["outputs_equal_under_load"] = rep["under_load_equal"]
    s["loaded_bytes_mismatches"] = sum(r.get("loaded_mismatches", 0) for w in res.values() if isinstance(w, dict)
                                       for r in w.get("runs", []))
    return s


def plot(path: str, res: dict) -> None:
    """Four panels: swe pass-2 TTFT CDF per mode (the first rate), req/s and p99 TTFT against the offered rate, and
    the multiturn hit rate per round."""
    from matplotlib.figure import Figure  # no pyplot: it probes IPython, which the GPU runs' bootstrap stubs

    fig = Figure(figsize=(21, 4.6))
    ax = fig.subplots(1, 4)
    swe, mt = res.get("swe"), res.get("multiturn")
    if swe and swe["runs"]:
        first = swe["runs"][0]["qps"]
        rates = sorted({r["qps"] for r in swe["runs"]})
        finite = [q for q in rates if q != float("inf")] or [1.0]
        xs = [q if q != float("inf") else 2 * max(finite) for q in rates]
        for mode in res["modes"]:
            runs = [r for r in swe["runs"] if r["mode"] == mode and r["qps"] == first]
            if not runs:
                continue
            t = np.sort(runs[0]["ttfts_ms"])
            ax[0].plot(t, np.arange(1, t.size + 1) / t.size, label=mode)
            ax[1].plot(xs, [_median(swe["runs"], mode, "req_per_s", qps=q) for q in rates], "o-", label=mode)
            ax[2].plot(xs, [_median(swe["runs"], mode, "ttft_p99_ms", qps=q) for q in rates], "o-", label=mode)
        ax[0].set(xlabel="TTFT (ms)", ylabel="fraction of requests", title=f"swe pass 2 at {first} req/s",
                  xscale="log")
        ax[1].set(xlabel="offered req/s (all at once: 2x the highest)", ylabel="served req/s", title="swe throughput")
        ax[2].set(xlabel="offered req/s (all at once: 2x the highest)", ylabel="p99 TTFT (ms)", title="swe p99 TTFT",
                  yscale="log")
        for a in ax[:3]:
            a.legend(fontsize=7)
    if mt and mt["runs"]:
        for mode in res["modes"]:
            runs = [r for r in mt["runs"] if r["mode"] == mode]
            if runs:
                rounds = sorted(runs[0]["rounds"], key=int)
                ax[3].plot([int(k) + 1 for k in rounds], [statistics.mean(r["rounds"][k]["hit_rate"] for r in runs)
                                                          for k in rounds], "o-", label=mode)
        ax[3].set(xlabel="round", ylabel="hit rate (device + host tokens / cacheable)", title="multiturn hit rate")
        ax[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", choices=("gpu", "smoke"), default="gpu")
    ap.add_argument("--layers", type=int, default=8, help="Qwen3-8B layers the GPU plan's model has")
    ap.add_argument("--modes", default=None, help="comma-separated (default: every mode the device runs); "
                    "kvtier@KEY=VALUE: kvtier with one config key set (e.g. kvtier@transfer_mode=direct)")
    ap.add_argument("--workloads", default="swe,multiturn,system,distinct")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ssd-dir", default=None, help="the SSD modes' directory on the machine's disk")
    ap.add_argument("--ram-dir", default=None, help="a RAM-backed directory for the SSD modes (e.g. /dev/shm/...)")
    ap.add_argument("--replay", action="store_true", help="replay swe one request at a time (outputs_equal_replay)")
    ap.add_argument("--device", default=None, help="run the plan on this device (e.g. the smoke plan on cuda)")
    ap.add_argument("--swe-prompts", type=int, default=None, help="swe prompts (the plan's by default)")
    ap.add_argument("--qps", default=None, help="swe pass-2 rates, comma-separated ('inf': all at once)")
    ap.add_argument("--multiturn", default=None, help="CLIENTS,ROUNDS,TURN_TOKENS (the plan's by default)")
    ap.add_argument("--distinct", type=int, default=None, help="distinct prompts (the plan's by default)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no new run after this many seconds (the JSON lists what did not run)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "serving.json"))
    args = ap.parse_args(argv)
    from kvtier.sglang.batch_server import CUDA_MODES, MODES

    plan = gpu_plan(args.layers) if args.plan == "gpu" else smoke_plan()
    if args.device:
        plan.device = args.device
        if plan.device.startswith("cuda"):
            plan.dtype = torch.bfloat16
    if args.swe_prompts:
        plan.swe_prompts = args.swe_prompts
    if args.qps:
        plan.swe_qps = tuple(float(q) for q in args.qps.split(","))
    if args.multiturn:
        plan.mt_clients, plan.mt_rounds, plan.mt_turn = (int(x) for x in args.multiturn.split(","))
    if args.distinct:
        plan.distinct_prompts = args.distinct
    if args.deadline_s is not None:
        plan.stop_at = time.monotonic() + args.deadline_s
    if plan.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the gpu plan needs CUDA (--plan smoke runs on a CPU)")
    modes = args.modes.split(",") if args.modes else [m for m in MODES if m != "radix" and (
        plan.device == "cuda" or m not in CUDA_MODES)]
    dirs = {}
    for mode in list(modes):
        if mode in ("kvtier_ssd", "hicache_file"):
            modes.remove(mode)
            for label, d in (("disk", args.ssd_dir), ("ram", args.ram_dir)):
                if d:
                    modes.append(f"{mode}@{label}")
                    dirs[f"{mode}@{label}"] = os.path.join(d, f"{mode}-{label}")
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    per_mode = (("swe" in args.workloads) * (1 + len(plan.swe_qps)) + sum(w in args.workloads for w in
                ("multiturn", "system", "distinct")))
    progress.plan(per_mode * len(modes) * args.repeats)
    model = build_model(plan)
    sizes = {k: v for k, v in dataclasses.asdict(plan).items() if k not in ("stop_at", "on_run")}
    res: dict = {"env": env_info(), "plan": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in sizes.items()},
                 "modes": modes, "args": vars(args),
                 # UnifiedRadixCache's TreeCore (the Rust one needs the torch sglang was built for)
                 "sglang_tree_core": os.environ.get("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "rust")}
    workloads = args.workloads.split(",")

    def save_partial(name: str, out: dict) -> None:  # a run cut short by the device's limit keeps what it measured
        write_json(args.out, {**res, name: out, "summary": summary({**res, name: out}, modes), "partial": True})
    plan.on_run = save_partial
    if "swe" in workloads:
        res["swe"] = run_swe(model, plan, modes, dirs, args.repeats, log)
        if args.replay:
            res["swe"]["replay"] = replay_all(model, plan, modes, dirs, res["swe"], log)
    if "multiturn" in workloads:
        res["multiturn"] = run_multiturn(model, plan, modes, dirs, args.repeats, log)
    if "system" in workloads:
        prompts = shared_system_prompt(plan.sys_requests, vocab=plan.vocab, system_len=plan.sys_len,
                                       question_len=(plan.page, 4 * plan.page))
        res["system"] = run_simple("system", model, plan, modes, dirs, args.repeats, log, prompts, float("inf"),
                                   plan.sys_requests, 8)
    if "distinct" in workloads:
        prompts = distinct_prompts(plan.distinct_prompts, vocab=plan.vocab, lengths=plan.distinct_len)
        res["distinct"] = run_simple("distinct", model, plan, modes, dirs, args.repeats, log, prompts,
                                     plan.distinct_qps, plan.max_running, 16)
    res["summary"] = summary(res, modes)
    write_json(args.out, res)
    try:
        plot(os.path.splitext(args.out)[0] + ".png", res)
    except ImportError:
        log("no matplotlib: no PNG")
    print({k: v for k, v in res["summary"].items()})
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
