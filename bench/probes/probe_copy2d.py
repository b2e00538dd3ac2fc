"""Staged transfers with one 2-D copy per run of blocks, against one 1-D copy per row and an earlier module.

Qwen3-8B, 36 layers, the bench_transfer ``Setup``. Cases where the copy shape matters:

* ``page_first``, one layer of 16384 tokens (64 MiB), consecutive blocks: a row per block (the 1-D module issued one
  copy per block);
* ``layer_first``, all layers of 1024 tokens (144 MiB), consecutive and random blocks: a row per (layer, K/V)
  plane (the 1-D module staged layer by layer there, one copy per K/V and run);
* ``layer_first``, one layer of 16384 tokens, consecutive blocks (the tier's layerwise path).

Methods: ``copy_2d`` (the current module), ``rows_whole`` (the same with 2-D copies off: a 1-D copy per row),
``copy_2d_stagingN`` (``--staging-mib``) and, with ``--baseline``, ``baseline`` (the module of an earlier commit;
named ``rows_1d`` in the first run). Each case: the methods alternate over rounds (GB/s from the median round),
host time per call, and a byte check of the current module's round trip.

Run on the GPU machine: ``python bench/probes/probe_copy2d.py --baseline OLD_STAGED.py --out $OUT/probe_copy2d.json``
with ``OLD_STAGED.py`` from ``git show <commit>:kvtier/kernels/staged.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.bench_transfer import MiB, Setup  # noqa: E402
from bench.common import env_info, gbps, host_us_per_call, random_slots, time_gpu_ms, write_json  # noqa: E402
from kvtier.kernels import Tuning  # noqa: E402
from kvtier.kernels import staged as staged_mod  # noqa: E402

CASES = [  # (layout, layers: None = all, tokens, blocks)
    ("page_first", 0, 16384, "consecutive"),
    ("layer_first", None, 1024, "consecutive"),
    ("layer_first", None, 1024, "random"),
    ("layer_first", 0, 16384, "consecutive"),
]


def _module(path: str):
    spec = importlib.util.spec_from_file_location("staged_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _on(stream, fn):
    def run():
        stream.wait_stream(torch.cuda.current_stream())
        return fn()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="", help="staged.py of an earlier commit (method 'baseline'), or none")
    ap.add_argument("--staging-mib", default="", help="extra copy_2d runs with these staging sizes, e.g. 64,128")
    ap.add_argument("--skip", default="", help="methods to leave out, e.g. rows_whole")
    ap.add_argument("--cases", default="", help="indices into CASES to run, e.g. 0,1 (default: all)")
    ap.add_argument("--out", default="/tmp/probe_copy2d.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pages", default="1,16,64")
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    host_bytes = torch.empty(2700 * MiB, dtype=torch.uint8, pin_memory=True)
    host_bytes.fill_(0x5A)
    # rows_whole: the current module with 2-D copies off (its pitch limit 0): one 1-D copy per row, whole spans
    rows_whole = _module(staged_mod.__file__)
    rows_whole._max_pitch = lambda: 0
    methods = {"copy_2d": (staged_mod, {}), "rows_whole": (rows_whole, {})}
    methods.update({f"copy_2d_staging{m}": (staged_mod, {"tuning": Tuning(staging_bytes=int(m) * MiB)})
                    for m in args.staging_mib.split(",") if m})
    if args.baseline:
        methods["baseline"] = (_module(args.baseline), {})
    for name in args.skip.split(","):
        methods.pop(name, None)
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    stream = torch.cuda.Stream()
    baseline_sha1 = None
    if args.baseline:
        with open(args.baseline, "rb") as f:
            baseline_sha1 = hashlib.sha1(f.read()).hexdigest()
    res = {"env": env_info(), "rounds": args.rounds, "baseline_sha1": baseline_sha1, "cases": []}
    for page in (int(p) for p in args.pages.split(",")):
        s = Setup("qwen3_8b", 36, page, 200_000, 16384, host_bytes)
        for layout, layers, tokens, pattern in cases:
            host = s.host(layout)
            pages = tokens // page
            slots = random_slots(2 * pages, page, s.num_slots, generator=gen)
            src, dst = slots[:tokens], slots[tokens:]
            blocks = (torch.randperm(s.num_blocks, generator=torch.Generator().manual_seed(page))[:pages]
                      if pattern == "random" else torch.arange(pages))
            n_layers = 36 if layers is None else 1
            nbytes = tokens * n_layers * s.geo.kv_count * s.geo.row_bytes
            case = {"page": page, "layout": layout, "layers": "all" if layers is None else layers,
                    "tokens": tokens, "blocks": pattern, "bytes": nbytes}
            fns = {}
            for name, (mod, kwargs) in methods.items():
                stager = mod.StagedTransfer(s.kv, host, layout=layout, **kwargs)
                fns[f"{name}_d2h"] = _on(stream, lambda st=stager: st.store(src, blocks, layers=layers, stream=stream,
                                                                            check=False))
                fns[f"{name}_h2d"] = _on(stream, lambda st=stager: st.load(dst, blocks, layers=layers, stream=stream,
                                                                           check=False))
            times = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    times[k].append(time_gpu_ms(fn, reps=5, warmup=2)["median_ms"])
            case["gbps"] = {k: gbps(nbytes, statistics.median(v)) for k, v in times.items()}
            case["host_us"] = {k: host_us_per_call(fn, reps=20) for k, fn in fns.items()}
            # byte check of the current module: store src, clobber nothing else, load into dst, compare
            fns["copy_2d_d2h"]()
            fns["copy_2d_h2d"]()
            torch.cuda.synchronize()
            span = range(36) if layers is None else [layers]
            case["exact"] = all(torch.equal(s.kv.buffers[layer * s.geo.kv_count + k][dst].view(torch.uint8),
                                            s.kv.buffers[layer * s.geo.kv_count + k][src].view(torch.uint8))
                                for layer in span for k in range(s.geo.kv_count))
            res["cases"].append(case)
            print("case", {k: v for k, v in case.items() if k != "bytes"}, flush=True)
            write_json(args.out, res)
        del s
        torch.cuda.empty_cache()
    write_json(args.out, res)


if __name__ == "__main__":
    main()
