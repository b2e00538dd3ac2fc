"""``kvtier`` command line: ``kvtier demo`` runs a real store/load round trip on this machine.

On a GPU the demo moves a Qwen3-8B-shaped KV cache (36 layers, 8 KV heads x 128, bf16, 16-token pages) through
pinned host blocks at full size; without CUDA the same kernels run on CPU tensors through the Triton interpreter,
at a small size. Every byte is verified.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Callable, Optional

import torch

from kvtier.geometry import KVGeometry


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

    def __call__(self, fn: Callable[[], Optional[object]]) -> float:
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


def run_demo(device: Optional[str] = None, console=None) -> bool:
    """Fill paged KV, store pages to host blocks, clobber the slots, load into other slots, verify every byte.

    Returns True when every round trip was byte-exact.
    """
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kvtier.kernels import PagedKV, StagedTransfer, load_pages, store_pages

    console = console or Console()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan = plan_for(device)
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
            table.add_row(mode, _rate(nbytes, t_store), _rate(nbytes, t_load), f"{nbytes / 2**20:.1f} MiB",
                          "[green]every byte[/green]" if ok else "[red]MISMATCH[/red]")
    console.print(table)
    if device == "cpu":
        console.print("CPU figures time the Triton interpreter, not a transfer: run on a GPU for real speed.")
    return all_ok


def _rate(nbytes: int, seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms = {nbytes / seconds / 1e9:.2f} GB/s"


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier", description="kvtier: a host-side tier for prefix KV caches")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="store pages to host blocks and load them back, verifying every byte")
    demo.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    args = parser.parse_args(argv)
    if args.device == "cpu":  # CPU tensors need the Triton interpreter, chosen before the kernels are imported
        if "kvtier.kernels" in sys.modules and torch.cuda.is_available():
            parser.error("--device cpu must be chosen before kvtier.kernels is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    if args.command == "demo":
        return 0 if run_demo(args.device) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
