"""Fragmented host pools (issue 17): every transfer path when a prefix's host blocks come back as short runs.

Part 1, transfers: Qwen3-8B KV, prefixes of 1k and 8k tokens, host blocks in shuffled runs of R consecutive ids (R
in 1, 2, 4, 8, 16, 64 and one run), both host layouts; every path (``direct``, ``direct_copy`` per layer,
``staged``, ``staged_copy`` per layer) loads and stores, each load checked byte for byte, with its GPU time (in
rounds over the grid) and host issue time, and what the transfer policy's ``auto`` picks for a whole load, a
layerwise load and a store; then (CUDA) a GEMM beside every path at R = 1 and one run. Part 2, churn: a small pool
under LRU eviction serves a multi-turn workload; the run lengths each load and store sees. Summary:
``frag_worst_over_one_run`` (auto's pick at the worst R over one run), ``frag_layerwise_issue_ms_max``,
``gemm_slowdown_pct`` and the churn's run lengths.

Run: ``bash tests/gpu_sglang.sh exec python3 bench/bench_fragmentation.py --out $OUT/fragmentation_h200.json``
(the GPU; ``--smoke``: toy sizes on the CPU through the Triton interpreter, seconds).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (ROOT, env_info, gemm_beside, host_us_per_call, make_pool, random_slots,  # noqa: E402
                          png_beside, pyplot, read_json, save_png, time_in_rounds, write_json)
from kvtier.config import TierConfig  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import DirectCopy, StagedTransfer, copy_pages_ref, load_pages, store_pages  # noqa: E402
from kvtier.kernels.staged import block_runs  # noqa: E402
from kvtier.kernels.staged_copy import StagedCopy  # noqa: E402
from kvtier.tier import HostBlockPool, KVTier  # noqa: E402
from kvtier.tier.transfer_policy import CopyPlan, TransferPolicy  # noqa: E402

RUNS = (1, 2, 4, 8, 16, 64, 0)  # 0: one run
PATHS = ("direct", "direct_copy", "staged", "staged_copy")


def fragmented_ids(n: int, run: int, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` distinct block ids of ``[0, num_blocks)`` in shuffled runs of ``run`` consecutive ids (0: one run)."""
    if run == 0 or run >= n:
        start = int(rng.integers(0, num_blocks - n + 1))
        return np.arange(start, start + n, dtype=np.int64)
    slots = num_blocks // run  # runs of `run` ids, one free id-run between taken ones on average
    picked = rng.permutation(slots)[:-(-n // run)]
    ids = (picked[:, None] * run + np.arange(run)[None]).reshape(-1)[:n]
    return ids.astype(np.int64)


def _fns(kv, host, stager, layout, slots, ids_cpu, to_host: bool):
    """Issue functions of every path for one transfer (each returns what time_gpu_ms may wait on)."""
    ids_dev = ids_cpu.to(kv.device)
    n_layers = kv.geometry.num_layers
    fn = store_pages if to_host else load_pages
    direct_copy = DirectCopy(kv, host, slots, ids_dev, to_host=to_host, layout=layout, check=False)
    staged_copy = StagedCopy(stager, slots, ids_cpu, to_host=to_host, check=False)

    def per_layer(copy):
        def run():
            for layer in range(n_layers):
                copy.launch(layer)
        return run
    run_staged = stager.store if to_host else stager.load
    return {
        "direct": lambda: fn(kv, host, slots, ids_dev, layout=layout, check=False),
        "direct_copy": per_layer(direct_copy),
        "staged": lambda: run_staged(slots, ids_cpu, check=False),
        "staged_copy": per_layer(staged_copy),
    }


# the bench's path (row) measuring each policy path of a whole copy: direct_layers is a DirectCopy per layer
_WHOLE_ROW = {"direct": "direct", "direct_layers": "direct_copy", "staged": "staged"}


def auto_paths(layout: str, geo: KVGeometry, ids: np.ndarray) -> dict:
    """The bench paths that measure what ``auto`` picks for a whole load, a layerwise load and a store of blocks
    ``ids``."""
    pick = TransferPolicy("auto", layout, geo).path
    L = geo.num_layers
    return {"load_whole": _WHOLE_ROW[pick(CopyPlan(False, ids, L)).value],
            "load_layerwise": pick(CopyPlan(False, ids, 1)).value + "_copy",
            "store": _WHOLE_ROW[pick(CopyPlan(True, ids, L)).value]}


def _transfer_geometry(args) -> KVGeometry:
    return KVGeometry(num_layers=args.layers, num_kv_heads=args.heads, head_dim=args.head_dim, dtype=torch.bfloat16,
                      page_size=16)


def _cases(args):
    """(layout, tokens, run, block ids) of every transfer case, in the bench's order (one seeded generator)."""
    geo = _transfer_geometry(args)
    num_blocks = 2 * max(args.tokens) // geo.page_size + 64
    rng = np.random.default_rng(0)
    for layout in ("layer_first", "page_first"):
        for tokens in args.tokens:
            for run in RUNS:
                yield layout, tokens, run, fragmented_ids(tokens // geo.page_size, run, num_blocks, rng)


def resummarize(args, path: str) -> dict:
    """Recompute ``auto``'s picks and the summary of a committed run from its rows, by the policy of this checkout
    (the rows measure every path; which one auto takes is the policy's): tuning the policy needs no GPU run."""
    res = read_json(path)
    geo = _transfer_geometry(args)
    res["auto"] = {}
    for layout, tokens, run, ids in _cases(args):
        res["auto"].setdefault(layout, {}).setdefault(str(tokens), {})[str(run)] = auto_paths(layout, geo, ids)
    res["summary"] = summarize(res)
    res["summary_policy"] = "auto picks and summary recomputed from the rows by --resummarize"
    return res


def run_transfers(args, res: dict) -> None:
    """Every cell's load check and host issue time, then its GPU time in ``args.rounds`` rounds over the whole grid
    (a cell's ``gpu_ms`` is the median of its rounds' medians, ``gpu_ms_rounds`` each round's): a slow spell of the
    machine lands on different cells in different rounds rather than on all the reps of one cell."""
    geo = _transfer_geometry(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_blocks = 2 * max(args.tokens) // geo.page_size + 64
    kv = make_pool(geo, 2 * max(args.tokens) + 64 * geo.page_size, device)
    gen = torch.Generator(device=device).manual_seed(0)
    pools: dict[str, tuple[HostBlockPool, StagedTransfer]] = {}
    cells = []  # (row, issue function)
    for layout, tokens, run, ids_np in _cases(args):
        if layout not in pools:
            pool = HostBlockPool(geo, num_blocks, layout=layout)
            pool.host.view(torch.uint8).random_(0, 256)
            pools[layout] = (pool, StagedTransfer(kv, pool.host, layout=layout))
        pool, stager = pools[layout]
        host = pool.host
        n = tokens // geo.page_size
        ids = torch.from_numpy(ids_np)
        slots = random_slots(n, geo.page_size, kv.num_slots, device, gen)
        runs = len(block_runs(ids_np))
        picks = res.setdefault("auto", {}).setdefault(layout, {}).setdefault(str(tokens), {})[str(run)] = \
            auto_paths(layout, geo, ids_np)
        for to_host in (False, True):
            fns = _fns(kv, host, stager, layout, slots, ids, to_host)
            for path, fn in fns.items():
                if not to_host:
                    _check_load(kv, host, layout, slots, ids, fn)
                elif path == picks["store"] or device != "cuda":  # the store auto takes (every one on the CPU)
                    _check_store(kv, host, layout, slots, ids, fn)
                row = dict(layout=layout, tokens=tokens, run=run, runs=runs,
                           op="store" if to_host else "load", path=path, nbytes=tokens * geo.token_bytes)
                if device == "cuda":
                    row["host_ms"] = host_us_per_call(fn, reps=args.host_reps) / 1e3
                else:
                    t = time.perf_counter()
                    fn()
                    row["gpu_ms"] = row["host_ms"] = (time.perf_counter() - t) * 1e3
                cells.append((row, fn))
    if device == "cuda":
        time_in_rounds(cells, args.rounds, args.reps)
    for row, _ in cells:
        row["gbps"] = row["nbytes"] / (row["gpu_ms"] * 1e-3) / 1e9
        print(f"{row['layout']:11s} {row['tokens']:5d} R={row['run'] or 'one':>3} runs={row['runs']:4d} "
              f"{row['op']:5s} {row['path']:12s} gpu {row['gpu_ms']:8.3f} ms host {row['host_ms']:8.3f} ms "
              f"{row['gbps']:6.1f} GB/s", flush=True)
    res["rows"] = [row for row, _ in cells]
    if device == "cuda":
        torch.cuda.synchronize()
    for pool, _ in pools.values():
        pool.destroy()


def run_gemm(args, res: dict) -> None:
    """An 8192^3 bf16 GEMM alone and beside back-to-back transfers of every path, the largest size, R = 1 and one
    run, both layouts (CUDA only). Summary: ``gemm_slowdown_pct``, the worst over what auto picks."""
    geo = _transfer_geometry(args)
    tokens = max(args.tokens)
    n = tokens // geo.page_size
    num_blocks = 2 * n + 64
    kv = make_pool(geo, 2 * tokens + 64 * geo.page_size, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    rng = np.random.default_rng(1)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    rows = []
    for layout in ("layer_first", "page_first"):
        pool = HostBlockPool(geo, num_blocks, layout=layout)
        stager = StagedTransfer(kv, pool.host, layout=layout)
        for run in (1, 0):
            ids = torch.from_numpy(fragmented_ids(n, run, num_blocks, rng))
            slots = random_slots(n, geo.page_size, kv.num_slots, "cuda", gen)
            for to_host in (False, True):
                for path, fn in _fns(kv, pool.host, stager, layout, slots, ids, to_host).items():
                    g = gemm_beside(fn, tokens * geo.token_bytes, a, b, side, n_copy=args.gemm_copies)
                    rows.append(dict(layout=layout, tokens=tokens, run=run, op="store" if to_host else "load",
                                     path=path, **{k: v for k, v in g.items() if k != "rounds"}))
                    print(f"gemm {layout:11s} R={run or 'one':>3} {rows[-1]['op']:5s} {path:12s} "
                          f"{g['slowdown_pct']:+6.2f}% ({g['gemm_alone_ms']:.3f} -> {g['gemm_with_h2d_ms']:.3f} ms)",
                          flush=True)
        del stager
        pool.destroy()
    res["gemm"] = rows


def _issue_and_wait(kv, fn) -> None:
    """Issue ``fn`` and wait until what it queued has run."""
    ev = fn()
    if isinstance(ev, torch.cuda.Event):
        torch.cuda.current_stream().wait_event(ev)
    if kv.is_cuda:
        torch.cuda.synchronize()


def _check_load(kv, host, layout, slots, ids, fn) -> None:
    """One issue of ``fn`` (a load) leaves exactly the reference's bytes in ``slots``."""
    for b in kv.buffers:
        b.view(torch.uint8)[slots] = 0
    _issue_and_wait(kv, fn)
    got = [b[slots].clone() for b in kv.buffers]
    for b in kv.buffers:
        b.view(torch.uint8)[slots] = 0
    copy_pages_ref(kv, host, slots, ids, to_host=False, layout=layout)
    for g, b in zip(got, kv.buffers):
        if not torch.equal(g.view(torch.uint8), b[slots].view(torch.uint8)):
            raise AssertionError(f"a fragmented load differs from the reference ({layout})")


def _check_store(kv, host, layout, slots, ids, fn) -> None:
    """One issue of ``fn`` (a store) writes exactly the bytes of ``slots`` into the blocks ``ids``: the blocks are
    zeroed first (the reference store of zeroed slots) and read back by the reference load."""
    saved = [b.view(torch.uint8)[slots].clone() for b in kv.buffers]

    def fill(values) -> None:
        for b, v in zip(kv.buffers, values):
            b.view(torch.uint8)[slots] = v
    fill([torch.zeros_like(v) for v in saved])
    copy_pages_ref(kv, host, slots, ids, to_host=True, layout=layout)
    fill(saved)
    _issue_and_wait(kv, fn)
    copy_pages_ref(kv, host, slots, ids, to_host=False, layout=layout)
    exact = all(torch.equal(b.view(torch.uint8)[slots], v) for b, v in zip(kv.buffers, saved))
    fill(saved)
    if not exact:
        raise AssertionError(f"a fragmented store differs from the reference ({layout})")


def churn(convs: int, system_len: int, pool_blocks: int, steps: int, *, seed: int = 3) -> dict:
    """Serve a multi-turn workload through a tier whose pool is ``pool_blocks`` blocks (LRU eviction); once the pool
    is full (no free block, or a store evicted) record the run lengths of the host block ids each load and store
    sees, and the pages the index already held of each request (hits)."""
    from kvtier.e2e.workloads import multi_turn

    geo = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16, page_size=16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    conversations = multi_turn(convs, vocab=150000, seed=seed, system_len=system_len, user_len=(100, 600),
                               turns=(3, 8))
    longest = max(len(c.system) + sum(len(u) + 32 for u in c.user_turns) for c in conversations)  # with the replies
    kv = make_pool(geo, 2 * longest + 64, device)
    pool = HostBlockPool(geo, pool_blocks, layout="layer_first")
    tier = KVTier(kv, TierConfig(page_size=16, cpu_cache_gb=1.0, eviction_policy="lru"), pool=pool)
    slots = torch.arange(longest + 16, dtype=torch.int64, device=device)
    loads, stores, fill = [], [], None
    hits = {"all": [0, 0], "full": [0, 0]}  # [pages held, pages asked]
    rng = np.random.default_rng(seed + 1)
    history = [list(c.system) for c in conversations]
    turn = [0] * len(conversations)
    step = 0
    while any(t < len(c.user_turns) for t, c in zip(turn, conversations)) and step < steps:
        live = [i for i, c in enumerate(conversations) if turn[i] < len(c.user_turns)]
        i = int(rng.choice(live))
        toks = np.array(history[i] + conversations[i].user_turns[turn[i]], dtype=np.int64)
        m = tier.index.match(toks[:toks.size // 16 * 16], None, touch=False)
        for key in ("all", "full") if fill is not None else ("all",):
            hits[key][0] += m.num_pages
            hits[key][1] += toks.size // 16
        if fill is not None and m.num_pages:
            loads.append([length for _, length in block_runs(np.asarray(m.block_ids))])
        task = tier.load(toks, None, slots[:toks.size])
        tier.wait(task)
        task = tier.store(toks, None, slots[:toks.size])
        rec = tier.in_flight().get(task.id)
        if fill is not None and rec is not None and rec.block_ids.size:
            stores.append([length for _, length in block_runs(rec.block_ids)])
        tier.wait(task)
        if fill is None and (pool.num_free == 0 or tier.stats()["pages_evicted"] > 0):
            fill = step  # from here every store evicts
        history[i] = list(toks) + [int(x) for x in rng.integers(0, 150000, 32)]  # the reply
        turn[i] += 1
        step += 1
    tier.destroy()

    def dist(per_copy):
        lengths = [x for runs in per_copy for x in runs]
        if not lengths:
            return {"copies": 0}
        return {"copies": len(per_copy), "runs": len(lengths), "median_R": float(np.median(lengths)),
                "p10_R": float(np.percentile(lengths, 10)), "p90_R": float(np.percentile(lengths, 90)),
                "runs_per_copy_median": float(np.median([len(r) for r in per_copy])),
                "hist": {str(k): int(v) for k, v in zip(*np.unique(lengths, return_counts=True))}}
    return {"conversations": convs, "seed": seed, "pool_blocks": pool_blocks, "steps": step,
            "pool_full_at_step": fill, "loads": dist(loads), "stores": dist(stores),
            "hit_rate": hits["all"][0] / max(1, hits["all"][1]),
            "hit_rate_full": hits["full"][0] / max(1, hits["full"][1])}


def summarize(res: dict) -> dict:
    rows = res.get("rows", [])

    def gpu(layout, tokens, run, op, path):
        return next(r["gpu_ms"] for r in rows if (r["layout"], r["tokens"], r["run"], r["op"], r["path"])
                    == (layout, tokens, run, op, path))
    worst, issue = {}, None
    for layout, by_tokens in res.get("auto", {}).items():
        largest = max(int(t) for t in by_tokens)
        for tokens_s, by_run in by_tokens.items():
            tokens = int(tokens_s)
            for kind in by_run["0"]:
                op = "store" if kind == "store" else "load"
                picked = {int(r): gpu(layout, tokens, int(r), op, paths[kind]) for r, paths in by_run.items()}
                r_worst = max(picked, key=picked.get)
                ratio = picked[r_worst] / picked[0]
                if ratio > worst.get(kind, (0, ""))[0]:
                    worst[kind] = (ratio, f"{layout}/{tokens}/R={r_worst or 'one'}/{by_run[str(r_worst)][kind]}")
                if kind == "load_layerwise" and tokens == largest:
                    h = max(r["host_ms"] for r in rows
                            if (r["layout"], r["tokens"], r["op"]) == (layout, tokens, "load")
                            and r["path"] == by_run[str(r["run"])][kind])
                    issue = h if issue is None else max(issue, h)
    s = {f"frag_worst_over_one_run_{k}": v[0] for k, v in worst.items()}
    s.update({f"frag_worst_cell_{k}": v[1] for k, v in worst.items()})
    if worst:
        s["frag_worst_over_one_run"] = max(v[0] for v in worst.values())
    s["frag_layerwise_issue_ms_max"] = issue
    gemm = res.get("gemm")
    if gemm:
        picked = [g for g in gemm
                  for kind, path in res["auto"][g["layout"]][str(g["tokens"])][str(g["run"])].items()
                  if path == g["path"] and (kind == "store") == (g["op"] == "store")]
        worst = max(picked, key=lambda g: g["slowdown_pct"])
        s["gemm_slowdown_pct"] = worst["slowdown_pct"]
        s["gemm_slowdown_cell"] = f"{worst['layout']}/R={worst['run'] or 'one'}/{worst['op']}/{worst['path']}"
    churn = res.get("churn")
    if churn:
        s["churn_load_median_R"] = churn["loads"].get("median_R")
        s["churn_load_p10_R"] = churn["loads"].get("p10_R")
        s["churn_store_median_R"] = churn["stores"].get("median_R")
        s["churn_store_p10_R"] = churn["stores"].get("p10_R")
    return s


def plot(res: dict, path: str) -> None:
    """One panel per host layout: what ``auto`` picks for a whole load, a layerwise load and a store, its GPU time over
    the one-run time of the same kind, by run length R, 1k and 8k tokens; the path picked is written at each point."""
    plt = pyplot()
    gpu = {(r["layout"], r["tokens"], r["run"], r["op"], r["path"]): r["gpu_ms"] for r in res["rows"]}
    runs = [r for r in res["runs"] if r] + [0]
    layouts = list(res["auto"])
    fig, axes = plt.subplots(1, len(layouts), figsize=(6.5 * len(layouts), 4.4), sharey=True, squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        for i, (tokens, by_run) in enumerate(res["auto"][layout].items()):
            for j, kind in enumerate(("load_whole", "load_layerwise", "store")):
                op = "store" if kind == "store" else "load"
                picks = [by_run[str(r)][kind] for r in runs]
                base = gpu[(layout, int(tokens), 0, op, by_run["0"][kind])]
                ys = [gpu[(layout, int(tokens), r, op, p)] / base for r, p in zip(runs, picks)]
                ax.plot(range(len(runs)), ys, marker="os^"[j], ls="-" if i else "--", color=f"C{j}",
                        label=f"{kind}, {int(tokens) // 1024}k tokens")
                for x, (y, p) in enumerate(zip(ys, picks)):
                    ax.annotate(p, (x, y), fontsize=5, xytext=(2, 2), textcoords="offset points")
        ax.axhline(1.10, color="grey", lw=0.8, ls=":")
        ax.set_xticks(range(len(runs)), [str(r) if r else "one" for r in runs])
        ax.set_xlabel("host blocks in runs of R pages")
        ax.set_title(f"{layout}: auto's pick, GPU time over one run", fontsize=9)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("time / one-run time (target <= 1.10)")
    save_png(fig, path, dpi=130)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fragmentation_h200.json"))
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (Triton interpreter)")
    ap.add_argument("--resummarize", metavar="JSON",
                    help="recompute auto's picks and the summary of a run's JSON by this checkout's policy, into --out")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of a run's JSON (next to it)")
    args = ap.parse_args(argv)
    if args.plot:
        plot(read_json(args.plot), png_beside(args.plot))
        return 0
    if args.smoke:
        args.layers, args.heads, args.head_dim, args.tokens, args.reps, args.host_reps = 2, 1, 64, (64, 256), 1, 1
        args.rounds = 1
        args.churn_convs, args.churn_system, args.churn_blocks, args.churn_steps = 6, 256, 48, 40
    else:
        args.layers, args.heads, args.head_dim = 36, 8, 128
        args.tokens, args.reps, args.host_reps = (1024, 8192), 10, 10
        args.rounds = 3
        args.churn_convs, args.churn_system, args.churn_blocks, args.churn_steps = 64, 2048, 4096, 400
    args.gemm_copies = 4
    if args.resummarize:
        res = resummarize(args, args.resummarize)
        write_json(args.out, res)
        for k, v in res["summary"].items():
            print(f"{k}: {v}")
        return 0
    t0 = time.time()
    res: dict = {"env": env_info(), "runs": list(RUNS), "paths": list(PATHS)}
    run_transfers(args, res)
    if torch.cuda.is_available():
        run_gemm(args, res)
    write_json(args.out + ".partial", res)  # the transfers, should the churn part not finish
    res["churn"] = churn(args.churn_convs, args.churn_system, args.churn_blocks, args.churn_steps)
    res["summary"] = summarize(res)
    res["seconds"] = time.time() - t0
    write_json(args.out, res)
    plot(res, png_beside(args.out))
    for k, v in res["summary"].items():
        print(f"{k}: {v}")
    print(f"wrote {args.out} in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
