"""Regenerate the README's result tables from bench/results/*.json (keeps the README in step with the data).

Usage: ``python bench/readme_tables.py`` rewrites the blocks between ``<!-- table:NAME -->`` and
``<!-- /table:NAME -->`` in README.md; ``--check`` exits 1 if the README is out of date instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20


def _load(name: str):
    path = os.path.join(ROOT, "bench", "results", name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _cell(rows, method, direction, layout="layer_first"):
    vals = [r["gbps"] for r in rows if r["method"] == method and r["direction"] == direction
            and r["layout"] == layout]
    if not vals:
        return "–"
    lo, hi = f"{min(vals):.1f}", f"{max(vals):.1f}"
    return lo if lo == hi else f"{lo}–{hi}"


def headline_table() -> str:
    """At most eight rows, each the worst cell of one result file (its own table below has the rest)."""
    tr, lw, fr = _load("transfer_h200.json"), _load("layerwise_h200.json"), _load("fragmentation_h200.json")
    e2e = _load("e2e_h200.json")
    rows = ["| headline (worst cell of each table below) | value |", "|---|---|"]
    if tr:
        t = tr["summary"]
        rows.append(f"| kvtier's direct kernel, slower direction, over SGLang HiCache's on identical work | "
                    f"{t['hicache_ratio_min']:.4f} |")
        rows.append(f"| store + load at once over the copy engines' own bound | {t['bidirectional_over_copy_engine']:.3f} |")
    if lw:
        rows.append(f"| layerwise load beside the forward, time over max(load, compute), 8k prefix | "
                    f"{lw['summary']['layerwise_over_max_ratio']:.3f} |")
    if e2e:
        e = e2e["summary"]
        rows.append(f"| end to end: outputs equal to the warm device cache; TTFT over its bound, layerwise | "
                    f"{e['outputs_equal_kvtier_vs_device']:.3f}; {e['ttft_over_bound_layerwise']:.3f} |")
    worst = _index_worst()
    if worst:
        rows.append(f"| host index vs the faster of SGLang's trees, worst cell over two runs (`{worst[1]}`) | "
                    f"{worst[0]:.2f}x |")
    if fr:
        f = fr["summary"]
        kind = max(("load_whole", "load_layerwise", "store"), key=lambda k: f[f"frag_worst_over_one_run_{k}"])
        rows.append(f"| fragmented host pool, worst run length's time over one run's, what `auto` picks "
                    f"(`{f[f'frag_worst_cell_{kind}']}`) | {f[f'frag_worst_over_one_run_{kind}']:.2f}x |")
    return "\n".join(rows)


def transfer_table() -> str:
    res = _load("transfer_h200.json")
    if res is None:
        return "_no results yet_"
    s = res["summary"]
    lat = s["one_page_all_layers_us_detail"]
    rows = [r for r in res["sizes"] if r["geometry"] == "qwen3_8b" and r["bytes"] == 64 * MiB]
    default = f"kvtier_direct_p{s['direct_programs']}"
    lines = [
        "| one layer, 64 MiB (K+V), Qwen3-8B 8x128 bf16, random slots, pages 1/16/64 | D2H GB/s | H2D GB/s |",
        "|---|---|---|",
        f"| copy engine, one contiguous copy (the PCIe bound) | {_cell(rows, 'copy_engine_contiguous', 'd2h')} "
        f"| {_cell(rows, 'copy_engine_contiguous', 'h2d')} |",
        f"| SGLang 0.5.23 HiCache kernel (`transfer_hicache_one_layer`, default) | "
        f"{_cell(rows, 'sglang_hicache', 'd2h')} | {_cell(rows, 'sglang_hicache', 'h2d')} |",
        f"| **kvtier direct**, {s['direct_programs']} programs (default), `layer_first`, random blocks | "
        f"**{_cell(rows, default, 'd2h')}** | **{_cell(rows, default, 'h2d')}** |",
        f"| kvtier direct, 8 programs | {_cell(rows, 'kvtier_direct_p8', 'd2h')} | "
        f"{_cell(rows, 'kvtier_direct_p8', 'h2d')} |",
        f"| kvtier direct, {s['direct_programs']} programs, `page_first` | {_cell(rows, default, 'd2h', 'page_first')} | "
        f"{_cell(rows, default, 'h2d', 'page_first')} |",
        f"| kvtier staged (gather + copy engine), `layer_first`, consecutive blocks | "
        f"{_cell(rows, 'kvtier_staged_contig', 'd2h')} | {_cell(rows, 'kvtier_staged_contig', 'h2d')} |",
        f"| torch gather + one copy | {_cell(rows, 'torch_gather_copy', 'd2h')} | "
        f"{_cell(rows, 'torch_gather_copy', 'h2d')} |",
    ]
    alt = res.get("hicache_alternating")
    if alt:
        by_case = s["hicache_ratio_by_case_random"]
        lines.append(f"| kvtier direct / HiCache on identical work (same slots, host bytes, random host pages), "
                     f"{alt['entries'][0]['rounds']} alternating rounds, pages 1/16/64, D2H / H2D | "
                     f"ratio {min(v for k, v in by_case.items() if k.startswith('d2h')):.4f}–"
                     f"{max(v for k, v in by_case.items() if k.startswith('d2h')):.4f} | "
                     f"ratio {min(v for k, v in by_case.items() if k.startswith('h2d')):.4f}–"
                     f"{max(v for k, v in by_case.items() if k.startswith('h2d')):.4f} |")
    bidir_ce = res.get("staged_sweep", [{}])[0] if res.get("staged_sweep") else None
    lines += [
        "",
        "| other measurements (same run as above, unless the row names another) | value |",
        "|---|---|",
        f"| staged, all 36 layers, `page_first`, page 16, 1024 tokens: store / load | {s['staged_d2h_gbps']} / "
        f"{s['staged_h2d_gbps']} GB/s |",
        f"| staged store and load at once, combined | {s['bidirectional_gbps']} GB/s |",
        *_bidir_alternating_rows(res.get("bidir", {}).get("alternating")),
        *([f"| copy engine, contiguous, same bytes: store / load / combined | {bidir_ce['store_gbps']} / "
           f"{bidir_ce['load_gbps']} / {bidir_ce['combined_gbps']} GB/s |"] if bidir_ce else []),
        *_staged_probe_rows(),
        *_copy2d_probe_rows(),
        f"| 8192³ bf16 GEMM slowdown beside back-to-back H2D: kvtier direct default / HiCache | "
        f"+{s['gemm_slowdown_pct']}% / +{s['gemm_slowdown_hicache_pct']}% |",
        _latency_row(lat),
        f"| host time to issue one direct call (varies 28–70 µs between runs and machines) | "
        f"{res['overhead']['store_pages_check_false_us']} µs |",
        *_overhead_probe_rows(),
    ]
    return "\n".join(lines)


_GEOMETRY_LABELS = {"qwen3_8b": "Qwen3-8B", "tp_1x128": "TP-sharded 1x128", "mla_bf16": "MLA 576 bf16",
                    "mla_fp8": "MLA 576 fp8"}


def _latency_row(lat: dict) -> str:
    """One 16-token page x 36 layers, slower direction, per measured geometry, with its PCIe floor."""
    names = [n for n in _GEOMETRY_LABELS if n in lat]
    floors = " / ".join(f"{_GEOMETRY_LABELS[n]} (PCIe floor {lat[n]['pcie_floor_us']} µs)" for n in names)
    values = " / ".join(f"{max(lat[n]['h2d_pdefault_us'], lat[n]['d2h_pdefault_us'])}" for n in names)
    return f"| one 16-token page × 36 layers, all-layer call, slower direction: {floors} | {values} µs |"


def _bidir_alternating_rows(alt: Optional[dict]) -> list:
    """Staged store + load at once in rounds alternating with the copy engines' contiguous bound (same run), if
    the run has them."""
    if alt is None:
        return []
    med = alt["combined_gbps_median"]
    return [f"| the same, {alt['rounds']} rounds alternating with the copy engines' contiguous bound on the same "
            f"host blocks: staged / bound (ratio), medians | {med['staged']:.2f} / "
            f"{med['copy_engine_contiguous']:.2f} GB/s ({alt['staged_over_copy_engine']}) |"]


def _overhead_probe_rows() -> list:
    """Host time per call from bench/probes/probe_overhead.py (another process), if committed: the latest run, which
    times StagedCopy too."""
    probe = _load("probes/probe_overhead_h200.json")
    if probe is None:
        return []
    us, staged = probe["us"], probe["layerwise_issue_us_staged"]
    return [f"| host time per call, one layer of one page, separate run (`bench/probes/probe_overhead.py`): "
            f"`DirectCopy.launch` (built once) / `load_pages` / the same through stream contexts (before) / "
            f"`torch.index_select` | {us['direct_copy_launch_one_layer']} / {us['load_pages_one_layer']} / "
            f"{us['load_pages_one_layer_context_path']} / {us['torch_index_select_one_page']} µs |",
            f"| the same, staged: `StagedCopy.launch` (planned once) / `StagedTransfer.load` | "
            f"{us['staged_copy_launch_one_layer']} / {us['staged_load_one_layer']} µs |",
            f"| host time to issue a 36-layer layerwise load of one page in the tier, direct / staged | "
            f"{probe['layerwise_issue_us']['load_layerwise_1p']} / {staged['load_layerwise_staged_1p']} µs |"]


def _row_if_committed(name: str, row) -> list:
    """``[row(result)]`` for the result file ``name`` when it is committed, else no row."""
    res = _load(name)
    return [] if res is None else [row(res)]


def _staged_probe_rows() -> list:
    """Rows from bench/probes/probe_staged.py's run (another process, same session), if committed."""
    def row(probe: dict) -> str:
        g = probe["gbps"]
        return (f"| staged load alone, 1024 tokens, {probe['rounds']} alternating rounds, separate run "
                f"(`bench/probes/probe_staged.py`): short last chunk (default) / without / one contiguous copy-engine copy | "
                f"{g['default']} / {g['no_short_tail']} / {g['copy_engine_contiguous']} GB/s |")
    return _row_if_committed("probes/probe_staged_h200.json", row)


