"""``kvtier doctor``: what this machine gives kvtier, and whether kvtier's copies work on it.

One line per finding (``ok``, ``note`` or ``FAIL``): Python, kvtier, torch and its CUDA, the GPU, Triton, numba,
CuPy (the layer signal), the Mooncake client, SGLang, host memory, the pinned-memory limit and ``/dev/shm`` (an MLA
model's TP ranks share their host pool there); then a round trip through :class:`~kvtier.tier.KVTier` (a store,
a whole load and a layerwise load, every byte compared) on the GPU with a registered pinned pool (as big pools are
pinned), or on the CPU through the Triton interpreter. Exit status 1 when a finding fails or a byte differs.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import resource
import shutil
import subprocess
import sys
from importlib import metadata

from kvtier.commands.config_check import KVTIER_RESERVE_GIB, available_memory_bytes, gib
from kvtier.commands.steps import step

__all__ = ["PYTHONS", "REMOTE_PYTHONS", "run"]

PYTHONS = ((3, 11), (3, 13))  # the Python versions kvtier's set-up resolves and is tested on (README, CI)
REMOTE_PYTHONS = ((3, 11), (3, 13))  # those the Mooncake client has wheels for (none for 3.14)
SGLANG = "0.5.23"  # kvtier.sglang.SUPPORTED_SGLANG_VERSION (a test keeps them equal)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps a whole number in front."""
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return ""  # pragma: no cover


def _span(versions: tuple) -> str:
    (a, b), (c, d) = versions
    return f"{a}.{b} to {c}.{d}"


def run() -> int:
    """Print the findings and the round trip's result; the exit status."""
    from rich.console import Console

    console = Console(soft_wrap=True, highlight=False)
    found: list[tuple[str, str]] = []

    def say(status: str, text: str) -> None:
        found.append((status, text))
        console.print(f"{status.upper() if status == 'fail' else status:<4}  {text}", markup=False)

    console.print("kvtier doctor: what this machine gives kvtier", markup=False)
    python(say)
    with step(console, "loading torch", prefix="kvtier doctor"):
        import torch
    device = gpu(say, torch)
    libraries(say, torch, device)
    host(say)
    ok = round_trip(say, console, device)
    failed = [text.split(":", 1)[0] for status, text in found if status == "fail"]
    if failed or not ok:
        print(f"kvtier doctor: {len(failed)} problem{'s' if len(failed) != 1 else ''} ("
              + ", ".join(failed) + ")" if failed else "kvtier doctor: the round trip failed", file=sys.stderr)
        return 1
    where = "on the GPU" if device == "cuda" else "on the CPU through the Triton interpreter (no GPU found)"
    console.print(f"kvtier doctor: kvtier works here, {where}", markup=False)
    return 0


def python(say) -> None:
    v = sys.version_info[:2]
    lo, hi = PYTHONS
    if lo <= v <= hi:
        say("ok", f"Python {platform.python_version()} (kvtier: {_span(PYTHONS)})")
    else:
        say("note", f"Python {platform.python_version()}: kvtier's set-up is resolved and tested on "
                    f"{_span(PYTHONS)}" + (" (3.14: without the remote extra, untested)" if v == (3, 14) else ""))
    import kvtier

    where = os.path.dirname(os.path.abspath(kvtier.__file__))
    checkout = os.path.isfile(os.path.join(os.path.dirname(where), "bench", "progress.py"))
    say("ok", f"kvtier {kvtier.__version__} from {where}" + (" (a source checkout)" if checkout else ""))


def gpu(say, torch) -> str:
    """Report torch's CUDA and the GPU; the device the round trip uses."""
    built = torch.version.cuda
    say("ok", f"torch {torch.__version__}, built {'for CUDA ' + built if built else 'without CUDA'}")
    if not torch.cuda.is_available():
        why = ("torch was built without CUDA: install its CUDA build" if not built else
               "no GPU visible (driver, CUDA_VISIBLE_DEVICES or the container's devices)")
        say("note", f"GPU: none ({why}); kvtier's copies run through the Triton interpreter (correct, not fast)")
        return "cpu"
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        say("ok", f"GPU {i}: {p.name}, compute capability {p.major}.{p.minor}, {gib(p.total_memory)}")
    driver = _nvidia_smi("driver_version")
    say("ok" if driver else "note", f"NVIDIA driver: {driver or 'unknown (no nvidia-smi)'}")
    return "cuda"


