"""Shared helpers of the benchmarks: CUDA-event timing, paged KV pools, the run's environment, JSON and PNG output."""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import torch

from kvtier.geometry import KVGeometry
from kvtier.kernels import PagedKV
from kvtier.tier.executor import ImmediateExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def time_gpu_ms(fn: Callable[[], Optional[object]], reps: int = 20, warmup: int = 3,
                hide_host_us: float = 200.0) -> dict:
    """Median (and spread) of ``fn``'s GPU time in ms, each rep bracketed by CUDA events on the current stream.

    ``fn`` may return a CUDA event that marks its end on another stream; the current stream waits on it.
    Before each rep the GPU spins for ``hide_host_us`` so that the host has queued the rep's launches before the
    start event fires: the time is the device's, not the Python launcher's (measured apart as host overhead).
    """
    spin_cycles = int(hide_host_us * 1e-6 * sm_clock_hz())
    def run_once() -> None:
        ev = fn()
        if isinstance(ev, torch.cuda.Event):
            torch.cuda.current_stream().wait_event(ev)

    for _ in range(warmup):
        run_once()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if spin_cycles:
            torch.cuda._sleep(spin_cycles)
        s.record()
        run_once()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"median_ms": statistics.median(times), "p20_ms": q(0.2), "p80_ms": q(0.8)}


def time_in_rounds(cells: list, rounds: int, reps: int) -> None:
    """GPU time of each ``(row, fn)`` of ``cells`` in ``rounds`` rounds over all of them (:func:`time_gpu_ms`, ``reps``
    a round): ``row["gpu_ms_rounds"]`` each round's median, ``row["gpu_ms"]`` their median. A slow spell of the
    machine lands on different cells in different rounds rather than on all the reps of one cell."""
    for row, _ in cells:
        row["gpu_ms_rounds"] = []
    for _ in range(rounds):
        for row, fn in cells:
            row["gpu_ms_rounds"].append(time_gpu_ms(fn, reps=reps)["median_ms"])
    for row, _ in cells:
        row["gpu_ms"] = statistics.median(row["gpu_ms_rounds"])


def sm_clock_hz() -> float:
    """The GPU's SM clock (cycles per second), for ``torch.cuda._sleep``."""
    return torch.cuda.get_device_properties(0).clock_rate * 1e3 if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 1.98e9


