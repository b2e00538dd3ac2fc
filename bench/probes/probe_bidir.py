"""Where a staged store + load at once loses to the copy engines' own bound: variants and a CUPTI timeline.

The workload is bench_transfer's ``bidir`` one (Qwen3-8B, 36 layers, page 16, 1024 tokens each way, ``page_first``,
consecutive blocks). Rounds alternate, so host drift hits all alike:

* the copy engines' contiguous bound: one 150 MB store and one load at once, same host blocks;
* kvtier's staged pair with the defaults, without the short edge chunks, with 64 MiB staging, with 3 buffers.

Then a torch.profiler (CUPTI) trace of the default pair and of the bound gives, per direction, each copy's GB/s,
the gaps between its copies, when its first copy starts and its last ends.

Run on the GPU machine: ``python bench/probes/probe_bidir.py --out $OUT/probe_bidir.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.bench_transfer import MiB, _bidir_setup, _both, _ce_contiguous  # noqa: E402
from bench.common import env_info, gbps, time_gpu_ms, write_json  # noqa: E402
from bench.probes.probe_staged import copy_stats, event_rows, record_timelines, trace_last_run  # noqa: E402
from kvtier.kernels import StagedTransfer, Tuning  # noqa: E402


def per_direction(run: list[dict]) -> dict:
    """Copy statistics of a traced run, split by direction (CUPTI names the copy kind)."""
    out = {}
    for name, key in (("d2h", "DtoH"), ("h2d", "HtoD")):
        copies = [e for e in run if e["cat"] == "gpu_memcpy" and key in e["name"]]
        out[name] = copy_stats(run, copies)
    out["span_us"] = round(max(e["ts"] + e["dur"] for e in run) - run[0]["ts"], 2)
    out["kernels_us"] = [round(e["dur"], 2) for e in run if e["cat"] == "kernel"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/probe_bidir.json")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    host_bytes = torch.empty(1200 * MiB, dtype=torch.uint8, pin_memory=True)
    host_bytes.fill_(0x5A)
    s, host, src, dst, st_blocks, ld_blocks, nbytes = _bidir_setup(host_bytes, gen)
    s_store, s_load = torch.cuda.Stream(), torch.cuda.Stream()

    def staged_pair(stager: StagedTransfer):
        return _both(lambda: stager.store(src, st_blocks, stream=s_store, check=False),
                     lambda: stager.load(dst, ld_blocks, stream=s_load, check=False), s_store, s_load)

    default = staged_pair(StagedTransfer(s.kv, host))
    fns = {
        "copy_engine_contiguous": _both(*_ce_contiguous(host, nbytes), s_store, s_load),
        "default": default,
        "no_short_edges": staged_pair(StagedTransfer(s.kv, host, tuning=Tuning(edge_chunk_divisor=1))),
        "staging64": staged_pair(StagedTransfer(s.kv, host, tuning=Tuning(staging_bytes=64 * MiB))),
        "buffers3": staged_pair(StagedTransfer(s.kv, host, tuning=Tuning(num_buffers=3))),
    }
    times = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            times[k].append(time_gpu_ms(fn, reps=20, hide_host_us=3000)["median_ms"])
    torch.cuda.synchronize()
    res = {"env": env_info(), "bytes_each_way": nbytes, "rounds": args.rounds,
           "combined_gbps": {k: gbps(2 * nbytes, statistics.median(v)) for k, v in times.items()},
           "round_gbps": {k: [gbps(2 * nbytes, t) for t in v] for k, v in times.items()}}
    bound = res["combined_gbps"]["copy_engine_contiguous"]
    res["over_bound"] = {k: round(g / bound, 4) for k, g in res["combined_gbps"].items()}
    print("combined", res["combined_gbps"], res["over_bound"], flush=True)
    write_json(args.out, res)
    def summary(fn):
        run = trace_last_run(fn)
        return {"events": event_rows(run), **per_direction(run)}
    record_timelines(res, args.out,
                     {k: functools.partial(summary, fns[k]) for k in ("default", "copy_engine_contiguous")})


if __name__ == "__main__":
    main()
