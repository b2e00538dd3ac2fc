"""TTFT of prefixes another instance put to the remote tier, against recompute (issue 19, part 7).

A real ``mooncake_master`` on loopback; instance A (a :class:`kvtier.e2e.engine.TierEngine` mounting the store's
memory) serves each prefix once, so its blocks reach the store; instance B (its own pools and Mooncake client,
mounting none) serves the prefix with a fresh suffix twice a repetition: ``recompute``, then ``remote`` with its
CPU tier emptied (the fetch waited for when admission lets it in). A cell's figure is median(remote TTFT) /
median(recompute TTFT). Summary: ``ttft_remote_over_recompute_admission`` (the worst prefix), ``..._no_admission``
and the fetch GB/s.

Run on the GPU machine: ``python bench/bench_remote_ttft.py --out $OUT/remote_ttft_h200.json``; ``--smoke`` runs
toy sizes on a CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_ssd_ttft import capture, kv_bytes_per_token, make_engine, model_for, parse_ttft_args  # noqa: E402
from bench.common import env_info, write_json  # noqa: E402
from tests.mooncake_master import Master  # noqa: E402


def run(model, cfg, master: str, admission: str, args) -> list[dict]:
    """Every prefix length's cell for one admission mode (a fresh pair of instances)."""
    longest = max(args.prefix) + args.suffix + args.new_tokens
    kv_gb = longest * kv_bytes_per_token(model) / 2**30
    remote = dict(remote_backend="mooncake", remote_master=master, remote_local_hostname="127.0.0.1",
                  remote_admission=admission, remote_timeout_s=30.0)
    cpu_gb = max(1 / 64, 2.5 * kv_gb)
    seg_gb = max(1 / 16, 2 * len(args.prefix) * kv_gb)
    ident = {"bench": "remote_ttft"}
    a = make_engine(model, args, ident, cpu_cache_gb=cpu_gb, remote_segment_gb=seg_gb, **remote)
    b = make_engine(model, args, ident, cpu_cache_gb=cpu_gb, remote_segment_gb=0, **remote)
    gen = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731

    def serve(engine, tokens, source):
        engine.drop_device_cache()
        r = engine.serve(tokens, args.new_tokens, source=source)
        engine.tier.lower_tier("remote").drain(wait=True)  # its puts end before the next request
        return r

    for engine in (a, b):
        capture(engine, 64, args)
        for source in ("none", "kvtier"):  # kernels compiled, every path warm
            serve(engine, rand(64), source)
    rows = []
    for plen in args.prefix:
        prefix = rand(plen)
        capture(a, plen + args.suffix, args)
        capture(b, plen + args.suffix, args)
        serve(a, prefix + rand(args.suffix), "none")  # A: the prefix reaches its CPU tier and the store
        rec, far, cached = [], [], []
        for _ in range(args.reps):
            prompt = prefix + rand(args.suffix)
            rec.append(serve(b, prompt, "none").ttft_s)
            b.tier.reset()  # B's CPU tier is empty: the prefix is in A's segment only
            r = serve(b, prompt, "kvtier")
            far.append(r.ttft_s)
            cached.append(r.cached)
        s = b.tier.stats()
        rows.append({"admission": admission, "prefix": plen, "suffix": args.suffix,
                     "recompute_ttft_ms": [x * 1e3 for x in rec], "remote_ttft_ms": [x * 1e3 for x in far],
                     "cached_tokens": cached, "ratio": statistics.median(far) / statistics.median(rec),
                     "remote_read_gbps": s["remote_read_gbps"], "remote_refused": s["remote_refused"],
                     "remote_blocks_corrupt": s["remote_blocks_corrupt"], "kv_bytes": plen * kv_bytes_per_token(model),
                     "graphs": args.graphs, "eager_forwards": b.graphs.eager if b.graphs else None})
        print(f"{admission} prefix {plen}: recompute {statistics.median(rec) * 1e3:.1f} ms, remote "
              f"{statistics.median(far) * 1e3:.1f} ms ({rows[-1]['ratio']:.3f}), cached {cached}, fetch "
              f"{s['remote_read_gbps']} GB/s, refused {s['remote_refused']}", flush=True)
    b.tier.destroy()
    a.tier.destroy()
    return rows


def main(argv=None) -> int:
    args = parse_ttft_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), argv)
    cfg, model = model_for(args)
    master = Master(tempfile.mkdtemp(prefix="kvtier-mooncake-"))
    try:
        rows = [r for adm in ("cost", "always") for r in run(model, cfg, master.addr, adm, args)]
    finally:
        master.kill()
    summary = {}
    for adm, key in (("cost", "admission"), ("always", "no_admission")):
        cells = [r for r in rows if r["admission"] == adm]
        summary[f"ttft_remote_over_recompute_{key}"] = max(r["ratio"] for r in cells)
        summary[f"remote_read_gbps_{key}"] = min((r["remote_read_gbps"] for r in cells if r["remote_read_gbps"]),
                                                 default=None)
    summary["remote_blocks_corrupt"] = sum(r["remote_blocks_corrupt"] for r in rows)
    write_json(args.out, {"env": env_info(), "args": vars(args), "model_layers": cfg.num_hidden_layers,
                          "summary": summary, "rows": rows})
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