def _copy2d_probe_rows() -> list:
    """Rows from bench/probes/probe_copy2d.py's runs (2-D copy-engine copies; before: one copy per block or plane), if
    committed: ``page_first`` from the first run, ``layer_first`` (groups of layers) from the latest."""
    first, latest = _load("probes/probe_copy2d_h200.json"), _load("probes/probe_copy2d_groups_h200.json")
    if first is None or latest is None:
        return []

    def cells(probe, layout, layers, blocks, method):
        sel = sorted((c for c in probe["cases"] if (c["layout"], c["layers"], c["blocks"]) == (layout, layers, blocks)),
                     key=lambda c: c["page"])
        return " / ".join("/".join(f"{c['gbps'][f'{method}_{d}']:g}" for c in sel) for d in ("d2h", "h2d"))

    rows = []
    for layout, layers, blocks, what in (("page_first", 0, "consecutive", "one layer of 16384 tokens"),
                                         ("layer_first", "all", "consecutive", "all 36 layers of 1024 tokens"),
                                         ("layer_first", "all", "random", "all 36 layers of 1024 tokens")):
        now = first if layout == "page_first" else latest
        rows.append(f"| staged, {what}, `{layout}`, {blocks} blocks, pages 1/16/64, store / load GB/s, separate runs "
                    f"(`bench/probes/probe_copy2d.py`): 2-D copies per run of blocks (now) ; one copy per block or plane "
                    f"(before) | {cells(now, layout, layers, blocks, 'copy_2d')} ; "
                    f"{cells(first, layout, layers, blocks, 'rows_1d')} |")
    return rows


