"""Which path a tier's copy takes: the policy behind ``TierConfig.transfer_mode``.

The paths are mechanisms of :mod:`kvtier.kernels`: ``direct`` (a Triton kernel whose SMs read or write the host
blocks over PCIe) and ``staged`` (a gather/scatter against a device staging buffer, and copy-engine copies
between it and the host blocks). ``direct`` and ``staged`` modes use that path for every copy; ``auto`` chooses per
copy from its direction, bytes and host block runs, by the figures below (H200, Qwen3-8B KV, 8192- and 1024-token
prefixes, bench/results/fragmentation_h200.json and bench/results/layerwise_h200.json):

* Stores go staged. A direct store slows a GEMM beside it by 30-130% (its SMs write host memory for the whole
  copy); the staged store by <= 3%, and it leaves the SMs to the forward pass.
* Whole loads of at least :data:`AUTO_STAGED_LOAD_BYTES` go staged when the copy engine's rows are at least
  :data:`AUTO_STAGED_MIN_ROW_BYTES` long on average. Shorter rows (host blocks in short runs) run the copy engine
  below the PCIe bound (32 KiB rows: 1.23-1.37x the one-run time in the copy engine alone,
  bench/results/probes/copy_engine_rows_h200.json; a ``layer_first`` row is 64 KiB a 16-token Qwen3-8B page), or hold
  the issuing thread for most of the copy (8k tokens in runs of two pages staged: 22.8 ms, 15.6 ms of it host issue,
  against 1.0 ms of issue for the direct kernel a layer at a time,
  bench/results/probes/fragmentation_h200_c2748ea.json). Such loads go ``direct_layers``, the direct kernel launched
  once per layer (23.8 ms at 8k tokens for every run length, against 22.0 staged from one run), which slows a GEMM
  beside it by 1.5-2.5% where one launch for all layers holds its SMs for the whole copy (10-15%); up to
  :data:`AUTO_DIRECT_LOAD_MAX_BYTES` they go direct in one launch, where 36 launches would add ~6% to the load.
  Smaller loads take the direct kernel in one launch: lowest latency, SMs held for microseconds.
* Layerwise loads go staged (a :class:`~kvtier.kernels.StagedCopy`) when a layer moves at least
  :data:`AUTO_STAGED_LAYER_BYTES` in at most :data:`AUTO_STAGED_MAX_LAYER_ROWS` copy-engine rows. More rows fill
  the copy engine's queue and the host waits on it while it issues (24 ms for 36 layers at runs of one page,
  against 1.6 ms for one run); a :class:`~kvtier.kernels.DirectCopy` issues a layer in ~20 us whatever the runs, at
  the same GPU time, and slows a GEMM beside it by < 2%, though a concurrent Qwen3-8B-sized forward by 18-23%
  against 5-10% through the copy engine (bench/results/layerwise_h200.json): one run stays staged. A ``page_first``
  layer slice shorter than :data:`AUTO_STAGED_MIN_SLICE_BYTES` goes direct too (the copy engine moves short rows
  slowly).
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from kvtier.geometry import KVGeometry

__all__ = ["Path", "CopyPlan", "TransferPolicy", "AUTO_STAGED_LOAD_BYTES", "AUTO_DIRECT_LOAD_MAX_BYTES",
           "AUTO_STAGED_LAYER_BYTES", "AUTO_STAGED_MIN_SLICE_BYTES", "AUTO_STAGED_MIN_ROW_BYTES",
           "AUTO_STAGED_MAX_LAYER_ROWS"]

# Tuned constants (docs/DESIGN.md, "Tuned constants"). Whole loads below this go direct: 4 MiB is one 16-token page
# of 36 Qwen3-8B layers less than twice over; below it the direct kernel's latency wins and the SMs are held for tens
# of microseconds only.
AUTO_STAGED_LOAD_BYTES = 4 * 1024 * 1024
# One layer of a layerwise load goes staged from this size: StagedCopy's generic path issues a layer in ~60-77 us of
# host time (bench/results/probes/probe_overhead_staged_copy_h200.json), and 77 us of copy at 54.5 GB/s is 4 MiB.
# Its one-chunk path (a layer of one run) issues in ~25 us (probes/layerwise_issue_onechunk_h200.json), which would
# put the break-even near 1.4 MiB; the value stays at the generic path's.
AUTO_STAGED_LAYER_BYTES = 4 * 1024 * 1024
# page_first layerwise loads: the copy engine moved 4 KiB rows at 20 GB/s and 64 KiB rows at 54 GB/s
# (bench/results/probes/probe_copy2d_h200.json).
AUTO_STAGED_MIN_SLICE_BYTES = 64 * 1024
# Whole loads: layer_first rows of 32-128 KiB took 1024 tokens in 3.4-6.9 ms staged, 256 KiB rows 2.77 ms, as one
# run (bench/results/fragmentation_h200.json as committed in 968d9d4, when a 16-token Qwen3-8B page of a layer was
# two rows of 32 KiB, K and V in planes of their own).
AUTO_STAGED_MIN_ROW_BYTES = 256 * 1024
# Fragmented whole loads up to this size go direct in one launch, bigger ones a launch per layer: 36 launches add
# ~0.18 ms (1024 tokens: 3.12-3.14 ms against 2.95-2.96 in one launch, 2.77 staged from one run), while one launch
# holds its SMs for the whole copy (~3 ms at 1024 tokens; a GEMM beside it +10-15% for that long)
# (bench/results/probes/fragmentation_h200_c2748ea.json). 256 MiB is 1820 tokens of Qwen3-8B KV.
AUTO_DIRECT_LOAD_MAX_BYTES = 256 * 1024 * 1024
# Layerwise loads: a layer of one run is one row (one 2-D copy of K and V before they were adjacent in layer_first)
# and issues 36 layers in 0.9-1.5 ms of host time (one issue at a time on a drained device: StagedCopy's one-chunk
# path, bench/results/fragmentation_h200.json, probes/layerwise_issue_onechunk_h200.json); 16 rows took 2.9-5.7 ms,
# 64 rows 4.9-6.8 ms (fragmentation_h200.json at 3cfdcfd, issues back to back).
AUTO_STAGED_MAX_LAYER_ROWS = 1


class Path(str, enum.Enum):
    """A copy's mechanism."""

    DIRECT = "direct"
    DIRECT_LAYERS = "direct_layers"  # the direct kernel, one launch per layer (SMs held a layer at a time)
    STAGED = "staged"


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """What the policy reads of one copy.

    Attributes:
        to_host: a store (device to host) or a load.
        block_ids: the host blocks it moves, in the copy's order.
        layers: layers it moves (a layerwise load plans one layer: 1).
    """

    to_host: bool
    block_ids: np.ndarray
    layers: int


