"""Copy-engine rows issued from several threads: the issue of a long batch of rows split among streams.

``cuMemcpyBatchAsync`` costs the host about what the copy engine takes to write a 32-64 KiB row to the host, so a store
of scattered blocks (18,432 rows of 64 KiB at 8k tokens of Qwen3-8B KV in runs of one page) can be paced by its issue.
Threads issuing at once wait on each other in the driver, and inside the staged store two threads go fast or slow from
one measurement to the next, so stores issue from one thread by default (``Tuning.store_row_threads``; docs/DESIGN.md,
"Tuned constants"). The driver calls release the GIL.

:class:`RowIssuer` runs the split: the caller's thread issues the first part on the caller's stream, worker threads
the others on their own streams, which wait for the caller's stream before their first copy and which the caller's
stream waits for after their last, so the rows run in the caller's stream order as one batch would.
"""

from __future__ import annotations

import concurrent.futures
from typing import Optional

import numpy as np
import torch

from kvtier.kernels import batch_copy

__all__ = ["RowIssuer", "issue_parts"]


def issue_parts(num_rows: int, threads: int, batch: int) -> list[tuple[int, int]]:
    """Rows ``[lo, hi)`` of each thread that issues a batch of ``num_rows`` rows: contiguous, in order, nearly
    equal, no part shorter than ``batch`` rows (fewer threads where the rows are few)."""
    if num_rows <= 0:
        return []
    parts = max(1, min(threads, num_rows // batch))
    edges = np.linspace(0, num_rows, parts + 1).round().astype(np.int64)
    return [(int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:])]


def _issue(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, batch: int, stream: int) -> None:
    """``memcpy_batch`` of the rows in batches of ``batch`` on the raw stream ``stream``."""
    for a in range(0, sizes.size, batch):
        batch_copy.memcpy_batch(dsts[a:a + batch], srcs[a:a + batch], sizes[a:a + batch], stream)


def _bind_device(index: int) -> None:
    """Make device ``index``'s primary context current on a worker thread (its driver calls need one):
    ``cudaSetDevice`` through CuPy, which calls it even where the thread's device already reads as ``index``
    (torch skips the call then); torch's where CuPy is missing."""
    try:
        import cupy
    except ImportError:  # pragma: no cover - cupy is an optional extra
        torch.cuda.set_device(index)
        return
    cupy.cuda.runtime.setDevice(index)


class RowIssuer:
    """Issues copy-engine rows on one device from ``threads`` threads (the caller's and ``threads - 1`` workers),
    in batches of ``batch`` rows.

    Not thread-safe: one caller at a time (a staged transfer's copies are issued by one thread at a time).
    """

    def __init__(self, device: torch.device, threads: int, batch: int) -> None:
        self.batch = batch
        workers = threads - 1 if device.type == "cuda" else 0
        self._device_index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if workers else None
        self._streams = [torch.cuda.Stream(device=device) for _ in range(workers)]
        self._begin = torch.cuda.Event() if workers else None
        self._ends = [torch.cuda.Event() for _ in range(workers)]
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        if workers:  # the ignore: _device_index is an int whenever there are workers
            self._pool = concurrent.futures.ThreadPoolExecutor(
                workers, thread_name_prefix="kvtier-rows",
                initializer=_bind_device, initargs=(self._device_index,))  # type: ignore[arg-type]

    def issue(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream) -> None:
        """Queue the copies ``srcs[i] -> dsts[i]`` of ``sizes[i]`` bytes (uint64 arrays) behind ``stream``'s work
        (a torch stream of the device); ``stream`` waits for all of them. A worker's failure raises here after
        every part issued has been joined to ``stream``."""
        parts = issue_parts(sizes.size, 1 + len(self._streams), self.batch) if self._streams else []
        if len(parts) <= 1:
            _issue(dsts, srcs, sizes, self.batch, stream.cuda_stream)
            return
        side = self._streams[:len(parts) - 1]
        assert self._begin is not None and self._pool is not None  # parts for side streams: there are workers
        self._begin.record(stream)
        for s in side:
            s.wait_event(self._begin)
        futures: list[concurrent.futures.Future] = []
        try:
            for (lo, hi), s in zip(parts[1:], side):
                futures.append(self._pool.submit(_issue, dsts[lo:hi], srcs[lo:hi], sizes[lo:hi], self.batch,
                                                 s.cuda_stream))
            lo, hi = parts[0]
            _issue(dsts[lo:hi], srcs[lo:hi], sizes[lo:hi], self.batch, stream.cuda_stream)
        finally:
            errors = [f.exception() for f in futures]  # waits for every worker submitted
            for s, end in zip(side[:len(futures)], self._ends):
                end.record(s)
                stream.wait_event(end)
        for e in errors:
            if e is not None:
                raise e

    def close(self) -> None:
        """Stop the worker threads (after the rows queued)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