def _index_worst() -> Optional[tuple[float, str]]:
    """The worst cell over the index bench's committed runs (index_cpu.json and its rerun)."""
    runs = [r["summary"] for r in (_load("index_cpu.json"), _load("index_cpu_rerun.json")) if r]
    if not runs:
        return None
    worst = min(runs, key=lambda s: s["index_min_speedup_vs_best_peer"])
    return worst["index_min_speedup_vs_best_peer"], worst["index_min_speedup_cell"]


def _index_rerun_rows() -> list:
    def row(rerun: dict) -> str:
        s = rerun["summary"]
        return (f"| the same, a second full run right after (`index_cpu_rerun.json`): worst / best cell | "
                f"{s['index_min_speedup_cell']}: {s['index_min_speedup_vs_best_peer']:.2f}x / "
                f"{s['index_max_speedup_cell']}: {s['index_max_speedup_vs_best_peer']:.2f}x |")
    return _row_if_committed("index_cpu_rerun.json", row)


def index_table() -> str:
    res = _load("index_cpu.json")
    if res is None:
        return "_no results yet_"
    s = res["summary"]
    blocks = sorted({(k.split("/page")[1], r["kvtier_tokens_per_block"]) for k, r in res["results"].items()},
                    key=lambda x: int(x[0]))
    return "\n".join([
        "| host index vs SGLang 0.5.23's Python and Rust radix trees, 2 CPU cores, same process | value |",
        "|---|---|",
        f"| worst cell (workload / page / op), best peer's time over kvtier's | {s['index_min_speedup_cell']}: "
        f"{s['index_min_speedup_vs_best_peer']:.2f}x |",
        f"| best cell | {s['index_max_speedup_cell']}: {s['index_max_speedup_vs_best_peer']:.2f}x |",
        *_index_rerun_rows(),
        "| kvtier's host block at each engine page size (tokens) | "
        + ", ".join(f"page {p}: {b}" for p, b in blocks) + " |",
        f"| every hit within one host block of the peers' | {s['hits_within_one_block']} |",
        f"| multi-turn, page 16: match / insert speedup vs SGLang RadixCache | {s['match_speedup_vs_sglang']:.2f}x / "
        f"{s['insert_speedup_vs_sglang']:.2f}x |",
        f"| bytes per block (16 tokens included) / memory for 10M blocks | {s['bytes_per_page']:.1f} / "
        f"{s['mem_10M_pages_gib']:.3f} GiB |",
    ])


