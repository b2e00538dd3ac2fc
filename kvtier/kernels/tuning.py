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
        pitched_min_rows: a ``layer_first`` run of blocks of a fragmented chunk is one pitched copy of its layers
            from this many layers; shorter spans go a copy per layer. Pitched copies cost the host ~5 us each to
            issue; a run of 2 rows (a layerwise load, K and V in planes of their own then) took 82 ms for 36 layers
            at 8k tokens against 37 ms a row each (bench/results/probes/staged_pitched_h200.json).
        store_rows_min_bytes: a fragmented ``layer_first`` store moves its runs as rows (a ``cuMemcpyBatchAsync``
            row per layer and run) rather than pitched rectangles when the runs are at least this many bytes of a
            layer on average: one 16-token page of a Qwen3-8B layer, K and V. The copy engine writes pitched rows
            slower than separate ones: 8k tokens in runs of one page stored in 29.45 ms pitched and 22.48-22.63 as
            rows, one run 22.0; runs of two 26.71 against 24.17; 1k in runs of one 3.68 against 3.04-3.08 (all with
            the copies queued before the device ran them: bench/results/probes/
            store_issue_bound_kv_adjacent_h200.json). Each row costs the host 0.45-1.05 us to issue, so a store of
            single pages is at times bound by its issue (1k tokens: 3.62 ms in fragmentation_h200.json, 3.05 in
            bench/results/probes/fragmentation_h200_store_pipeline_run1.json, against 2.80 one run).
        store_row_threads: threads that issue a store's rows (the caller's and workers, each on its own stream).
            One: with K and V in planes of their own (32 KiB rows), three rounds of the staged store at 8k in runs
            of one page took 24.87 / 41.15 / 26.03 ms from two threads in batches of 256 against 24.61 / 27.78 /
            24.60 from one in batches of 1024, at 1k 4.79 / 5.29 / 4.32 against 3.63 / 3.64 / 3.63; runs of two
            (64 KiB rows) 22.64 / 22.92 / 22.63 against 22.53 / 22.54 / 22.53 (probes/
            store_issue_bound_kv_planes_h200.json; two threads went fast or slow per measurement in
            staged_store_threads_h200.json too).
        store_piece_bytes, store_split_max_bytes: a store's rows (``layer_first``, a run's pages of one layer)
            of up to ``store_split_max_bytes`` go as pieces of ``store_piece_bytes`` (whole pages), every row of the
            chunk in a shuffled order (:func:`kvtier.kernels.staged.scattered_pieces`). The copy engine writes
            neighbouring host bytes one after the other slower: 8k tokens in runs of two pages stored in 24.12 ms as
            128 KiB rows or as 64 KiB pieces in order, 22.77 every run's first page then every second page
            (bench/results/probes/store_gather_interference_order_h200.json); 24.11 as the 128 KiB rows shuffled,
            22.46 as 64 KiB pieces shuffled (one run 22.00); runs of four 23.11 against 22.54; 1k in runs of two
            3.15 against 2.95 (one run 2.80) (_shuffle_h200.json), all queued before the device ran them. The
            pieces cost the host a row each, as runs of one page do, so a store of runs of two is paced by its
            issue on a slow host as one of single pages is, and runs of four stay whole: cut, their 18,432 rows at
            8k took 23.6 ms to issue and the store 23.76 against 23.02 whole. Runs of two stored in 22.35-22.37
            against 23.92-23.94 whole, 1k 2.94 against 3.13 (probes/store_pieces_ab_h200.json with 256 KiB,
            _128k_h200.json).
        row_batch: rows per ``cuMemcpyBatchAsync`` call of a store. One thread, same rounds as above: 8k in runs of
            one page 26.37 / 25.97 / 25.71 ms in batches of 256, 24.61 / 27.78 / 24.60 in batches of 1024; runs of
            two 22.62 / 32.87 / 22.65 against 22.53 / 22.54 / 22.53; 1k alike (3.65-3.98 against 3.63-3.64).
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
