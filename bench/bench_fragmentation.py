"""Fragmented host pools (issue 17): every transfer path when a prefix's host blocks come back as short runs.

Part 1, transfers (H200): Qwen3-8B KV (36 layers, 8 KV heads x 128, bf16, page 16), prefixes of 1k and 8k tokens,
host blocks in shuffled runs of R consecutive ids (R in 1, 2, 4, 8, 16, 64 and one run), both host layouts. Paths:
``direct`` (load_pages/store_pages, all layers in one launch), ``direct_copy`` (a DirectCopy launched per layer, 36
launches), ``staged`` (StagedTransfer, all layers), ``staged_copy`` (a StagedCopy launched per layer), for loads and
stores, and ``auto``: what ``KVTier`` in ``auto`` mode picks for a whole load, a layerwise load and a store. For each:
GPU time (CUDA events, medians) and host issue time (the GPU kept busy), and every load is checked byte for byte
once. Summary: ``frag_worst_over_one_run`` (what auto picks: the worst R's GPU time over the same path's one-run
time, over both layouts and sizes, per kind) and ``frag_layerwise_issue_ms_max`` (auto's layerwise load, 8k tokens,
host issue ms at the worst R).

Part 2, churn: a KVTier with a small pool serves a multi-turn workload (stores of every turn, loads of each
conversation's history) under LRU eviction; after a warm-up that fills the pool, the run lengths of the host block ids
each load and store sees (median, p10, and the distribution).

Run: ``bash tests/gpu_sglang.sh exec python3 bench/bench_fragmentation.py --out $OUT/fragmentation_h200.json``
(the GPU; ``--smoke``: toy sizes on the CPU through the Triton interpreter, seconds).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import env_info, host_us_per_call, make_pool, random_slots, time_gpu_ms, write_json  # noqa: E402
from kvtier.config import TierConfig  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import DirectCopy, StagedTransfer, copy_pages_ref, load_pages, store_pages  # noqa: E402
from kvtier.kernels.staged import _runs  # noqa: E402
from kvtier.kernels.staged_copy import StagedCopy  # noqa: E402
from kvtier.tier import HostBlockPool, KVTier  # noqa: E402

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


def _auto_modes(kv, pool, sizes) -> dict:
    """Per size (tokens), the paths ``KVTier`` in ``auto`` mode picks for a whole load, a layerwise load and a store."""
    tier = KVTier(kv, TierConfig(page_size=kv.geometry.page_size, host_layout=pool.layout, transfer_mode="auto",
                                 cpu_cache_gb=1.0), pool=pool)
    geo = tier.geometry
    out = {}
    for tokens in sizes:
        nbytes = tokens * geo.token_bytes
        out[str(tokens)] = {"load_whole": tier._mode(False, nbytes),
                            "load_layerwise": tier._mode(False, nbytes // geo.num_layers, per_layer=True) + "_copy",
                            "store": tier._mode(True, nbytes)}
    return out


def run_transfers(args, res: dict) -> None:
    geo = KVGeometry(num_layers=args.layers, num_kv_heads=args.heads, head_dim=args.head_dim, dtype=torch.bfloat16,
                     page_size=16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    max_pages = max(args.tokens) // geo.page_size
    num_blocks = 2 * max_pages + 64
    kv = make_pool(geo, 2 * max(args.tokens) + 64 * geo.page_size, device)
    gen = torch.Generator(device=device).manual_seed(0)
    rng = np.random.default_rng(0)
    rows = []
    for layout in ("layer_first", "page_first"):
        pool = HostBlockPool(geo, num_blocks, layout=layout)
        host = pool.host
        host.view(torch.uint8).random_(0, 256)
        stager = StagedTransfer(kv, host, layout=layout)
        res.setdefault("auto", {})[layout] = _auto_modes(kv, pool, args.tokens)
        for tokens in args.tokens:
            n = tokens // geo.page_size
            for run in RUNS:
                ids = torch.from_numpy(fragmented_ids(n, run, num_blocks, rng))
                slots = random_slots(n, geo.page_size, kv.num_slots, device, gen)
                runs = len(_runs(ids.numpy()))
                for to_host in (False, True):
                    fns = _fns(kv, host, stager, layout, slots, ids, to_host)
                    for path, fn in fns.items():
                        if not to_host:
                            _check_load(kv, host, layout, slots, ids, fn)
                        row = dict(layout=layout, tokens=tokens, run=run, runs=runs,
                                   op="store" if to_host else "load", path=path, nbytes=tokens * geo.token_bytes)
                        if device == "cuda":
                            row["gpu_ms"] = time_gpu_ms(fn, reps=args.reps)["median_ms"]
                            row["host_ms"] = host_us_per_call(fn, reps=args.host_reps) / 1e3
                        else:
                            t = time.perf_counter()
                            fn()
                            row["gpu_ms"] = row["host_ms"] = (time.perf_counter() - t) * 1e3
                        row["gbps"] = row["nbytes"] / (row["gpu_ms"] * 1e-3) / 1e9
                        rows.append(row)
                        print(f"{layout:11s} {tokens:5d} R={run or 'one':>3} runs={runs:4d} "
                              f"{row['op']:5s} {path:12s} gpu {row['gpu_ms']:8.3f} ms host {row['host_ms']:8.3f} ms "
                              f"{row['gbps']:6.1f} GB/s", flush=True)
        del stager
        pool.destroy()
    res["rows"] = rows


def _check_load(kv, host, layout, slots, ids, fn) -> None:
    """One issue of ``fn`` (a load) leaves exactly the reference's bytes in ``slots``."""
    for b in kv.buffers:
        b.view(torch.uint8)[slots] = 0
    ev = fn()
    if isinstance(ev, torch.cuda.Event):
        torch.cuda.current_stream().wait_event(ev)
    if kv.is_cuda:
        torch.cuda.synchronize()
    got = [b[slots].clone() for b in kv.buffers]
    for b in kv.buffers:
        b.view(torch.uint8)[slots] = 0
    copy_pages_ref(kv, host, slots, ids, to_host=False, layout=layout)
    for g, b in zip(got, kv.buffers):
        if not torch.equal(g.view(torch.uint8), b[slots].view(torch.uint8)):
            raise AssertionError(f"a fragmented load differs from the reference ({layout})")


