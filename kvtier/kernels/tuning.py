"""Tuning: the transfer kernels' tuned constants, in one frozen dataclass with the measured defaults.

Callers never need one: every launcher defaults to :data:`DEFAULT_TUNING`. Benchmarks and tests that sweep a
constant pass ``tuning=Tuning(...)``. Each default is the value measured best on an H200 (PCIe Gen5 x16,
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
        gather_programs, gather_tile_bytes, gather_warps: the gather kernel (stores); not swept: a gather hides
            behind the previous chunk's copy, which takes much longer.
        scatter_programs: programs of the scatter kernel (loads): a scatter beside a forward costs it least when
            it is short.
        edge_chunk_divisor: the exposed first gather of a store and last scatter of a load move a chunk this
            many times smaller than a full one.
        pitched_min_rows: a ``layer_first`` run of blocks of a fragmented chunk is one pitched copy of its layers
            from this many layers; shorter spans go a copy per layer (a pitched copy costs the host more to issue
            and runs slower than its rows when they are few).
        store_rows_min_bytes: a fragmented ``layer_first`` store moves its runs as rows (a ``cuMemcpyBatchAsync``
            row per layer and run) rather than pitched rectangles when the runs are at least this many bytes of a
            layer on average (one 16-token Qwen3-8B page, K and V): the copy engine writes pitched rows slower.
        store_row_threads: threads that issue a store's rows (the caller's and workers, each on its own stream):
            from more than one, a store goes fast or slow from one measurement to the next.
        store_piece_bytes, store_split_max_bytes: a store's rows (``layer_first``, a run's pages of one layer)
            of up to ``store_split_max_bytes`` go as pieces of ``store_piece_bytes`` (whole pages), every row of the
            chunk in a shuffled order (:func:`kvtier.kernels.staged.scattered_pieces`): the copy engine writes
            neighbouring host bytes one after the other slower; longer runs stay whole, since cut their issue
            outlasts the copy.
        row_batch: rows per ``cuMemcpyBatchAsync`` call of a store: fewer, larger calls issue a store steadier.
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
    pitched_min_rows: int = 8
    store_rows_min_bytes: int = 64 * KiB
    store_piece_bytes: int = 64 * KiB
    store_split_max_bytes: int = 128 * KiB
    store_row_threads: int = 1
    row_batch: int = 1024

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
