"""``kvtier demo``: the cache at work (a model serves a prompt cold, warm on the device, then from kvtier after the
device cache is dropped), and ``kvtier demo --kernels``: a store/load round trip of the transfer kernels.

On a GPU both run at Qwen3-8B's size (36 layers, 8 KV heads x 128, bf16, 16-token pages); without CUDA they run
small, the kernels on CPU tensors through the Triton interpreter. Outputs and bytes are verified; a mismatch fails.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from kvtier.geometry import KVGeometry

# said while the index is prepared: numba's compile is the first run's longest silence (about 160 s on 2 cores)
INDEX_COMPILE_NOTE = ("(numba compiles it on the first run: up to a few minutes on a small machine; later runs load "
                      "it from numba's cache in about a second)")


@dataclasses.dataclass
class DemoPlan:
    geometry: KVGeometry
    num_slots: int
    num_pages: int
    layout: str


def plan_for(device: str) -> DemoPlan:
    if device == "cuda":
        return DemoPlan(KVGeometry(36, 8, 128, torch.bfloat16, page_size=16), num_slots=32768, num_pages=512,
                        layout="page_first")
    return DemoPlan(KVGeometry(4, 2, 64, torch.bfloat16, page_size=16), num_slots=1024, num_pages=24,
                    layout="page_first")


class _Timer:
    """Wall time on CPU, CUDA events on GPU."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object | None]) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            ev = fn()
            if isinstance(ev, torch.cuda.Event):
                torch.cuda.current_stream().wait_event(ev)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t