def layerwise_table() -> str:
    res = _load("layerwise_h200.json")
    if res is None:
        return "_no results yet_"
    s = res["summary"]
    runs = [r for r in res["runs"] if "error" not in r and not r.get("staged_config")
            and r["transfer_mode"] == s.get("transfer_mode", r["transfer_mode"])]
    per_size = [f"| new tokens {r['new_tokens']}: compute / load / layerwise / host-blocking ms; layerwise / max; "
                f"host-blocking / layerwise | {r['times']['compute_only']['median_ms']:.2f} / "
                f"{r['times']['load_only']['median_ms']:.2f} / {r['times']['layerwise']['median_ms']:.2f} / "
                f"{r['times']['host_blocking']['median_ms']:.2f}; {r['layerwise_over_max_ratio']:.3f}; "
                f"{r['host_blocking_over_layerwise_ratio']:.3f} |" for r in runs]
    return "\n".join([
        f"| layerwise load, Qwen3-8B, 8192-token prefix, {s['new_tokens']} new tokens, H200, "
        f"`transfer_mode={s.get('transfer_mode', 'auto')}` | value |",
        "|---|---|",
        f"| layerwise time / max(load, compute) (target <= 1.1) | {s['layerwise_over_max_ratio']:.3f} |",
        f"| host-blocking (FlexKV-style) / layerwise (target > 1) | {s['host_blocking_over_layerwise_ratio']:.3f} |",
        f"| load then compute / layerwise | {s['load_then_compute_over_layerwise_ratio']:.3f} |",
        f"| host time inside `wait_until` (median) | {s['wait_until_host_us_median']:.1f} µs |",
        f"| layerwise bytes exact | {s['layerwise_bytes_exact']} |",
        *per_size,
        f"| pinning a {res['pin']['gib']:.0f} GiB pool in {res['pin']['chunks']} registrations | "
        f"{res['pin']['seconds']:.1f} s ({s['pin_seconds_per_gib']:.3f} s/GiB) |",
    ])


def fragmentation_table() -> str:
    res = _load("fragmentation_h200.json")
    if res is None:
        return "_no results yet_"
    s = res["summary"]
    kinds = [("load_whole", "whole load"), ("load_layerwise", "layerwise load"), ("store", "store")]
    return "\n".join([
        "| host blocks in runs of R (1, 2, 4, 8, 16, 64, one run), Qwen3-8B, 1k and 8k tokens, both layouts, H200, "
        "what `auto` picks | value |",
        "|---|---|",
        *[f"| {label}: worst R / one run (target <= 1.10), worst cell | {s[f'frag_worst_over_one_run_{k}']:.3f} "
          f"(`{s[f'frag_worst_cell_{k}']}`) |" for k, label in kinds],
        f"| host time to issue a 36-layer layerwise load of 8k tokens at the worst R (target <= 3 ms) | "
        f"{s['frag_layerwise_issue_ms_max']:.2f} ms |",
        f"| 8192³ bf16 GEMM slowdown beside what auto picks (8k tokens, R = 1 and one run), worst (target <= 3%), "
        f"cell | {s['gemm_slowdown_pct']:+.2f}% "
        f"(`{s['gemm_slowdown_cell']}`) |",
        f"| run lengths after LRU churn (multi-turn), loads / stores: median, p10 | {s['churn_load_median_R']:.0f}, "
        f"{s['churn_load_p10_R']:.0f} / {s['churn_store_median_R']:.0f}, {s['churn_store_p10_R']:.0f} |",
    ])


