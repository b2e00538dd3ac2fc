"""Host-index benchmark (CPU): kvtier PageTrie vs SGLang 0.5.23 RadixCache in one process, one run.

Workloads: ``multi_turn`` (probe/radix_bench.py's generator: 2000 sequences under 8 system prompts), ``long_context``
(8 sequences of 128k sharing 96k documents), ``random`` (1000 unrelated sequences). Each library gets the same
``array('q')`` keys and its own conversion inside the timed call; per repeat: a fresh cache, insert, match and evict
everything. Reported: medians over repeats of per-call medians, numba compile time apart, the memory of 10M pages.

Run (SGLang must import in the same interpreter; see bench/results/index_notes.md for the venv):
    .venv-sglang/bin/python bench/bench_index.py            # full run, writes bench/results/index_cpu.json
    .venv-sglang/bin/python bench/bench_index.py --quick    # smaller, for a smoke test
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
import warnings
from array import array

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ROOT, command, machine, pyplot, save_png, write_json  # noqa: E402
from kvtier.config import default_tokens_per_block  # noqa: E402
from kvtier.index import PageTrie  # noqa: E402

pc = time.perf_counter
SPEEDUPS = {"match": "match_us_median", "insert": "insert_us_median", "match_cold_loop": "match_us_cold_loop",
            "evict_per_page": "evict_us_per_page"}  # a peer's figure over kvtier's, per operation


# ---- workloads ------------------------------------------------------------------------------------
def multi_turn(n_seq=2000, sys_len=2048, n_sys=8, turn=512, max_turns=8, seed=0):
    """Exactly radix_bench.py's generator."""
    rng = random.Random(seed)
    systems = [[rng.randrange(150000) for _ in range(sys_len)] for _ in range(n_sys)]
    convs = []
    for _ in range(n_seq):
        s = list(systems[rng.randrange(n_sys)])
        for _ in range(rng.randrange(1, max_turns)):
            s += [rng.randrange(150000) for _ in range(turn)]
        convs.append(s)
    return convs


def long_context(n_docs=2, doc_len=96 * 1024, tails=4, tail_len=32 * 1024, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_docs):
        doc = rng.integers(0, 150000, doc_len).tolist()
        for _ in range(tails):
            out.append(doc + rng.integers(0, 150000, tail_len).tolist())
    return out


def random_seqs(n_seq=1000, lo=512, hi=8192, seed=2):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 150000, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n_seq)]


