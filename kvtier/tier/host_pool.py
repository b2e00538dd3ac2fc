"""HostBlockPool: the host tier's block store, one (pinned) host tensor cut into blocks, and its block allocator.

A block is one page (``page_size`` tokens) of every layer, K and V (:class:`~kvtier.geometry.KVGeometry`); the
pool's tensor is ``geometry.host_shape(num_blocks, layout)``. Block ids are handed out by :meth:`alloc` and
returned by :meth:`free`; the pool does not know what a block holds (the manager and the index do).

Pinning: on CUDA machines the tensor is page-locked so the transfer kernels can address it through UVA and the copy
engines can DMA it. Pools up to :data:`PIN_MEMORY_MAX_BYTES` use ``torch.empty(pin_memory=True)``; bigger ones are
allocated as plain memory and registered with ``cudaHostRegister`` in chunks of at most :data:`REGISTER_CHUNK_BYTES`
(one registration of hundreds of GiB fails, vllm#51081; torch's pinned allocator would round a 48 GiB request up to
64 GiB). Chunk boundaries are page aligned and, where the geometry allows, fall between blocks (``page_first``) or
between layers (``layer_first``), and a contiguous run handed out by :meth:`alloc` stays within one
``page_first`` chunk. Ids from the no-run fallback may still be consecutive across a boundary, and a layer_first layer
over the chunk limit is split mid-layer; a copy-engine copy may then span two registrations (pools over 64 GiB
only; see bench/results/tier_notes.md). Without CUDA nothing can be pinned and the pool is plain memory (the kernels
only require pinning when the device side is CUDA).

All public methods hold the pool's RLock (``synchronized``); :meth:`destroy` is idempotent.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from typing import Optional, Sequence

import numpy as np
import torch
import xxhash

from kvtier._checks import check_count
from kvtier.geometry import KVGeometry, check_layout
from kvtier.kernels.pinned import register_pinned_range, unregister_pinned_range

GiB = 1 << 30
# Tuned constants (docs/DESIGN.md, "Tuned constants"). torch's pinned allocator rounds requests up to a power of two:
# fine for small pools, wasteful for big ones.
PIN_MEMORY_MAX_BYTES = 1 * GiB
# Largest single cudaHostRegister: vllm#51081 registers in 64 GiB chunks (one >= 512 GiB registration fails with
# code 2 on an H200 host); registration costs the same per GiB either way.
REGISTER_CHUNK_BYTES = 64 * GiB
PAGE_ALIGN = 4096  # chunk boundaries fall on OS page boundaries: two registrations never share a page
# Host memory left free when a pool is sized against what the machine has (no engine budget given): the process's
# own heap, the engine's other host buffers and the page cache need room; an engine passes its per-rank budget.
DEFAULT_RESERVE_GB = 2.0


def synchronized(method):
    """Run ``method`` holding ``self._lock`` (an RLock)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def available_memory_bytes() -> Optional[int]:
    """Host memory available for new allocations (psutil, else /proc/meminfo MemAvailable); None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan_chunks(nbytes: int, *, unit: int, limit: int = REGISTER_CHUNK_BYTES,
                align: int = PAGE_ALIGN) -> list[tuple[int, int]]:
    """Split ``[0, nbytes)`` into ``(offset, length)`` registration chunks of at most ``limit`` bytes.

    Boundaries are multiples of ``lcm(unit, align)`` (so they fall between units and on page boundaries) when that
    fits in ``limit``, else multiples of ``align`` alone.
    """
    if nbytes <= 0:
        return []
    step = unit * align // math.gcd(unit, align)
    if step > limit:
        step = align
    chunk = max(limit // step, 1) * step
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


class HostBlockPool:
    """A host tensor of ``num_blocks`` blocks and an allocator over their ids.

    Args:
        geometry: the KV geometry (block = one page of all layers, K and V).
        num_blocks: blocks to hold; or give ``cpu_cache_gb`` (GiB) and the pool holds as many as fit.
        cpu_cache_gb: pool size in GiB when ``num_blocks`` is not given.
        layout: ``"layer_first"`` or ``"page_first"`` (see :mod:`kvtier.geometry`).
        pin: True: page-lock (error without CUDA); False: plain memory; None: pin when CUDA is available.
        reserve_gb: host memory to leave free; the pool is refused if it would not.
        budget_bytes: this process's share of host memory, given by the engine (SGLang splits what is available,
            less a reserve, between the ranks of a host); checked instead of the machine's available memory.
        memory: host memory to cut the pool from instead of allocating it: a CPU uint8 tensor of at least
            ``num_blocks * block_bytes`` bytes, page aligned (a segment several processes map,
            :class:`~kvtier.tier.shared_memory.SharedSegment`); registered with CUDA in chunks when pinning.

    Raises:
        ValueError: the pool is empty, or bigger than the available host memory minus ``reserve_gb``.
        RuntimeError: the memory cannot be pinned (the message gives the CUDA error and the usual causes).

    How it pins is two tuned constants, class attributes (a test or benchmark subclass sets smaller ones to force
    the registered path and several chunks): ``pin_memory_max_bytes`` (pools up to it are pinned by torch's
    allocator, bigger ones registered) and ``register_chunk_bytes`` (the largest single ``cudaHostRegister``).
    """

    pin_memory_max_bytes: int = PIN_MEMORY_MAX_BYTES
    register_chunk_bytes: int = REGISTER_CHUNK_BYTES

    def __init__(self, geometry: KVGeometry, num_blocks: Optional[int] = None, *,
                 cpu_cache_gb: Optional[float] = None, layout: str = "layer_first", pin: Optional[bool] = None,
                 reserve_gb: float = DEFAULT_RESERVE_GB, budget_bytes: Optional[int] = None,
                 memory: Optional[torch.Tensor] = None) -> None:
        check_layout(layout)
        self._lock = threading.RLock()
        self.geometry, self.layout = geometry, layout
        if (num_blocks is None) == (cpu_cache_gb is None):
            raise ValueError("give exactly one of num_blocks and cpu_cache_gb")
        if num_blocks is None:
            assert cpu_cache_gb is not None  # exactly one of the two (checked above)
            if not cpu_cache_gb > 0:
                raise ValueError(f"cpu_cache_gb must be > 0, got {cpu_cache_gb!r}")
            num_blocks = int(cpu_cache_gb * GiB) // geometry.block_bytes
            if num_blocks < 1:
                raise ValueError(f"cpu_cache_gb={cpu_cache_gb} holds no block of {geometry.block_bytes} bytes")
        self.num_blocks = check_count("num_blocks", num_blocks)
        self.block_bytes = geometry.block_bytes
        self.nbytes = self.num_blocks * self.block_bytes
        cuda = torch.cuda.is_available()
        if pin is None:
            pin = cuda
        if pin and not cuda:
            raise RuntimeError("cannot pin host memory: CUDA is not available (use pin=False or pin=None)")
        if memory is not None:
            if memory.dtype != torch.uint8 or memory.device.type != "cpu" or memory.dim() != 1:
                raise ValueError("memory must be a 1-D CPU uint8 tensor")
            if memory.numel() < self.nbytes or memory.data_ptr() % PAGE_ALIGN:
                raise ValueError(f"memory of {memory.numel()} bytes at {memory.data_ptr():#x} cannot hold a page "
                                 f"aligned pool of {self.nbytes} bytes")
        if memory is None or budget_bytes is not None:  # memory given exists already: nothing more to check
            self._check_memory(reserve_gb, budget_bytes)

        self._registered: list[int] = []  # data pointers of cudaHostRegister'ed chunks, unregistered by destroy()
        self.pinned_bytes = 0
        self.pin_seconds = 0.0
        self.chunks: list[tuple[int, int]] = [(0, self.nbytes)]
        t0 = time.perf_counter()
        if memory is not None:
            raw = memory
        elif pin and self.nbytes <= self.pin_memory_max_bytes:
            try:
                raw = torch.empty(self.nbytes + PAGE_ALIGN, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:
                raise RuntimeError(f"cannot pin a {self.nbytes / GiB:.2f} GiB host pool: {e} (check the locked-"
                                   f"memory limit, ulimit -l, and the container's memlock limit)") from None
            self.pinned_bytes = self.nbytes
        else:
            raw = torch.empty(self.nbytes + PAGE_ALIGN, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE_ALIGN
        self._raw = raw
        self._flat = raw[start:start + self.nbytes]
        self.host: torch.Tensor = self._flat.view(geometry.dtype).view(geometry.host_shape(self.num_blocks, layout))
        self._bytes: Optional[np.ndarray] = None  # block_rows' view of the pool (made on first use)
        if self.pinned_bytes == 0:  # plain memory: registered in chunks when pinning (planned either way)
            self.chunks = plan_chunks(self.nbytes, unit=self._register_unit(), limit=self.register_chunk_bytes)
            if pin:
                self._register_chunks()
        self.pin_seconds = time.perf_counter() - t0

        # Allocation runs never cross a page_first chunk boundary that falls between blocks.
        seg = self.num_blocks
        if layout == "page_first" and len(self.chunks) > 1 and self.chunks[0][1] % self.block_bytes == 0:
            # (a chunk that is not a whole number of blocks cannot be respected: runs may span, still correct)
            seg = self.chunks[0][1] // self.block_bytes
        self._segment_blocks = seg
        self._free = np.ones(self.num_blocks, dtype=bool)  # block id -> free?
        self._num_free = self.num_blocks
        self._cursor = 0  # where the next contiguous run is tried first
        self._block_digest = 0  # rolling hash of every alloc and free, in order (see block_digest)
        self._destroyed = False

    # --- sizing and pinning ---

    def _check_memory(self, reserve_gb: float, budget_bytes: Optional[int]) -> None:
        if budget_bytes is not None:
            if self.nbytes > budget_bytes:
                raise ValueError(f"host pool of {self.nbytes / GiB:.2f} GiB does not fit this rank's share of host "
                                 f"memory, {budget_bytes / GiB:.2f} GiB (what is available, less the engine's "
                                 f"reserve, split between the ranks of this host); lower cpu_cache_gb")
            return
        avail = available_memory_bytes()
        if avail is None:
            return
        usable = avail - int(reserve_gb * GiB)
        if self.nbytes > usable:
            raise ValueError(f"host pool of {self.nbytes / GiB:.2f} GiB does not fit: {avail / GiB:.2f} GiB "
                             f"available, {reserve_gb:.2f} GiB kept in reserve; lower cpu_cache_gb")

    def _register_unit(self) -> int:
        """Bytes between natural boundaries of the host tensor: a block, or a layer."""
        if self.layout == "page_first":
            return self.block_bytes
        return self.num_blocks * self.geometry.page_bytes

    def _register_chunks(self) -> None:
        cudart = torch.cuda.cudart()
        base = self._flat.data_ptr()
        for off, length in self.chunks:
            ptr = base + off
            err = cudart.cudaHostRegister(ptr, length, 0)
            code = int(getattr(err, "value", err))
            if code != 0:
                self._unregister()
                raise RuntimeError(
                    f"cannot pin the host pool: cudaHostRegister of {length / GiB:.2f} GiB at offset "
                    f"{off / GiB:.2f} GiB (pool {self.nbytes / GiB:.2f} GiB) failed with CUDA error {code} "
                    f"({err}); check the locked-memory limit (ulimit -l, container memlock) and free host memory")
            self._registered.append(ptr)
            register_pinned_range(ptr, length)  # torch's is_pinned() does not know registered memory
            self.pinned_bytes += length

    def _unregister(self) -> None:
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                unregister_pinned_range(ptr)
                cudart.cudaHostUnregister(ptr)
        self._registered = []
        self.pinned_bytes = 0

    @property
    @synchronized
    def destroyed(self) -> bool:
        """True once :meth:`destroy` has released the memory."""
        return getattr(self, "_destroyed", True)

    def destroy(self) -> None:
        """Unregister pinned chunks and drop the memory; idempotent. No transfer may use the pool afterwards."""
        if getattr(self, "_destroyed", True):
            return
        self._destroyed = True
        self._unregister()
        self.host = self._flat = self._raw = self._bytes = None  # type: ignore[assignment]

    def __del__(self) -> None:
        try:
            self.destroy()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # --- block allocator ---

    @synchronized
    def alloc(self, n: int) -> Optional[np.ndarray]:
        """Take ``n`` free block ids, preferring one run of consecutive ids.

        Returns:
            int64 ids (ascending), or None when fewer than ``n`` blocks are free (nothing taken then).
        """
        self._check_alive()
        n = check_count("n", n, 0)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        if n > self._num_free:
            return None
        start = self._find_run(n)
        if start is not None:
            ids = np.arange(start, start + n, dtype=np.int64)
        else:  # no run long enough: the lowest free ids (ascending, so they still form a few runs)
            ids = np.flatnonzero(self._free)[:n].astype(np.int64)
        self._free[ids] = False
        self._num_free -= n
        self._block_digest = xxhash.xxh64_intdigest(b"A" + ids.tobytes(), seed=self._block_digest) >> 1
        self._cursor = int(ids[-1]) + 1
        if self._cursor >= self.num_blocks:
            self._cursor = 0
        return ids

    def _find_run(self, n: int) -> Optional[int]:
        seg = self._segment_blocks
        c = self._cursor
        if c + n <= self.num_blocks and c // seg == (c + n - 1) // seg and self._free[c:c + n].all():
            return c
        if n > seg:
            return None
        for s0 in range(0, self.num_blocks, seg):  # first fit, segment by segment
            free = self._free[s0:s0 + seg]
            edges = np.diff(np.concatenate(([0], free.view(np.int8), [0])))
            starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
            fit = np.flatnonzero(ends - starts >= n)
            if fit.size:
                return s0 + int(starts[fit[0]])
        return None

    @synchronized
    def free(self, ids: Sequence[int] | np.ndarray) -> None:
        """Return block ids to the pool.

        Raises:
            ValueError: an id is out of range, repeated, or already free (a double free); nothing is freed then.
        """
        self._check_alive()
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        if a.size == 0:
            return
        if a.min() < 0 or a.max() >= self.num_blocks:
            raise ValueError(f"block ids out of range [0, {self.num_blocks}): {a[(a < 0) | (a >= self.num_blocks)]}")
        if np.unique(a).size != a.size:
            raise ValueError(f"block ids repeated in one free: {a}")
        already = a[self._free[a]]
        if already.size:
            raise ValueError(f"double free of host blocks {already.tolist()}")
        self._free[a] = True
        self._num_free += a.size
        self._block_digest = xxhash.xxh64_intdigest(b"F" + a.tobytes(), seed=self._block_digest) >> 1

    @synchronized
    def reset(self, keep: Optional[np.ndarray] = None) -> None:
        """Mark every block free except those of ``keep`` (the caller guarantees no transfer uses the others)."""
        self._check_alive()
        self._free[:] = True
        if keep is not None and keep.size:
            self._free[keep] = False
        self._num_free = int(self._free.sum())
        self._cursor = 0

    @synchronized
    def block_rows(self, block_id: int) -> np.ndarray:
        """Block ``block_id``'s bytes as a uint8 view ``[layers, row]``, a row being one layer's page, K then V:
        contiguous in ``page_first``, one strided row per layer in ``layer_first``. Its byte order is a
        ``page_first`` block's, so bytes copied through it mean the same in both layouts."""
        self._check_alive()
        layers = self.geometry.num_layers
        if self._bytes is None:
            flat = self._flat.numpy()
            shape = (self.num_blocks, layers, -1) if self.layout == "page_first" else (layers, self.num_blocks, -1)
            self._bytes = flat.reshape(shape)
        return self._bytes[block_id] if self.layout == "page_first" else self._bytes[:, block_id]

    def is_free(self, block_id: int) -> bool:
        return bool(self._free[block_id])

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("the host pool was destroyed")

    # --- accounting ---

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def block_digest(self) -> int:
        """A hash (>= 0, < 2**63) of the ids every :meth:`alloc` handed out and every :meth:`free` took back, in
        order: pools that went through the same allocations and frees have the same digest (processes sharing one
        pool's memory compare it)."""
        return self._block_digest

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def occupancy(self) -> float:
        """Fraction of blocks in use (held by the index or by in-flight stores)."""
        return self.num_used / self.num_blocks

    @property
    def is_pinned(self) -> bool:
        return self.pinned_bytes == self.nbytes

    def stats(self) -> dict:
        return {"num_blocks": self.num_blocks, "block_bytes": self.block_bytes, "nbytes": self.nbytes,
                "pinned_bytes": self.pinned_bytes, "num_used": self.num_used, "num_free": self.num_free,
                "occupancy": self.occupancy, "register_chunks": len(self._registered),
                "pin_seconds": self.pin_seconds}

    def __repr__(self) -> str:
        return (f"HostBlockPool(blocks={self.num_blocks}, block_bytes={self.block_bytes}, layout={self.layout!r}, "
                f"used={self.num_used}, pinned={self.pinned_bytes / GiB:.2f} GiB)")