def ssd_table() -> str:
    res = _load("ssd_cpu.json")
    if res is None:
        return "_no results yet_"
    rows = ["| SSD store (`kvtier/storage`), 2.25 MiB blocks | raw O_DIRECT write / read GB/s | store write / read "
            "GB/s (over raw) | recovery, s per million blocks |",
            "|---|---|---|---|"]
    h200 = _load("ssd_h200.json")
    for res_, machine in ((res, "CPU machine"), (h200, "H200 machine")):
        for key, label in (("disk", "disk"), ("ram", "RAM-backed directory")):
            d = (res_ or {}).get(key)
            if d:
                rows.append(f"| {machine}, {label} | {d['raw_write_gbps']:.2f} / {d['raw_read_gbps']:.2f} | "
                            f"{d['store_write_gbps']:.2f} ({d['write_over_raw']:.3f}) / {d['store_read_gbps']:.2f} "
                            f"({d['read_over_raw']:.3f}) | {d['recovery_s_per_million_blocks']:.2f} |")
    return "\n".join(rows)


def ssd_tier_table() -> str:
    ttft, policy = _load("ssd_ttft_h200.json"), _load("ssd_policy_cpu.json")
    crash = (_load("ssd_cpu.json") or {}).get("crash")
    if ttft is None and policy is None and crash is None:
        return "_no results yet_"
    rows = ["| SSD tier behind the CPU pool (TTFT targets: <= 1.05 with admission on the disk, < 1 on RAM) | value |",
            "|---|---|"]
    if ttft is not None:
        t = ttft["summary"]
        cells = {(r["dir"].startswith("/dev/shm"), r["admission"], r["prefix"]): r["ratio"] for r in ttft["rows"]}
        prefixes = sorted({k[2] for k in cells})
        for ram, label in ((False, "disk"), (True, "RAM-backed directory")):
            for adm, what in (("cost", "admission by cost"), ("always", "no admission")):
                vals = [cells.get((ram, adm, p)) for p in prefixes]
                if all(v is None for v in vals):
                    continue
                rows.append(f"| H200, {label}, {what}: TTFT over recompute at "
                            + " / ".join(f"{p // 1024}k" for p in prefixes) + " | "
                            + " / ".join(f"{v:.3f}" for v in vals) + " |")
        rows.append(f"| H200 SSD tier read GB/s measured, disk / RAM (admission on) | "
                    f"{t['ssd_read_gbps_admission']:.2f} / {t.get('ssd_read_gbps_admission_ram') or 0:.2f} |")
    if policy is not None:
        p = policy["summary"]
        rows.append("| write policy, CPU machine (CPU pool a quarter of the workload): host hits cold / after a "
                    "restart, MiB written; write_through; write_back | " + "; ".join(
                        f"{p[f'host_hit_pass1_{w}']:.3f} / {p[f'host_hit_after_restart_{w}']:.3f}, "
                        f"{p[f'ssd_bytes_written_{w}'] / 2**20:.1f}" for w in ("write_through", "write_back")) + " |")
        rows.append(f"| restart to the first SSD hit in the CPU tier (CPU machine, write_through) | "
                    f"{p['start_to_first_hit_s_write_through']:.3f} s |")
    if crash is not None:
        rows.append(f"| crash loop (SIGKILL a storing process, restart, check): kills; acknowledged blocks lost; "
                    f"corrupt blocks served (targets >= 200; 0; 0) | {crash['kills']}; {crash['durable_lost']}; "
                    f"{crash['corrupt_served']} |")
    return "\n".join(rows)


def _equal(counts: dict, modes) -> str:
    eq, tot = sum(counts[m]["equal"] for m in modes), sum(counts[m]["total"] for m in modes)
    return f"{eq}/{tot}"


