"""End to end: a random-weight Qwen3 serves prefixes through SGLang 0.5.23's KV pool, tree cache and scheduler
sequence (:mod:`kvtier.sglang.serving`), in four modes on the same prompts in one process: ``recompute`` (radix
cache disabled), ``device`` (SGLang's RadixCache, prefixes still on the device: the best case), ``kvtier_whole``
and ``kvtier_layerwise`` (KVTierRadixCache, device tree flushed, prefixes loaded from the host tier).

Workloads: ``fixed`` (1k/8k/28k prefixes with 32 and 1024 new tokens, 36 layers; the bound of a cell is
max(device-warm TTFT, prefix bytes at the copy engine's H2D rate measured in this run)), ``long`` (120 FlexKV-style
prompts, pass 1 fills, pass 2 measures, at ``--long-layers``) and ``chat`` (multi-turn conversations under a shared
system prompt, a device pool too small for the history in ``device_small`` and the kvtier modes).

Run on the GPU machine (carry .whl-sgl): ``bash tests/gpu_sglang.sh exec python3 bench/bench_e2e.py --out
$OUT/e2e_h200.json``. ``--smoke`` runs every workload at toy sizes on a CPU in seconds (CI runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ROOT, env_info, png_beside, pyplot, read_json, save_png, write_json  # noqa: E402
from kvtier.config import TierConfig  # noqa: E402
from kvtier.e2e.model import PagedDecoder, qwen3_config  # noqa: E402
from kvtier.e2e.workloads import fixed_prefix, long_prompts, multi_turn  # noqa: E402

KVTIER_MODES = ("kvtier_whole", "kvtier_layerwise")


@dataclasses.dataclass
class Plan:
    """Sizes of one run."""

    fixed_layers: int
    long_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    page_size: int
    fixed_prefixes: tuple
    fixed_new: tuple
    fixed_reps: int
    fixed_out: int
    long_count: int
    long_median: int
    long_max: int
    long_min: int
    long_groups: int
    long_out: int
    chat_convs: int
    chat_system: int
    chat_user: tuple
    chat_out: int
    chat_small_kv: int
    device: str
    dtype: torch.dtype
    tokens_per_block: Optional[int] = None  # kvtier's host block (None: the config's default for page_size)


def gpu_plan(long_layers: int) -> Plan:
    return Plan(36, long_layers, 4096, 32, 8, 128, 12288, 151936, 16, (1024, 8192, 28672), (32, 1024), 3, 8,
                120, 7000, 28672, 1024, 8, 32, 12, 2048, (100, 600), 32, 12288, "cuda", torch.bfloat16)


def smoke_plan() -> Plan:
    return Plan(2, 2, 64, 4, 2, 16, 128, 512, 4, (32, 64), (4, 12), 2, 3, 12, 60, 120, 24, 2, 4, 3, 32, (8, 20),
                4, 96, "cpu", torch.bfloat16, tokens_per_block=4)


def build_model(plan: Plan, layers: int) -> PagedDecoder:
    cfg = qwen3_config(num_layers=layers, hidden=plan.hidden, heads=plan.heads, kv_heads=plan.kv_heads,
                       head_dim=plan.head_dim, intermediate=plan.intermediate, vocab=plan.vocab)
    return PagedDecoder.from_config(cfg, seed=0, device=plan.device, dtype=plan.dtype)


# --- measurement helpers ---

def copy_engine_h2d_gbps(nbytes: int, reps: int = 10) -> float:
    """One contiguous pinned-host -> device copy (the copy engine's H2D bound), median over ``reps``."""
    host = torch.empty(nbytes // 8, dtype=torch.int64, pin_memory=True)
    host.copy_(torch.arange(host.numel(), dtype=torch.int64))
    dev = torch.empty_like(host, device="cuda")
    times = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    del dev, host
    return nbytes / statistics.median(times) / 1e9


def ttft_stats(ttfts_s: list[float]) -> dict:
    ms = np.array(ttfts_s) * 1e3
    if ms.size == 0:
        return {"n": 0}
    return {"n": int(ms.size), "avg_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
            "p90_ms": float(np.percentile(ms, 90)), "p99_ms": float(np.percentile(ms, 99))}


def aligned(n: int, page: int) -> int:
    """Prompt tokens a prefix cache can serve: SGLang matches at most n - 1, in whole pages."""
    return (n - 1) // page * page


def row(workload: str, mode: str, r, **extra) -> dict:
    return dict(workload=workload, mode=mode, ttft_ms=r.ttft_s * 1e3, serve_ms=r.total_s * 1e3,
                prompt_len=r.prompt_len,
                device_len=r.device_len, host_hit=r.host_hit, loaded=r.loaded, computed=r.computed,
                output=r.output, **extra)


def warm_up(servers: dict, vocab: int, page: int, n: int) -> None:
    """Compile and warm every path (Triton kernels, the numba index, cuBLAS/SDPA) outside the measurements."""
    rng = np.random.default_rng(12345)
    for mode, server in servers.items():
        prompt = rng.integers(1, vocab, size=n).tolist()
        server.serve(prompt, 2)
        if mode.startswith("kvtier"):
            server.flush_device()
            server.serve(prompt, 2)
            server.flush_device()


def equal_counts(rows: list[dict], key_fields: tuple, ref_mode: str, modes: tuple) -> dict:
    """For each mode, how many prompts give the same output as ``ref_mode`` (prompts identified by key_fields)."""
    ref = {tuple(r[k] for k in key_fields): r["output"] for r in rows if r["mode"] == ref_mode}
    out = {}
    for mode in modes:
        mine = [(tuple(r[k] for k in key_fields), r["output"]) for r in rows if r["mode"] == mode]
        out[mode] = {"equal": sum(ref.get(k) == o for k, o in mine), "total": len(mine)}
    return out


# --- workloads ---

def run_fixed(plan: Plan, model: PagedDecoder, bw_gbps: float, log) -> tuple[list, list]:
    from kvtier.sglang.serving import Server

    page, bpt = plan.page_size, model.kv_shape.bytes_per_token(plan.dtype)
    longest = max(plan.fixed_prefixes) + max(plan.fixed_new) + plan.fixed_out + 2 * page
    kv_tokens = 2 * longest + 4096
    host_gb = (longest * (plan.fixed_reps + 2)) * bpt / 2**30 + 0.05
    servers = {m: Server(model, m, kv_tokens=kv_tokens, page_size=page, tokens_per_block=plan.tokens_per_block,
                         max_context=longest + page, cpu_cache_gb=host_gb)
               for m in ("recompute", "device") + KVTIER_MODES}
    warm_up(servers, plan.vocab, page, min(2048, max(plan.fixed_prefixes)))
    rows, cells = [], []
    for L in plan.fixed_prefixes:
        prefix, _ = fixed_prefix(L, 0, 0, vocab=plan.vocab)
        for mode in ("device",) + KVTIER_MODES:  # fill
            servers[mode].serve(prefix, 1)
        for N in plan.fixed_new:
            _, suffixes = fixed_prefix(L, N, plan.fixed_reps, vocab=plan.vocab)
            for rep, suffix in enumerate(suffixes):
                for mode, server in servers.items():  # every mode in turn, each repetition
                    if mode in KVTIER_MODES:
                        server.flush_device()
                    r = server.serve(prefix + suffix, plan.fixed_out)
                    rows.append(row("fixed", mode, r, prefix_len=L, new_tokens=N, rep=rep))
            med = {m: statistics.median(x["ttft_ms"] for x in rows if x["mode"] == m and x["prefix_len"] == L
                                        and x["new_tokens"] == N) for m in servers}
            load_bound_ms = aligned(L + 1, page) * bpt / (bw_gbps * 1e9) * 1e3
            bound = max(med["device"], load_bound_ms)
            ceiling = med["recompute"] / (load_bound_ms + med["device"])
            cell = {"prefix_len": L, "new_tokens": N, "ttft_ms": med, "prefix_bytes": aligned(L + 1, page) * bpt,
                    "load_bound_ms": load_bound_ms, "bound_ms": bound, "ceiling_speedup": ceiling}
            for m in KVTIER_MODES:
                cell[f"ttft_over_bound_{m}"] = med[m] / bound
                cell[f"speedup_vs_recompute_{m}"] = med["recompute"] / med[m]
                cell[f"speedup_over_ceiling_{m}"] = (med["recompute"] / med[m]) / ceiling
            cells.append(cell)
            log(f"fixed {L:>6}+{N:<5} ttft ms " + " ".join(f"{m}={v:.1f}" for m, v in med.items())
                + f" | bound {bound:.1f} (load {load_bound_ms:.1f}) | over bound layerwise "
                f"{cell['ttft_over_bound_kvtier_layerwise']:.3f} whole {cell['ttft_over_bound_kvtier_whole']:.3f}")
    for m, server in servers.items():
        if server.tier is not None:
            log(f"fixed {m} tier stats: {_tier_brief(server.tier.stats())}")
        assert server.leaked_slots() == 0, f"{m}: device slots leaked"
        _close(server)
    return rows, cells


def run_long(plan: Plan, model: PagedDecoder, log, deadline: float, rows: list,
             checkpoint=lambda: None) -> tuple[list, dict]:
    """The long workload; ``rows`` is appended to as requests are served and ``checkpoint`` runs after each mode,
    so what was measured stays if a later mode does not finish."""
    from kvtier.sglang.serving import Server

    page, bpt = plan.page_size, model.kv_shape.bytes_per_token(plan.dtype)
    prompts = long_prompts(plan.long_count, vocab=plan.vocab, median=plan.long_median, max_len=plan.long_max,
                           min_len=plan.long_min, groups=plan.long_groups)
    total = sum(len(p) for p in prompts)
    longest = max(len(p) for p in prompts) + plan.long_out + 2 * page
    tier_stats = {}
    # device: room for every prompt, pass 1 fills, pass 2 measures
    s = Server(model, "device", kv_tokens=total + len(prompts) * 2 * page + 2 * longest, page_size=page,
               max_context=longest)
    warm_up({"device": s}, plan.vocab, page, min(2048, longest // 2))
    _fill(s, prompts, log, "long device pass 1")
    t = time.time()
    for i, p in enumerate(prompts):
        rows.append(row("long", "device", s.serve(p, plan.long_out), prompt=i, pass_=2))
    assert s.leaked_slots() == 0
    _close(s)
    log(f"long device pass 2: {time.time() - t:.1f} s")
    checkpoint()
    # kvtier: pass 1 fills the host tier; pass 2 whole, then pass 2 layerwise, device flushed before each request
    host_gb = (total + len(prompts) * (plan.long_out + 2 * page)) * bpt * 1.05 / 2**30 + 0.05
    s = Server(model, "kvtier_whole", kv_tokens=2 * longest + 4096, page_size=page,
               tokens_per_block=plan.tokens_per_block, max_context=longest, cpu_cache_gb=host_gb)
    warm_up({"kvtier_whole": s}, plan.vocab, page, min(2048, longest // 2))
    s.tier.reset()
    _fill(s, prompts, log, "long kvtier pass 1")
    for mode in KVTIER_MODES:
        t = time.time()
        s.set_layerwise(mode == "kvtier_layerwise")
        before = s.tier.stats()
        for i, p in enumerate(prompts):
            s.flush_device()
            rows.append(row("long", mode, s.serve(p, plan.long_out), prompt=i, pass_=2))
        s.cache.wait_all()
        after = s.tier.stats()
        nbytes, secs = after["bytes_h2d"] - before["bytes_h2d"], after["seconds_h2d"] - before["seconds_h2d"]
        tier_stats[mode] = {"load_bytes": nbytes, "load_seconds": secs,
                            "load_gbps": nbytes / secs / 1e9 if secs > 0 else None,
                            "pages_evicted": after["pages_evicted"], "pages_held": after["pages_held"],
                            "pages_store_dropped": after["pages_store_dropped"]}
        log(f"long {mode} pass 2: {time.time() - t:.1f} s; {_tier_brief(after)}")
        checkpoint()
    assert s.leaked_slots() == 0
    _close(s)
    # recompute last, TTFT only (one output token), until the deadline: the slowest mode, nothing to fill
    s = Server(model, "recompute", kv_tokens=2 * longest, page_size=page, max_context=longest)
    warm_up({"recompute": s}, plan.vocab, page, min(2048, longest // 2))
    for i, p in enumerate(prompts):
        if time.time() > deadline:
            log(f"long recompute: deadline reached after {i} prompts")
            break
        rows.append(row("long", "recompute", s.serve(p, 1), prompt=i, pass_=2))
    _close(s)
    log(f"long recompute done ({len(prompts)} prompts, {total} tokens)")
    return rows, tier_stats


def _fill(server, prompts: list, log, what: str) -> None:
    """Serve every prompt for one output token (a pass that fills the caches), and log its time."""
    t = time.time()
    for p in prompts:
        server.serve(p, 1)
    log(f"{what}: {time.time() - t:.1f} s")


def run_chat(plan: Plan, model: PagedDecoder, log) -> list:
    from kvtier.sglang.serving import Server

    page, bpt = plan.page_size, model.kv_shape.bytes_per_token(plan.dtype)
    convs = multi_turn(plan.chat_convs, vocab=plan.vocab, system_len=plan.chat_system, user_len=plan.chat_user)
    total = plan.chat_system + sum(sum(len(u) + plan.chat_out for u in c.user_turns) for c in convs)
    longest = plan.chat_system + max(sum(len(u) + plan.chat_out for u in c.user_turns) for c in convs) + 2 * page
    host_gb = total * bpt * 1.2 / 2**30 + 0.05
    sizes = {"recompute": 2 * longest, "device": total + 2 * longest + 64 * page,
             "device_small": max(plan.chat_small_kv, longest + 4 * page)}
    servers = {m: Server(model, m.replace("_small", ""), kv_tokens=sizes[m], page_size=page,
                         tokens_per_block=plan.tokens_per_block, max_context=longest)
               for m in sizes}
    for m in KVTIER_MODES:
        servers[m] = Server(model, m, kv_tokens=sizes["device_small"], page_size=page,
                            tokens_per_block=plan.tokens_per_block, max_context=longest,
                            cpu_cache_gb=host_gb)
    warm_up(servers, plan.vocab, page, min(1024, plan.chat_system))
    for s in servers.values():
        if s.tier is not None:
            s.tier.reset()
    log(f"chat: {len(convs)} conversations, device_small/kvtier device pool {sizes['device_small']} tokens "
        f"for {total} tokens of history")
    rows = []
    history = [list(c.system) for c in convs]
    for turn in range(max(len(c.user_turns) for c in convs)):
        for ci, conv in enumerate(convs):
            if turn >= len(conv.user_turns):
                continue
            prompt = history[ci] + conv.user_turns[turn]
            outs = {}
            for mode, s in servers.items():  # the device mode's output extends the history every mode sees
                r = s.serve(prompt, plan.chat_out)
                outs[mode] = r.output
                rows.append(row("chat", mode, r, conv=ci, turn=turn))
            history[ci] = prompt + outs["device"]
    for m, s in servers.items():
        if s.tier is not None:
            log(f"chat {m}: {_tier_brief(s.tier.stats())}")
        assert s.leaked_slots() == 0, f"chat {m}: device slots leaked"
        _close(s)
    return rows


def _tier_brief(st: dict) -> str:
    keys = ("hit_pages", "pages_stored", "pages_loaded", "pages_evicted", "pages_store_dropped", "gbps_h2d",
            "gbps_d2h")
    return ", ".join(f"{k}={st[k]:.2f}" if isinstance(st[k], float) else f"{k}={st[k]}" for k in keys)


def _close(server) -> None:
    pool = server.host_pool
    server.close()
    if pool is not None:
        pool.destroy()
    _free_gpu()


def _memory() -> str:
    """The process's resident host memory and the GPU memory torch holds (they show one workload's leftovers)."""
    rss = 0.0
    try:
        with open("/proc/self/status") as f:
            rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 2**20
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0
    return f"[rss {rss:.1f} GiB, cuda reserved {gpu:.1f} GiB]"


def _free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- summary, plot ---

def summarize(plan: Plan, fixed_rows, cells, long_rows, long_tier, chat_rows, bw_gbps) -> dict:
    page = plan.page_size
    s: dict = {"copy_engine_h2d_gbps": bw_gbps, "long_layers": plan.long_layers, "fixed_layers": plan.fixed_layers}
    all_rows = fixed_rows + long_rows + chat_rows
    keys = {"fixed": ("prefix_len", "new_tokens", "rep"), "long": ("prompt",), "chat": ("conv", "turn")}
    eq_device, eq_recompute = [], []
    for wl, kf in keys.items():
        rows = [r for r in all_rows if r["workload"] == wl]
        if not rows:
            continue
        with_recompute = wl != "long"  # long's recompute pass gives one output token (its TTFT only)
        counts = equal_counts(rows, kf, "device", KVTIER_MODES + (("recompute",) if with_recompute else ()))
        s[f"outputs_equal_{wl}"] = counts
        eq_device += [counts[m] for m in KVTIER_MODES]
        if with_recompute:
            eq_recompute.append(counts["recompute"])
    if eq_device:
        s["outputs_equal_kvtier_vs_device"] = (sum(c["equal"] for c in eq_device)
                                               / sum(c["total"] for c in eq_device))
        if eq_recompute:
            s["outputs_equal_vs_recompute"] = (sum(c["equal"] for c in eq_recompute)
                                               / sum(c["total"] for c in eq_recompute))
    if long_rows:
        block = TierConfig(page_size=page, tokens_per_block=plan.tokens_per_block).block_tokens
        _summarize_long(s, long_rows, long_tier, block)  # kvtier serves whole host blocks
    if cells:
        _summarize_fixed(s, cells)
    if chat_rows:
        s["chat_ttft"] = {m: ttft_stats([r["ttft_ms"] / 1e3 for r in chat_rows if r["mode"] == m])
                          for m in sorted({r["mode"] for r in chat_rows})}
        s["chat_prefill_tokens_computed"] = {m: sum(r["computed"] for r in chat_rows if r["mode"] == m)
                                             for m in s["chat_ttft"]}
    return s


def _summarize_long(s: dict, long_rows: list, long_tier: dict, block: int) -> None:
    by_mode = {m: [r for r in long_rows if r["mode"] == m] for m in ("recompute", "device") + KVTIER_MODES}
    s["long_ttft"] = {m: ttft_stats([r["ttft_ms"] / 1e3 for r in rs]) for m, rs in by_mode.items()}
    s["long_prefill_tokens_computed"] = {m: sum(r["computed"] for r in rs) for m, rs in by_mode.items()}
    s["long_host_hit_tokens"] = {m: sum(r["loaded"] for r in by_mode[m]) for m in KVTIER_MODES}
    want = sum(aligned(r["prompt_len"], block) for r in by_mode["kvtier_whole"])
    s["host_hit_fraction_pass2"] = min(sum(r["loaded"] for r in by_mode[m]) / want for m in KVTIER_MODES)
    s["long_tier"] = long_tier
    done = {r["prompt"] for r in by_mode["recompute"]}  # recompute may stop at the deadline: same prompts only
    s["long_recompute_prompts"] = len(done)
    if not done:  # the deadline came before recompute served a prompt: nothing to compare against
        s["ttft_speedup_vs_recompute_p50"] = None
        return
    p50 = {m: float(np.median([r["ttft_ms"] for r in rs if r["prompt"] in done])) for m, rs in by_mode.items()}
    s["ttft_speedup_vs_recompute_p50"] = {m: p50["recompute"] / p50[m] for m in ("device",) + KVTIER_MODES}


def _summarize_fixed(s: dict, cells: list) -> None:
    s["fixed_cells"] = cells
    big = [c for c in cells if c["prefix_len"] >= 8192] or cells
    for m in KVTIER_MODES:
        short = m.replace("kvtier_", "")
        s[f"ttft_over_bound_{short}"] = max(c[f"ttft_over_bound_{m}"] for c in big)
        s[f"ttft_speedup_over_ceiling_{short}"] = min(c[f"speedup_over_ceiling_{m}"] for c in big)
        s[f"ttft_speedup_over_ceiling_{short}_all_cells"] = min(c[f"speedup_over_ceiling_{m}"] for c in cells)
    longest = max(c["prefix_len"] for c in cells)
    s["ttft_speedup_vs_recompute_longest_prefix"] = {
        f"{c['prefix_len']}+{c['new_tokens']}": {m: c[f"speedup_vs_recompute_{m}"] for m in KVTIER_MODES}
        for c in cells if c["prefix_len"] == longest}


def plot(path: str, summary: dict, long_rows: list) -> None:
    plt = pyplot()
    modes = ("recompute", "device", "kvtier_whole", "kvtier_layerwise")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    cells = summary["fixed_cells"]
    x = np.arange(len(cells))
    for k, m in enumerate(modes):
        ax1.bar(x + (k - 1.5) * 0.2, [c["ttft_ms"][m] for c in cells], 0.2, label=m)
    ax1.scatter(x, [c["bound_ms"] for c in cells], marker="_", s=400, color="k", zorder=3, label="bound")
    ax1.set_xticks(x, [f"{c['prefix_len'] // 1024}k+{c['new_tokens']}" for c in cells])
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT, ms (median)")
    ax1.set_title(f"fixed prefix + new tokens, {summary['fixed_layers']} layers")
    ax1.legend(fontsize=8)
    for m in modes:
        t = np.sort([r["ttft_ms"] for r in long_rows if r["mode"] == m])
        ax2.plot(t, np.arange(1, t.size + 1) / t.size, label=m)
    ax2.set_xscale("log")
    ax2.set_xlabel("TTFT, ms")
    ax2.set_ylabel("fraction of prompts")
    ax2.set_title(f"{len(long_rows) // len(modes)} long prompts, pass 2, {summary['long_layers']} layers")
    ax2.legend(fontsize=8)
    save_png(fig, path)


def try_plot(path: str, summary: dict, long_rows: list, result_path: str) -> None:
    try:
        plot(path, summary, long_rows)
    except ImportError:
        print(f"no matplotlib here: plot later with python bench/bench_e2e.py --plot {result_path}")


def merge(paths: list, out: str) -> int:
    """Merge result files of separate runs of this script (one per workload set: a device machine runs at most
    10 minutes a command) into ``out``; every figure in the summary comes from rows and cells of one run, whose
    copy-engine bound is its own (``runs`` lists each run's workloads, bound and environment)."""
    parts = [read_json(path) for path in paths]
    plans = {json.dumps(p["plan"], sort_keys=True) for p in parts}
    if len(plans) != 1:
        raise SystemExit(f"{paths}: the runs used different plans; merge only runs of one plan")
    wls = [sorted({r["workload"] for r in p["rows"]}) for p in parts]
    if sum(len(w) for w in wls) != len({x for w in wls for x in w}):
        raise SystemExit(f"{paths}: a workload appears in more than one run ({wls})")
    plan = Plan(**{k: (torch.bfloat16 if k == "dtype" else tuple(v) if isinstance(v, list) else v)
                   for k, v in parts[0]["plan"].items()})
    rows = [r for p in parts for r in p["rows"]]
    pick = lambda wl: [r for r in rows if r["workload"] == wl]  # noqa: E731
    cells = next((p["summary"]["fixed_cells"] for p in parts if "fixed_cells" in p["summary"]), [])
    long_tier = next((p["summary"]["long_tier"] for p in parts if "long_tier" in p["summary"]), {})
    summary = summarize(plan, pick("fixed"), cells, pick("long"), long_tier, pick("chat"), None)
    summary["copy_engine_h2d_gbps"] = {",".join(w): p["summary"]["copy_engine_h2d_gbps"]
                                       for w, p in zip(wls, parts)}
    runs = [{"file": os.path.basename(path), "workloads": w, "seconds": p.get("seconds"), "failed": p["failed"],
             "copy_engine_h2d_gbps": p["summary"]["copy_engine_h2d_gbps"], "env": p["env"]}
            for path, w, p in zip(paths, wls, parts)]
    result = {"env": parts[0]["env"], "plan": parts[0]["plan"], "summary": summary, "runs": runs, "rows": rows,
              "failed": [f for p in parts for f in p["failed"]]}
    write_json(out, result)
    print_summary(summary)
    if cells and pick("long"):
        try_plot(png_beside(out), summary, pick("long"), out)
    print(f"merged {len(paths)} runs into {out}")
    return 1 if result["failed"] else 0


def print_summary(summary: dict) -> None:
    keys = ("outputs_equal_kvtier_vs_device", "outputs_equal_vs_recompute", "host_hit_fraction_pass2",
            "ttft_over_bound_layerwise", "ttft_over_bound_whole", "ttft_speedup_over_ceiling_layerwise",
            "ttft_speedup_over_ceiling_whole", "ttft_speedup_vs_recompute_p50")
    for k in keys:
        print(f"{k}: {summary.get(k)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "e2e_h200.json"))
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (seconds)")
    ap.add_argument("--long-layers", type=int, default=9)
    ap.add_argument("--workloads", default="fixed,chat,long")
    ap.add_argument("--page-size", type=int, default=None,
                    help="SGLang's page size (default: the plan's, 16); kvtier's host block is the config's default "
                         "for it (16 tokens at page 1)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="stop long's recompute pass after this")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of a result file")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="only merge result files of separate runs (each with its own workloads and copy-engine "
                         "bound) into --out, with the summary over all their rows")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if args.plot:
        res = read_json(args.plot)
        plot(png_beside(args.plot), res["summary"], [r for r in res["rows"] if r["workload"] == "long"])
        return 0
    plan = smoke_plan() if args.smoke else gpu_plan(args.long_layers)
    if args.page_size is not None:
        plan = dataclasses.replace(plan, page_size=args.page_size)
    if plan.device == "cuda" and not torch.cuda.is_available():
        ap.error("the GPU run needs CUDA (use --smoke on a CPU)")
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:7.1f}s] {msg} {_memory()}", flush=True)

    wanted = set(args.workloads.split(","))
    bw = copy_engine_h2d_gbps(1 << 30) if plan.device == "cuda" else 1.0
    log(f"copy engine H2D bound: {bw:.2f} GB/s")
    fixed_rows, cells, long_rows, long_tier, chat_rows = [], [], [], {}, []
    failed = []

    def attempt(name, fn, *a):
        try:
            return fn(*a)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            return None

    def checkpoint() -> None:
        """The rows so far, in case a later workload does not finish."""
        write_json(args.out + ".partial", {"env": env_info(), "rows": fixed_rows + long_rows + chat_rows,
                                           "cells": cells, "failed": failed, "seconds": time.time() - t0})

    if "fixed" in wanted:
        model = build_model(plan, plan.fixed_layers)
        log(f"model: {plan.fixed_layers} layers built")
        fixed_rows, cells = attempt("fixed", run_fixed, plan, model, bw, log) or ([], [])
        checkpoint()
        del model
        _free_gpu()
    if wanted & {"long", "chat"}:
        model = build_model(plan, plan.long_layers)
        log(f"model: {plan.long_layers} layers built")
        if "chat" in wanted:
            chat_rows = attempt("chat", run_chat, plan, model, log) or []
            checkpoint()
        if "long" in wanted:
            long_rows, long_tier = attempt("long", run_long, plan, model, log, t0 + args.deadline_s,
                                           long_rows, checkpoint) or (long_rows, {})
        del model
    summary = summarize(plan, fixed_rows, cells, long_rows, long_tier, chat_rows, bw)
    result = {"env": env_info(), "plan": {k: (str(v) if isinstance(v, torch.dtype) else v)
                                          for k, v in dataclasses.asdict(plan).items()},
              "summary": summary, "rows": fixed_rows + long_rows + chat_rows, "failed": failed,
              "seconds": time.time() - t0}
    write_json(args.out, result)
    if long_rows and cells:
        try_plot(png_beside(args.out), summary, long_rows, args.out)
    print_summary(summary)
    print(f"wrote {args.out} in {time.time() - t0:.0f} s" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
