"""TTFT of SSD-resident prefixes against recompute, with admission by cost on and off (issue 18, part 9).

A random-weight Qwen3 (8B shapes on a GPU) serves through :class:`kvtier.e2e.engine.TierEngine` with an SSD tier in
each directory given (a disk, and a RAM-backed one for the software's own ceiling). For every prefix length, the
prefix is served once (it reaches the CPU tier and, written through, the SSD); then every repetition serves the
prefix with a fresh suffix twice: ``recompute`` (nothing cached; the engine reports the prefill rate the admission
uses) and ``ssd`` (the CPU tier emptied first, so the prefix is on the SSD only: the request waits for its
promotion when admission lets it in, then loads it layer by layer, or, with ``--graphs``, whole). The SSD writes
of each request finish before the next one starts.

``--graphs`` (the default on a GPU): the engine replays CUDA graphs of its forward, captured before the timed
requests for every shape they take (``TierEngine.capture_graphs``), and loads hits whole. Without graphs the
harness's forward costs tens of milliseconds of host time for any number of new tokens (bench/results/README.md,
"SSD tier"), which no engine with fused kernels and graphs pays, and which hides what a hit saves.

The figure of a cell is median(ssd TTFT) / median(recompute TTFT); a cell where admission refused the hit
recomputes (ratio ~1).

Summary: ``ttft_ssd_over_recompute_admission`` (disk, the worst prefix), ``ttft_ssd_over_recompute_admission_ram``,
and the same with admission off (``..._no_admission``, ``..._no_admission_ram``), with the read GB/s measured.

Run on the GPU machine: ``python bench/bench_ssd_ttft.py --dir /var/tmp/kvtier-ttft --ram-dir /dev/shm/kvtier-ttft
--out $OUT/ssd_ttft_h200.json``; ``--smoke`` runs toy sizes on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import env_info, write_json  # noqa: E402
from kvtier.config import TierConfig  # noqa: E402
from kvtier.e2e.engine import TierEngine  # noqa: E402
from kvtier.e2e.model import PagedDecoder, qwen3_config  # noqa: E402


def model_for(args):
    if args.smoke:
        cfg = qwen3_config(num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)
    else:
        cfg = qwen3_config(num_layers=args.layers)
    return cfg, PagedDecoder.from_config(cfg, seed=0, device=args.device)


def kv_bytes_per_token(model: PagedDecoder) -> int:
    shape = model.kv_shape
    return shape.num_layers * (1 if shape.is_mla else 2) * shape.kv_heads * shape.head_dim * model.dtype.itemsize


PAGE = 16


def make_engine(model, args, identity: dict, **config) -> TierEngine:
    """A TierEngine over ``model`` for prompts up to the longest prefix, on graphs with ``args.graphs``."""
    longest = max(args.prefix) + args.suffix + args.new_tokens
    cfg = TierConfig(page_size=PAGE, layerwise=not args.graphs, **config)
    return TierEngine(model, cfg, num_slots=2 * (longest + 64), model_identity=identity, cuda_graphs=args.graphs)


def capture(engine: TierEngine, prompt_len: int, args) -> None:
    """With graphs: capture the shapes a ``prompt_len``-token prompt takes, recomputed or past its hit."""
    if args.graphs:
        engine.capture_graphs(prompt_len, args.new_tokens)


def run_dir(model, cfg, directory: str, admission: str, args) -> list[dict]:
    """Every prefix length's cell for one directory and admission mode."""
    shutil.rmtree(directory, ignore_errors=True)
    longest = max(args.prefix) + args.suffix + args.new_tokens
    kv_gb = longest * kv_bytes_per_token(model) / 2**30
    engine = make_engine(model, args, {"bench": "ssd_ttft"}, cpu_cache_gb=max(1 / 64, 2.5 * kv_gb),
                         ssd_cache_gb=max(1 / 16, 3 * kv_gb), ssd_cache_dir=directory, ssd_admission=admission,
                         ssd_io_threads=args.ssd_io_threads)
    gen = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    tier = engine.tier

    def serve(tokens, source):
        engine.drop_device_cache()
        r = engine.serve(tokens, args.new_tokens, source=source)
        tier.flush_lower()
        return r

    # kernels compiled, every path warm; admission keeps the median of the 64-token prefills: three warm ones
    # outvote the process's cold first one
    capture(engine, 64, args)
    for source in ("none", "none", "kvtier", "kvtier"):
        serve(rand(64), source)
    rows = []
    for plen in args.prefix:
        prefix = rand(plen)
        capture(engine, plen + args.suffix, args)
        serve(prefix + rand(args.suffix), "none")
        rec, ssd, cached = [], [], []
        for _ in range(args.reps):
            prompt = prefix + rand(args.suffix)
            rec.append(serve(prompt, "none").ttft_s)
            tier.reset()  # the CPU tier is empty; the SSD keeps the prefix
            r = serve(prompt, "kvtier")
            ssd.append(r.ttft_s)
            cached.append(r.cached)
        s = tier.stats()
        rows.append({"dir": directory, "admission": admission, "prefix": plen, "suffix": args.suffix,
                     "recompute_ttft_ms": [x * 1e3 for x in rec], "ssd_ttft_ms": [x * 1e3 for x in ssd],
                     "cached_tokens": cached, "ratio": statistics.median(ssd) / statistics.median(rec),
                     "ssd_read_gbps": s["ssd_read_gbps"], "ssd_direct_io": s["ssd_direct_io"],
                     "prefill_1k_tokens_s": s["ssd_prefill_1k_tokens_s"], "ssd_refused": s["ssd_refused"],
                     "kv_bytes": plen * kv_bytes_per_token(model), "graphs": args.graphs,
                     "graph_replays": engine.graphs.replays if engine.graphs else None,  # the run's so far
                     "eager_forwards": engine.graphs.eager if engine.graphs else None})
        print(f"{directory} {admission} prefix {plen}: recompute {statistics.median(rec) * 1e3:.1f} ms, ssd "
              f"{statistics.median(ssd) * 1e3:.1f} ms ({rows[-1]['ratio']:.3f}), cached {cached}, read "
              f"{s['ssd_read_gbps']} GB/s, refused {s['ssd_refused']}", flush=True)
    tier.destroy()
    shutil.rmtree(directory, ignore_errors=True)
    return rows