def host_us_per_call(fn: Callable[[], object], reps: int = 200) -> float:
    """Median host (Python) time of issuing ``fn``: each issue starts with the device drained, then busy (a spin
    longer than the issue), so the calls queue behind the spin and the issue never waits for queue space that
    earlier reps' copies hold."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    spin_cycles = int((2 * (time.perf_counter() - t) + 200e-6) * sm_clock_hz())  # twice a warm issue + 200 us
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(spin_cycles)
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 2)


def gemm_beside(fn: Callable[[], object], nbytes: int, a: torch.Tensor, b: torch.Tensor, side: torch.cuda.Stream,
                n_copy: int, n_gemm: int = 15, rounds: int = 3) -> dict:
    """GEMM ``a @ b`` time alone and while ``n_copy`` back-to-back calls of ``fn`` (each moving ``nbytes``) run on
    ``side``: the median over ``rounds`` of the median GEMM inside the copies' window, and the slowdown in %."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    issue_s = time.perf_counter() - t  # host time to issue one call: the copies must all be queued first
    torch.cuda.synchronize()
    head_cycles = int((2e-3 + 1.5 * n_copy * issue_s) * sm_clock_hz())
    out = []
    for _ in range(rounds):
        alone = time_gpu_ms(lambda: a @ b, reps=10, warmup=3, hide_host_us=0)["median_ms"]
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_gemm)]
        # The GEMMs queue first, behind a spin a little longer than the copies' (both spins start together), so
        # that host-bound copies are queued in full before either stream starts.
        torch.cuda._sleep(head_cycles + int(1e-3 * sm_clock_hz()))
        for e0, e1 in ev:
            e0.record()
            a @ b
            e1.record()
        with torch.cuda.stream(side):
            torch.cuda._sleep(head_cycles)
            c0.record(side)
            for _ in range(n_copy):
                ev_copy = fn()
                if isinstance(ev_copy, torch.cuda.Event):
                    side.wait_event(ev_copy)
            c1.record(side)
        torch.cuda.synchronize()
        copy_ms = c0.elapsed_time(c1)
        inside = sorted(e0.elapsed_time(e1) for e0, e1 in ev
                        if c0.elapsed_time(e0) >= 0 and c0.elapsed_time(e1) <= copy_ms)
        out.append({"alone_ms": alone, "with_ms": inside[len(inside) // 2] if inside else float("nan"),
                    "overlapped": len(inside), "h2d_gbps_during": gbps(nbytes * n_copy, copy_ms)})
    alone = sorted(r["alone_ms"] for r in out)[len(out) // 2]
    with_ = sorted(r["with_ms"] for r in out)[len(out) // 2]
    return {"gemm_alone_ms": round(alone, 4), "gemm_with_h2d_ms": round(with_, 4),
            "slowdown_pct": round(100 * (with_ / alone - 1), 2), "rounds": out}


def call_us(fn: Callable[[], object], reps: int) -> list[float]:
    """Wall-clock microseconds of each of ``reps`` calls of ``fn``."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out


def gbps(nbytes: int, ms: float) -> float:
    return round(nbytes / (ms * 1e-3) / 1e9, 2)


def make_pool(geo: KVGeometry, num_slots: int, device: str = "cuda") -> PagedKV:
    """A paged KV pool of random bytes (never zeros: they hide unwritten bytes). Compare bytes, not floats."""
    bufs = []
    for _ in range(geo.num_layers * geo.kv_count):
        b = torch.empty(geo.device_shape(num_slots), dtype=geo.dtype, device=device)
        b.view(torch.uint8).random_(0, 256)
        bufs.append(b)
    return PagedKV(bufs, page_size=geo.page_size, is_mla=geo.is_mla)


def random_slots(num_pages: int, page_size: int, num_slots: int, device: str = "cuda",
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Token slots of ``num_pages`` distinct random device pages (slots of a page are consecutive, as in SGLang)."""
    pages = torch.randperm(num_slots // page_size, device=device, generator=generator)[:num_pages]
    return (pages[:, None] * page_size + torch.arange(page_size, device=device)[None]).reshape(-1).contiguous()


def env_info() -> dict:
    import triton
    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        import cupy
        info["cupy"] = cupy.__version__
    except Exception:
        info["cupy"] = None
    return info


def machine() -> dict:
    """The CPU side of the machine: cores, platform, processor, Python."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version()}


def command() -> str:
    """This process's command line, shell-quoted."""
    return " ".join([sys.executable] + [shlex.quote(a) for a in sys.argv])


def write_json(path: str, obj: dict, say: bool = False) -> None:
    """``obj`` as indented JSON at ``path`` (its directory made); ``say``: print where."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
    if say:
        print(f"wrote {path}", flush=True)


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str, dpi: int = 110) -> None:
    """Lay out ``fig``, write it to ``path`` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    print("wrote", path, flush=True)


def png_beside(json_path: str) -> str:
    return os.path.splitext(json_path)[0] + ".png"


# --- CPU tiers and child processes (the remote-tier benches) ---

class SkipCopies(ImmediateExecutor):
    """CPU executor that skips the copies named in ``skip`` (all when None): on the CPU they run in the Triton
    interpreter and are not what these benches measure; host blocks and device slots keep the bytes they hold."""

    def __init__(self, skip: Optional[tuple] = None) -> None:
        super().__init__()
        self.skip = skip

    def run(self, name, fn, own_stream=False):
        if self.skip is not None and name not in self.skip:
            super().run(name, fn, own_stream)


def send_signal(pid: int, sig: int) -> None:
    """``sig`` to ``pid``, unless it is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill(proc: subprocess.Popen) -> None:
    """Kill ``proc`` by its pid (resumed first, should it be stopped) and reap it."""
    if proc.poll() is None:
        send_signal(proc.pid, signal.SIGCONT)
        send_signal(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
