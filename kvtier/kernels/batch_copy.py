"""Many copy-engine copies in one driver call (CUDA 12.8 and later), through ctypes.

A fragmented host pool turns one staged copy into a copy per run of blocks and row. Issued one by one
(``cudaMemcpyAsync`` through CuPy, microseconds of host time each, more for 2-D copies) thousands of them make the host,
not PCIe, the bound. One batched call queues them all; the batch runs in stream order as a whole, its copies in no
order among themselves (they never overlap here). Two calls:

* ``cuMemcpyBatchAsync`` (:func:`memcpy_batch`): arrays of (dst, src, size), one copy per row.
* ``cuMemcpy3DBatchAsync`` (:func:`memcpy_rects`): pitched rectangles, ``height`` rows of ``width`` bytes each,
  one copy per rectangle. A run of blocks of a ``layer_first`` pool is such a rectangle (a row per layer, its
  pages' K and V), so a chunk of short runs is a copy per run, not per run and layer.

The CUDA 13 driver exports them as ``..._v2`` (no failure index); 12.8 and 12.9 drivers without the suffix, with a
``failIdx`` argument. Without them (an older driver, no driver) :func:`available` / :func:`rects_available` are
False and callers issue their copies one by one.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, NamedTuple, Optional

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
    call: Callable[..., int]  # the ctypes function
    fail_at: Optional[int]  # the 12.8 ABI: where its size_t* failIdx argument goes (None: the _v2 call, none)
    error_string: Callable[..., int]


@functools.cache
def _driver() -> Optional[_Driver]:
    """The driver's batched copy, or None where it is missing (loaded once)."""
    p = ctypes.c_void_p
    return _load(("cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync"), [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t],
                 fail_at=7)


@functools.cache
def _driver_3d() -> Optional[_Driver]:
    """The driver's batched 3-D copy, or None where it is missing (loaded once)."""
    return _load(("cuMemcpy3DBatchAsync_v2", "cuMemcpy3DBatchAsync"),
                 [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_ulonglong], fail_at=2)


def available() -> bool:
    """Whether this process can issue batched copies (a CUDA 12.8+ driver with ``cuMemcpyBatchAsync``)."""
    return _driver() is not None


def _load(names: tuple[str, str], argtypes: list, fail_at: int) -> Optional[_Driver]:
    """The first of ``names`` that the driver exports: the ``_v2`` call, taking ``argtypes`` and the stream, or
    the 12.8 ABI, which takes a ``size_t* failIdx`` at position ``fail_at`` as well; None without a 12.8+ driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < _MIN_DRIVER_VERSION:
        return None
    for name, at in zip(names, (None, fail_at)):
        call = getattr(lib, name, None)
        if call is None:
            continue
        types = list(argtypes)
        if at is not None:
            types.insert(at, ctypes.c_void_p)
        call.argtypes = types + [ctypes.c_void_p]
        call.restype = ctypes.c_int
        err = lib.cuGetErrorString
        err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        return _Driver(call, at, err)
    return None


def _call(drv: _Driver, what: str, args: list, stream: int) -> None:
    """Issue a batched call, raising with the driver's message on failure."""
    fail = ctypes.c_size_t(0)
    if drv.fail_at is not None:
        args = args[:drv.fail_at] + [ctypes.addressof(fail)] + args[drv.fail_at:]
    rc = drv.call(*args, stream)
    if rc != 0:
        msg = ctypes.c_char_p()
        drv.error_string(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")


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
    _call(drv, f"cuMemcpyBatchAsync of {n} copies", args, stream)


def rects_available() -> bool:
    """Whether this process can issue batched pitched copies (a CUDA 12.8+ driver with ``cuMemcpy3DBatchAsync``)."""
    return _driver_3d() is not None


_OPERAND_POINTER = 1  # CU_MEMCPY_OPERAND_TYPE_POINTER
# CUDA_MEMCPY3D_BATCH_OP with pointer operands (cuda.h): src and dst are CUmemcpy3DOperand {type; pad; ptr,
# rowLength, layerHeight, locHint {type, id}} of 40 bytes each, then the extent (width, height, depth), the source
# access order and flags: 112 bytes. Pointer-to-pointer copies count elements in bytes.
_BATCH_OP = np.dtype({
    "names": ["src_type", "src_ptr", "src_pitch", "src_height", "dst_type", "dst_ptr", "dst_pitch", "dst_height",
              "width", "height", "depth", "order"],
    "formats": ["<i4", "<u8", "<u8", "<u8", "<i4", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<i4"],
    "offsets": [0, 8, 16, 24, 40, 48, 56, 64, 80, 88, 96, 104],
    "itemsize": 112})


def memcpy_rects(dsts: np.ndarray, dst_pitches: np.ndarray, srcs: np.ndarray, src_pitches: np.ndarray,
                 widths: np.ndarray, heights: np.ndarray, stream: int) -> None:
    """Queue one pitched copy per rectangle ``i``: ``heights[i]`` rows of ``widths[i]`` bytes from
    ``srcs[i] + r * src_pitches[i]`` to ``dsts[i] + r * dst_pitches[i]``, on the CUDA stream handle ``stream``, in
    one driver call. Pitches are at least the width; a rectangle's host rows lie in one host registration."""
    drv = _driver_3d()
    if drv is None:
        raise RuntimeError("cuMemcpy3DBatchAsync needs a CUDA 12.8+ driver "
                           "(kvtier.kernels.batch_copy.rects_available())")
    n = widths.size
    if not all(a.size == n for a in (dsts, dst_pitches, srcs, src_pitches, heights)):
        raise ValueError("the rectangles' arrays differ in length")
    if n == 0:
        return
    ops = np.zeros(n, dtype=_BATCH_OP)
    ops["src_type"] = ops["dst_type"] = _OPERAND_POINTER
    ops["src_ptr"], ops["dst_ptr"], ops["width"], ops["height"] = srcs, dsts, widths, heights
    ops["src_height"] = ops["dst_height"] = heights
    # a one-row rectangle's pitch is its width (a pitch of 0 is not one the driver takes)
    ops["src_pitch"] = np.maximum(src_pitches, widths)
    ops["dst_pitch"] = np.maximum(dst_pitches, widths)
    ops["depth"] = 1
    ops["order"] = _SRC_ACCESS_ORDER_STREAM
    _call(drv, f"cuMemcpy3DBatchAsync of {n} rectangles", [n, ops.ctypes.data, 0], stream)


def crosses_registration(host: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per host span ``[host[i], ends[i])``: whether a registration boundary falls strictly inside it (a copy may
    not span two ``cudaHostRegister`` ranges)."""
    bounds = registration_boundaries()
    if bounds.size == 0:
        return np.zeros(host.size, dtype=bool)
    return np.searchsorted(bounds, host, side="right") < np.searchsorted(bounds, ends, side="left")


def split_rows(host: np.ndarray, other: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``[host[i], host[i] + sizes[i])`` (with their partner addresses ``other[i]``) split where a host row
    crosses a registration boundary (a copy may not span two ``cudaHostRegister`` ranges). Rows inside one range,
    or outside all of them, pass unchanged; the order is kept."""
    if host.size == 0:
        return host, other, sizes
    crosses = crosses_registration(host, host + sizes)
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
