"""Tuning: the transfer kernels' tuned constants, in one frozen dataclass with the measured defaults.

Callers never need one: every launcher defaults to :data:`DEFAULT_TUNING`. Benchmarks, probes and tests that
sweep a constant pass ``tuning=Tuning(...)``. Each default is the value measured best on an H200 (PCIe Gen5 x16,
Qwen3-8B KV); the reason for each, and the result file behind it, is a row of the "Tuned constants" table of
docs/DESIGN.md, and the sweeps are in bench/results/transfer_notes.md.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from kvtier._checks import check_count

__all__ = ["Tuning", "DEFAULT_TUNING", "check_tuning"]

MiB = 1 << 20
KiB = 1 << 10


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The kernels' tuned constants (docs/DESIGN.md, "Tuned constants", one row each).

    Direct kernel (:mod:`kvtier.kernels.transfer`):
        programs: persistent programs (one SM each) for bulk transfers: at the SM path's ceiling while a GEMM
            beside it slows least.
        tile_bytes: bytes one program loads before it stores (K and V together), the bytes it keeps in flight:
            host reads are latency bound over PCIe.
        num_warps: warps per program: 32 hold a 64 KiB tile at 64 B per thread (four 16-byte vectors).
        burst_bytes, burst_programs: a transfer of at most ``burst_bytes`` holds its SMs for microseconds, so it
            takes ``burst_programs`` of them to cut latency (one 16-token page of 36 layers is 36 tiles).

    Staged path (:mod:`kvtier.kernels.staged`):
        staging_bytes: bytes of each staging buffer: one layer of an 8k-token Qwen3-8B prefix, so a layerwise
            load is one chunk per layer.
        num_buffers: staging buffers per direction: a chunk's copy outlasts its gather and the next chunk's issue.
        gather_programs, gather_tile_bytes, gather_warps: the gather kernel (stores); not swept: a gather (~30 us
            a 16 MiB chunk) hides behind the previous chunk's copy (~300 us).
        scatter_programs: programs of the scatter kernel (loads): a scatter beside a forward costs it least when
            it is short.
        edge_chunk_divisor: the exposed first gather of a store and last scatter of a load move a chunk this
            many times smaller than a full one.
        pitched_min_rows: a ``layer_first`` run of blocks of a fragmented chunk is one pitched copy of its (layer,
            K/V) planes from this many planes (a span of 8 layers); shorter ones go a copy per plane. Pitched copies
            cost the host ~5 us each to issue; a run of 2 planes (a layerwise load) took 82 ms for 36 layers at
            8k tokens against 37 ms per plane (bench/results/probes/staged_pitched_h200.json).
        store_rows_min_bytes: a fragmented ``layer_first`` store moves its runs as rows (a ``cuMemcpyBatchAsync``
            row per plane and run, issued from ``store_row_threads`` threads) rather than pitched rectangles when
            the runs are at least this many bytes of a plane on average. The copy engine writes pitched 32 KiB rows
            at ~41 GB/s and separate rows at PCIe speed, but each separate row costs the host 0.45-1.05 us to issue,
            about what the engine takes to write 32 KiB, and a store's row mode is fast or slow per measurement
            (tight within one). Runs of two 16-token Qwen3-8B pages (64 KiB rows), staged store at 8k tokens: 22.6-
            22.8 ms as rows from two threads in 3 of 5 measurements, 28.6-30.5 in 2, against 29.3 pitched; at 1k
            3.12-3.30 in 4 of 5 and 4.13 in one, against 3.70 pitched. Runs of one page (32 KiB): 29.5-41.8 ms from
            two threads against 35.1-35.5 pitched, so they stay pitched (bench/results/probes/
            staged_store_threads_h200.json, staged_store_default64k_h200.json, fragmentation_h200_store_rows32k*.json
            and fragmentation_h200.json).
        store_row_threads: threads that issue a store's rows (the caller's and workers, each on its own stream).
            The rows of 1k tokens in runs of one page, alone on the copy engine: 3.1-3.3 ms from two threads in
            batches of 256 rows, 4.1-4.3 from one (one run 2.84); at 8k, 23.1-23.3 from two, 22.7 from one in batches
            of 1024 rows in 8 of 9 samples (store_rows_threads_h200.json). In the staged store at 8k, runs of two
            pages: 29.4 ms from one thread in batches of 256 (one measurement), 32.2 from three, 36.4 from four
            (staged_store_threads_h200.json); one thread in batches of 1024 is not measured there.
        row_batch: rows per ``cuMemcpyBatchAsync`` call of a store: the copy engine starts on a batch only once
            it is issued, so short batches start it sooner (1k tokens' rows from two threads: 3.1-3.3 ms in batches
            of 256 rows, 3.8-4.2 in batches of 1024; store_rows_threads_h200.json).
    """

    programs: int = 4
    tile_bytes: int = 64 * KiB
    num_warps: int = 32
    burst_bytes: int = 4 * MiB
    burst_programs: int = 32
    staging_bytes: int = 32 * MiB
    num_buffers: int = 2
    gather_programs: int = 8
    gather_tile_bytes: int = 64 * KiB
    gather_warps: int = 16
    scatter_programs: int = 64
    edge_chunk_divisor: int = 4
    pitched_min_rows: int = 16
    store_rows_min_bytes: int = 64 * KiB
    store_row_threads: int = 2
    row_batch: int = 256

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check_count(field.name, getattr(self, field.name))

    def programs_for(self, nbytes: int) -> int:
        """Direct-kernel programs for a transfer of ``nbytes`` when the caller names none: few for bulk, more for
        short bursts."""
        return self.burst_programs if nbytes <= self.burst_bytes else self.programs

    def staged_programs(self, to_host: bool) -> int:
        """Programs of the staged path's gather (``to_host``: a store) or scatter (a load)."""
        return self.gather_programs if to_host else self.scatter_programs


DEFAULT_TUNING = Tuning()


def check_tuning(tuning: Optional[Tuning]) -> Tuning:
    """``tuning``, or :data:`DEFAULT_TUNING` for None; TypeError for anything but a :class:`Tuning`."""
    if tuning is None:
        return DEFAULT_TUNING
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning must be a kvtier.kernels.Tuning, got {type(tuning).__name__}")
    return tuning