def _nvidia_smi(field: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={field}", "--format=csv,noheader"], check=False, capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def libraries(say, torch, device: str) -> None:
    triton = _version("triton")
    interp = os.environ.get("TRITON_INTERPRET") == "1" or device == "cpu"
    say("ok" if triton else "fail", f"triton: {triton or 'not installed (kvtier needs it)'}"
        + (" (the interpreter: TRITON_INTERPRET=1)" if triton and interp else ""))
    for dist in ("numba", "numpy"):
        v = _version(dist)
        say("ok" if v else "fail", f"{dist}: {v or 'not installed (kvtier needs it)'}")
    cupy = [(d, v) for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if (v := _version(d))]
    if not cupy:
        say("note", "CuPy: not installed: the layer signal uses torch's CUDA events (CuPy's cost less host time: "
                    "pip install 'kvtier[cuda13]' or 'kvtier[cuda12]', matching torch's CUDA)"
            if device == "cuda" else "CuPy: not installed (only the GPU's layer signal uses it)")
    else:
        dist, v = cupy[0]
        built = torch.version.cuda
        match = built is None or not dist.startswith("cupy-cuda") or dist[len("cupy-cuda"):].startswith(
            built.split(".")[0])
        say("ok" if match else "fail", f"CuPy: {dist} {v}" + ("" if match else
            f", but torch is built for CUDA {built}: install cupy-cuda{built.split('.')[0]}x"))
    mooncake = _version("mooncake-transfer-engine-non-cuda") or _version("mooncake-transfer-engine")
    if mooncake is None:
        say("note", "Mooncake client: not installed (only the remote tier needs it: pip install 'kvtier[remote]', "
                    f"Python {_span(REMOTE_PYTHONS)})")
    else:
        try:
            from mooncake.store import MooncakeDistributedStore  # noqa: F401
        except ImportError as e:
            say("fail", f"Mooncake client: {mooncake} does not load ({e}): apt-get install libibverbs1")
        else:
            say("ok", f"Mooncake client: {mooncake} (loads)")
    sglang = _version("sglang")
    if sglang is None:
        say("note", f"SGLang: not installed (the backend needs sglang=={SGLANG})")
    else:
        say("ok" if sglang == SGLANG else "fail", f"SGLang: {sglang}"
            + ("" if sglang == SGLANG else f" (kvtier's backend supports {SGLANG} only)"))


def host(say) -> None:
    avail = available_memory_bytes()
    if avail is not None:
        usable = max(0, avail - int(KVTIER_RESERVE_GIB * (1 << 30)))
        say("ok", f"host memory: {gib(avail)} available: a host pool of up to {gib(usable)} fits by kvtier's rule "
                  f"({KVTIER_RESERVE_GIB:g} GiB kept free; under SGLang its own rule: kvtier config check)")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else _size(soft)
    say("ok" if soft == resource.RLIM_INFINITY else "note",
        f"locked-memory limit (ulimit -l): {limit} (CUDA's pinned pools do not count against it; Mooncake's RDMA "
        "registration does)")
    if os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        say("ok", f"/dev/shm: {gib(st.f_blocks * st.f_frsize)}, {gib(st.f_bavail * st.f_frsize)} free (an MLA "
                  "model's TP ranks on one host share one host pool there; Docker: --shm-size)")
    else:
        say("note", "/dev/shm: absent (an MLA model's TP ranks each keep a host pool of their own)")


def round_trip(say, console, device: str) -> bool:
    """Store 6 pages through a KVTier, load them whole and layer by layer into other slots, compare every byte."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    with step(console, "preparing a KVTier (pool, host index)", "(numba compiles the index on a first run: up "
              "to a few minutes; later runs load it from its cache)", prefix="kvtier doctor"):
        import torch

        from kvtier.config import TierConfig
        from kvtier.kernels import PagedKV
        from kvtier.tier import HostBlockPool, KVTier

        class RegisteredPool(HostBlockPool):
            pin_memory_max_bytes = 0  # pinned by cudaHostRegister, as pools over 1 GiB are

        layers, slots_n, page = 4, 512, 16
        gen = torch.Generator().manual_seed(0)
        bufs = [torch.randn(slots_n, 2, 64, generator=gen).to(torch.bfloat16).to(device) for _ in range(2 * layers)]
        kv = PagedKV.mha(bufs[:layers], bufs[layers:], page_size=page)
        config = TierConfig(cpu_cache_gb=1 / 64, page_size=page)
        pool = RegisteredPool(kv.geometry, cpu_cache_gb=config.cpu_cache_gb, layout=config.host_layout)
        tier = KVTier(kv, config, pool=pool)
    try:
        prompt = list(range(1000, 1100))  # 6 full pages
        src = torch.arange(0, 100, device=device)
        kept = [b[src[:96]].clone() for b in kv.buffers]
        with step(console, "store, load and layerwise load", prefix="kvtier doctor"):
            tier.wait(tier.store(prompt, None, src))
            held = tier.lookup(prompt)
            results = {}
            for name, fn, base in (("load", tier.load, 128), ("layerwise load", tier.load_layerwise, 256)):
                dst = torch.arange(base, base + 100, device=device)
                task = fn(prompt, None, dst)
                tier.wait_on_current_stream(task)
                if device == "cuda":
                    torch.cuda.current_stream().synchronize()
                tier.wait(task)
                results[name] = all(torch.equal(b[dst[:96]], k) for b, k in zip(kv.buffers, kept))
    finally:
        tier.destroy()
    ok = held == 6 and all(results.values())
    pinned = "a registered pinned pool" if device == "cuda" else "an unpinned pool (no CUDA)"
    say("ok" if ok else "fail", f"round trip: KVTier on {device} with {pinned}: {held} of 6 pages held; "
        + ", ".join(f"{name} {'every byte back' if same else 'BYTES DIFFER'}" for name, same in results.items()))
    return ok
