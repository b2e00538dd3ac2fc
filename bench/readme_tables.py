"""Regenerate the result tables of README.md and bench/results/README.md from bench/results/*.json.

Usage: ``python bench/readme_tables.py`` rewrites the blocks between ``<!-- table:NAME -->`` and
``<!-- /table:NAME -->`` in both files (README.md holds the headline, bench/results/README.md every detailed table);
``--check`` exits 1 instead when a file is out of date or lacks one of its blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
PAGES = (1, 16, 64)
DIRECTIONS = ("d2h", "h2d")


def _load(name: str):
    path = os.path.join(ROOT, "bench", "results", name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _table(header: list[str], rows: list[list]) -> str:
    """A Markdown table: one header row, then one line per row (cells converted with ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _join(*tables: str) -> str:
    return "\n\n".join(t for t in tables if t)


def _from(name: str) -> Callable[[Callable[[dict], str]], Callable[[], str]]:
    """A table drawn from the result file ``name``: "_no results yet_" while it is not committed."""
    def wrap(table: Callable[[dict], str]) -> Callable[[], str]:
        return lambda: "_no results yet_" if (res := _load(name)) is None else table(res)
    return wrap


# --- transfer kernels (bench_transfer.py) -----------------------------------------------------------------------

def _transfer_sizes(res: dict) -> list:
    """One layer of 64 MiB of Qwen3-8B: the rows of each method and page size."""
    return [r for r in res["sizes"] if r["geometry"] == "qwen3_8b" and r["bytes"] == 64 * MiB]


def _gbps(rows: list, method: str, direction: str, page: int, layout: str = "layer_first") -> Optional[float]:
    vals = [r["gbps"] for r in rows if (r["method"], r["direction"], r["page"], r["layout"])
            == (method, direction, page, layout)]
    return min(vals) if vals else None


def _gbps_cells(rows: list, method: str, layout: str = "layer_first") -> list:
    vals = [_gbps(rows, method, d, p, layout) for d in DIRECTIONS for p in PAGES]
    return ["–" if v is None else f"{v:.1f}" for v in vals]


def _direct_default(res: dict) -> str:
    return f"kvtier_direct_p{res['summary']['direct_programs']}"


def _hicache_worst(res: dict) -> tuple[float, str]:
    by_case = res["summary"]["hicache_ratio_by_case_random"]
    case = min(by_case, key=by_case.get)
    return by_case[case], case


def _pcie_worst(res: dict) -> tuple[float, float]:
    """kvtier direct's slowest cell (direction, page size) and the copy engine's slowest, GB/s."""
    rows = _transfer_sizes(res)
    direct = min(_gbps(rows, _direct_default(res), d, p) for d in DIRECTIONS for p in PAGES)
    bound = min(_gbps(rows, "copy_engine_contiguous", d, p) for d in DIRECTIONS for p in PAGES)
    return direct, bound


def _transfer_methods_table(res: dict) -> str:
    s, rows = res["summary"], _transfer_sizes(res)
    default = _direct_default(res)
    methods = [
        ("copy engine, one contiguous copy (the PCIe bound)", "copy_engine_contiguous", "layer_first"),
        ("SGLang 0.5.23 HiCache kernel (`transfer_hicache_one_layer`, default)", "sglang_hicache", "layer_first"),
        (f"**kvtier direct**, {s['direct_programs']} programs (default), `layer_first`, random blocks", default,
         "layer_first"),
        ("kvtier direct, 8 programs", "kvtier_direct_p8", "layer_first"),
        (f"kvtier direct, {s['direct_programs']} programs, `page_first`", default, "page_first"),
        ("kvtier staged (gather + copy engine), `layer_first`, consecutive blocks", "kvtier_staged_contig",
         "layer_first"),
        ("torch gather + one copy", "torch_gather_copy", "layer_first"),
    ]
    body = [[label, *_gbps_cells(rows, method, layout)] for label, method, layout in methods]
    body[2] = [body[2][0], *(f"**{c}**" for c in body[2][1:])]
    alt = res.get("hicache_alternating")
    if alt:
        by_case = s["hicache_ratio_by_case_random"]
        body.append([f"kvtier direct / HiCache on identical work (same slots, host bytes, random host pages), "
                     f"{alt['entries'][0]['rounds']} alternating rounds: ratio",
                     *(f"{by_case[f'{d}_p{p}']:.4f}" for d in DIRECTIONS for p in PAGES)])
    return _table(["one layer, 64 MiB (K+V), Qwen3-8B 8x128 bf16, random slots, GB/s", "D2H page 1", "D2H page 16",
                   "D2H page 64", "H2D page 1", "H2D page 16", "H2D page 64"], body)


def _staged_table(res: dict) -> str:
    """The staged path's bulk figures, and a store and a load at once against the copy engines' bound."""
    s = res["summary"]
    body = [["staged, all 36 layers, `page_first`, page 16, 1024 tokens, one direction at a time",
             s["staged_d2h_gbps"], s["staged_h2d_gbps"], "–", "–"],
            ["staged store and load at once", "–", "–", s["bidirectional_gbps"], "–"]]
    alt = res.get("bidir", {}).get("alternating")
    if alt:
        med = alt["combined_gbps_median"]
        body += [[f"the same at once, median of {alt['rounds']} rounds alternating with the copy engines' contiguous "
                  f"bound on the same host blocks", "–", "–", f"{med['staged']:.2f}", alt["staged_over_copy_engine"]],
                 ["the copy engines' contiguous bound, one store and one load at once, same rounds", "–", "–",
                  f"{med['copy_engine_contiguous']:.2f}", "–"]]
    sweep = res.get("staged_sweep")
    if sweep:
        ce = sweep[0]
        body.append(["copy engine, contiguous, same bytes", ce["store_gbps"], ce["load_gbps"], ce["combined_gbps"],
                     "–"])
    return _table(["staged path, GB/s", "store", "load", "store + load at once", "over the bound"], body)


_GEOMETRY_LABELS = {"qwen3_8b": "Qwen3-8B", "tp_1x128": "TP-sharded 1x128", "mla_bf16": "MLA 576 bf16",
                    "mla_fp8": "MLA 576 fp8"}


def _latency_table(res: dict) -> str:
    """One 16-token page x 36 layers, all-layer call, per measured geometry, with its PCIe floor."""
    lat = res["summary"]["one_page_all_layers_us_detail"]
    body = [[_GEOMETRY_LABELS[n], lat[n]["d2h_pdefault_us"], lat[n]["h2d_pdefault_us"], lat[n]["pcie_floor_us"]]
            for n in _GEOMETRY_LABELS if n in lat]
    return _table(["one 16-token page × 36 layers, all-layer call, direct kernel", "D2H µs", "H2D µs",
                   "PCIe floor µs"], body)


def _cost_table(res: dict) -> str:
    """What a copy costs beside it: a GEMM's slowdown, and the host time to issue one."""
    s = res["summary"]
    return _table(["cost of a copy", "value"],
                  [["8192³ bf16 GEMM slowdown beside back-to-back H2D, kvtier direct (default)",
                    f"+{s['gemm_slowdown_pct']}%"],
                   ["the same beside SGLang HiCache's kernel", f"+{s['gemm_slowdown_hicache_pct']}%"],
                   ["host time to issue one direct call, `store_pages(..., check=False)` (varies 28–70 µs between "
                    "runs and machines)", f"{res['overhead']['store_pages_check_false_us']} µs"]])


@_from("transfer_h200.json")
def transfer_table(res: dict) -> str:
    return _join(_transfer_methods_table(res), _staged_table(res), _latency_table(res), _cost_table(res))


# --- the headline (README.md) ----------------------------------------------------------------------------------

def _index_worst() -> Optional[tuple[float, str, int]]:
    """The worst cell over the index bench's committed runs (index_cpu.json and its rerun, when there is one), and
    how many runs there are."""
    runs = [r["summary"] for r in (_load("index_cpu.json"), _load("index_cpu_rerun.json")) if r]
    if not runs:
        return None
    worst = min(runs, key=lambda s: s["index_min_speedup_vs_best_peer"])
    return worst["index_min_speedup_vs_best_peer"], worst["index_min_speedup_cell"], len(runs)


def headline_table() -> str:
    """At most eight rows, each the worst cell of one result (bench/results/README.md has the rest)."""
    tr, lw, fr = _load("transfer_h200.json"), _load("layerwise_h200.json"), _load("fragmentation_h200.json")
    e2e = _load("e2e_h200.json")
    body = []
    if tr:
        ratio, case = _hicache_worst(tr)
        body.append([f"kvtier's direct kernel over SGLang HiCache's on identical work, worst direction and page "
                     f"(`{case}`, random host pages)", f"{ratio:.4f}"])
        direct, bound = _pcie_worst(tr)
        body.append(["one layer of 64 MiB, slowest direction and page: kvtier direct GB/s; the PCIe bound (one "
                     "contiguous copy-engine copy)", f"{direct:.1f}; {bound:.1f}"])
    if fr and tr:
        f = fr["summary"]
        body.append([f"SM cost: an 8192³ bf16 GEMM's slowdown beside kvtier's copies, worst path `auto` picks "
                     f"(`{f['gemm_slowdown_cell']}`); beside HiCache's kernel",
                     f"{f['gemm_slowdown_pct']:+.2f}%; +{tr['summary']['gemm_slowdown_hicache_pct']}%"])
    if tr:
        body.append(["a store and a load at once over the copy engines' own bound on the same blocks",
                     f"{tr['summary']['bidirectional_over_copy_engine']:.3f}"])
    if lw:
        body.append(["layerwise load beside the forward, time over max(load, compute), 8k prefix",
                     f"{lw['summary']['layerwise_over_max_ratio']:.3f}"])
    worst = _index_worst()
    if worst:
        over = "two runs" if worst[2] == 2 else "one run"
        body.append([f"host index vs the faster of SGLang's trees, worst cell over {over} (`{worst[1]}`), "
                     f"2 CPU cores", f"{worst[0]:.2f}x"])
    if e2e:
        e = e2e["summary"]
        body.append(["end to end through SGLang's pool and scheduler sequence: outputs equal to the warm device "
                     "cache; TTFT over its bound, layerwise, 8k and 28k prefixes",
                     f"{e['outputs_equal_kvtier_vs_device']:.3f}; {e['ttft_over_bound_layerwise']:.3f}"])
    worst = []
    for res in _fragmentation_runs():
        f = res["summary"]
        kind = max(("load_whole", "load_layerwise", "store"), key=lambda k: f[f"frag_worst_over_one_run_{k}"])
        worst.append(f"{f[f'frag_worst_over_one_run_{kind}']:.2f}x {_card(res)} (`{f[f'frag_worst_cell_{kind}']}`)")
    if worst:
        body.append(["fragmented host pool, worst run length's time over one run's, what `auto` picks, per run",
                     "; ".join(worst)])
    return _table(["headline: the worst cell of each result (H200 unless noted)", "value"], body)


# --- host tier ---------------------------------------------------------------------------------------------------

@_from("layerwise_h200.json")
def layerwise_table(res: dict) -> str:
    s = res["summary"]
    runs = [r for r in res["runs"] if "error" not in r and not r.get("staged_config")
            and r["transfer_mode"] == s.get("transfer_mode", r["transfer_mode"])]
    summary = _table(
        [f"layerwise load, Qwen3-8B, 8192-token prefix, {s['new_tokens']} new tokens, H200, "
         f"`transfer_mode={s.get('transfer_mode', 'auto')}`", "value"],
        [["layerwise time / max(load, compute) (target <= 1.1)", f"{s['layerwise_over_max_ratio']:.3f}"],
         ["host-blocking (FlexKV-style) / layerwise (target > 1)", f"{s['host_blocking_over_layerwise_ratio']:.3f}"],
         ["load then compute / layerwise", f"{s['load_then_compute_over_layerwise_ratio']:.3f}"],
         ["host time inside `wait_until` (median)", f"{s['wait_until_host_us_median']:.1f} µs"],
         ["layerwise bytes exact", s["layerwise_bytes_exact"]],
         [f"pinning a {res['pin']['gib']:.0f} GiB pool in {res['pin']['chunks']} registrations",
          f"{res['pin']['seconds']:.1f} s ({s['pin_seconds_per_gib']:.3f} s/GiB)"]])
    times = lambda r, k: f"{r['times'][k]['median_ms']:.2f}"  # noqa: E731
    per_size = _table(
        ["new tokens", "compute ms", "load ms", "layerwise ms", "host-blocking ms", "layerwise / max",
         "host-blocking / layerwise"],
        [[r["new_tokens"], times(r, "compute_only"), times(r, "load_only"), times(r, "layerwise"),
          times(r, "host_blocking"), f"{r['layerwise_over_max_ratio']:.3f}",
          f"{r['host_blocking_over_layerwise_ratio']:.3f}"] for r in runs])
    return _join(summary, per_size)


FRAGMENTATION_RUNS = ("fragmentation_h200.json", "fragmentation_h100.json")  # each run's card is in its env


def _card(res: dict) -> str:
    """A run's card and date, e.g. ``H100 2026-12-05`` (from its env)."""
    gpu = res["env"].get("gpu", "?")
    card = next((c for c in ("H200", "H100") if c in gpu), gpu)
    return f"{card} {res['env'].get('time', '?')[:10]}"


def _fragmentation_runs() -> list[dict]:
    return [r for r in (_load(name) for name in FRAGMENTATION_RUNS) if r]


def fragmentation_table() -> str:
    runs = _fragmentation_runs()
    if not runs:
        return "_no results yet_"
    kinds = [("load_whole", "whole load"), ("load_layerwise", "layerwise load"), ("store", "store")]
    header = ["host blocks in runs of R (1, 2, 4, 8, 16, 64, one run), Qwen3-8B, 1k and 8k tokens, both layouts, "
              "what `auto` picks"] + [f"{_card(r)}: value, worst cell" for r in runs]
    cell = lambda value, where: f"{value} (`{where}`)"  # noqa: E731
    rows = [[f"{label}: worst R / one run (target <= 1.10)",
             *[cell(f"{r['summary'][f'frag_worst_over_one_run_{k}']:.3f}", r["summary"][f"frag_worst_cell_{k}"])
               for r in runs]] for k, label in kinds]
    rows.append(["host time to issue a 36-layer layerwise load of 8k tokens at the worst R (target <= 3 ms)",
                 *[f"{r['summary']['frag_layerwise_issue_ms_max']:.2f} ms" for r in runs]])
    rows.append(["8192³ bf16 GEMM slowdown beside what `auto` picks (8k tokens, R = 1 and one run), worst "
                 "(target <= 3%)",
                 *[cell(f"{r['summary']['gemm_slowdown_pct']:+.2f}%", r["summary"]["gemm_slowdown_cell"])
                   for r in runs]])
    run_lengths = lambda s, op: f"{s[f'churn_{op}_median_R']:.0f} / {s[f'churn_{op}_p10_R']:.0f}"  # noqa: E731
    churn = _table(["run lengths R after LRU churn (multi-turn), median / p10"] + [_card(r) for r in runs],
                   [[f"{op}s", *[run_lengths(r["summary"], op) for r in runs]] for op in ("load", "store")])
    return _join(_table(header, rows), churn)


# --- SSD and remote tiers ----------------------------------------------------------------------------------------

@_from("ssd_cpu.json")
def ssd_table(res: dict) -> str:
    body = []
    for res_, machine in ((res, "CPU machine"), (_load("ssd_h200.json"), "H200 machine")):
        for key, label in (("disk", "disk"), ("ram", "RAM-backed directory")):
            d = (res_ or {}).get(key)
            if d:
                old = "" if "layouts" in d else " (store puts and gets of 32 blocks, before the tier's path)"
                body.append([f"{machine}, {label}{old}", f"{d['raw_write_gbps']:.2f}", f"{d['raw_read_gbps']:.2f}",
                             f"{d['store_write_gbps']:.2f}", f"{d['write_over_raw']:.3f}",
                             f"{d['store_read_gbps']:.2f}", f"{d['read_over_raw']:.3f}",
                             f"{d['recovery_s_per_million_blocks']:.2f}",
                             f"{d['recovery_headers_s_per_million_blocks']:.1f}"
                             if "recovery_headers_s_per_million_blocks" in d else "-"])
    return _table(["SSD tier's data path (`SsdTier` over `kvtier/storage`), 2.25 MiB blocks between a CPU pool and "
                   "the disk, the slower pool layout; medians, raw (its best request pattern) and tier runs shuffled",
                   "raw O_DIRECT write GB/s",
                   "raw read GB/s", "tier write GB/s", "over raw", "tier read GB/s", "over raw",
                   "recovery from the journal, s per million blocks",
                   "from the slot headers (the journal missing or not trusted)"], body)


def _ttft_rows(rows: list, key: Callable[[dict], tuple], groups: list) -> tuple[list, list]:
    """TTFT over recompute per (group, prefix): the prefixes, and one table row per group that has cells."""
    cells = {(*key(r), r["prefix"]): r["ratio"] for r in rows}
    prefixes = sorted({k[-1] for k in cells})
    body = []
    for group, label in groups:
        vals = [cells.get((*group, p)) for p in prefixes]
        if any(v is not None for v in vals):
            body.append([label, *("–" if v is None else f"{v:.3f}" for v in vals)])
    return prefixes, body


def ssd_tier_table() -> str:
    ttft, policy = _load("ssd_ttft_h200.json"), _load("ssd_policy_cpu.json")
    crash = (_load("ssd_cpu.json") or {}).get("crash")
    if ttft is None and policy is None and crash is None:
        return "_no results yet_"
    tables = []
    if ttft is not None:
        groups = [((ram, adm), f"H200, {where}, {what}")
                  for ram, where in ((False, "disk"), (True, "RAM-backed directory"))
                  for adm, what in (("cost", "admission by cost"), ("always", "no admission"))]
        prefixes, body = _ttft_rows(ttft["rows"], lambda r: (r["dir"].startswith("/dev/shm"), r["admission"]), groups)
        tables.append(_table(["SSD tier behind the CPU pool: TTFT over recompute (targets: <= 1.05 with admission on "
                              "the disk, < 1 on RAM)", *(f"{p // 1024}k prefix" for p in prefixes)], body))
        t = ttft["summary"]
        tables.append(_table(["H200 SSD tier read rate measured (admission on)", "GB/s"],
                             [["disk", f"{t['ssd_read_gbps_admission']:.2f}"],
                              ["RAM-backed directory", f"{t.get('ssd_read_gbps_admission_ram') or 0:.2f}"]]))
    if policy is not None:
        p = policy["summary"]
        tables.append(_table(
            ["write policy, CPU machine (CPU pool a quarter of the workload)", "host hits, cold",
             "host hits after a restart", "MiB written to the SSD", "restart to the first SSD hit in the CPU tier"],
            [[w, f"{p[f'host_hit_pass1_{w}']:.3f}", f"{p[f'host_hit_after_restart_{w}']:.3f}",
              f"{p[f'ssd_bytes_written_{w}'] / 2**20:.1f}", f"{p[f'start_to_first_hit_s_{w}']:.3f} s"]
             for w in ("write_through", "write_back")]))
    if crash is not None:
        tables.append(_table(["crash loop (SIGKILL a storing process, restart, check)", "kills (target >= 200)",
                              "acknowledged blocks lost (target 0)", "corrupt blocks served (target 0)"],
                             [["CPU machine, disk", crash["kills"], crash["durable_lost"], crash["corrupt_served"]]]))
    return _join(*tables)


def _worst_run(s: dict, op: str) -> str:
    """The lowest of a multi-run summary's per-run worst cells, else '-' (one run)."""
    v = s.get(f"remote_{op}_over_raw_worst_run")
    return "-" if v is None else f"{v:.3f}"


def remote_table() -> str:
    cpu, h200, ttft = _load("remote_cpu.json"), _load("remote_h200.json"), _load("remote_ttft_h200.json")
    if cpu is None and ttft is None:
        return "_no results yet_"
    rates, worst, hits = [], [], []
    for res, machine in ((cpu, "CPU machine"), (h200, "H200 machine")):
        if res is None:
            continue
        s = res["summary"]
        for lay in ("layer_first", "page_first"):
            rates.append([f"{machine}, `{lay}` pool", f"{s[f'{lay}/kvtier_put_gbps']:.2f}",
                          f"{s[f'{lay}/raw_put_gbps']:.2f}", f"{s[f'{lay}/put_over_raw']:.3f}",
                          f"{s[f'{lay}/kvtier_fetch_gbps']:.2f}", f"{s[f'{lay}/raw_get_gbps']:.2f}",
                          f"{s[f'{lay}/get_over_raw']:.3f}"])
        runs = s.get("runs", 1)
        worst.append([f"{machine}, {runs} run{'s' if runs > 1 else ''}", f"{s['remote_put_over_raw']:.3f}",
                      f"`{s['remote_put_worst_cell']}`", _worst_run(s, "put"),
                      f"{s['remote_get_over_raw']:.3f}", f"`{s['remote_get_worst_cell']}`", _worst_run(s, "get")])
        hits.append([machine, f"{s['hit_8k_ms']:.0f}", f"{s['hit_8k_raw_get_ms']:.0f}"])
    tables = [
        _table(["remote tier on Mooncake Store, loopback TCP (target: over raw >= 0.8)", "kvtier put GB/s",
                "raw `batch_put_from` GB/s", "put over raw", "kvtier fetch GB/s", "raw `batch_get_into` GB/s",
                "get over raw"], rates),
        _table(["worst cell over raw (median over runs)", "put", "cell", "put, worst run", "get", "cell",
                "get, worst run"], worst),
        _table(["instance B's hit on an 8k-token prefix", "lookup to fetched, ms", "raw get of its bytes, ms"], hits),
    ]
    if ttft is not None:
        groups = [(("cost",), "admission by cost"), (("always",), "no admission")]
        prefixes, body = _ttft_rows(ttft["rows"], lambda r: (r["admission"],), groups)
        tables.append(_table(["H200, instance B's TTFT from A's remote blocks over recompute",
                              *(f"{p // 1024}k prefix" for p in prefixes)], body))
        tables.append(_table(["H200 fetch rate measured (loopback TCP, no admission)", "GB/s"],
                             [["remote tier", f"{ttft['summary']['remote_read_gbps_no_admission']:.2f}"]]))
    return _join(*tables)


# --- end to end --------------------------------------------------------------------------------------------------

def _equal(counts: dict, modes) -> str:
    eq, tot = sum(counts[m]["equal"] for m in modes), sum(counts[m]["total"] for m in modes)
    return f"{eq}/{tot}"


def _page1_rows() -> list:
    """The fixed prompts at SGLang --page-size 1 (kvtier's host blocks: 16 tokens), a run of their own."""
    res = _load("e2e_h200_page1_fixed.json")
    s = res["summary"] if res else None
    return [["fixed prompts at --page-size 1 (host blocks of 16 tokens), separate run",
             f"{s['outputs_equal_kvtier_vs_device']:.3f}", f"{s['ttft_over_bound_layerwise']:.3f}",
             f"{s['ttft_over_bound_whole']:.3f}"]] if s else []


@_from("e2e_h200.json")
def e2e_table(res: dict) -> str:
    s = res["summary"]
    kv = ("kvtier_whole", "kvtier_layerwise")
    wls = [w for w in ("fixed", "chat", "long") if f"outputs_equal_{w}" in s]
    eq_rc = {w: _equal(s[f"outputs_equal_{w}"], ("recompute",)) for w in wls if "recompute" in s[f"outputs_equal_{w}"]}
    equality = _table(
        ["end to end, H200: random-weight Qwen3 (Qwen3-8B shapes), SGLang 0.5.23 pool, tree cache, scheduler "
         "sequence; outputs equal to the warm device cache's", "all", *wls],
        [["kvtier, whole and layerwise (target 1.0)", f"{s['outputs_equal_kvtier_vs_device']:.3f}",
          *(_equal(s[f"outputs_equal_{w}"], kv) for w in wls)],
         ["recompute", f"{s['outputs_equal_vs_recompute']:.3f}", *(eq_rc.get(w, "–") for w in wls)]])
    bounds = _table(
        ["fixed prompts, worst cell at 8k and 28k prefixes", "outputs equal, kvtier vs device",
         "TTFT over the bound, layerwise (target <= 1.15)", "TTFT over the bound, whole"],
        [[f"{s['fixed_layers']} layers, engine page 16", "(above)", f"{s['ttft_over_bound_layerwise']:.3f}",
          f"{s['ttft_over_bound_whole']:.3f}"], *_page1_rows(),
         ["speedup over the ceiling (target >= 0.85), fixed prompts", "–",
          f"{s['ttft_speedup_over_ceiling_layerwise']:.3f}", f"{s['ttft_speedup_over_ceiling_whole']:.3f}"]])
    ms = lambda c, m: f"{c['ttft_ms'][m]:.1f}"  # noqa: E731
    fixed = _table(
        [f"fixed prompts, {s['fixed_layers']} layers, median TTFT ms", "recompute", "device", "layerwise", "whole",
         "bound", "layerwise / bound", "whole / bound"],
        [[f"{c['prefix_len'] // 1024}k prefix + {c['new_tokens']} new", ms(c, "recompute"), ms(c, "device"),
          ms(c, "kvtier_layerwise"), ms(c, "kvtier_whole"), f"{c['bound_ms']:.1f}",
          f"{c['ttft_over_bound_kvtier_layerwise']:.3f}", f"{c['ttft_over_bound_kvtier_whole']:.3f}"]
         for c in s["fixed_cells"]])
    longest = s["ttft_speedup_vs_recompute_longest_prefix"]
    speedup = _table(["28k prefix, TTFT speedup vs recompute", "layerwise", "whole"],
                     [[f"{k.split('+')[1]} new tokens", f"{v['kvtier_layerwise']:.1f}x", f"{v['kvtier_whole']:.1f}x"]
                      for k, v in longest.items()])
    lt, sp = s["long_ttft"], s["ttft_speedup_vs_recompute_p50"] or {}
    modes = ("recompute", "device", "kvtier_layerwise", "kvtier_whole")
    long_ = _table(
        [f"{lt['device']['n']} long prompts, {s['long_layers']} layers, pass 2 TTFT", "p50 ms", "p90 ms", "p99 ms",
         "p50 speedup vs recompute", "prefill tokens computed", "host tier load GB/s"],
        [[m.replace("kvtier_", ""), f"{lt[m]['p50_ms']:.1f}", f"{lt[m]['p90_ms']:.1f}", f"{lt[m]['p99_ms']:.1f}",
          f"{sp[m]:.2f}x" if m in sp else "–", s["long_prefill_tokens_computed"].get(m, "–"),
          f"{s['long_tier'][m]['load_gbps']:.1f}" if m in s["long_tier"] else "–"] for m in modes])
    hit = _table(["long prompts, host-hit fraction of page-aligned prompt tokens, pass 2 (target >= 0.99)", "value"],
                 [["kvtier", f"{s['host_hit_fraction_pass2']:.4f}"]])
    ct, chat_tokens = s["chat_ttft"], s["chat_prefill_tokens_computed"]
    labels = {"recompute": "recompute", "device": "device (room for all)", "device_small": "device (small)",
              "kvtier_layerwise": "layerwise", "kvtier_whole": "whole"}
    chat = _table(["chat (device pool smaller than the history)", "TTFT p50 ms", "prefill tokens computed"],
                  [[label, f"{ct[m]['p50_ms']:.1f}", chat_tokens[m]] for m, label in labels.items()])
    runs = _table(["copy-engine H2D bound per device command (each run's ratios use its own)", "GB/s"],
                  [["+".join(r["workloads"]), f"{r['copy_engine_h2d_gbps']:.2f}"] for r in res.get("runs", [])])
    return _join(equality, bounds, fixed, speedup, long_, hit, chat, runs)


# --- host index --------------------------------------------------------------------------------------------------

@_from("index_cpu.json")
def index_table(res: dict) -> str:
    s = res["summary"]
    rerun = _load("index_cpu_rerun.json")
    runs = [("index_cpu.json", s)] + ([("index_cpu_rerun.json", rerun["summary"])] if rerun else [])
    extremes = _table(
        ["host index vs SGLang 0.5.23's Python and Rust radix trees, 2 CPU cores, same process: best peer's time "
         "over kvtier's, per run", "worst cell", "speedup", "best cell", "speedup"],
        [[f"`{name}`", f"`{r['index_min_speedup_cell']}`", f"{r['index_min_speedup_vs_best_peer']:.2f}x",
          f"`{r['index_max_speedup_cell']}`", f"{r['index_max_speedup_vs_best_peer']:.2f}x"] for name, r in runs])
    cells = sorted({k.rsplit("/", 1)[0] for k in s["speedup_vs_best_peer"]}, key=lambda c: c.split("/page"))
    per_cell = _table(
        ["cell (workload / engine page)", *(f"match, `{n}`" for n, _ in runs), *(f"insert, `{n}`" for n, _ in runs),
         "evict per token, `index_cpu.json`"],
        [[c, *(f"{r['speedup_vs_best_peer'][f'{c}/match']:.2f}x" for _, r in runs),
          *(f"{r['speedup_vs_best_peer'][f'{c}/insert']:.2f}x" for _, r in runs),
          f"{s['evict_speedup_vs_best_peer'][c]:.2f}x"] for c in cells])
    blocks = sorted({(k.split("/page")[1], r["kvtier_tokens_per_block"]) for k, r in res["results"].items()},
                    key=lambda x: int(x[0]))
    other = _table(
        ["`index_cpu.json`", "value"],
        [["kvtier's host block at each engine page size (tokens)", ", ".join(f"page {p}: {b}" for p, b in blocks)],
         ["every hit within one host block of the peers'", s["hits_within_one_block"]],
         ["multi-turn, page 16: match speedup vs SGLang RadixCache", f"{s['match_speedup_vs_sglang']:.2f}x"],
         ["multi-turn, page 16: insert speedup vs SGLang RadixCache", f"{s['insert_speedup_vs_sglang']:.2f}x"],
         ["bytes per block (16 tokens included)", f"{s['bytes_per_page']:.1f}"],
         ["memory for 10M blocks", f"{s['mem_10M_pages_gib']:.3f} GiB"]])
    return _join(extremes, per_cell, other)


# --- observers ---------------------------------------------------------------------------------------------------

@_from("observe_h200.json")
def observe_table(res: dict) -> str:
    r = res["observed_over_bare"]
    sets = ("metrics", "log", "metrics+log")
    measures = [("issue_us", f"store + load issue calls, {res['pages_per_request']}-page "
                             f"({res['request_mb']:.0f} MB) requests"),
                ("lookup_us", "lookup"), ("cycle_us", "whole cycle (copies included)")]
    return _table(
        [f"observers' overhead, H200, observed / bare, median of paired cycles ({res['repeats']} repeats of "
         f"{res['cycles']})", "metrics", "transfer log", "both (the default with `metrics_port`)"],
        [*[[label, *(f"{r[s][key]:.3f}" for s in sets)] for key, label in measures],
         ["a metrics sync at scrape time (off the engine's path), µs, median", f"{res['sync_us_median']:.0f}", "–",
          "–"]])


# --- serving under load ------------------------------------------------------------------------------------------

# FlexKV's serving table (Qwen3-8B on one H20, 120 SWE-bench-Lite prompts, pass 2 at qps 2.0, concurrency 24, 32 new
# tokens): TTFT avg / p50 / p90 / p99 s, E2E p50 s, req/s
FLEXKV_TABLE = (("FlexKV's table: SGLang, no host tier (H20)", 6.86, 8.04, 9.88, 10.89, 8.15, 1.86),
                ("FlexKV's table: SGLang HiCache (H20)", 0.04, 0.04, 0.06, 0.06, 0.23, 2.02),
                ("FlexKV's table: FlexKV (H20)", 0.05, 0.05, 0.07, 0.08, 0.24, 2.02))


def _serving_runs() -> list[tuple[str, dict]]:
    names = sorted(f for f in os.listdir(os.path.join(ROOT, "bench", "results"))
                   if re.fullmatch(r"serving_\w+\.json", f))
    return [(n[len("serving_"):-len(".json")], _load(n)) for n in names]


def _ms(v) -> str:
    return "-" if v is None else f"{v / 1e3:.3f}"


def serving_table() -> str:
    rows = [[label, *[f"{x:.2f}" for x in cells[:5]], f"{cells[5]:.2f}", "-", "-"] for label, *cells in FLEXKV_TABLE]
    notes = []
    for card, res in _serving_runs():
        swe = res.get("swe") or {}
        plan = res["plan"]
        notes.append(f"{card.upper()}: Qwen3-8B shapes with {plan['layers']} of its 36 layers (random weights), "
                     f"{swe.get('prompts')} prompts, device pool {swe.get('kv_tokens')} tokens, host pools "
                     f"{swe.get('host_gb', 0):.1f} GiB")
        ratios = res.get("summary", {})
        per = [(w, ratios.get(f"{w}_throughput_over_hicache"), ratios.get(f"{w}_ttft_p99_over_hicache"))
               for w in ("swe", "multiturn", "system")]
        per = [(w, t, p) for w, t, p in per if t is not None and p is not None]
        if per:
            notes.append(f"{card.upper()} kvtier over HiCache in the same run, req/s and TTFT p99: "
                         + ", ".join(f"{w} {t:.2f}x and {p:.2f}x" for w, t, p in per))
        for qps in sorted({r["qps"] for r in swe.get("runs", [])}):
            for mode in res["modes"]:
                runs = [r for r in swe["runs"] if r["mode"] == mode and r["qps"] == qps]
                if not runs:
                    continue
                med = lambda k, runs=runs: sorted(r[k] for r in runs)[len(runs) // 2]  # noqa: E731
                rate = "all at once" if qps == float("inf") else f"qps {qps:g}"
                rows.append([f"{card.upper()} {mode}, {rate} ({len(runs)} runs)", _ms(med("ttft_avg_ms")),
                             _ms(med("ttft_p50_ms")), _ms(med("ttft_p90_ms")), _ms(med("ttft_p99_ms")),
                             _ms(med("e2e_p50_ms")), f"{med('req_per_s'):.2f}", f"{med('output_tok_per_s'):.1f}",
                             f"{med('hit_rate'):.2f}"])
        for mode, err in (swe.get("errors") or {}).items():
            rows.append([f"{card.upper()} {mode}", "failed: " + err.strip().splitlines()[-1][:80], *["-"] * 7])
    table = _table(["swe pass 2 (FlexKV's workload; 24 in flight, 32 new tokens)", "TTFT avg s", "p50", "p90",
                    "p99", "E2E p50 s", "req/s", "output tok/s", "hit rate"], rows)
    return table + ("\n\n" + "; ".join(notes) if notes else "")


# --- files -------------------------------------------------------------------------------------------------------

TABLES = {"headline": headline_table, "transfer": transfer_table, "index": index_table, "layerwise": layerwise_table,
          "fragmentation": fragmentation_table, "ssd": ssd_table, "ssd_tier": ssd_tier_table, "remote": remote_table,
          "e2e": e2e_table, "observe": observe_table, "serving": serving_table}

# Which file holds which tables: the README the headline, bench/results/README.md every detailed one.
FILES = {"README.md": ("headline", "serving"),
         os.path.join("bench", "results", "README.md"): tuple(n for n in TABLES if n != "headline")}


def render(text: str, names=tuple(TABLES)) -> str:
    for name in names:
        pattern = re.compile(rf"(<!-- table:{name} -->\n)(?:.*?\n)?(<!-- /table:{name} -->)", re.S)
        text = pattern.sub(lambda m, name=name: m.group(1) + TABLES[name]() + "\n" + m.group(2), text)
    return text


def missing_blocks(text: str, names) -> list:
    """The names among ``names`` whose block markers ``text`` lacks."""
    return [n for n in names if f"<!-- table:{n} -->" not in text or f"<!-- /table:{n} -->" not in text]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a file is out of date instead of writing it")
    args = ap.parse_args()
    failed = False
    for rel, names in FILES.items():
        path = os.path.join(ROOT, rel)
        with open(path, encoding="utf-8") as f:
            old = f.read()
        missing = missing_blocks(old, names)
        if missing:
            print(f"{rel}: no <!-- table:NAME --> block for {', '.join(missing)}", file=sys.stderr)
            failed = True
            continue
        new = render(old, names)
        if new == old:
            continue
        if args.check:
            print(f"{rel}: tables are out of date: run python bench/readme_tables.py", file=sys.stderr)
            failed = True
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
