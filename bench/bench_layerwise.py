"""Layerwise load benchmark on one GPU: does loading a host hit layer by layer hide the load behind the forward pass?

An 8k-token prefix of Qwen3-8B KV (36 layers, 8 KV heads x 128, bf16, page 16) sits in the host tier; the "forward"
is one Qwen3-8B decoder layer per layer over the new tokens (QKV, the new K/V written to the pool, attention over
the gathered prefix + new K/V, output projection, SwiGLU MLP). Variants, timed on the GPU from one start event to
the end of the last layer: ``compute_only``, ``load_only`` / ``load_only_layerwise``, ``load_then_compute``,
``layerwise`` (per-layer loads, ``wait_until(i)`` a GPU-side wait before layer i) and ``host_blocking`` (the host
waits for layer i's event, FlexKV-style). Summary: ``layerwise_over_max_ratio`` = layerwise / max(load_only,
compute_only) (target <= 1.1), ``host_blocking_over_layerwise_ratio`` (target > 1), ``pin_seconds_per_gib``. Writes
the JSON (``--out``) and a Markdown table beside it (``.md``).

GPU: ``python bench/bench_layerwise.py --out $OUT/layerwise_h200.json``.
CPU smoke test of the code paths (tiny sizes, Triton interpreter, no timing claims):
``python bench/bench_layerwise.py --dry --out /tmp/layerwise_dry.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import env_info, make_pool, sm_clock_hz, write_json  # noqa: E402
from kvtier.config import TierConfig  # noqa: E402
from kvtier.geometry import KVGeometry  # noqa: E402
from kvtier.kernels import PagedKV, StagedTransfer, Tuning  # noqa: E402
from kvtier.kernels.pinned import is_pinned  # noqa: E402
from kvtier.tier import HostBlockPool, KVTier  # noqa: E402
from kvtier.tier.host_pool import GiB  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Model:
    """One decoder layer's shapes (Qwen3-8B by default)."""

    num_layers: int = 36
    hidden: int = 4096
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    dtype: torch.dtype = torch.bfloat16

    def params_per_layer(self) -> int:
        qkv = self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim
        return qkv + self.q_heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate


QWEN3_8B = Model()
DRY = Model(num_layers=3, hidden=32, q_heads=2, kv_heads=1, head_dim=8, intermediate=64, dtype=torch.float32)


class Forward:
    """The simulated forward pass: ``layer(i)`` reads the paged KV of layer i for the prefix + new tokens."""

    def __init__(self, m: Model, kv: PagedKV, prefix_slots: torch.Tensor, new_slots: torch.Tensor,
                 device: str) -> None:
        self.m, self.kv = m, kv
        n = new_slots.numel()
        g = torch.Generator(device="cpu").manual_seed(0)

        def w(*shape):
            return (torch.randn(*shape, generator=g) * shape[0] ** -0.5).to(device=device, dtype=m.dtype)

        self.w_qkv = w(m.hidden, (m.q_heads + 2 * m.kv_heads) * m.head_dim)
        self.w_o = w(m.q_heads * m.head_dim, m.hidden)
        self.w_gate_up = w(m.hidden, 2 * m.intermediate)
        self.w_down = w(m.intermediate, m.hidden)
        self.x0 = w(n, m.hidden)
        self.x = self.x0.clone()
        self.new_slots = new_slots.to(device)
        self.all_slots = torch.cat([prefix_slots.to(device), self.new_slots])

    def reset(self) -> None:
        self.x.copy_(self.x0)

    def layer(self, i: int) -> None:
        m, n = self.m, self.new_slots.numel()
        x = self.x
        qkv = x @ self.w_qkv
        q, k, v = qkv.split([m.q_heads * m.head_dim, m.kv_heads * m.head_dim, m.kv_heads * m.head_dim], dim=1)
        k_buf, v_buf = self.kv.layer_buffers(i)
        k_buf.index_copy_(0, self.new_slots, k.reshape(n, m.kv_heads, m.head_dim).to(k_buf.dtype))
        v_buf.index_copy_(0, self.new_slots, v.reshape(n, m.kv_heads, m.head_dim).to(v_buf.dtype))
        keys = k_buf.index_select(0, self.all_slots).to(m.dtype).transpose(0, 1).unsqueeze(0)  # [1, kvh, T, d]
        vals = v_buf.index_select(0, self.all_slots).to(m.dtype).transpose(0, 1).unsqueeze(0)
        qh = q.reshape(n, m.q_heads, m.head_dim).transpose(0, 1).unsqueeze(0)
        group = m.q_heads // m.kv_heads  # GQA by repeating K/V heads: keeps SDPA on its flash kernel
        keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
        attn = torch.nn.functional.scaled_dot_product_attention(qh, keys, vals)
        x = x + attn.squeeze(0).transpose(0, 1).reshape(n, -1) @ self.w_o
        gate, up = (x @ self.w_gate_up).chunk(2, dim=1)
        self.x = x + (torch.nn.functional.silu(gate) * up) @ self.w_down