def _page1_rows() -> list:
    """The fixed prompts at SGLang --page-size 1 (kvtier's host blocks: 16 tokens), a run of their own."""
    def row(res: dict) -> str:
        s = res["summary"]
        return (f"| fixed prompts at --page-size 1 (host blocks of 16 tokens): outputs equal kvtier vs device; worst "
                f"layerwise / bound at 8k and 28k; whole | {s['outputs_equal_kvtier_vs_device']:.3f}; "
                f"{s['ttft_over_bound_layerwise']:.3f}; {s['ttft_over_bound_whole']:.3f} |")
    return _row_if_committed("e2e_h200_page1_fixed.json", row)


def e2e_table() -> str:
    res = _load("e2e_h200.json")
    if res is None:
        return "_no results yet_"
    s = res["summary"]
    kv = ("kvtier_whole", "kvtier_layerwise")
    wls = [w for w in ("fixed", "chat", "long") if f"outputs_equal_{w}" in s]
    eq_kv = ", ".join(f"{w} {_equal(s[f'outputs_equal_{w}'], kv)}" for w in wls)
    eq_rc = ", ".join(f"{w} {_equal(s[f'outputs_equal_{w}'], ('recompute',))}" for w in wls
                      if "recompute" in s[f"outputs_equal_{w}"])
    cells = [f"| {c['prefix_len'] // 1024}k prefix + {c['new_tokens']} new, {s['fixed_layers']} layers: recompute / "
             f"device / layerwise / whole ms; bound ms; layerwise, whole over bound | "
             f"{c['ttft_ms']['recompute']:.1f} / {c['ttft_ms']['device']:.1f} / "
             f"{c['ttft_ms']['kvtier_layerwise']:.1f} / {c['ttft_ms']['kvtier_whole']:.1f}; {c['bound_ms']:.1f}; "
             f"{c['ttft_over_bound_kvtier_layerwise']:.3f}, {c['ttft_over_bound_kvtier_whole']:.3f} |"
             for c in s["fixed_cells"]]
    lt = s["long_ttft"]
    modes = ("recompute", "device", "kvtier_layerwise", "kvtier_whole")
    sp = s["ttft_speedup_vs_recompute_p50"]
    longest = s["ttft_speedup_vs_recompute_longest_prefix"]
    runs = "; ".join(f"{'+'.join(r['workloads'])} {r['copy_engine_h2d_gbps']:.2f}" for r in res.get("runs", []))
    ct = s["chat_ttft"]
    return "\n".join([
        "| end to end, H200: random-weight Qwen3 (Qwen3-8B shapes), SGLang 0.5.23 pool, tree cache, scheduler "
        "sequence | value |",
        "|---|---|",
        f"| outputs equal, kvtier (whole and layerwise) vs warm device cache (target 1.0) | "
        f"{s['outputs_equal_kvtier_vs_device']:.3f} ({eq_kv}) |",
        f"| outputs equal, recompute vs warm device cache | {s['outputs_equal_vs_recompute']:.3f} ({eq_rc}) |",
        *cells,
        f"| worst layerwise / bound at 8k and 28k (target <= 1.15); whole | {s['ttft_over_bound_layerwise']:.3f}; "
        f"{s['ttft_over_bound_whole']:.3f} |",
        f"| worst speedup over the ceiling at 8k and 28k (target >= 0.85), layerwise / whole | "
        f"{s['ttft_speedup_over_ceiling_layerwise']:.3f} / {s['ttft_speedup_over_ceiling_whole']:.3f} |",
        *_page1_rows(),
        "| 28k prefix, speedup vs recompute, layerwise / whole: " + "; ".join(
            f"{k.split('+')[1]} new" for k in longest) + " | " + "; ".join(
            f"{v['kvtier_layerwise']:.1f}x / {v['kvtier_whole']:.1f}x" for v in longest.values()) + " |",
        f"| {lt['device']['n']} long prompts, {s['long_layers']} layers, pass 2 TTFT p50 / p90 / p99 ms: "
        + ", ".join(m.replace("kvtier_", "") for m in modes) + " | " + "; ".join(
            f"{lt[m]['p50_ms']:.1f} / {lt[m]['p90_ms']:.1f} / {lt[m]['p99_ms']:.1f}" for m in modes) + " |",
        "| long prompts, p50 TTFT speedup vs recompute: device / layerwise / whole | "
        + (" / ".join(f"{sp[m]:.2f}x" for m in ("device", "kvtier_layerwise", "kvtier_whole")) if sp else "–")
        + " |",
        f"| long prompts, host-hit fraction of page-aligned prompt tokens, pass 2 (target >= 0.99) | "
        f"{s['host_hit_fraction_pass2']:.4f} |",
        "| long prompts, prefill tokens computed: recompute / kvtier | "
        f"{s['long_prefill_tokens_computed']['recompute']} / {s['long_prefill_tokens_computed']['kvtier_layerwise']} |",
        "| long prompts, host tier load GB/s, layerwise / whole | "
        f"{s['long_tier']['kvtier_layerwise']['load_gbps']:.1f} / {s['long_tier']['kvtier_whole']['load_gbps']:.1f} |",
        "| chat (device pool smaller than the history), TTFT p50 ms and prefill tokens: recompute, device "
        "(room for all), device (small), layerwise, whole | " + "; ".join(
            f"{ct[m]['p50_ms']:.1f} ms {s['chat_prefill_tokens_computed'][m]}"
            for m in ("recompute", "device", "device_small", "kvtier_layerwise", "kvtier_whole")) + " |",
        f"| copy-engine H2D bound GB/s, per run (each run's ratios use its own) | {runs} |",
    ])