class TransferPolicy:
    """Chooses each copy's :class:`Path` for one tier (``mode``: ``auto``, ``direct`` or ``staged``)."""

    def __init__(self, mode: str, layout: str, geometry: KVGeometry) -> None:
        self.mode, self.layout, self.geometry = mode, layout, geometry

    def path(self, plan: CopyPlan) -> Path:
        """The path ``plan`` takes (see the module docstring for ``auto``)."""
        if self.mode != "auto":
            return Path(self.mode)
        if plan.to_host:
            return Path.STAGED
        geo = self.geometry
        nbytes = plan.block_ids.size * plan.layers * geo.page_bytes
        rows = self.staged_rows(plan)
        if plan.layers == geo.num_layers:
            if nbytes < AUTO_STAGED_LOAD_BYTES:
                return Path.DIRECT
            if rows == 1 or nbytes >= rows * AUTO_STAGED_MIN_ROW_BYTES:
                return Path.STAGED
            return Path.DIRECT if nbytes <= AUTO_DIRECT_LOAD_MAX_BYTES else Path.DIRECT_LAYERS
        else:
            ok = (nbytes >= AUTO_STAGED_LAYER_BYTES and rows <= AUTO_STAGED_MAX_LAYER_ROWS * plan.layers
                  and not (self.layout == "page_first" and geo.page_bytes < AUTO_STAGED_MIN_SLICE_BYTES))
        return Path.STAGED if ok else Path.DIRECT

    def staged_rows(self, plan: CopyPlan) -> int:
        """Copy-engine rows the staged path issues for ``plan``: a row per block and layer span (``page_first``;
        one row per run when every layer moves) or per run and layer (``layer_first``). A single run
        counts as one row: it is one 2-D copy per staging chunk, its rows as long as the layout makes them."""
        ids = plan.block_ids
        runs = 1 + int(np.count_nonzero(np.diff(ids) != 1)) if ids.size else 0
        geo = self.geometry
        if runs <= 1:
            return runs
        if self.layout == "page_first":
            return runs if plan.layers == geo.num_layers else ids.size
        return runs * plan.layers