class Clock:
    """GPU time between two points on the current stream (CUDA events), or wall time on CPU."""

    def __init__(self, cuda: bool, spin_cycles: int) -> None:
        self.cuda, self.spin = cuda, spin_cycles

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        torch.cuda._sleep(self.spin)  # let the host queue the whole variant before the clock starts
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, start) -> float:
        """Milliseconds since ``start`` (waits for the GPU)."""
        if not self.cuda:
            return (time.perf_counter() - start) * 1e3
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def _sync_event(ev) -> None:
    """Block the host until a layer event has completed (torch or CuPy event; host flags are already done)."""
    if hasattr(ev, "synchronize"):
        ev.synchronize()


def run_variants(tier: KVTier, fwd: Forward, toks: np.ndarray, prefix_dst: torch.Tensor, clock: Clock,
                 reps: int) -> dict:
    L = fwd.m.num_layers
    counter = tier.counter
    host_wait_s: list[float] = []

    def compute_only():
        for i in range(L):
            fwd.layer(i)

    def load_only():
        task = tier.load(toks, None, prefix_dst)
        tier.wait_on_current_stream(task)
        return task

    def load_only_layerwise():
        task = tier.load_layerwise(toks, None, prefix_dst)
        counter.set_consumer(task.producer_index)
        counter.wait_until(L - 1)
        return task

    def load_then_compute():
        task = load_only()
        compute_only()
        return task

    def layerwise():
        task = tier.load_layerwise(toks, None, prefix_dst)
        counter.set_consumer(task.producer_index)
        for i in range(L):
            t = time.perf_counter()
            counter.wait_until(i)
            host_wait_s.append(time.perf_counter() - t)
            fwd.layer(i)
        return task

    def host_blocking():
        task = tier.load_layerwise(toks, None, prefix_dst)
        for i in range(L):
            _sync_event(counter.events[task.producer_index][i])  # the host waits for layer i (FlexKV style)
            fwd.layer(i)
        return task

    variants = {"compute_only": compute_only, "load_only": load_only, "load_only_layerwise": load_only_layerwise,
                "load_then_compute": load_then_compute, "layerwise": layerwise, "host_blocking": host_blocking}
    out = {}
    for name, fn in variants.items():
        times = []
        for rep in range(reps + 2):  # two warm-up reps
            fwd.reset()
            if clock.cuda:
                torch.cuda.synchronize()
            if name == "layerwise":
                host_wait_s.clear()
            start = clock.start()
            task = fn()
            ms = clock.stop(start)
            if task is not None:
                tier.wait(task)
                assert task.num_pages * tier.page_size == prefix_dst.numel(), f"{name}: partial hit {task}"
            if rep >= 2:
                times.append(ms)
        times.sort()
        out[name] = {"median_ms": statistics.median(times), "min_ms": times[0], "max_ms": times[-1]}
        if name == "layerwise":
            hw = sorted(host_wait_s)
            out[name]["wait_until_host_us_median"] = hw[len(hw) // 2] * 1e6
            out[name]["wait_until_host_us_max"] = hw[-1] * 1e6
    tier.poll()
    return out


def validate_layerwise(tier: KVTier, fwd: Forward, toks: np.ndarray, src: torch.Tensor, dst: torch.Tensor) -> bool:
    """One layerwise load into poisoned slots, each layer read right after wait_until: bytes equal the source."""
    for b in tier.kv.buffers:
        b[dst] = 0
    if tier.kv.is_cuda:
        torch.cuda.synchronize()
    task = tier.load_layerwise(toks, None, dst)
    tier.counter.set_consumer(task.producer_index)
    reads = []
    for i in range(fwd.m.num_layers):
        tier.counter.wait_until(i)
        reads.append([b.index_select(0, dst) for b in tier.kv.layer_buffers(i)])
    tier.wait(task)
    want = [[b.index_select(0, src) for b in tier.kv.layer_buffers(i)] for i in range(fwd.m.num_layers)]
    return all(torch.equal(r.view(torch.uint8), w.view(torch.uint8)) for rl, wl in zip(reads, want)
               for r, w in zip(rl, wl))


def bench_new_tokens(m: Model, geo: KVGeometry, device: str, prefix_tokens: int, new_tokens: int, reps: int,
                     spin_cycles: int, transfer_mode: str = "auto", staged: tuple = (),
                     layout: str = "layer_first") -> dict:
    P = geo.page_size
    pages = prefix_tokens // P
    kv = make_pool(geo, (2 * pages + -(-new_tokens // P) + 1) * P, device)
    pool_gb = 2 * pages * geo.block_bytes / GiB + 0.01
    cfg = TierConfig(cpu_cache_gb=pool_gb, page_size=P, host_layout=layout, transfer_mode=transfer_mode)
    tier = KVTier(kv, cfg)
    if staged:  # (staging MiB, scatter programs for loads) of the tier's staged path
        tier.copies.close()  # the default staging buffers' threads; this run's tuning replaces them
        tier.copies.staged_transfer = StagedTransfer(kv, tier.pool.host, layout=cfg.host_layout,
                                                     tuning=Tuning(staging_bytes=staged[0] << 20,
                                                                   scatter_programs=staged[1]))
    toks = np.random.default_rng(0).integers(0, 150_000, prefix_tokens).astype(np.int64)
    src = torch.arange(0, pages * P, device=device)
    dst = torch.arange(pages * P, 2 * pages * P, device=device)
    new_slots = torch.arange(2 * pages * P, 2 * pages * P + new_tokens, device=device)
    tier.wait(tier.store(toks, None, src))
    assert tier.lookup(toks, None) == pages, "the prefix did not land in the host tier"
    # the forward's prefix KV lives in the slots the loads fill
    fwd = Forward(m, kv, dst, new_slots, device)
    clock = Clock(device == "cuda", spin_cycles)
    res = {"new_tokens": new_tokens, "prefix_tokens": prefix_tokens, "counter_backend": tier.counter.backend,
           "staged_config": list(staged) or None,
           "transfer_mode": cfg.transfer_mode, "host_layout": cfg.host_layout,
           "prefix_bytes": pages * geo.block_bytes, "flops_per_layer": 2 * m.params_per_layer() * new_tokens}
    res["layerwise_bytes_exact"] = validate_layerwise(tier, fwd, toks, src, dst)
    res["times"] = run_variants(tier, fwd, toks, dst, clock, reps)
    t = {k: v["median_ms"] for k, v in res["times"].items()}
    res["load_gbps"] = res["prefix_bytes"] / (t["load_only"] * 1e-3) / 1e9
    res["layerwise_over_max_ratio"] = t["layerwise"] / max(t["load_only"], t["compute_only"])
    res["layerwise_over_max_layerwise_load_ratio"] = t["layerwise"] / max(t["load_only_layerwise"],
                                                                          t["compute_only"])
    res["host_blocking_over_layerwise_ratio"] = t["host_blocking"] / t["layerwise"]
    res["load_then_compute_over_layerwise_ratio"] = t["load_then_compute"] / t["layerwise"]
    res["tier_stats"] = {k: v for k, v in tier.stats().items() if not isinstance(v, float) or v == v}
    tier.destroy()
    return res


def bench_pin(geo: KVGeometry, gib: float, chunk_gib: float) -> dict:
    """Pin a ``gib`` GiB pool (cudaHostRegister in chunks of at most ``chunk_gib``) and time it."""
    t = time.perf_counter()
    chunked = type("ChunkedPool", (HostBlockPool,), {"register_chunk_bytes": int(chunk_gib * GiB)})
    pool = chunked(geo, cpu_cache_gb=gib, layout="layer_first")
    secs = time.perf_counter() - t
    res = {"gib": pool.nbytes / GiB, "pinned_gib": pool.pinned_bytes / GiB, "chunks": len(pool.chunks),
           "seconds": secs, "register_seconds": pool.pin_seconds, "pin_seconds_per_gib": secs / (pool.nbytes / GiB),
           "pinned": pool.is_pinned and (not torch.cuda.is_available() or is_pinned(pool.host))}
    t = time.perf_counter()
    pool.destroy()
    res["unregister_seconds"] = time.perf_counter() - t
    return res


def markdown(results: dict) -> str:
    s = results["summary"]
    lines = [f"# Layerwise load, {results['env'].get('gpu', 'CPU dry run')}", "",
             f"Qwen3-8B geometry, {results['config']['prefix_tokens']}-token prefix, page "
             f"{results['config']['page_size']}, {results['config'].get('layout', 'layer_first')}, "
             f"counter backend {s.get('counter_backend')}. Medians of {results['config']['reps']} reps, ms to the "
             f"end of the last layer.", "",
             "| new tokens | load mode | compute only | load only (1 launch / per layer) | load then compute "
             "| layerwise | host-blocking | layerwise / max(load, compute) | host-blocking / layerwise "
             "| wait_until host us (median / max) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        if "error" in r:
            lines.append(f"| {r['new_tokens']} | {r.get('transfer_mode')} | error: {r['error'][:80]} |||||||| ")
            continue
        t = {k: v["median_ms"] for k, v in r["times"].items()}
        lw = r["times"]["layerwise"]
        mode = r["transfer_mode"] + (" (staging {} MiB, {} programs)".format(*r["staged_config"])
                                     if r.get("staged_config") else "")
        lines.append(f"| {r['new_tokens']} | {mode} | {t['compute_only']:.2f} | {t['load_only']:.2f} / "
                     f"{t['load_only_layerwise']:.2f} | {t['load_then_compute']:.2f} | {t['layerwise']:.2f} | "
                     f"{t['host_blocking']:.2f} | {r['layerwise_over_max_ratio']:.3f} | "
                     f"{r['host_blocking_over_layerwise_ratio']:.3f} | {lw['wait_until_host_us_median']:.1f} / "
                     f"{lw['wait_until_host_us_max']:.1f} |")
    if "pin" in results:
        p = results["pin"]
        lines += ["", f"Pinning a {p.get('gib', 0):.1f} GiB pool in {p.get('chunks')} registration(s): "
                      f"{p.get('seconds', float('nan')):.2f} s ({p.get('pin_seconds_per_gib', float('nan')):.3f} "
                      f"s/GiB), pinned: {p.get('pinned')}" if "error" not in p else f"Pinning failed: {p['error']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/layerwise_h200.json")
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", default="1024,256,4096", help="comma list; the first one feeds the summary")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--staged-configs", default="",
                    help="extra runs of the first mode with staging MiB:programs of the staged path, e.g. 32:4,16:8")
    ap.add_argument("--modes", default="auto,staged",
                    help="TierConfig.transfer_mode values to run; the first one feeds the summary")
    ap.add_argument("--layout", default="layer_first", choices=["layer_first", "page_first"],
                    help="host layout of the tier (TierConfig.host_layout)")
    ap.add_argument("--pin-gb", type=float, default=64.0, help="pool size to pin-time (0: skip)")
    ap.add_argument("--pin-chunk-gb", type=float, default=16.0, help="largest single registration (<= 64)")
    ap.add_argument("--spin-ms", type=float, default=30.0, help="GPU spin before each timed variant")
    ap.add_argument("--dry", action="store_true", help="CPU smoke test: tiny sizes, interpreter, wall clock")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.dry
    if not cuda and not args.dry:
        sys.exit("no CUDA device: run with --dry for a CPU smoke test")
    if args.dry:
        args.prefix_tokens, args.new_tokens, args.reps = 8, "4", 1
    m, page = (DRY, 2) if args.dry else (QWEN3_8B, 16)
    prefix, reps = args.prefix_tokens, args.reps
    news = [int(x) for x in args.new_tokens.split(",")]
    device = "cuda" if cuda else "cpu"
    geo = KVGeometry(num_layers=m.num_layers, num_kv_heads=m.kv_heads, head_dim=m.head_dim,
                     dtype=torch.float16 if args.dry else torch.bfloat16, page_size=page)
    spin = int(args.spin_ms * 1e-3 * sm_clock_hz()) if cuda else 0
    results = {"env": env_info(), "runs": [],
               "config": {"model": dataclasses.asdict(m) | {"dtype": str(m.dtype)}, "page_size": page,
                          "layout": args.layout, "prefix_tokens": prefix, "reps": reps, "dry": args.dry}}
    runs = [(mode, ()) for mode in args.modes.split(",")]
    runs += [(runs[0][0], tuple(int(x) for x in c.split(":"))) for c in args.staged_configs.split(",") if c]
    for n in news:
        for mode, staged in runs:
            try:
                r = bench_new_tokens(m, geo, device, prefix, n, reps, spin, mode, staged, args.layout)
            except Exception as e:  # recorded, the other sizes still run
                traceback.print_exc()
                r = {"new_tokens": n, "transfer_mode": mode, "error": repr(e)[:500]}
            results["runs"].append(r)
            write_json(args.out, results)  # kept if a later size is cut short
            print({k: v for k, v in r.items() if k not in ("tier_stats",)}, flush=True)
            if cuda:
                torch.cuda.empty_cache()
    if args.pin_gb > 0 and cuda:
        try:
            results["pin"] = bench_pin(geo, args.pin_gb, args.pin_chunk_gb)
        except Exception as e:
            traceback.print_exc()
            results["pin"] = {"gib": args.pin_gb, "error": repr(e)[:500]}
        print(results["pin"], flush=True)
    first = results["runs"][0]
    summary = {"new_tokens": first["new_tokens"], "transfer_mode": first["transfer_mode"]}
    if "error" not in first:
        summary.update({k: first[k] for k in ("layerwise_over_max_ratio", "host_blocking_over_layerwise_ratio",
                                              "layerwise_over_max_layerwise_load_ratio",
                                              "load_then_compute_over_layerwise_ratio", "load_gbps",
                                              "layerwise_bytes_exact", "counter_backend")})
        summary["wait_until_host_us_median"] = first["times"]["layerwise"]["wait_until_host_us_median"]
        same_mode = [r for r in results["runs"] if "error" not in r and r["transfer_mode"] == first["transfer_mode"]
                     and not r.get("staged_config")]
        summary["layerwise_over_max_ratio_worst"] = max(r["layerwise_over_max_ratio"] for r in same_mode)
        summary["host_blocking_over_layerwise_ratio_best"] = max(r["host_blocking_over_layerwise_ratio"]
                                                                 for r in same_mode)
    if "pin" in results and "error" not in results["pin"]:
        summary["pin_seconds_per_gib"] = results["pin"]["pin_seconds_per_gib"]
        summary["pinned_gib"] = results["pin"]["pinned_gib"]
    results["summary"] = summary
    write_json(args.out, results)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(markdown(results))
    print(markdown(results))
    print("summary", summary)


if __name__ == "__main__":
    main()