def remote_table() -> str:
    cpu, h200, ttft = _load("remote_cpu.json"), _load("remote_h200.json"), _load("remote_ttft_h200.json")
    if cpu is None and ttft is None:
        return "_no results yet_"
    rows = ["| remote tier on Mooncake Store (targets: put and get over raw >= 0.8) | value |", "|---|---|"]
    for res, machine in ((cpu, "CPU machine"), (h200, "H200 machine")):
        if res is None:
            continue
        s = res["summary"]
        for lay in ("layer_first", "page_first"):
            rows.append(f"| {machine}, loopback TCP, `{lay}` pool: kvtier put / raw `batch_put_from` GB/s (ratio); "
                        f"fetch / raw `batch_get_into` (ratio) | {s[f'{lay}/kvtier_put_gbps']:.2f} / "
                        f"{s[f'{lay}/raw_put_gbps']:.2f} ({s[f'{lay}/put_over_raw']:.3f}); "
                        f"{s[f'{lay}/kvtier_fetch_gbps']:.2f} / {s[f'{lay}/raw_get_gbps']:.2f} "
                        f"({s[f'{lay}/get_over_raw']:.3f}) |")
        rows.append(f"| {machine}: worst put over raw (`{s['remote_put_worst_cell']}`); worst get over raw "
                    f"(`{s['remote_get_worst_cell']}`) | {s['remote_put_over_raw']:.3f}; "
                    f"{s['remote_get_over_raw']:.3f} |")
        rows.append(f"| {machine}: instance B's hit on an 8k-token prefix, lookup to fetched; raw get of its bytes | "
                    f"{s['hit_8k_ms']:.0f} ms; {s['hit_8k_raw_get_ms']:.0f} ms |")
    if ttft is not None:
        cells = {(r["admission"], r["prefix"]): r["ratio"] for r in ttft["rows"]}
        prefixes = sorted({k[1] for k in cells})
        for adm, what in (("cost", "admission by cost"), ("always", "no admission")):
            rows.append(f"| H200, instance B's TTFT from A's remote blocks over recompute, {what}, at "
                        + " / ".join(f"{p // 1024}k" for p in prefixes) + " | "
                        + " / ".join(f"{cells[(adm, p)]:.3f}" for p in prefixes) + " |")
        t = ttft["summary"]
        rows.append(f"| H200 fetch GB/s measured (loopback TCP, no admission) | "
                    f"{t['remote_read_gbps_no_admission']:.2f} |")
    return "\n".join(rows)


TABLES = {"headline": headline_table, "transfer": transfer_table, "index": index_table, "layerwise": layerwise_table,
          "fragmentation": fragmentation_table, "ssd": ssd_table, "ssd_tier": ssd_tier_table, "remote": remote_table,
          "e2e": e2e_table}


def render(readme: str) -> str:
    for name, fn in TABLES.items():
        pattern = re.compile(rf"(<!-- table:{name} -->\n)(?:.*?\n)?(<!-- /table:{name} -->)", re.S)
        readme = pattern.sub(lambda m: m.group(1) + fn() + "\n" + m.group(2), readme)
    return readme


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        old = f.read()
    new = render(old)
    if args.check:
        if new != old:
            print("README.md tables are out of date: run python bench/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    with open(path, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
