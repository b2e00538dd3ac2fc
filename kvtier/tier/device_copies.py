"""DeviceCopies: how :class:`~kvtier.tier.KVTier` moves pages between the device KV and the host pool.

One object per tier: the executor's streams, the transfer policy's choice of path per copy (direct kernel, direct per
layer, or staged through the copy engine), the staging buffers (made on first use, or at start on CUDA), and the
layer-done counter a layerwise load signals. It issues copies and returns their completion; the tier keeps the
bookkeeping (blocks, locks, tasks).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional, Union

import numpy as np
import torch

from kvtier.kernels import DirectCopy, PagedKV, StagedCopy, StagedTransfer, load_pages, store_pages
from kvtier.tier.host_pool import HostBlockPool
from kvtier.tier.signal import LayerDoneCounter
from kvtier.tier.transfer_policy import CopyPlan, Path, TransferPolicy

logger = logging.getLogger(__name__)

__all__ = ["DeviceCopies"]


def _range_check(slots: torch.Tensor) -> bool:
    """Whether a copy checks its indices' range: only host-side slots (a check of device ones costs a sync)."""
    return slots.device.type == "cpu"


class DeviceCopies:
    """Copies between ``kv`` (device) and ``pool`` (host blocks) on ``executor``'s streams.

    Args:
        store_layers: the layers a store copies (processes sharing one pool split them); loads copy all.
        num_programs: the direct kernel's program count (None: its default).
    """

    def __init__(self, kv: PagedKV, pool: HostBlockPool, executor, policy: TransferPolicy,
                 counter: LayerDoneCounter, store_layers: range, num_programs: Optional[int]) -> None:
        self.kv, self.pool, self.layout = kv, pool, pool.layout
        self.executor, self.policy, self.counter = executor, policy, counter
        self.store_layers, self.num_programs = store_layers, num_programs
        self.num_layers = kv.geometry.num_layers
        self.staged_transfer: Optional[StagedTransfer] = None  # a caller may set its own (e.g. other tuning)

    def staged(self) -> StagedTransfer:
        """The staged path's buffers and threads (made on first use)."""
        if self.staged_transfer is None:
            self.staged_transfer = StagedTransfer(self.kv, self.pool.host, layout=self.layout)
        return self.staged_transfer

    def store(self, slots: torch.Tensor, ids: np.ndarray):
        """Issue a store of ``slots`` into host blocks ``ids``; its completion."""
        return self._launch("store", lambda: self._copy(True, slots, ids))

    def load(self, dst: torch.Tensor, ids: np.ndarray, *, skip: int, layerwise: bool,
             set_slot: Callable[[int], None]):
        """Issue a load of host blocks ``ids`` into ``dst`` (whole, or per layer with the counter's events, whose
        slot goes to ``set_slot``); its completion. ``skip``: tokens of the first block on the device already."""
        if not layerwise:
            return self._launch("load", lambda: self._copy(False, dst, ids, skip=skip))
        self.executor.begin("load")
        stream = self.executor.stream("load")
        before = self.counter.producer_index
        slot = self.counter.update_producer(stream)
        set_slot(slot)
        try:
            return self._issue_layers(slot, dst, ids, stream, skip)
        except BaseException:  # the next load takes this slot again, never one a forward pass waits on
            self.counter.rewind(before)
            raise

    def settle(self, stream: str) -> None:
        """Wait for whatever of a failed copy reached ``stream`` (it may still read or write slots and blocks)."""
        try:
            self.executor.fence(stream).wait()
        except Exception:  # the stream itself is broken: nothing more can be waited for
            logger.exception("kvtier: waiting for the %s stream after a failed copy failed too", stream)

    def close(self) -> None:
        """Stop the staged path's row-issuing threads."""
        if self.staged_transfer is not None:
            self.staged_transfer.close()

    def _launch(self, stream: str, fn):
        self.executor.begin(stream)
        self.executor.run(stream, fn, own_stream=True)  # fn is a _copy: it passes the stream to its launches
        return self.executor.fence(stream)

    def _issue_layers(self, slot: int, dst: torch.Tensor, ids: np.ndarray, stream, skip: int):
        """Issue a layerwise load's copies on ``stream``, each layer's event of counter slot ``slot`` recorded behind
        its copy; its completion."""
        ex = self.executor
        path = self.policy.path(CopyPlan(to_host=False, block_ids=ids, layers=1))
        # checked, indices uploaded (on the stream) and planned once for all layers, launched per layer
        check = _range_check(dst)
        copy: Union[DirectCopy, StagedCopy]
        if path is Path.DIRECT:
            copy = DirectCopy(self.kv, self.pool.host, dst, torch.from_numpy(ids), to_host=False,
                              layout=self.layout, num_programs=self.num_programs, stream=stream,
                              check=check, skip_tokens=skip)
        else:
            copy = StagedCopy(self.staged(), dst, torch.from_numpy(ids), to_host=False, stream=stream,
                              check=check, skip_tokens=skip)
        copy_layer = functools.partial(copy.launch, stream=stream)
        for layer in range(self.num_layers):
            ex.run("load", functools.partial(copy_layer, layer), own_stream=True)
            # Recorded at issue time, behind the layer's copy in stream order. With the DeferredExecutor
            # (tests) the host event is set before the deferred copy runs: layerwise bytes are checked there
            # after wait(task), not through wait_until.
            self.counter.complete(layer, slot=slot, stream=stream)
        return ex.fence("load")

    def _copy(self, to_host: bool, slots: torch.Tensor, ids: np.ndarray, skip: int = 0) -> None:
        """Issue one copy of every layer on the executor's stream (runs inside ``executor.run``), by the policy's
        path; ``skip``: tokens of the first block not moved."""
        stream = self.executor.stream("store" if to_host else "load")
        block_ids = torch.from_numpy(ids)
        check = _range_check(slots)
        layers = self.store_layers if to_host else range(self.num_layers)
        if not layers:  # a store whose layers other processes sharing the pool copy
            return
        whole = len(layers) == self.num_layers
        path = self.policy.path(CopyPlan(to_host=to_host, block_ids=ids, layers=len(layers)))
        if path is Path.STAGED:
            st = self.staged()
            fn = st.store if to_host else st.load
            ev = fn(slots, block_ids, layers=None if whole else layers, stream=stream, check=check,
                    skip_tokens=skip)
            if ev is not None:
                stream.wait_event(ev)  # the task's completion is fenced on this stream
        elif path is Path.DIRECT_LAYERS:  # a load: checked once, launched per layer
            copy = DirectCopy(self.kv, self.pool.host, slots, block_ids, to_host=to_host, layout=self.layout,
                              num_programs=self.num_programs, stream=stream, check=check, skip_tokens=skip)
            for layer in range(self.num_layers):
                copy.launch(layer, stream=stream)
        else:
            pages = store_pages if to_host else load_pages
            pages(self.kv, self.pool.host, slots, block_ids, layout=self.layout, layers=None if whole else layers,
                  num_programs=self.num_programs, stream=stream, check=check, skip_tokens=skip)
