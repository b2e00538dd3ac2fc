"""Many copy-engine copies in one driver call: ``cuMemcpyBatchAsync`` (CUDA 12.8 and later), through ctypes.

A fragmented host pool turns one staged copy into a copy per run of blocks and row. Issued one by one
(``cudaMemcpyAsync`` through CuPy, ~1-2 us of host time each, more for 2-D copies) thousands of them make the host,
not PCIe, the bound. One batched call takes arrays of (dst, src, size) and queues them all; the batch runs in
stream order as a whole, its copies in no order among themselves (they never overlap here).

The CUDA 13 driver exports the call as ``cuMemcpyBatchAsync_v2`` (no failure index); 12.8 and 12.9 drivers as
``cuMemcpyBatchAsync`` with a ``failIdx`` argument. Without either (an older driver, no driver) :func:`available`
is False and callers issue their copies one by one.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple, Optional

import numpy as np

from kvtier.kernels.pinned import registration_boundaries, split_at_registrations

_MIN_DRIVER_VERSION = 12080  # cuMemcpyBatchAsync appears in CUDA 12.8
_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """CUmemcpyAttributes."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]


class _Driver(NamedTuple):
    call: object  # the ctypes function
    with_fail_index: bool  # the 12.8 ABI: a size_t* failIdx before the stream
    error_string: object


@functools.cache
def _driver() -> Optional[_Driver]:
    """The driver's batched copy, or None where it is missing (loaded once)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < _MIN_DRIVER_VERSION:
        return None
    p = ctypes.c_void_p
    for name, with_fail in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        call = getattr(lib, name, None)
        if call is None:
            continue
        call.argtypes = [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t] + ([p] if with_fail else []) + [p]
        call.restype = ctypes.c_int
        err = lib.cuGetErrorString
        err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        return _Driver(call, with_fail, err)
    return None


def available() -> bool:
    """Whether this process can issue batched copies (a CUDA 12.8+ driver with ``cuMemcpyBatchAsync``)."""
    return _driver() is not None


_ATTRS = _Attributes(_SRC_ACCESS_ORDER_STREAM, _Location(0, 0), _Location(0, 0), 0)
_ATTR_INDEX = (ctypes.c_size_t * 1)(0)


def memcpy_batch(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
    """Queue ``len(sizes)`` copies ``srcs[i] -> dsts[i]`` of ``sizes[i]`` bytes on the CUDA stream handle
    ``stream`` (not the legacy default stream) in one driver call. Addresses are device pointers or host memory the
    GPU can address; no copy may span two host registrations (see :func:`split_rows`)."""
    drv = _driver()
    if drv is None:
        raise RuntimeError("cuMemcpyBatchAsync needs a CUDA 12.8+ driver (kvtier.kernels.batch_copy.available())")
    n = sizes.size
    if not (dsts.size == srcs.size == n):
        raise ValueError(f"dsts, srcs and sizes differ in length: {dsts.size}, {srcs.size}, {n}")
    if n == 0:
        return
    d, s, z = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
    args = [d.ctypes.data, s.ctypes.data, z.ctypes.data, n, ctypes.addressof(_ATTRS), ctypes.addressof(_ATTR_INDEX), 1]
    if drv.with_fail_index:
        fail = ctypes.c_size_t(0)
        args.append(ctypes.addressof(fail))
    rc = drv.call(*args, stream)
    if rc != 0:
        msg = ctypes.c_char_p()
        drv.error_string(rc, ctypes.byref(msg))
        raise RuntimeError(f"cuMemcpyBatchAsync of {n} copies failed: CUDA error {rc} "
                           f"({(msg.value or b'?').decode()})")


def split_rows(host: np.ndarray, other: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``[host[i], host[i] + sizes[i])`` (with their partner addresses ``other[i]``) split where a host row
    crosses a registration boundary (a copy may not span two ``cudaHostRegister`` ranges). Rows inside one range,
    or outside all of them, pass unchanged; the order is kept."""
    bounds = registration_boundaries()
    if bounds.size == 0 or host.size == 0:
        return host, other, sizes
    ends = host + sizes
    crosses = np.searchsorted(bounds, host, side="right") < np.searchsorted(bounds, ends, side="left")
    if not crosses.any():
        return host, other, sizes
    out_h, out_o, out_z = [], [], []
    for i in range(host.size):
        h, o, z = int(host[i]), int(other[i]), int(sizes[i])
        pieces = split_at_registrations(h, z) if crosses[i] else [(0, z)]
        for off, length in pieces:
            out_h.append(h + off)
            out_o.append(o + off)
            out_z.append(length)
    as_u64 = functools.partial(np.array, dtype=np.uint64)
    return as_u64(out_h), as_u64(out_o), as_u64(out_z)