def run_churn(args, res: dict) -> None:
    """Run lengths that a tier's loads and stores see once LRU churn has filled its pool."""
    from kvtier.e2e.workloads import multi_turn

    geo = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16, page_size=16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    convs = multi_turn(args.churn_convs, vocab=150000, seed=3, system_len=args.churn_system,
                       user_len=(100, 600), turns=(3, 8))
    longest = max(len(c.system) + sum(len(u) + 32 for u in c.user_turns) for c in convs)  # with the replies
    kv = make_pool(geo, 2 * longest + 64, device)
    pool = HostBlockPool(geo, args.churn_blocks, layout="layer_first")
    tier = KVTier(kv, TierConfig(page_size=16, cpu_cache_gb=1.0), pool=pool)
    slots = torch.arange(longest + 16, dtype=torch.int64, device=device)
    loads, stores, fill = [], [], None
    rng = np.random.default_rng(4)
    history = [list(c.system) for c in convs]
    turn = [0] * len(convs)
    step = 0
    while any(t < len(c.user_turns) for t, c in zip(turn, convs)) and step < args.churn_steps:
        live = [i for i, c in enumerate(convs) if turn[i] < len(c.user_turns)]
        i = int(rng.choice(live))
        toks = np.array(history[i] + convs[i].user_turns[turn[i]], dtype=np.int64)
        m = tier.index.match(toks[:toks.size // 16 * 16], None, touch=False)
        if fill is not None and m.num_pages:
            loads.append([length for _, length in _runs(np.asarray(m.block_ids))])
        task = tier.load(toks, None, slots[:toks.size])
        tier.wait(task)
        task = tier.store(toks, None, slots[:toks.size])
        rec = tier._inflight.get(task.id)
        if fill is not None and rec is not None and rec.block_ids.size:
            stores.append([length for _, length in _runs(rec.block_ids)])
        tier.wait(task)
        if fill is None and pool.num_free == 0:
            fill = step  # from here the pool is full: every store evicts
        history[i] = list(toks) + [int(x) for x in rng.integers(0, 150000, 32)]  # the reply
        turn[i] += 1
        step += 1

    def dist(per_copy):
        lengths = [x for runs in per_copy for x in runs]
        if not lengths:
            return {"copies": 0}
        return {"copies": len(per_copy), "runs": len(lengths), "median_R": float(np.median(lengths)),
                "p10_R": float(np.percentile(lengths, 10)), "p90_R": float(np.percentile(lengths, 90)),
                "runs_per_copy_median": float(np.median([len(r) for r in per_copy])),
                "hist": {str(k): int(v) for k, v in zip(*np.unique(lengths, return_counts=True))}}
    res["churn"] = {"conversations": len(convs), "pool_blocks": args.churn_blocks, "steps": step,
                    "pool_full_at_step": fill, "loads": dist(loads), "stores": dist(stores)}
    tier.destroy()


def summarize(res: dict) -> dict:
    rows = res.get("rows", [])

    def gpu(layout, tokens, run, op, path):
        return next(r["gpu_ms"] for r in rows if (r["layout"], r["tokens"], r["run"], r["op"], r["path"])
                    == (layout, tokens, run, op, path))
    worst, issue = {}, None
    for layout, by_tokens in res.get("auto", {}).items():
        for tokens_s, auto in by_tokens.items():
            tokens = int(tokens_s)
            for kind, path in auto.items():
                op = "store" if kind == "store" else "load"
                one = gpu(layout, tokens, 0, op, path)
                ratio = max(gpu(layout, tokens, r, op, path) for r in RUNS) / one
                if ratio > worst.get(kind, (0, ""))[0]:
                    worst[kind] = (ratio, f"{layout}/{tokens}/{path}")
                if kind == "load_layerwise" and tokens == max(int(t) for t in by_tokens):
                    h = max(r["host_ms"] for r in rows if (r["layout"], r["tokens"], r["op"], r["path"])
                            == (layout, tokens, "load", path))
                    issue = h if issue is None else max(issue, h)
    s = {f"frag_worst_over_one_run_{k}": v[0] for k, v in worst.items()}
    s.update({f"frag_worst_cell_{k}": v[1] for k, v in worst.items()})
    if worst:
        s["frag_worst_over_one_run"] = max(v[0] for v in worst.values())
    s["frag_layerwise_issue_ms_max"] = issue
    churn = res.get("churn")
    if churn:
        s["churn_load_median_R"] = churn["loads"].get("median_R")
        s["churn_load_p10_R"] = churn["loads"].get("p10_R")
        s["churn_store_median_R"] = churn["stores"].get("median_R")
        s["churn_store_p10_R"] = churn["stores"].get("p10_R")
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fragmentation_h200.json"))
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (Triton interpreter)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.heads, args.head_dim, args.tokens, args.reps, args.host_reps = 2, 1, 64, (64, 256), 1, 1
        args.churn_convs, args.churn_system, args.churn_blocks, args.churn_steps = 6, 256, 48, 40
    else:
        args.layers, args.heads, args.head_dim, args.tokens, args.reps, args.host_reps = 36, 8, 128, (1024, 8192), 10, 10
        args.churn_convs, args.churn_system, args.churn_blocks, args.churn_steps = 64, 2048, 4096, 400
    t0 = time.time()
    res: dict = {"env": env_info(), "runs": list(RUNS), "paths": list(PATHS)}
    run_transfers(args, res)
    write_json(args.out + ".partial", res)  # the transfers, should the churn part not finish
    run_churn(args, res)
    res["summary"] = summarize(res)
    res["seconds"] = time.time() - t0
    write_json(args.out, res)
    for k, v in res["summary"].items():
        print(f"{k}: {v}")
    print(f"wrote {args.out} in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
