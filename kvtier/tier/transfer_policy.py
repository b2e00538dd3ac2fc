"""Which path a tier's copy takes: the policy behind ``TierConfig.transfer_mode``.

The paths are mechanisms of :mod:`kvtier.kernels`: ``direct`` (a Triton kernel whose SMs read or write the host
blocks over PCIe) and ``staged`` (a gather/scatter against a device staging buffer, and copy-engine copies
between it and the host blocks). ``direct`` and ``staged`` modes use that path for every copy; ``auto`` chooses per
copy from its direction, bytes and host block runs. Each threshold is a tuned constant (docs/DESIGN.md, "Transfer
paths and policy" and "Tuned constants"; the runs behind them: bench/results/README.md, "Fragmented host pools"):

* Stores go staged: a direct store's SMs write host memory for the whole copy and slow a GEMM beside it many times
  more than the staged store, which leaves the SMs to the forward pass.
* Whole loads of at least :data:`AUTO_STAGED_LOAD_BYTES` go staged when the copy engine's rows are at least
  :data:`AUTO_STAGED_MIN_ROW_BYTES` long on average. Shorter rows (host blocks in short runs) run the copy engine
  below the PCIe bound, or hold the issuing thread for most of the copy. Such loads go ``direct_layers``, the direct
  kernel launched once per layer (its speed does not depend on the runs), which slows a GEMM beside it a little
  where one launch for all layers holds its SMs for the whole copy; up to :data:`AUTO_DIRECT_LOAD_MAX_BYTES` they go
  direct in one launch, where a launch per layer would add to the load. Smaller loads take the direct kernel in one
  launch: lowest latency, SMs held for microseconds.
* Layerwise loads go staged (a :class:`~kvtier.kernels.StagedCopy`) when a layer moves at least
  :data:`AUTO_STAGED_LAYER_BYTES` in at most :data:`AUTO_STAGED_MAX_LAYER_ROWS` copy-engine rows. More rows fill
  the copy engine's queue and the host waits on it while it issues; a :class:`~kvtier.kernels.DirectCopy` issues a
  layer quickly whatever the runs, at the same GPU time, though it slows a concurrent forward more than the copy
  engine does (bench/results/tier_notes.md): one run stays staged. A ``page_first`` layer slice shorter than
  :data:`AUTO_STAGED_MIN_SLICE_BYTES` goes direct too (the copy engine moves short rows slowly).
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from kvtier.geometry import KVGeometry

__all__ = ["Path", "CopyPlan", "TransferPolicy", "AUTO_STAGED_LOAD_BYTES", "AUTO_DIRECT_LOAD_MAX_BYTES",
           "AUTO_STAGED_LAYER_BYTES", "AUTO_STAGED_MIN_SLICE_BYTES", "AUTO_STAGED_MIN_ROW_BYTES",
           "AUTO_STAGED_MAX_LAYER_ROWS"]

# Tuned constants: the reason for each value and the run behind it are its row of docs/DESIGN.md, "Tuned constants".
# Whole loads below this go direct: there the direct kernel's latency wins and holds the SMs only briefly.
AUTO_STAGED_LOAD_BYTES = 4 * 1024 * 1024
# A layer of a layerwise load goes staged from this size: there its copy outlasts StagedCopy's host issue.
AUTO_STAGED_LAYER_BYTES = 4 * 1024 * 1024
# page_first layerwise loads: the copy engine moves layer slices shorter than this slowly.
AUTO_STAGED_MIN_SLICE_BYTES = 64 * 1024
# Whole loads: shorter copy-engine rows cost the host as long to issue as the copy takes.
AUTO_STAGED_MIN_ROW_BYTES = 256 * 1024
# Fragmented whole loads up to this size go direct in one launch (a launch per layer would add to a short load),
# bigger ones a launch per layer (one launch would hold its SMs for the whole copy). 256 MiB: 1820 tokens of Qwen3-8B.
AUTO_DIRECT_LOAD_MAX_BYTES = 256 * 1024 * 1024
# Layerwise loads stage a layer of at most this many copy-engine rows (one run): more fill the copy engine's queue
# and the host waits on it while it issues.
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
