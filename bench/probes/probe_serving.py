"""Where does the harness's serving time go on the GPU? (decode step cost, first-time costs per prompt length.)

Run under ``bash tests/gpu_sglang.sh exec python3 bench/probes/probe_serving.py $OUT/probe_serving_h200.json``.

1. whether SGLang's JIT ``store_cache`` kernel serves the pool's writes here, and what its first call costs;
2. a 36-layer Qwen3-8B-shape model in ``device`` mode: wall time of a decode step over an 8k prefix, against the
   GPU time of the same steps (CUDA events), and torch.profiler's top CUDA kernels and CPU ops of 8 decode steps;
3. a 9-layer model: TTFT of prompts of lengths never served before, then of new prompts of the same lengths
   (a first-time cost per length shows as a gap between the two), in ``device`` and ``recompute`` modes;
4. the paged forward's logits against the transformers model's own forward (same weights, different kernels).
"""
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from kvtier.e2e.model import PagedDecoder, qwen3_config  # noqa: E402


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def store_cache_probe() -> dict:
    from sglang.kernels.ops.kvcache.kvcache import can_use_store_cache

    ok, s = timed(lambda: bool(can_use_store_cache(8 * 128 * 2, 8 * 128 * 2)))
    return {"can_use_store_cache": ok, "first_call_s": s}


def decode_probe(res: dict) -> None:
    from kvtier.sglang.serving import Server

    m = PagedDecoder.from_config(qwen3_config(num_layers=36), device="cuda")
    s = Server(m, "device", kv_tokens=40000, page_size=16, max_context=20000)
    rng = np.random.default_rng(0)
    s.serve(rng.integers(1, 150000, 2048).tolist(), 4)  # warm-up
    prompt = rng.integers(1, 150000, 8192).tolist()
    r = s.serve(prompt, 33)
    res["decode_36l_8k"] = {"ttft_ms": r.ttft_s * 1e3, "decode_ms_per_token": (r.total_s - r.ttft_s) / 32 * 1e3}
    # the same decode steps straight on the pool: wall vs GPU time
    pool, tokens = s.kv_pool, torch.tensor(prompt, device="cuda")
    slots = s._take_slots(8192 + 40)
    m.forward(pool, tokens, 0, slots[:8192], slots[:8192])
    walls, gpus = [], []
    for j in range(24):
        pos = 8192 + j
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        a.record()
        logits = m.forward(pool, tokens[:1], pos, slots[pos:pos + 1], slots[:pos + 1])
        b.record()
        int(logits.argmax())
        walls.append(time.perf_counter() - t)
        gpus.append(a.elapsed_time(b) / 1e3)
    res["decode_36l_8k"].update(wall_ms_median=float(np.median(walls[4:]) * 1e3),
                                gpu_ms_median=float(np.median(gpus[4:]) * 1e3))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for j in range(8):
            pos = 8192 + 24 + j
            int(m.forward(pool, tokens[:1], pos, slots[pos:pos + 1], slots[:pos + 1]).argmax())
    ka = prof.key_averages()
    res["decode_profile_cuda"] = ka.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)
    res["decode_profile_cpu"] = ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)
    print(res["decode_36l_8k"], flush=True)
    print(res["decode_profile_cuda"], flush=True)
    print(res["decode_profile_cpu"], flush=True)
    del s, pool, m
    torch.cuda.empty_cache()


def first_time_probe(res: dict) -> None:
    from kvtier.sglang.serving import Server

    m = PagedDecoder.from_config(qwen3_config(num_layers=9), device="cuda")
    lengths = [3001, 5003, 7919, 12007, 20011, 28001]
    rng = np.random.default_rng(1)
    for mode in ("device", "recompute"):
        s = Server(m, mode, kv_tokens=2 * sum(lengths) + 70000, page_size=16, max_context=30000)
        s.serve(rng.integers(1, 150000, 2048).tolist(), 2)
        out = {}
        for rnd in ("first", "second"):
            out[rnd] = []
            for n in lengths:
                r, wall = timed(lambda: s.serve(rng.integers(1, 150000, n).tolist(), 4))
                out[rnd].append({"len": n, "ttft_ms": r.ttft_s * 1e3, "serve_ms": wall * 1e3})
        res[f"first_time_{mode}"] = out
        print(mode, json.dumps(out), flush=True)
        del s
        torch.cuda.empty_cache()
    # 4. paged forward vs the transformers forward
    from kvtier.sglang.serving import Server

    s = Server(m, "recompute", kv_tokens=8192, page_size=16, max_context=4096)
    toks = rng.integers(1, 150000, 1024).tolist()
    r = s.serve(toks, 1, keep_logits=True)
    ref = m.reference_logits(torch.tensor(toks, device="cuda")).cpu()
    res["paged_vs_transformers"] = {"max_abs_diff": float((r.logits[0] - ref).abs().max()),
                                    "ref_abs_max": float(ref.abs().max()),
                                    "argmax_equal": int(r.logits[0].argmax()) == int(ref.argmax())}
    print(res["paged_vs_transformers"], flush=True)


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/probe_serving.json"
    res: dict = {"device": torch.cuda.get_device_name()}
    for name, fn in (("store_cache", lambda: res.update(store_cache=store_cache_probe())),
                     ("decode", lambda: decode_probe(res)), ("first_time", lambda: first_time_probe(res))):
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # record and go on: the other parts still inform
            import traceback

            traceback.print_exc()
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
        res[f"{name}_seconds"] = time.perf_counter() - t
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if "profile" not in k}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