# ---- adapters: same calls, each library's own input types -------------------------------------------
class KvtierLib:
    """kvtier's index as ``KVTier`` builds it for an engine page size: host blocks of ``tokens_per_block`` tokens
    (the config's default for that page size unless ``--tokens-per-block`` names one), one node slot per host
    block of the pool (here: the blocks the workload needs), so it never grows mid-serving."""

    name = "kvtier"
    tokens_per_block = None  # --tokens-per-block (None: the config's default for the engine page size)

    def __init__(self, page, blocks=4096):
        self.page = page
        self.block = self.block_for(page)
        self.t = PageTrie(self.block, initial_nodes=blocks)

    @classmethod
    def block_for(cls, page):
        """kvtier's host block (tokens) at engine page ``page``."""
        return cls.tokens_per_block or default_tokens_per_block(page)

    @classmethod
    def capacity(cls, page, seqs):
        return sum(len(s) // cls.block_for(page) for s in seqs)

    @property
    def unit_tokens(self):
        return self.block

    def values(self, seqs):
        return [np.arange(len(s) // self.block, dtype=np.int64) for s in seqs]

    def insert(self, key, value):
        self.t.insert(key, value)

    def match(self, key):
        return self.t.match(key).num_pages * self.block

    def evict_pages(self, pages):
        return len(self.t.evict(pages))

    def pages(self):
        return self.t.total_pages


class _NullAllocator:
    """Stands in for the KV allocator of a simulated SGLang cache: frees are no-ops."""

    device = "cpu"

    def __getattr__(self, name):
        return lambda *a, **k: None


class SglangLib:
    name = "sglang_radix"

    def __init__(self, page, blocks=None):  # blocks: unused (a Python tree has no preset capacity)
        import torch
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        self.torch, self.page = torch, page
        self.RadixKey, self.IP, self.MP, self.EP = RadixKey, InsertParams, MatchPrefixParams, EvictParams
        self.c = self._make(page)

    @classmethod
    def capacity(cls, page, seqs):
        return None

    def _make(self, page):
        from sglang.srt.mem_cache.radix_cache import RadixCache
        return RadixCache.create_simulated(page_size=page, mock_allocator=_NullAllocator())

    @property
    def unit_tokens(self):
        return self.page

    def values(self, seqs):
        return [self.torch.arange(len(s) // self.page * self.page, dtype=self.torch.int64) for s in seqs]

    def insert(self, key, value):
        self.c.insert(self.IP(key=self.RadixKey(key), value=value))

    def match(self, key):
        return self.c.match_prefix(self.MP(key=self.RadixKey(key))).device_prefix_len

    def evict_pages(self, pages):
        return self.c.evict(self.EP(num_tokens=pages * self.page)).num_tokens_evicted // self.page

    def pages(self):
        return (self.c.evictable_size() + self.c.protected_size()) // self.page


class SglangUnifiedLib(SglangLib):
    name = "sglang_unified_rust"

    def _make(self, page):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        p = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=_NullAllocator(),
                            page_size=page, tree_components=(ComponentType.FULL,))
        c = UnifiedRadixCache(p)
        self.core = type(c.tree_core).__name__
        return c


# ---- timing ---------------------------------------------------------------------------------------
def run_library(cls, page, seqs, arrs, reps, evict_chunk_pages):
    per_rep = []
    hits = None
    for _ in range(reps):
        gc.collect()
        lib = cls(page, cls.capacity(page, seqs))
        vals = lib.values(seqs)
        ins = []
        for a, v in zip(arrs, vals):
            key = a[:]
            t0 = pc()
            lib.insert(key, v)
            ins.append(pc() - t0)
        gc.collect()
        mt, got = [], []
        for a in arrs:
            key = a[:]
            t0 = pc()
            h = lib.match(key)
            mt.append(pc() - t0)
            got.append(h)
        t0 = pc()
        for a in arrs:
            lib.match(a)
        cold = (pc() - t0) / len(arrs)
        total_pages = lib.pages()
        gc.collect()
        ev_t, ev_n = 0.0, 0
        while True:
            t0 = pc()
            k = lib.evict_pages(evict_chunk_pages)
            ev_t += pc() - t0
            if k == 0:
                break
            ev_n += k
        hits = got
        per_rep.append(dict(insert=ins, match=mt, cold=cold, evict_s=ev_t, evicted=ev_n, pages=total_pages,
                            unit=lib.unit_tokens))
        del lib, vals
    ntok = sum(len(s) for s in seqs)
    med = statistics.median
    res = {
        "insert_us_median": med(med(r["insert"]) for r in per_rep) * 1e6,
        "insert_us_mean": med(statistics.fmean(r["insert"]) for r in per_rep) * 1e6,
        "match_us_median": med(med(r["match"]) for r in per_rep) * 1e6,
        "match_us_mean": med(statistics.fmean(r["match"]) for r in per_rep) * 1e6,
        "match_us_cold_loop": med(r["cold"] for r in per_rep) * 1e6,
        "evict_us_per_page": med(r["evict_s"] / max(r["evicted"], 1) for r in per_rep) * 1e6,
        # per token: kvtier evicts host blocks (several engine pages at page 1), the peers engine pages
        "evict_us_per_token": med(r["evict_s"] / max(r["evicted"] * r["unit"], 1) for r in per_rep) * 1e6,
        "pages_held": per_rep[-1]["pages"], "pages_evicted": per_rep[-1]["evicted"],
        "insert_mtok_s": ntok / med(sum(r["insert"]) for r in per_rep) / 1e6,
        "match_mtok_s": ntok / med(sum(r["match"]) for r in per_rep) / 1e6, "reps": reps}
    return res, hits


def compile_times():
    """First insert+match+lock+evict in a fresh process: without the numba cache, then with it (twice)."""
    code = ("import time; t=time.perf_counter(); import numpy as np; from kvtier.index import PageTrie; "
            "t1=time.perf_counter(); p=PageTrie(16); r=p.insert(np.arange(64), np.arange(4)); "
            "m=p.match(np.arange(64)); p.lock(m); p.unlock(m); p.evict(1); "
            "print(t1-t, time.perf_counter()-t1)")
    out = {}
    for label, env in (("no_cache", {"KVTIER_NUMBA_CACHE": "0"}), ("cache_fill", {}), ("cached", {})):
        e = dict(os.environ, PYTHONPATH=ROOT, **env)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=ROOT)
        imp, first = (float(x) for x in r.stdout.split())
        out[label] = {"import_s": imp, "first_calls_s": first}
    return out


def memory_10m(pages=10_000_000, page=16, seq_pages=4096, seed=3):
    """Index ``pages`` pages of random tokens (the arrays sized for them up front, as a tier sizes its index for its
    pool) and measure the arrays' bytes."""
    rng = np.random.default_rng(seed)
    t = PageTrie(page, initial_nodes=pages)
    gc.collect()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = pc()
    done, probes = 0, []
    while done < pages:
        n = min(seq_pages, pages - done)
        toks = rng.integers(0, 150000, n * page, dtype=np.uint32)
        t.insert(toks, np.arange(done, done + n, dtype=np.int64))
        if len(probes) < 64:
            probes.append((toks, done))
        done += n
    build = pc() - t0
    ok = all(t.match(q, touch=False).block_ids[0] == first for q, first in probes)
    full = all(t.match(q, touch=False).num_pages == len(q) // page for q, _ in probes)
    nbytes = t.nbytes
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # what plain doubling from 4096 slots would have allocated for the same pages (no size given up front)
    slots = 4096
    while slots < pages:
        slots *= 2
    from kvtier.index._state import new_state, state_nbytes
    doubling = state_nbytes(new_state(page, slots))  # np.zeros/np.full of untouched pages: nbytes, not RSS
    return {"pages": t.total_pages, "page_size": page, "nbytes": nbytes, "gib": nbytes / 2**30,
            "bytes_per_page": nbytes / pages, "tokens_bytes_per_page": 4 * page, "build_s": build,
            "insert_us_per_page": build / pages * 1e6, "maxrss_delta_gib": (rss1 - rss0) / 2**20,
            "sample_matches_ok": bool(ok and full), "doubling_without_capacity_gib": doubling / 2**30}


# ---- main -----------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "index_cpu.json"))
    ap.add_argument("--mem-pages", type=int, default=10_000_000)
    ap.add_argument("--no-sglang", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--workloads", default="multi_turn,long_context,random",
                    help="comma-separated subset of multi_turn,long_context,random")
    ap.add_argument("--tokens-per-block", type=int, default=None,
                    help="kvtier's host block (default: the config's default for each page size)")
    args = ap.parse_args()
    KvtierLib.tokens_per_block = args.tokens_per_block
    warnings.filterwarnings("ignore")

    libs = [KvtierLib]
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    import numba
    versions["numba"] = numba.__version__
    notes = {}
    if not args.no_sglang:
        import sglang
        versions["sglang"] = sglang.__version__
        libs.append(SglangLib)
        try:
            SglangUnifiedLib(16)
            libs.append(SglangUnifiedLib)
        except Exception as e:  # recorded, not fatal
            notes["sglang_unified"] = f"not built: {type(e).__name__}: {e}"

    print("compile times ...", flush=True)
    comp = compile_times()
    scale = 0.25 if args.quick else 1.0
    workloads = {
        "multi_turn": (multi_turn(n_seq=int(2000 * scale)), [16, 1], 1 if args.quick else 3),
        "long_context": (long_context(), [16, 1], 1 if args.quick else 5),
        "random": (random_seqs(n_seq=int(1000 * scale)), [16, 1], 1 if args.quick else 3),
    }
    workloads = {k: v for k, v in workloads.items() if k in args.workloads.split(",")}
    results = {}
    for wname, (seqs, pages, reps) in workloads.items():
        arrs = [array("q", s) for s in seqs]
        ntok = sum(len(s) for s in seqs)
        for page in pages:
            key = f"{wname}/page{page}"
            results[key] = {"seqs": len(seqs), "tokens": ntok}
            hits = {}
            for cls in libs:
                print(f"{key}: {cls.name} ...", flush=True)
                res, hits[cls.name] = run_library(cls, page, seqs, arrs, reps, evict_chunk_pages=max(4096 // page, 1))
                results[key][cls.name] = res
                print(f"   insert {res['insert_us_median']:.1f} us, match {res['match_us_median']:.1f} us "
                      f"(cold loop {res['match_us_cold_loop']:.1f}), evict {res['evict_us_per_page']:.3f} us/page",
                      flush=True)
            base = hits["kvtier"]
            block = KvtierLib.block_for(page)
            results[key]["kvtier_tokens_per_block"] = block
            results[key]["matched_tokens"] = {n: sum(h) for n, h in hits.items()}
            # what kvtier matches short of each peer, per sequence: under one host block when hits are exact
            results[key]["max_shortfall_tokens"] = {n: max(a - b for a, b in zip(h, base))
                                                    for n, h in hits.items() if n != "kvtier"}
            results[key]["within_one_block"] = all(0 <= a - b < block for n, h in hits.items() if n != "kvtier"
                                                   for a, b in zip(h, base))
            k = results[key]["kvtier"]
            for n in hits:
                if n != "kvtier":
                    results[key][f"speedup_vs_{n}"] = {op: results[key][n][m] / k[m] for op, m in SPEEDUPS.items()}
        del arrs
        gc.collect()

    print("memory at %d pages ..." % args.mem_pages, flush=True)
    mem = memory_10m(args.mem_pages)
    mt = results.get("multi_turn/page16", {"kvtier": {}})
    sp = mt.get("speedup_vs_sglang_radix", {})
    summary = {**worst_cells(results), "match_speedup_vs_sglang": sp.get("match"),
               "insert_speedup_vs_sglang": sp.get("insert"),
               "match_speedup_vs_sglang_cold_loop": sp.get("match_cold_loop"),
               "evict_speedup_vs_sglang": sp.get("evict_per_page"), "bytes_per_page": mem["bytes_per_page"],
               "mem_10M_pages_gib": mem["gib"] if args.mem_pages == 10_000_000 else None,
               "workload": "multi_turn/page16", "kvtier_match_us": mt["kvtier"].get("match_us_median"),
               "kvtier_insert_us": mt["kvtier"].get("insert_us_median"),
               "sglang_match_us": mt.get("sglang_radix", {}).get("match_us_median"),
               "sglang_insert_us": mt.get("sglang_radix", {}).get("insert_us_median")}
    out = {"summary": summary, "compile": comp, "memory": mem, "results": results, "versions": versions,
           "notes": notes, "machine": machine(), "command": command()}
    write_json(args.out, out)
    print(json.dumps(summary, indent=1))
    print(table(results))
    if not args.no_plot:
        try:
            plot(results, os.path.join(os.path.dirname(args.out), "index_cpu.png"))
        except Exception as e:  # matplotlib missing: the JSON is the result
            print("plot skipped:", e)


def worst_cells(results):
    """Over every cell (workload x page size) and operation (match, insert): the best peer's time over kvtier's,
    its minimum and maximum and where they are; evictions apart (reported, not part of the minimum)."""
    ratios, evict = {}, {}
    for key, r in results.items():
        peers = [lib for lib in ("sglang_radix", "sglang_unified_rust") if lib in r]
        if not peers:
            continue
        for op in ("match", "insert"):
            best = min(r[lib][f"{op}_us_median"] for lib in peers)
            ratios[f"{key}/{op}"] = best / r["kvtier"][f"{op}_us_median"]
        evict[key] = min(r[lib]["evict_us_per_token"] for lib in peers) / r["kvtier"]["evict_us_per_token"]
    if not ratios:
        return {}
    worst, best = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    return {"index_min_speedup_vs_best_peer": ratios[worst], "index_min_speedup_cell": worst,
            "index_max_speedup_vs_best_peer": ratios[best], "index_max_speedup_cell": best,
            "speedup_vs_best_peer": ratios, "evict_speedup_vs_best_peer": evict,
            "hits_within_one_block": all(r.get("within_one_block", True) for r in results.values())}


def table(results):
    rows = ["| workload | library | insert µs/seq | match µs/seq | match µs (cold loop) | evict µs/page "
            "| match speedup |",
            "|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        for lib in ("kvtier", "sglang_radix", "sglang_unified_rust"):
            if lib not in r:
                continue
            x = r[lib]
            sp = "" if lib == "kvtier" else f"{r[f'speedup_vs_{lib}']['match']:.1f}x"
            rows.append(f"| {key} | {lib} | {x['insert_us_median']:.1f} | {x['match_us_median']:.1f} | "
                        f"{x['match_us_cold_loop']:.1f} | {x['evict_us_per_page']:.3f} | {sp} |")
    return "\n".join(rows)


def plot(results, path):
    plt = pyplot()
    keys = list(results)
    libs = [lib for lib in ("kvtier", "sglang_radix", "sglang_unified_rust") if lib in results[keys[0]]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    w = 0.8 / len(libs)
    for ax, metric, title in ((axes[0], "match_us_median", "match µs per sequence"),
                              (axes[1], "insert_us_median", "insert µs per sequence")):
        for i, lib in enumerate(libs):
            ax.bar(np.arange(len(keys)) + i * w, [results[k][lib][metric] for k in keys], w, label=lib)
        ax.set_xticks(np.arange(len(keys)) + w * (len(libs) - 1) / 2, keys, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title + " (median, log scale)")
        ax.legend(fontsize=8)
    save_png(fig, path)


if __name__ == "__main__":
    main()
