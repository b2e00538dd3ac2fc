"""Where a staged load's time goes: GB/s of variants and a CUPTI timeline of one load, on the bidir workload.

The workload is bench_transfer's ``bidir`` one (Qwen3-8B, 36 layers, page 16, 1024 tokens, ``page_first``,
consecutive blocks). Variants alternate over rounds so drift hits all alike:

* the contiguous copy-engine copy of the same bytes (the bound);
* kvtier's staged load with the current defaults, and with the short last chunk turned off;
* scatter programs 32 / 128, and 16 MiB / 64 MiB staging.

Then a torch.profiler (CUPTI) trace of three default loads gives, per chunk, the copy's GB/s, the gaps between
copies and the exposed tail (last copy's end to the last scatter's end).

Run on the GPU machine: ``python bench/probes/probe_staged.py --out $OUT/probe_staged.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.bench_transfer import MiB, _bidir_setup  # noqa: E402
from bench.common import env_info, gbps, time_gpu_ms, write_json  # noqa: E402
from kvtier.kernels import StagedTransfer, Tuning  # noqa: E402


def _load_fn(stager: StagedTransfer, dst, blocks, stream):
    def run():
        stream.wait_stream(torch.cuda.current_stream())
        return stager.load(dst, blocks, stream=stream, check=False)
    return run


def record_timelines(res: dict, out: str, summaries: dict) -> None:
    """``res["timeline_<name>"] = summarize()`` for each of ``summaries``, printed and written to ``out`` one by
    one; a failure (the profiler may be unavailable) is recorded instead, and the figures before stand alone."""
    for name, summarize in summaries.items():
        try:
            t = res[f"timeline_{name}"] = summarize()
            print("timeline", name, {x: t[x] for x in t if x != "events"}, flush=True)
        except Exception as e:
            res[f"timeline_{name}_error"] = repr(e)[:500]
            print("timeline error", e, flush=True)
        write_json(out, res)


def trace_last_run(fn, reps: int = 3) -> list[dict]:
    """The GPU events (kernels and copies, not the spin) of ``fn``'s last of ``reps`` runs, from a CUPTI trace."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            torch.cuda._sleep(int(3e6))
            ev = fn()
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")),
                 key=lambda e: e["ts"])
    # split into runs: a copy that starts > 1 ms after the previous event ends begins a new run
    runs, cur, last_end = [], [], None
    for e in gpu:
        if "sleep" in e["name"].lower() or "spin" in e["name"].lower():
            continue
        if last_end is not None and e["ts"] - last_end > 1000:
            runs.append(cur)
            cur = []
        cur.append(e)
        last_end = max(last_end or 0, e["ts"] + e["dur"])
    runs.append(cur)
    return runs[-1]


def event_rows(run: list[dict]) -> list[dict]:
    """The events of a run, times relative to its first event."""
    return [{"cat": e["cat"], "name": e["name"][:60], "stream": e.get("args", {}).get("stream"),
             "ts_us": round(e["ts"] - run[0]["ts"], 2), "dur_us": round(e["dur"], 2),
             "bytes": e.get("args", {}).get("bytes")} for e in run]


def copy_stats(run: list[dict], copies: list[dict]) -> dict:
    """Per-copy GB/s, the gaps between consecutive copies, and their busy time within ``run``."""
    return {
        "copy_gbps": [round(e["args"]["bytes"] / (e["dur"] * 1e3), 2) for e in copies if e.get("args", {}).get("bytes")],
        "gaps_between_copies_us": [round(b["ts"] - (a["ts"] + a["dur"]), 2) for a, b in zip(copies, copies[1:])],
        "first_copy_start_us": round(copies[0]["ts"] - run[0]["ts"], 2) if copies else None,
        "last_copy_end_us": round(copies[-1]["ts"] + copies[-1]["dur"] - run[0]["ts"], 2) if copies else None,
        "copy_busy_us": round(sum(e["dur"] for e in copies), 2),
    }


def timeline(fn, reps: int = 3) -> dict:
    """Per-chunk copy GB/s, gaps and exposed tail of ``fn``'s last run, from a CUPTI trace."""
    run = trace_last_run(fn, reps)
    copies = [e for e in run if e["cat"] == "gpu_memcpy"]
    kernels = [e for e in run if e["cat"] == "kernel"]
    return {
        "events": event_rows(run),
        **copy_stats(run, copies),
        "scatter_us": [round(e["dur"], 2) for e in kernels],
        "span_us": round(max(e["ts"] + e["dur"] for e in run) - run[0]["ts"], 2),
        "tail_us": round(max(e["ts"] + e["dur"] for e in run) - max(e["ts"] + e["dur"] for e in copies), 2)
        if copies else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/probe_staged.json")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    host_bytes = torch.empty(1200 * MiB, dtype=torch.uint8, pin_memory=True)
    host_bytes.fill_(0x5A)
    s, host, src, dst, st_blocks, ld_blocks, nbytes = _bidir_setup(host_bytes, gen)
    stream = torch.cuda.Stream()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_flat = host.view(-1).view(torch.uint8)[nbytes:2 * nbytes]

    def ce():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dev.copy_(host_flat, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    stagers = {
        "default": StagedTransfer(s.kv, host),
        "no_short_tail": StagedTransfer(s.kv, host, tuning=Tuning(edge_chunk_divisor=1)),
        "scatter32": StagedTransfer(s.kv, host, tuning=Tuning(scatter_programs=32)),
        "scatter128": StagedTransfer(s.kv, host, tuning=Tuning(scatter_programs=128)),
        "staging16": StagedTransfer(s.kv, host, tuning=Tuning(staging_bytes=16 * MiB)),
        "staging64": StagedTransfer(s.kv, host, tuning=Tuning(staging_bytes=64 * MiB)),
    }
    fns = {"copy_engine_contiguous": ce}
    fns.update({k: _load_fn(st, dst, ld_blocks, stream) for k, st in stagers.items()})
    times = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            times[k].append(time_gpu_ms(fn, reps=20, hide_host_us=3000)["median_ms"])
    torch.cuda.synchronize()
    exact = all(torch.equal(b[dst].view(torch.uint8), b[src].view(torch.uint8)) for b in s.kv.buffers)
    res = {"env": env_info(), "bytes": nbytes, "rounds": args.rounds, "load_exact": exact,
           "gbps": {k: gbps(nbytes, statistics.median(v)) for k, v in times.items()},
           "round_gbps": {k: [gbps(nbytes, t) for t in v] for k, v in times.items()}}
    print("gbps", res["gbps"], flush=True)
    write_json(args.out, res)
    record_timelines(res, args.out, {k: functools.partial(timeline, fns[k]) for k in ("default", "no_short_tail")})


if __name__ == "__main__":
    main()
