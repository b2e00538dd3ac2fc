"""Staged transfers planned once and launched per span of layers: a layerwise load through the copy engine.

:meth:`StagedTransfer.load` checks the indices, moves the block ids to the host, plans the staging chunks and packs
the gather/scatter arguments on every call, several times the host time of a direct launch
(bench/results/transfer_notes.md, "Host time per call"), which a layerwise load pays once per layer.
:class:`StagedCopy` does all of that once, through the stager's public plan (:meth:`StagedTransfer.layer_groups`,
:meth:`~StagedTransfer.chunks`, :meth:`~StagedTransfer.chunk_launch`); a launch then issues, per staging chunk, the
buffer's wait, the copy-engine copies, one event between the streams and the gather/scatter launch, reusing its
events. A load whose span is one staging chunk of one run of blocks (the layerwise load ``auto`` stages: a layer of
up to 8k tokens of Qwen3-8B KV in one run) goes through raw handles instead: one ``cudaMemcpy2DAsync``
(:class:`~kvtier.kernels.staged.SingleCopy`), the scatter, and four CuPy event calls
(:class:`~kvtier.kernels.raw_events.RawEvent`), in a fraction of the host time :func:`issue_chunks` takes
(bench/results/README.md, "Fragmented host pools").
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional, Union, cast

import numpy as np
import torch

from kvtier.kernels import raw_events
from kvtier.kernels.checks import LayerSpan, check_staged_skip, check_transfer, kept_indices, layer_span
from kvtier.kernels.raw_events import RawEvent
from kvtier.kernels.staged import (ChunkIssue, ChunkRuns, SingleCopy, StagedTransfer, StagingBuffers, block_runs,
                                   issue_chunks)
from kvtier.kernels.transfer import KernelLaunch, _current_raw_stream, on_device, on_stream, raw_stream, torch_stream


@dataclasses.dataclass
class _OneChunk:
    """A load whose span of layers is one staging chunk of one run of blocks: per staging buffer its copy and its
    scatter, and the events that hand the buffer between the streams (raw handles: a few per layer)."""

    copies: list[SingleCopy]
    launches: list[KernelLaunch]
    handoff: list[RawEvent]
    free: list[RawEvent]
    follow: RawEvent


@dataclasses.dataclass
class _Chunk:
    """One staging chunk of a plan: its blocks, their runs and rectangles (``plan``), and a gather/scatter launch
    per buffer."""

    host_ids: np.ndarray
    plan: ChunkRuns
    launches: list[KernelLaunch]


class StagedCopy:
    """A :class:`StagedTransfer` copy of fixed slots and blocks, planned once and launched for any layers.

    Args:
        stager: the staged path to use (its staging buffers and copy streams are shared with its own calls).
        slots, block_ids, to_host, check: as :meth:`StagedTransfer.store` / :meth:`StagedTransfer.load`.
        stream: orders the index checks and uploads.

    Each :meth:`launch` orders the transfer's completion on its ``stream`` (default: the current stream): a load's
    scatter runs there, and a store makes it wait for its copies. The caller keeps the indices alive while
    launches may run.
    """

    def __init__(self, stager: StagedTransfer, slots, block_ids, *, to_host: bool, stream=None,
                 check: bool = True, skip_tokens: int = 0) -> None:
        kv = stager.kv
        with on_stream(kv, stream):
            slots, block_ids, _ = check_transfer(kv, stager.host, slots, block_ids, layout=stager.layout,
                                                 host_side=True, writes_blocks=to_host, check_indices=check,
                                                 block_ids_to_device=False, skip_tokens=skip_tokens)
            skip_tokens = check_staged_skip(skip_tokens, to_host=to_host)
            slots, block_ids = kept_indices(slots, block_ids)  # planned and launched later
            self._host_ids = block_ids.cpu().numpy()
        self.stager, self.to_host, self._slots, self._skip = stager, to_host, slots, skip_tokens
        self._direction: StagingBuffers = stager.buffers(to_host)
        n = len(self._direction.buffers)
        # per staging buffer: the event that hands a chunk from one stream to the other, and the buffer's free event
        self._handoff = [torch.cuda.Event() if kv.is_cuda else None for _ in range(n)]
        self._free = [torch.cuda.Event() if kv.is_cuda else None for _ in range(n)]
        self._plans: dict[tuple[int, bool], list[_Chunk]] = {}
        self._groups: dict[int, list[tuple[int, int]]] = {}
        self._one_chunk: dict[int, Optional[_OneChunk]] = {}
        self._programs = stager.tuning.staged_programs(to_host)

    def launch(self, layers: Union[None, int, range] = None, *, stream=None) -> None:
        """Copy ``layers`` (None: all, an int, or a range) of every page, on ``stream`` (default: current)."""
        stager = self.stager
        kv = stager.kv
        span = layer_span(layers, kv.geometry.num_layers)
        if self._host_ids.size == 0:  # nothing to copy (checked: the layers are in range)
            return
        if kv.is_cuda and not self.to_host:
            if span.count not in self._one_chunk:
                self._one_chunk[span.count] = self._plan_one_chunk(span.count)
            one = self._one_chunk[span.count]
            if one is not None:
                with on_device(kv):
                    self._launch_one_chunk(one, span, _current_raw_stream(kv.device.index) if stream is None
                                           else raw_stream(stream))
                return
        work = None
        if kv.is_cuda:
            work = torch.cuda.current_stream(kv.device) if stream is None else torch_stream(kv, stream)
        d = self._direction
        with on_device(kv) if kv.is_cuda else contextlib.nullcontext():
            if work is not None and not self.to_host:
                d.follow(work)
            subs = self._layer_groups(span)
            last = issue_chunks(d, work, self.to_host, (
                self._issue(d, work, chunk, sub) for i, sub in enumerate(subs)
                for chunk in self._plan(sub.count, i == (0 if self.to_host else len(subs) - 1))))
            if self.to_host and work is not None and last is not None:
                work.wait_event(last)

    def _plan_one_chunk(self, count: int) -> Optional[_OneChunk]:
        """The raw plan of a load of ``count`` layers that is one staging chunk of one run of blocks (a layerwise
        load of a prefix whose layer fits the staging buffer, its blocks in one run); None for any other (or
        without CuPy): those issue through :func:`issue_chunks`."""
        if not raw_events.available() or self._layer_groups(LayerSpan(0, count)) != [LayerSpan(0, count)]:
            return None
        plan = self._plan(count, True)
        if len(plan) != 1 or len(plan[0].plan.runs) != 1:
            return None
        chunk, buffers = plan[0], self._direction.buffers
        copies = [self.stager.single_load(buf, chunk.host_ids, count) for buf in buffers]
        if any(c is None for c in copies):
            return None
        with on_device(self.stager.kv):
            # none of the copies is None (checked above)
            return _OneChunk(cast(list[SingleCopy], copies), chunk.launches, [RawEvent() for _ in buffers],
                             [RawEvent() for _ in buffers], RawEvent())

    def _launch_one_chunk(self, one: _OneChunk, span: LayerSpan, work: int) -> None:
        """Issue a one-chunk load of ``span`` behind the raw stream ``work``: the copy on the copy stream after
        ``work``'s work so far and the buffer's last reader, the scatter on ``work`` after the copy; the buffer's
        free event after the scatter. If the scatter's launch raises, ``work`` waits for the copy."""
        d = self._direction
        assert d.copy_stream is not None  # a CUDA device
        copy_stream = d.copy_stream.cuda_stream
        b = d.take_buffer()
        one.follow.record(work)
        one.follow.wait(copy_stream)
        free = d.free_events[b]
        if free is not None:
            raw_events.wait_event(d.copy_stream, free)
        one.copies[b].issue(span.start, copy_stream)
        one.handoff[b].record(copy_stream)
        one.handoff[b].wait(work)  # the copy precedes whatever follows on work, also if the launch raises
        one.launches[b].fire(span, self._programs, work, blocks_layer0=span.start)
        one.free[b].record(work)
        d.free_events[b] = one.free[b]

    def _layer_groups(self, span: LayerSpan) -> list[LayerSpan]:
        """:meth:`StagedTransfer.layer_groups` of ``span``, from the groups of a span of its width from layer 0
        (cached: they depend on the span's width, the blocks and the direction only)."""
        groups = self._groups.get(span.count)
        if groups is None:
            groups = self._groups[span.count] = [
                (g.start, g.count) for g in self.stager.layer_groups(LayerSpan(0, span.count), self._host_ids,
                                                                     self.to_host)]
        return [LayerSpan(span.start + start, count) for start, count in groups]

    def _plan(self, count: int, short_edge: bool) -> list[_Chunk]:
        """The chunks of a span of ``count`` layers (cached): pages, runs and a launch per staging buffer."""
        key = (count, short_edge)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        stager = self.stager
        plan = []
        for c in stager.chunks(self._host_ids.size, count, self.to_host, short_edge=short_edge, skip=self._skip):
            ids = self._host_ids[c.first:c.first + c.pages]
            chunk_slots = self._slots[c.slot_lo:c.slot_hi]
            launches = [stager.chunk_launch(buf, chunk_slots, c, count, self.to_host)
                        for buf in self._direction.buffers]
            plan.append(_Chunk(ids, ChunkRuns(block_runs(ids)), launches))
        self._plans[key] = plan
        return plan

    def _issue(self, d: StagingBuffers, work, chunk: _Chunk, span: LayerSpan) -> ChunkIssue:
        """One chunk through the next buffer, as :class:`StagedTransfer` stages it, with this copy's events."""
        b = d.take_buffer()
        handle = raw_stream(work) if work is not None else None
        return ChunkIssue(
            b, fire=lambda: chunk.launches[b].fire(span, self._programs, handle, blocks_layer0=span.start),
            copy=lambda: self._copy(d.buffers[b], chunk, span, d.copy_stream),
            handoff=self._handoff[b], free=self._free[b])

    def _copy(self, staging: torch.Tensor, chunk: _Chunk, span: LayerSpan, copy_stream) -> None:
        self.stager.copy_runs(staging, chunk.host_ids, span, to_host=self.to_host, stream=copy_stream,
                              plan=chunk.plan)