def run_kernel_demo(device: str | None = None, console=None, layout: str | None = None) -> bool:
    """Fill paged KV, store pages to host blocks, clobber the slots, load into other slots, verify every byte.

    Returns True when every round trip was byte-exact.
    """
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kvtier.commands.steps import step

    console = console or Console()
    with step(console, "loading kvtier's kernels (Triton)"):
        from kvtier.kernels import PagedKV, StagedTransfer, load_pages, store_pages

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan = plan_for(device)
    if layout is not None:
        plan = dataclasses.replace(plan, layout=layout)
    geo, page = plan.geometry, plan.geometry.page_size
    interp = " (Triton interpreter)" if device == "cpu" else ""
    console.print(f"[bold]kvtier demo[/bold] on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}"
                  f"{interp}: {geo.num_layers} layers x {geo.num_kv_heads} KV heads x {geo.head_dim}, "
                  f"{str(geo.dtype).replace('torch.', '')}, page {page}, {plan.num_pages} pages "
                  f"({plan.num_pages * geo.block_bytes / 2**20:.1f} MiB)")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    bufs = []
    for _ in range(geo.num_layers * geo.kv_count):  # random bytes, never zeros: zeros hide unwritten slots
        b = torch.empty(geo.device_shape(plan.num_slots), dtype=geo.dtype, device=device)
        b.view(torch.uint8).random_(0, 256)
        bufs.append(b)
    kv = PagedKV(bufs, page_size=page, is_mla=geo.is_mla)
    host = torch.empty(geo.host_shape(plan.num_pages, plan.layout), dtype=geo.dtype,
                       pin_memory=(device == "cuda"))
    pages = torch.randperm(plan.num_slots // page, generator=gen)[:2 * plan.num_pages]
    slots = (pages[:, None] * page + torch.arange(page)[None]).reshape(-1)
    src, dst = slots[:plan.num_pages * page], slots[plan.num_pages * page:]
    blocks = torch.arange(plan.num_pages)
    if device == "cuda":
        src, dst = src.cuda(), dst.cuda()
    nbytes = plan.num_pages * geo.block_bytes
    timer = _Timer(device)
    stager = StagedTransfer(kv, host, layout=plan.layout)
    modes = {
        "direct": (lambda: store_pages(kv, host, src, blocks, layout=plan.layout),
                   lambda: load_pages(kv, host, dst, blocks, layout=plan.layout)),
        "staged": (lambda: stager.store(src, blocks), lambda: stager.load(dst, blocks)),
    }
    table = Table(title="device slots -> host blocks (store) -> other device slots (load)")
    for col in ("mode", "store", "load", "bytes each way", "verified"):
        table.add_column(col)
    all_ok = True
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("moving KV", total=len(modes) * 3)
        for mode, (store, load) in modes.items():
            source = [b[src].view(torch.uint8).cpu() for b in kv.buffers]
            if device == "cuda":  # compile the kernels and warm the copy paths before timing
                store(), load()
            t_store = timer(store)
            progress.advance(task)
            for b in kv.buffers:  # clobber the source slots: the load must come from the host copy
                b[src] = torch.zeros((), dtype=geo.dtype, device=device)
            t_load = timer(load)
            progress.advance(task)
            ok = all(torch.equal(b[dst].view(torch.uint8).cpu(), s) for b, s in zip(kv.buffers, source))
            progress.advance(task)
            for b, s in zip(kv.buffers, source):  # restore for the next mode
                b[src] = s.to(device).view(geo.dtype)
            all_ok &= ok
            rate = (lambda t: _rate(nbytes, t)) if device == "cuda" else (lambda t: "–")
            table.add_row(mode, rate(t_store), rate(t_load), f"{nbytes / 2**20:.1f} MiB",
                          "[green]every byte[/green]" if ok else "[red]MISMATCH[/red]")
    console.print(table)
    if device == "cpu":
        console.print("On a CPU the kernels run in the Triton interpreter: bytes are verified, speed is not shown.")
    return all_ok


def _rate(nbytes: int, seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms = {nbytes / seconds / 1e9:.2f} GB/s"


@dataclasses.dataclass
class ServePlan:
    model: str
    layers: int
    prompt_tokens: int
    new_tokens: int
    num_slots: int
    cpu_cache_gb: float


def serve_plan_for(device: str) -> ServePlan:
    if device == "cuda":
        return ServePlan("Qwen3-8B shapes", 36, 8192, 16, 32768, 4.0)
    return ServePlan("tiny Qwen3", 4, 512, 16, 4096, 1 / 64)


def run_serve_demo(device: str | None = None, console=None, *, layout: str = "layer_first",
                   layerwise: bool = True, prompt_tokens: int | None = None) -> bool:
    """A random-weight Qwen3 serves one prompt three times: cold (full prefill), from a warm device cache, and from
    kvtier after the device cache is dropped. Returns True when the kvtier-served output equals the warm device
    cache's and kvtier served every full page but the last token's."""
    from rich.console import Console
    from rich.table import Table

    from kvtier.commands.steps import step
    from kvtier.config import TierConfig

    console = console or Console()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan = serve_plan_for(device)
    if prompt_tokens is not None:
        plan = dataclasses.replace(plan, prompt_tokens=prompt_tokens,
                                   num_slots=max(plan.num_slots, 2 * (prompt_tokens + 64)))
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter for kvtier's copies)"
    console.print(f"[bold]kvtier demo[/bold] on {where}: {plan.model}, {plan.layers} layers, random weights; a "
                  f"{plan.prompt_tokens}-token prompt, {plan.new_tokens} new tokens, {layout}, "
                  f"{'layerwise' if layerwise else 'whole'} loads")
    with step(console, "loading transformers, numba and kvtier's tier"):
        from kvtier.e2e.engine import TierEngine
        from kvtier.e2e.model import PagedDecoder, qwen3_config
        from kvtier.index import PageTrie

    with step(console, "building the model"):
        if device == "cuda":
            cfg = qwen3_config(num_layers=plan.layers)
        else:
            cfg = qwen3_config(num_layers=plan.layers, hidden=256, heads=4, kv_heads=2, head_dim=64,
                               intermediate=512, vocab=2048)
        model = PagedDecoder.from_config(cfg, seed=0, device=device)
    config = TierConfig(cpu_cache_gb=plan.cpu_cache_gb, page_size=16, host_layout=layout, layerwise=layerwise)
    with step(console, "preparing the host index", INDEX_COMPILE_NOTE):
        PageTrie.compile(config.block_tokens)  # what KVTier does at start, here where it can be said
    engine = TierEngine(model, config, num_slots=plan.num_slots)
    prompt = torch.randint(1, cfg.vocab_size, (plan.prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    if device == "cuda":  # compile the kernels and warm every path outside the figures
        for source in ("none", "device", "kvtier"):
            engine.serve(prompt[: plan.prompt_tokens // 2], 2, source=source)
        engine.tier.reset()
    runs = {}
    with step(console, "serving the prompt three ways", "(on a CPU the copies run in the Triton interpreter)"
              if device == "cpu" else ""):
        for source in ("none", "device", "kvtier"):
            runs[source] = engine.serve(prompt, plan.new_tokens, source=source)
    engine.drop_device_cache()
    table = Table(title="one prompt, served three ways")
    labels = {"none": "1 cold: nothing cached", "device": "2 warm device cache", "kvtier": "3 device dropped: kvtier"}
    for col in ("request", "prefill computed", "prefix cached") + (("TTFT",) if device == "cuda" else ()):
        table.add_column(col)
    for source, r in runs.items():
        cells = [labels[source], f"{r.computed} tokens", f"{r.cached} tokens"]
        if device == "cuda":
            cells.append(f"{r.ttft_s * 1e3:.1f} ms")
        table.add_row(*cells)
    console.print(table)
    want = (plan.prompt_tokens - 1) // 16 * 16
    same = runs["kvtier"].output == runs["device"].output
    ok = same and runs["kvtier"].cached == want
    console.print(f"kvtier served {runs['kvtier'].cached} of {want} cacheable tokens; its {plan.new_tokens} output "
                  f"tokens are {'[green]identical[/green]' if same else '[red]DIFFERENT[/red]'} to the warm device "
                  f"cache's" + (f"; TTFT {runs['none'].ttft_s / runs['kvtier'].ttft_s:.1f}x faster than cold"
                                if device == "cuda" else ""))
    if device == "cpu":
        console.print("On a CPU the copies run in the Triton interpreter, so TTFT is not shown: run it on a GPU.")
    engine.tier.destroy()
    return ok
