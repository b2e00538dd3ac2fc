"""Where the host time of one direct transfer call goes (GPU machine): the call against its parts, and a profile.

A layerwise load issues one call per layer, so a 36-layer model pays the call's host time 36 times per request.
This probe times (median host µs over many calls, the GPU kept busy so no call waits on a queue):

* ``load_pages(..., layers=i, check=False)`` with device indices (what the tier issues per layer), and the same
  call through stream and device contexts (the path every call took before the context-free one), and a
  :class:`~kvtier.kernels.DirectCopy` built once and launched per layer (what the tier's layerwise load does), and
  a staged one-layer load (gather/scatter launch plus copy-engine copies);
* its parts: ``check_transfer``, ``on_stream`` entered and left, ``is_pinned``, one packed kernel launch alone
  (``launch_copy_pages`` in the results);
* peers: ``torch.index_select`` of one page, an empty ``torch.cuda.stream`` context;

then prints the top of a cProfile of the full call. Writes ``$OUT/probe_overhead_h200.json``.

Usage: ``python bench/probes/probe_overhead.py [--calls 2000]``; ``PYTHONPATH=<older tree> python bench/probes/probe_overhead.py
--tier-only --out ...`` times an older kvtier's layerwise issue the same way.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import numpy as np
import torch

# appended, not prepended: PYTHONPATH may point at another kvtier to compare (--tier-only against an older tree)
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.common import env_info, make_pool, random_slots, write_json  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import StagedCopy, StagedTransfer, Tuning, load_pages  # noqa: E402
from kvtier.kernels import transfer as tr  # noqa: E402
from kvtier.kernels.checks import check_transfer, layer_span  # noqa: E402
from kvtier.kernels.pinned import is_pinned  # noqa: E402

TUNED = Tuning()  # the kernels' defaults


def host_us(fn, calls: int) -> float:
    """Median host µs per call over batches of 50 calls, with the GPU busy in between."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_batch = []
    for _ in range(max(calls // 50, 1)):
        torch.cuda._sleep(int(5e6))  # a few ms of GPU work: the launches below queue behind it
        t = time.perf_counter()
        for _ in range(50):
            fn()
        per_batch.append((time.perf_counter() - t) / 50)
        torch.cuda.synchronize()
    return round(statistics.median(per_batch) * 1e6, 2)


def tier_issue_us(kv, geo: KVGeometry, reps: int = 200, mode: str = "direct", page_counts=(1, 8)) -> dict:
    """Host µs to issue one 36-layer layerwise load of each of ``page_counts`` pages in ``transfer_mode``
    ``mode``; for ``"direct"`` also 36 ``load_pages`` calls of one layer each (what the tier issued before it
    built a ``DirectCopy`` per load)."""
    from kvtier.config import TierConfig
    from kvtier.tier import KVTier

    tier = KVTier(kv, TierConfig(cpu_cache_gb=0.25, page_size=geo.page_size, transfer_mode=mode))
    out = {}
    try:
        for pages in page_counts:
            n = pages * geo.page_size
            toks = np.arange(1000 * pages, 1000 * pages + n, dtype=np.int64)
            src = torch.arange(0, n, device="cuda")
            dst = torch.arange(n, 2 * n, device="cuda")
            tier.wait(tier.store(toks, None, src))
            ids = torch.from_numpy(np.array(tier.index.match(toks, None).block_ids)).cuda()
            stream = tier.executor.stream("load")

            def per_layer_calls():
                for layer in range(geo.num_layers):
                    load_pages(kv, tier.pool.host, dst, ids, layout=tier.layout, layers=layer, stream=stream,
                               check=False)

            tag = "" if mode == "direct" else f"_{mode}"
            for name, fn in ((f"load_layerwise{tag}_{pages}p", None), (f"load_pages_x36_{pages}p", per_layer_calls)):
                if fn is not None and mode != "direct":
                    continue
                times = []
                for rep in range(reps + 10):
                    torch.cuda._sleep(int(5e6))
                    t = time.perf_counter()
                    if fn is None:  # the tier's layerwise load: time the issue only; wait for the task outside
                        task = tier.load_layerwise(toks, None, dst)
                        dt = time.perf_counter() - t
                        tier.wait(task)
                    else:
                        fn()
                        dt = time.perf_counter() - t
                    torch.cuda.synchronize()
                    if rep >= 10:
                        times.append(dt)
                out[name] = round(statistics.median(times) * 1e6, 1)
                print(f"{name:32s} {out[name]:8.1f} us", flush=True)
            prof = cProfile.Profile()
            for _ in range(50):
                torch.cuda._sleep(int(5e6))
                prof.enable()
                task = tier.load_layerwise(toks, None, dst)
                prof.disable()
                tier.wait(task)
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
            out[f"profile_load_layerwise{tag}_{pages}p"] = text.getvalue()
            print(text.getvalue(), flush=True)
    finally:
        tier.destroy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--tier-only", action="store_true", help="only the tier's layerwise issue time, direct and staged")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "probe_overhead_h200.json"))
    args = ap.parse_args()

    geo = KVGeometry(36, 8, 128, torch.bfloat16, page_size=16)
    kv = make_pool(geo, 65536)
    if args.tier_only:
        write_json(args.out, {"env": env_info(), "kvtier": os.path.dirname(tr.__file__),
                              "layerwise_issue_us": tier_issue_us(kv, geo),
                              "layerwise_issue_us_staged": tier_issue_us(kv, geo, mode="staged",
                                                                         page_counts=(1, 64))})
        return
    num_blocks = 256
    host = torch.empty(geo.host_shape(num_blocks, "layer_first"), dtype=geo.dtype, pin_memory=True)
    slots = random_slots(1, 16, kv.num_slots)
    blocks_cpu = torch.tensor([7])
    blocks = blocks_cpu.cuda()
    stream = torch.cuda.Stream()
    span = layer_span(3, geo.num_layers)
    checked = check_transfer(kv, host, slots, blocks, layout="layer_first", host_side=True, writes_blocks=False,
                             check_indices=False)
    strides = geo.host_row_strides(num_blocks, "layer_first")

    stager = StagedTransfer(kv, host, layout="layer_first")
    staged_copy = StagedCopy(stager, slots, blocks_cpu, to_host=False, stream=stream, check=False)
    copy = tr.DirectCopy(kv, host, slots, blocks, to_host=False, layout="layer_first", stream=stream, check=False)

    def full():
        load_pages(kv, host, slots, blocks, layout="layer_first", layers=3, stream=stream, check=False)

    def launch_pages(sl, bl, strides_):
        """One copy kernel launch, packed and fired as ``load_pages`` issues it after its checks."""
        launch = tr.KernelLaunch(kv, host, sl, bl, strides_, to_blocks=False, tile_bytes=TUNED.tile_bytes,
                                 num_warps=TUNED.num_warps)
        launch.fire(span, TUNED.programs_for(launch.layer_bytes), None)

    def context_path():  # what every call did before the context-free path: stream and device contexts
        with tr.on_stream(kv, stream):
            sl, bl, nb = check_transfer(kv, host, slots, blocks, layout="layer_first", host_side=True,
                                        writes_blocks=False, check_indices=False)
            launch_pages(sl, bl, geo.host_row_strides(nb, "layer_first"))

    def enter_exit():
        with tr.on_stream(kv, stream):
            pass

    def stream_context():
        with torch.cuda.stream(stream):
            pass

    def launch_only():
        with torch.cuda.stream(stream):
            launch_pages(checked[0], checked[1], strides)

    parts = {
        "load_pages_one_layer": full,
        "load_pages_one_layer_context_path": context_path,
        "direct_copy_build": lambda: tr.DirectCopy(kv, host, slots, blocks, to_host=False, layout="layer_first",
                                                stream=stream, check=False),
        "direct_copy_launch_one_layer": lambda: copy.launch(3, stream=stream),
        # host block ids on the CPU, as the tier passes them (device ids would cost a synchronizing copy)
        "staged_load_one_layer": lambda: stager.load(slots, blocks_cpu, layers=3, stream=stream, check=False),
        "staged_copy_launch_one_layer": lambda: staged_copy.launch(3, stream=stream),
        "check_transfer": lambda: check_transfer(kv, host, slots, blocks, layout="layer_first", host_side=True,
                                                 writes_blocks=False, check_indices=False),
        "on_stream_enter_exit": enter_exit,
        "is_pinned": lambda: is_pinned(host),
        "tensor_is_pinned": lambda: host.is_pinned(),
        "launch_copy_pages": launch_only,
        "torch_stream_context": stream_context,
        "torch_index_select_one_page": lambda: torch.index_select(kv.buffers[0], 0, slots),
    }
    res = {"env": env_info(), "calls": args.calls, "us": {}}
    for name, fn in parts.items():
        res["us"][name] = host_us(fn, args.calls)
        print(f"{name:32s} {res['us'][name]:8.2f} us", flush=True)

    res["layerwise_issue_us"] = tier_issue_us(kv, geo)
    res["layerwise_issue_us_staged"] = tier_issue_us(kv, geo, mode="staged", page_counts=(1, 8, 64))
    # 64 pages of Qwen3-8B: 4 MiB a layer, the smallest layer auto stages (AUTO_STAGED_LAYER_BYTES)
    res["layerwise_issue_us_auto"] = tier_issue_us(kv, geo, mode="auto", page_counts=(64,))
    for name in ("load_pages_one_layer", "direct_copy_launch_one_layer"):
        fn = parts[name]
        prof = cProfile.Profile()
        torch.cuda._sleep(int(5e7))
        prof.enable()
        for _ in range(1000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        res[f"profile_{name}_tottime_top15"] = text.getvalue()
        print(name, text.getvalue())
    write_json(args.out, res)


if __name__ == "__main__":
    main()
