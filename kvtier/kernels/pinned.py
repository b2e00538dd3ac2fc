"""Which host memory the GPU can address: torch's pinned allocations plus ranges registered with cudaHostRegister.

torch's ``Tensor.is_pinned()`` only knows memory from its own pinned allocator, so a big host pool that registers
plain memory in chunks (kvtier's HostBlockPool does, as vLLM does) reads as "not pinned" there although the GPU
addresses it fine. Whoever registers memory records the range here; the transfer checks consult both.
"""

from __future__ import annotations

import bisect
import threading

import numpy as np
import torch

_lock = threading.Lock()
_starts: list[int] = []  # sorted start addresses of registered ranges
_ends: dict[int, int] = {}  # start -> end (exclusive)


def register_pinned_range(ptr: int, nbytes: int) -> None:
    """Record that ``[ptr, ptr + nbytes)`` is registered with CUDA (cudaHostRegister succeeded)."""
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    with _lock:
        if ptr in _ends:
            raise ValueError(f"host range at {ptr:#x} is already recorded as pinned")
        bisect.insort(_starts, ptr)
        _ends[ptr] = ptr + nbytes


def unregister_pinned_range(ptr: int) -> None:
    """Forget a range recorded by :func:`register_pinned_range` (call before cudaHostUnregister)."""
    with _lock:
        if _ends.pop(ptr, None) is not None:
            _starts.remove(ptr)


def _covered(start: int, end: int) -> bool:
    """Whether registered ranges cover ``[start, end)`` without a gap."""
    with _lock:
        pos = start
        while pos < end:
            i = bisect.bisect_right(_starts, pos) - 1
            if i < 0 or _ends[_starts[i]] <= pos:
                return False
            pos = _ends[_starts[i]]
        return True


def split_at_registrations(ptr: int, nbytes: int) -> list[tuple[int, int]]:
    """Split ``[ptr, ptr + nbytes)`` into ``(offset, length)`` pieces that each lie in one registered range.

    One ``cudaMemcpyAsync`` may not span two separate ``cudaHostRegister`` registrations (it fails with
    cudaErrorInvalidValue, seen on an H200), so copy-engine copies into a chunk-registered pool are issued per piece.
    Memory outside every recorded range (torch-pinned or pageable) is one piece.
    """
    pieces = []
    with _lock:
        pos, end = ptr, ptr + nbytes
        while pos < end:
            i = bisect.bisect_right(_starts, pos) - 1
            stop = end
            if i >= 0 and _ends[_starts[i]] > pos:  # inside a registered range: stop at its end
                stop = min(end, _ends[_starts[i]])
            elif i + 1 < len(_starts):  # before the next range: stop where it starts
                stop = min(end, _starts[i + 1])
            pieces.append((pos - ptr, stop - pos))
            pos = stop
    return pieces


def is_pinned(t: torch.Tensor) -> bool:
    """Whether the GPU can address all of host tensor ``t``'s bytes (torch-pinned or recorded as registered)."""
    if t.is_pinned():
        return True
    nbytes = t.numel() * t.element_size()
    return nbytes > 0 and _covered(t.data_ptr(), t.data_ptr() + nbytes)


def registration_boundaries() -> np.ndarray:
    """Every start and end address of the recorded ranges, sorted (uint64): a host span ``[a, b)`` lies in one
    range or outside all of them when no boundary falls strictly inside it."""
    with _lock:
        bounds = set(_starts) | set(_ends.values())
    return np.array(sorted(bounds), dtype=np.uint64)