def run_idle_server(model, cfg, directory: str, admission: str, policy: str, args) -> list[dict]:
    """Issue 50's measure: one request at a time reaches an idle server (SGLang 0.5.23's scheduler objects,
    :mod:`kvtier.sglang.batch_server`, with ``--enable-lmcache``'s prefetch gate) with its prefix on the SSD only;
    against a request of the same length that nothing holds (recompute). Whole loads, no graphs."""
    from kvtier.sglang.batch_server import Arrival, BatchServer, Engine, EngineConfig

    shutil.rmtree(directory, ignore_errors=True)
    longest = max(args.prefix) + args.suffix + args.new_tokens
    kv_gb = longest * kv_bytes_per_token(model) / 2**30
    tier = dict(ssd_admission=admission, prefetch_policy=policy, ssd_io_threads=args.ssd_io_threads,
                prefetch_idle_poll_s=args.idle_poll_s)
    engine = Engine(model, EngineConfig(
        mode="kvtier_ssd", kv_tokens=-(-3 * longest // PAGE) * PAGE, page_size=PAGE, max_running_requests=2,
        max_context=longest + PAGE, host_gb=max(1 / 64, 2.5 * kv_gb), ssd_dir=directory, ssd_gb=max(1 / 16, 3 * kv_gb),
        tier_overrides=tier))
    server = BatchServer(engine)
    gen = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731

    def serve(tokens, ssd_only: bool):
        engine.flush_device()
        if ssd_only:
            engine.tier.reset()  # the CPU tier is empty; the SSD keeps what was written through
        (rec,) = server.run([Arrival(tokens, args.new_tokens)], timeout_s=120)
        engine.wait_host_copies()
        engine.tier.flush_lower()
        return rec

    for n in (64, 64, 64, min(args.prefix)):  # warm: kernels, and the prefills admission weighs reads against
        serve(rand(n), False)
    rows = []
    for plen in args.prefix:
        prefix = rand(plen)
        serve(prefix + rand(args.suffix), False)  # the prefix reaches the CPU tier and, written through, the SSD
        rec, ssd, cached = [], [], []
        for _ in range(args.reps):
            rec.append(serve(rand(plen + args.suffix), False).ttft_s)
            r = serve(prefix + rand(args.suffix), True)
            ssd.append(r.ttft_s)
            cached.append(r.host_hit)
        s = engine.tier.stats()
        waits = engine.cache.prefetch.counts
        rows.append({"dir": directory, "admission": admission, "policy": policy, "idle_poll_s": args.idle_poll_s,
                     "prefix": plen,
                     "recompute_ttft_ms": [x * 1e3 for x in rec], "ssd_ttft_ms": [x * 1e3 for x in ssd],
                     "cached_tokens": cached, "ratio": statistics.median(ssd) / statistics.median(rec),
                     "ssd_read_gbps": s["ssd_read_gbps"], "ssd_refused": s["ssd_refused"],
                     "prefill_1k_tokens_s": s["ssd_prefill_1k_tokens_s"], "waits": dataclasses.asdict(waits)})
        print(f"idle {directory} {admission} {policy} prefix {plen}: recompute {statistics.median(rec) * 1e3:.1f} ms, "
              f"ssd {statistics.median(ssd) * 1e3:.1f} ms ({rows[-1]['ratio']:.3f}), cached {cached}", flush=True)
    engine.close()
    shutil.rmtree(directory, ignore_errors=True)
    return rows


def idle_summary(rows: list[dict], dirs: list) -> dict:
    """``idle_ssd_<disk|ram>_ttft_over_recompute_<k>k`` per prefix (the waiting policy's cells; disk: admission on)
    and the same for ``best_effort`` (what an idle server did before the prefetch gate)."""
    out = {}
    for name, d in dirs:
        for r in rows:
            if r["dir"] != d or (name == "disk" and r["admission"] != "cost"):
                continue
            tail = "" if r["policy"] != "best_effort" else "_best_effort"
            out[f"idle_ssd_{name}_ttft_over_recompute_{r['prefix'] // 1024}k{tail}"] = r["ratio"]
    return out


def parse_ttft_args(ap: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The TTFT benches' common arguments (prefix lengths, suffix, model, repetitions, --smoke, --out) added to
    ``ap``, parsed; ``--smoke`` shrinks the sizes."""
    ap.add_argument("--prefix", type=int, nargs="+", default=[2048, 8192, 28672])
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=2)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="toy model and sizes (a CPU, seconds)")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="replay CUDA graphs of the forward (default: on a CUDA device)")
    ap.add_argument("--ssd-io-threads", type=int, default=TierConfig.ssd_io_threads, help="the SSD tier's (SSD bench)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.graphs is None:
        args.graphs = torch.device(args.device).type == "cuda"
    if args.smoke:
        args.prefix, args.reps = [64, 128], 1
    return args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="an SSD cache directory on the disk to measure")
    ap.add_argument("--ram-dir", default="", help="an SSD cache directory on a RAM-backed file system")
    ap.add_argument("--idle-server", action="store_true",
                    help="an idle server through SGLang's scheduler objects (needs sglang) instead of the tier engine")
    ap.add_argument("--policy", default="timeout", help="--idle-server: the waiting policy measured")
    ap.add_argument("--idle-poll-s", type=float, default=TierConfig.prefetch_idle_poll_s,
                    help="--idle-server: prefetch_idle_poll_s (0: the scheduler spins while a request waits)")
    args = parse_ttft_args(ap, argv)
    cfg, model = model_for(args)
    dirs = [("disk", args.dir)] + ([("ram", args.ram_dir)] if args.ram_dir else [])
    if args.idle_server:
        if args.smoke:
            args.prefix = [320]  # past the 256-token prefetch threshold
        rows = [r for name, d in dirs for adm in (("cost",) if name == "disk" else ("always",))
                for pol in (args.policy, "best_effort") for r in run_idle_server(model, cfg, d, adm, pol, args)]
        summary = idle_summary(rows, dirs)
        write_json(args.out, {"env": env_info(), "args": vars(args), "model_layers": cfg.num_hidden_layers,
                              "summary": summary, "idle": rows})
        print(summary)
        return 0
    rows = [r for _, d in dirs for adm in ("cost", "always") for r in run_dir(model, cfg, d, adm, args)]
    summary = {}
    for name, d in dirs:
        tail = "" if name == "disk" else "_ram"
        for adm, key in (("cost", "admission"), ("always", "no_admission")):
            cells = [r for r in rows if r["dir"] == d and r["admission"] == adm]
            summary[f"ttft_ssd_over_recompute_{key}{tail}"] = max(r["ratio"] for r in cells)
            summary[f"ssd_read_gbps_{key}{tail}"] = min((r["ssd_read_gbps"] for r in cells
                                                         if r["ssd_read_gbps"]), default=None)
    write_json(args.out, {"env": env_info(), "args": vars(args), "model_layers": cfg.num_hidden_layers,
                          "summary": summary, "rows": rows})
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
