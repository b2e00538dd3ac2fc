"""Staged page transfers: Triton gather/scatter against a device staging buffer + copy-engine copies.

Store (D2H): the copy kernel gathers a chunk of pages from the device slots into a staging buffer laid out like
the host blocks, then the copy engine copies each run of consecutive host blocks in one ``cudaMemcpyAsync``.
Load (H2D) is the reverse. Chunks alternate between ``num_buffers`` staging buffers, so the gather of chunk c+1
overlaps the copy of chunk c. The SMs only do device-to-device work (microseconds per chunk); PCIe is driven by
the copy engines, one per direction, so a store and a load can run at the same time at close to twice the
bandwidth of either (bench/results/README.md, "Transfer kernels").

Copies follow the runs of consecutive block ids: a ``page_first`` run is a row per block (or one row of whole
blocks when every layer moves), a ``layer_first`` run a row per layer (its pages' K and V). A chunk of one run is
one ``cudaMemcpy2DAsync``. A chunk of several runs (a fragmented pool) is batched driver calls
(:mod:`kvtier.kernels.batch_copy`): a pitched copy per ``layer_first`` run of at least ``Tuning.pitched_min_rows``
layers, a copy per row of the others, so the host issues a call or two per chunk (a store's rows: a call per
``Tuning.row_batch`` rows, from ``Tuning.store_row_threads`` threads), not a call per run and row.
Without cupy, or where the rows cross a host registration, a 2-D copy becomes one copy per row; without the batched
calls (a driver older than CUDA 12.8) each run is its own 2-D copy.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable, Iterable, Iterator, NamedTuple, Optional, Union

import numpy as np
import torch

from kvtier.geometry import KVGeometry
from kvtier.kernels import batch_copy
from kvtier.kernels.checks import (LayerSpan, check_blocks_tensor, check_kv, check_staged_skip, check_transfer,
                                   layer_span)
from kvtier.kernels.paged_kv import PagedKV
from kvtier.kernels.pinned import split_at_registrations
from kvtier.kernels.raw_events import wait_event
from kvtier.kernels.row_issue import RowIssuer
from kvtier.kernels.transfer import KernelLaunch, on_stream
from kvtier.kernels.tuning import DEFAULT_TUNING, Tuning, check_tuning

# The staging size, buffers, programs and edge chunk are tuned constants (kvtier.kernels.tuning, docs/DESIGN.md
# "Tuned constants").
_CUDA_DEV_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch

try:  # cupy's raw memcpy costs the host a fraction of torch's copy_ on views (bench/results/transfer_notes.md)
    import cupy as _cupy
except Exception:  # pragma: no cover - cupy is an optional extra
    _cupy = None


def chunk_pages(num_pages: int, per_chunk: int, to_host: bool, *, short_edge: bool = True,
                edge_divisor: int = DEFAULT_TUNING.edge_chunk_divisor) -> list[int]:
    """Pages of each staging chunk, in order: full chunks, and a short chunk where the pipeline is exposed.

    A store starts with a gather that no copy overlaps, so its first chunk is short. A load that needs several
    chunks ends with a scatter that no copy overlaps, so its last chunk is short (a load that fits one chunk is
    not split: the extra copy and launch would cost about what the shorter scatter saves). The short chunk is
    1 / ``edge_divisor`` of a full one. ``short_edge=False``: full chunks only (a span in the middle of a transfer
    staged in several spans).
    """
    edge = max(1, per_chunk // edge_divisor)
    if not short_edge:
        full, rest = divmod(num_pages, per_chunk)
        return [per_chunk] * full + ([rest] if rest else [])
    if num_pages <= (edge if to_host else per_chunk):
        return [num_pages] if num_pages else []
    full, rest = divmod(num_pages - edge, per_chunk)
    body = [per_chunk] * full + ([rest] if rest else [])
    return [edge] + body if to_host else body + [edge]


class Chunk(NamedTuple):
    """One staging chunk of a copy: blocks ``first .. first + pages`` of it, their slots ``slots[slot_lo:slot_hi]``,
    and the tokens of its own first block not moved (``skip``: the copy's skip for its first chunk, else 0)."""

    first: int
    pages: int
    slot_lo: int
    slot_hi: int
    skip: int


def chunks_of(page_counts: list[int], page: int, skip: int) -> list[Chunk]:
    """The chunks of a copy whose chunks hold ``page_counts`` blocks of ``page`` tokens, in order, when the first
    ``skip`` tokens of its first block are not moved."""
    out, first = [], 0
    for n in page_counts:
        chunk_skip = skip if first == 0 else 0
        out.append(Chunk(first, n, first * page - skip + chunk_skip, (first + n) * page - skip, chunk_skip))
        first += n
    return out


class Rows(NamedTuple):
    """Copy rows as byte offsets into the host blocks and the staging buffer, and their widths (uint64 arrays)."""

    host_off: np.ndarray
    stg_off: np.ndarray
    width: np.ndarray

    def shifted(self, host_bytes: int) -> "Rows":
        """The same rows ``host_bytes`` further into the host blocks (another layer's rows)."""
        return self._replace(host_off=self.host_off + np.uint64(host_bytes))


def ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, index) of every item when item ``i`` of a list has ``counts[i]`` parts: each part's item and its place
    among that item's parts (int64 arrays, parts in order)."""
    counts = counts.astype(np.int64)
    owner = np.repeat(np.arange(counts.size), counts)
    return owner, np.arange(owner.size) - np.repeat(np.cumsum(counts) - counts, counts)


@functools.lru_cache(maxsize=64)
def _shuffle(n: int) -> np.ndarray:
    """A fixed permutation of ``n`` items (read-only; one per count)."""
    order = np.random.default_rng(n).permutation(n)
    order.flags.writeable = False
    return order


def scattered_pieces(rows: Rows, piece: int, max_width: int) -> Rows:
    """``rows`` with each row wider than ``piece`` bytes and at most ``max_width`` wide cut into pieces of ``piece``
    bytes (the last one shorter where the width is not a multiple), and, where any row was cut, every row in a fixed
    shuffled order (one per row count). The copy engine writes neighbouring host bytes one after the other slower
    than one run of the same bytes, and a shuffled order seldom puts them one after the other
    (``Tuning.store_piece_bytes``; docs/DESIGN.md, "Transfer paths and policy")."""
    width = rows.width
    cut = (width > np.uint64(piece)) & (width <= np.uint64(max_width))
    if not cut.any():
        return rows
    row, index = ragged(np.where(cut, (width + np.uint64(piece - 1)) // np.uint64(piece), np.uint64(1)))
    order = _shuffle(row.size)
    row, at = row[order], index[order].astype(np.uint64) * np.uint64(piece)  # at: 0 for the rows not cut
    return Rows(rows.host_off[row] + at, rows.stg_off[row] + at,
                np.where(cut[row], np.minimum(width[row] - at, np.uint64(piece)), width[row]))


class Rects(NamedTuple):
    """Pitched rectangles, one per run of blocks: ``height`` rows of ``width`` bytes at ``host_pitch`` /
    ``stg_pitch`` from byte offsets into the host blocks and the staging buffer (uint64 arrays, one entry each)."""

    host_off: np.ndarray
    stg_off: np.ndarray
    width: np.ndarray
    height: np.ndarray
    host_pitch: np.ndarray
    stg_pitch: np.ndarray

    def rows(self) -> Rows:
        """Every row of every rectangle, rectangle by rectangle, top to bottom."""
        if self.height.size and (self.height == self.height[0]).all():  # one height (a layer group's runs): outer sums
            row = np.arange(int(self.height[0]), dtype=np.uint64)
            at = lambda off, pitch: (off[:, None] + pitch[:, None] * row).ravel()  # noqa: E731
            return Rows(at(self.host_off, self.host_pitch), at(self.stg_off, self.stg_pitch),
                        np.repeat(self.width, row.size))
        rect, row = ragged(self.height)
        row = row.astype(np.uint64)
        return Rows(self.host_off[rect] + row * self.host_pitch[rect], self.stg_off[rect] + row * self.stg_pitch[rect],
                    self.width[rect])

    def select(self, keep: np.ndarray) -> "Rects":
        """The rectangles where the boolean mask ``keep`` is set."""
        return Rects(*(a[keep] for a in self))

    def shifted(self, host_bytes: int) -> "Rects":
        """The same rectangles ``host_bytes`` further into the host blocks (another layer's rows)."""
        return self._replace(host_off=self.host_off + np.uint64(host_bytes))


def block_runs(block_ids: np.ndarray) -> list[tuple[int, int]]:
    """Split positions ``0..n`` of ``block_ids`` into runs of consecutive ids: ``[(start, length), ...]``."""
    if block_ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(block_ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [block_ids.size]))
    return list(zip(starts.tolist(), (ends - starts).tolist()))


class StagingBuffers:
    """Staging buffers, a copy-engine stream and reuse events for one direction."""

    def __init__(self, kv: PagedKV, elems: int, num_buffers: int) -> None:
        self.buffers = [torch.empty(elems, dtype=kv.geometry.dtype, device=kv.device) for _ in range(num_buffers)]
        self.free_events: list = [None] * num_buffers  # per buffer: a torch event or a RawEvent, or None
        self.copy_stream = torch.cuda.Stream(device=kv.device) if kv.is_cuda else None
        self._follow = torch.cuda.Event() if kv.is_cuda else None
        self.next_buffer = 0

    def follow(self, work) -> None:
        """Order the copy stream's next copies after ``work``'s work so far (a load's host-to-staging copies start
        on the copy stream, after the previous reader of the staging buffers or writer of the host blocks)."""
        assert self._follow is not None and self.copy_stream is not None  # work to follow: a CUDA device
        self._follow.record(work)
        self.copy_stream.wait_event(self._follow)

    def take_buffer(self) -> int:
        """The staging buffer the next chunk uses (round robin)."""
        b = self.next_buffer
        self.next_buffer = (b + 1) % len(self.buffers)
        return b


class ChunkIssue(NamedTuple):
    """One staging chunk through buffer ``buffer``: ``fire`` (the gather or scatter launch, on the work stream) and
    ``copy`` (the copy-engine copies, on the copy stream); ``handoff`` hands the buffer from the chunk's first step
    to its second, ``free`` is recorded after its last use of the buffer (None on the CPU: no events there)."""

    buffer: int
    fire: Callable[[], None]
    copy: Callable[[], None]
    handoff: Optional[torch.cuda.Event]
    free: Optional[torch.cuda.Event]


def issue_chunks(d: StagingBuffers, work, to_host: bool, chunks: Iterable[ChunkIssue]) -> Optional[torch.cuda.Event]:
    """Issue ``chunks`` through ``d``'s buffers in the direction's order (a store gathers, then copies; a load
    copies, then scatters); returns the last chunk's free event (None on the CPU, where ``work`` is None). If an
    issue raises, ``work`` waits for everything already on the copy stream before the error propagates, so a fence
    on ``work`` covers every copy that may still touch the slots, staging or host blocks.

    Each chunk's first step is issued up to ``len(d.buffers) - 1`` chunks ahead of the earlier chunks' second steps:
    a store's gather of chunk c + 1 is queued before the copies of chunk c, so the copy engine does not wait for the
    host to launch it after issuing chunk c's rows (where the host issues ahead of the copy engine, or paces it, this
    changes nothing: docs/DESIGN.md, "Transfer paths and policy"). A chunk's first step waits for the free
    event of the chunk that last used its buffer; a pending chunk on the same buffer gets its second step first."""
    ahead = len(d.buffers) - 1
    pending: collections.deque[ChunkIssue] = collections.deque()
    done = None
    try:
        for chunk in chunks:
            while any(p.buffer == chunk.buffer for p in pending):  # never with buffers taken in turn
                done = _second_step(d, work, to_host, pending.popleft())
            _first_step(d, work, to_host, chunk)
            pending.append(chunk)
            if len(pending) > ahead:
                done = _second_step(d, work, to_host, pending.popleft())
        while pending:
            done = _second_step(d, work, to_host, pending.popleft())
    except BaseException:
        if work is not None:  # what reached the copy stream may still read or write: the caller's fence covers it
            work.wait_stream(d.copy_stream)
        raise
    return done


def _first_step(d: StagingBuffers, work, to_host: bool, chunk: ChunkIssue) -> None:
    """A chunk's write of its buffer (a store's gather, a load's copy), after the buffer's last reader."""
    stream = work if to_host else d.copy_stream
    free = d.free_events[chunk.buffer] if work is not None else None
    if free is not None:  # a torch event, or a RawEvent of a StagedCopy's one-chunk load
        wait_event(stream, free)
    (chunk.fire if to_host else chunk.copy)()
    if work is not None:
        assert chunk.handoff is not None  # a CUDA chunk
        chunk.handoff.record(stream)


def _second_step(d: StagingBuffers, work, to_host: bool, chunk: ChunkIssue) -> Optional[torch.cuda.Event]:
    """A chunk's read of its buffer (a store's copy, a load's scatter), after its write; records its free event."""
    stream = d.copy_stream if to_host else work
    if work is not None:
        assert stream is not None and chunk.handoff is not None  # a CUDA chunk
        stream.wait_event(chunk.handoff)
    (chunk.copy if to_host else chunk.fire)()
    if work is None:
        return None
    assert chunk.free is not None  # a CUDA chunk
    chunk.free.record(stream)
    d.free_events[chunk.buffer] = chunk.free
    return chunk.free


class StagedTransfer:
    """Page transfers through device staging buffers and the copy engines, for one KV pool and one host tensor.

    Args:
        kv: the device KV buffers.
        host: host blocks (pinned when ``kv`` is on CUDA), shaped for ``layout``.
        layout: ``"page_first"`` or ``"layer_first"``.
        tuning: the staged path's tuned constants (:class:`~kvtier.kernels.tuning.Tuning`: staging bytes, at
            least one page of all layers; buffers per direction, >= 2 to overlap gather and copy; gather and
            scatter programs).

    ``store`` and ``load`` are asynchronous and return a CUDA event (None on CPU, or when no page moves) that
    completes with the transfer:
    for a store, when the host blocks hold the bytes; for a load, when the slots do (the load is also ordered on
    ``stream``). A store and a load may run at once; two stores (or two loads) run one after the other.

    The plan of a copy (:meth:`layer_groups`, :meth:`chunks`, :meth:`chunk_launch`, :meth:`copy_runs`,
    :meth:`run_rows`) is public: :class:`~kvtier.kernels.staged_copy.StagedCopy` plans a copy once with it and
    issues it per layer through the same buffers (:meth:`buffers`).
    """

    def __init__(self, kv: PagedKV, host: torch.Tensor, *, layout: str = "page_first",
                 tuning: Optional[Tuning] = None) -> None:
        check_kv(kv)
        self.tuning = check_tuning(tuning)
        self.num_blocks = check_blocks_tensor(kv, host, layout, host_side=True)
        self.kv, self.host, self.layout = kv, host, layout
        self._host_bytes = host.reshape(-1).view(torch.uint8)  # the copies address host blocks in bytes
        geo = kv.geometry
        self.layer_pitch = self.num_blocks * geo.page_bytes  # layer_first: host bytes from a layer to the next
        # whole words: the staging buffers are viewed as the KV's words
        self.staging_bytes = max(self.tuning.staging_bytes // kv.word_bytes * kv.word_bytes, geo.block_bytes)
        elems = self.staging_bytes // geo.itemsize
        self._store = StagingBuffers(kv, elems, self.tuning.num_buffers)
        self._load = StagingBuffers(kv, elems, self.tuning.num_buffers)
        self._span_geos: dict[int, KVGeometry] = {}
        self._local_ids = torch.arange(self.staging_bytes // (geo.page_bytes), dtype=torch.int64, device=kv.device)
        self._store_rows: Optional[RowIssuer] = None  # built on a store's first row batch

    def store(self, slots, block_ids, *, layers: Union[None, int, range] = None, stream=None,
              check: bool = True, skip_tokens: int = 0) -> Optional[torch.cuda.Event]:
        """D2H: copy pages from device slots to host blocks; see :func:`kvtier.kernels.store_pages`."""
        return self._run(slots, block_ids, layers, stream, check, skip_tokens, to_host=True)

    def load(self, slots, block_ids, *, layers: Union[None, int, range] = None, stream=None,
             check: bool = True, skip_tokens: int = 0) -> Optional[torch.cuda.Event]:
        """H2D: copy pages from host blocks to device slots; see :func:`kvtier.kernels.load_pages`."""
        return self._run(slots, block_ids, layers, stream, check, skip_tokens, to_host=False)

    # --- the plan of a copy (shared with StagedCopy) ---

    def buffers(self, to_host: bool) -> StagingBuffers:
        """The staging buffers, copy stream and reuse events of stores (``to_host``) or of loads."""
        return self._store if to_host else self._load

    @property
    def batched(self) -> bool:
        """Whether chunks of several runs go in one batched call (CUDA, CuPy and a CUDA 12.8+ driver)."""
        return self.kv.is_cuda and _cupy is not None and batch_copy.available()

    def pitched(self, span: LayerSpan, host_ids: np.ndarray, to_host: bool,
                runs: Optional[list[tuple[int, int]]] = None) -> bool:
        """Whether a batched call moves a ``layer_first`` run of ``span``'s layers as one pitched rectangle
        (``cuMemcpy3DBatchAsync``), not layer by layer: the span has at least ``Tuning.pitched_min_rows`` layers,
        the pool's layer pitch fits the device's limit (:func:`_copy_batched` still sends a rectangle whose host
        bytes cross a registration row by row) and, for a store, ``host_ids``' runs are narrower on average than
        ``Tuning.store_rows_min_bytes`` of a layer. The average is the measure because a store as rows costs the
        copy engine and the host a fixed time per row against the engine's time per byte: a copy of R runs has R
        rows a layer, so its rows per byte are those of R runs of the average width, whatever the mix of short and
        long runs. ``runs``: ``block_runs(host_ids)`` when the caller has it."""
        geo = self.kv.geometry
        if not (self.layout == "layer_first" and span.count >= self.tuning.pitched_min_rows
                and batch_copy.rects_available() and self.layer_pitch <= _max_pitch()):
            return False
        if not to_host:
            return True
        runs = block_runs(host_ids) if runs is None else runs
        return host_ids.size * geo.page_bytes < self.tuning.store_rows_min_bytes * max(1, len(runs))

    def layer_groups(self, span: LayerSpan, host_ids: np.ndarray, to_host: bool) -> list[LayerSpan]:
        """The layer spans to stage one after the other: the whole span, or (``layer_first``) groups of layers.

        In ``layer_first`` a chunk's copy has a row per layer and run of blocks, as wide as the run's pages in the
        chunk. The copy engine writes narrow rows to the host slower (bench/results/transfer_notes.md, "Stores of
        many narrow rows"). When the runs of blocks are
        longer than a chunk of the whole span holds, the span is staged in groups of as many layers as hold all
        its pages in one staging buffer: about the same number of chunks, each with fewer and wider rows (a group
        of one layer whose pages do not fit stages them over several chunks). Short runs (scattered blocks) gain
        no width from it. They stage the whole span where a run is one pitched copy (:meth:`pitched`: a copy per
        run of all the span's layers) or there is no batched call (a copy per run); with row-by-row batches only,
        they are grouped (still one call per chunk, and a group's rows lie close together in host memory, which
        the copy engine writes faster). ``to_host``:
        the copy is a store (whose wide runs go as rows, see :meth:`pitched`).
        """
        if self.layout != "layer_first":
            return [span]
        num_pages = host_ids.size
        group = max(1, self.staging_bytes // (num_pages * self.kv.geometry.page_bytes))
        runs = block_runs(host_ids)
        short_runs = num_pages <= len(runs) * self._pages_per_chunk(span.count)
        rows_only = self.batched and not self.pitched(span, host_ids, to_host, runs)
        if group >= span.count or (short_runs and not rows_only):
            return [span]
        end = span.start + span.count
        return [LayerSpan(layer, min(group, end - layer)) for layer in range(span.start, end, group)]

    def chunks(self, num_pages: int, num_layers: int, to_host: bool, *, short_edge: bool,
               skip: int = 0) -> list[Chunk]:
        """The staging chunks of a copy of ``num_pages`` blocks and ``num_layers`` layers (one layer group).
        ``short_edge``: this group starts a store or ends a load (see :func:`chunk_pages`); ``skip``: tokens of the
        first block not moved."""
        counts = chunk_pages(num_pages, self._pages_per_chunk(num_layers), to_host, short_edge=short_edge,
                             edge_divisor=self.tuning.edge_chunk_divisor)
        return chunks_of(counts, self.kv.geometry.page_size, skip)

    def chunk_launch(self, staging: torch.Tensor, chunk_slots: torch.Tensor, chunk: Chunk, num_layers: int,
                     to_host: bool) -> KernelLaunch:
        """The gather (``to_host``) or scatter of ``chunk`` between ``chunk_slots`` and ``staging``, for a group of
        ``num_layers`` layers, packed for :meth:`KernelLaunch.fire` (each fire names the group's first layer)."""
        strides = self.span_geometry(num_layers).host_row_strides(chunk.pages, self.layout)
        return KernelLaunch(self.kv, staging, chunk_slots, self._local_ids[:chunk.pages], strides, to_blocks=to_host,
                            tile_bytes=self.tuning.gather_tile_bytes, num_warps=self.tuning.gather_warps,
                            skip_rows=chunk.skip)

    def span_geometry(self, num_layers: int) -> KVGeometry:
        """The geometry of a staging chunk holding ``num_layers`` layers (cached: built on every call otherwise)."""
        geo = self._span_geos.get(num_layers)
        if geo is None:
            geo = self._span_geos[num_layers] = dataclasses.replace(self.kv.geometry, num_layers=num_layers)
        return geo

    def copy_runs(self, staging: torch.Tensor, host_ids: np.ndarray, span: LayerSpan, *, to_host: bool,
                  stream, plan: Optional[ChunkRuns] = None) -> None:
        """Copy-engine copies between the staging buffer and the host blocks of ``host_ids``' runs.

        With CuPy and a stream the copies are issued from byte offsets alone (no tensor views: a layerwise load
        issues them once per layer): one 2-D copy for a single run, one batched call for several (``plan``: the
        chunk's :class:`ChunkRuns` when the caller keeps one, whose rectangles and rows serve every layer group; see
        :func:`_copy_batched`); otherwise through views and :func:`_copy_2d`."""
        plan = ChunkRuns(block_runs(host_ids)) if plan is None else plan
        runs = plan.runs
        if stream is not None and _cupy is not None:
            host_ptr, stg_ptr = self._host_bytes.data_ptr(), staging.data_ptr()
            if len(runs) > 1 and batch_copy.available():
                issuer = self._row_issuer() if to_host else None
                if self.pitched(span, host_ids, to_host, runs):
                    _copy_batched(host_ptr, stg_ptr, to_host=to_host, stream=stream, issuer=issuer,
                                  rects=self.span_rects(plan, host_ids, span))
                else:
                    _copy_batched(host_ptr, stg_ptr, to_host=to_host, stream=stream, issuer=issuer,
                                  rows=self.span_rows(plan, host_ids, span, to_host=to_host))
                return
            for r in self._run_rects(host_ids, span, runs):
                _copy_rect(host_ptr + r.host_off, stg_ptr + r.stg_off, r.height, r.width, r.host_pitch,
                           r.stg_pitch, to_host=to_host, stream=stream)
            return
        for host_view, staging_view in self._run_views(staging, host_ids, span, runs):
            _copy_2d(host_view, staging_view, to_host=to_host, stream=stream)

    def single_load(self, staging: torch.Tensor, host_ids: np.ndarray, count: int) -> Optional["SingleCopy"]:
        """The one copy-engine copy from the host blocks of ``host_ids`` (one run) into ``staging`` for a span of
        ``count`` layers from any first layer, as raw runtime arguments (a layerwise load issues it per layer);
        None without CuPy, for several runs, or where a span's host rows cross a host registration or the pitches
        exceed the device's limit (those copies go row by row: :meth:`copy_runs`)."""
        runs = block_runs(host_ids)
        if _cupy is None or not self.kv.is_cuda or len(runs) != 1:
            return None
        geo = self.kv.geometry
        host_off, stg_off, width, height, host_pitch, stg_pitch = self._rect_fields(
            LayerSpan(0, count), int(host_ids[0]), 0, host_ids.size, host_ids.size)
        host = self._host_bytes.data_ptr() + host_off
        shift, extent = self.layer_shift(), (height - 1) * host_pitch + width
        if height > 1 and max(host_pitch, stg_pitch) > _max_pitch():
            return None
        if any(len(split_at_registrations(host + first * shift, extent)) > 1
               for first in range(geo.num_layers - count + 1)):
            return None
        return SingleCopy(staging.data_ptr() + stg_off, stg_pitch, host, host_pitch, width, height, shift)

    def close(self) -> None:
        """Stop the threads that issue stores' rows, if any (``Tuning.store_row_threads`` > 1); idempotent. A store
        after it starts them again."""
        issuer, self._store_rows = self._store_rows, None
        if issuer is not None:
            issuer.close()

    def _row_issuer(self) -> RowIssuer:
        """The threads that issue stores' row batches (``Tuning.store_row_threads``)."""
        if self._store_rows is None:
            self._store_rows = RowIssuer(self.kv.device, self.tuning.store_row_threads, self.tuning.row_batch)
        return self._store_rows

    # --- pipeline ---

    def _run(self, slots, block_ids, layers, stream, check: bool, skip: int,
             to_host: bool) -> Optional[torch.cuda.Event]:
        kv = self.kv
        span = layer_span(layers, kv.geometry.num_layers)
        with on_stream(kv, stream):
            # the gather/scatter addresses staging by local ids; host block ids only drive the host-side copies
            slots, block_ids, _ = check_transfer(kv, self.host, slots, block_ids, layout=self.layout,
                                                 host_side=True, writes_blocks=to_host, check_indices=check,
                                                 block_ids_to_device=False, skip_tokens=skip)
            skip = check_staged_skip(skip, to_host=to_host)
            if block_ids.numel() == 0:
                return None  # nothing to move: a no-op, as on the direct path
            host_ids = block_ids.cpu().numpy()
            work = torch.cuda.current_stream() if kv.is_cuda else None
            direction = self.buffers(to_host)
            if work is not None and not to_host:
                direction.follow(work)
            subs = self.layer_groups(span, host_ids, to_host)
            return issue_chunks(direction, work, to_host, self._span_chunks(direction, work, slots, host_ids, subs,
                                                                            to_host, skip))

    def _span_chunks(self, direction: StagingBuffers, work, slots: torch.Tensor, host_ids: np.ndarray,
                     subs: list[LayerSpan], to_host: bool, skip: int) -> Iterator[ChunkIssue]:
        """The chunks that stage ``subs``' layers of every page, group after group (the first group starts a store
        with a short chunk, the last ends a load with one: :func:`chunk_pages`); ``skip``: tokens of the first
        block not moved. A chunk's runs and layer-0 rectangles serve the chunk of the same pages in other groups."""
        plans: dict[tuple[int, int], ChunkRuns] = {}
        for i, span in enumerate(subs):
            edge = i == (0 if to_host else len(subs) - 1)
            for c in self.chunks(host_ids.size, span.count, to_host, short_edge=edge, skip=skip):
                ids = host_ids[c.first:c.first + c.pages]
                plan = plans.get((c.first, c.pages))
                if plan is None:
                    plan = plans[(c.first, c.pages)] = ChunkRuns(block_runs(ids))
                yield self._chunk(direction, work, slots[c.slot_lo:c.slot_hi], ids, span, c, to_host, plan)

    def _pages_per_chunk(self, num_layers: int) -> int:
        """Pages of ``num_layers`` layers one staging buffer holds (>= 1: it holds at least a whole block)."""
        return self.staging_bytes // self.span_geometry(num_layers).block_bytes

    def _chunk(self, d: StagingBuffers, work, chunk_slots: torch.Tensor, host_ids: np.ndarray, span: LayerSpan,
               chunk: Chunk, to_host: bool, plan: ChunkRuns) -> ChunkIssue:
        """``chunk`` of ``span``'s layers through the next staging buffer, ready for :func:`issue_chunks`."""
        b = d.take_buffer()
        # The staging buffer holds the chunk's pages of the span's layers, laid out like the host blocks.
        staging = d.buffers[b]
        launch = plan.launches.get((b, span.count))
        if launch is None:  # one per buffer and span width: the other layer groups fire it at their first layer
            launch = plan.launches[(b, span.count)] = self.chunk_launch(staging, chunk_slots, chunk, span.count,
                                                                        to_host)
        cuda = work is not None
        return ChunkIssue(
            b, fire=lambda: launch.fire(span, self.tuning.staged_programs(to_host), None, blocks_layer0=span.start),
            copy=lambda: self.copy_runs(staging, host_ids, span, to_host=to_host, stream=d.copy_stream, plan=plan),
            handoff=torch.cuda.Event() if cuda else None, free=torch.cuda.Event() if cuda else None)

    def run_rects(self, host_ids: np.ndarray, span: LayerSpan,
                  runs: Optional[list[tuple[int, int]]] = None) -> Rects:
        """The byte rectangle of each run of consecutive host blocks (numpy; a layerwise plan builds them once).

        ``page_first``: a row per block, the span's layers of it (one row of whole blocks when the span is all
        layers). ``layer_first``: a row per layer of the span, the run's pages of it (K and V). ``runs``:
        ``block_runs(host_ids)`` when the caller has it already.
        """
        runs = block_runs(host_ids) if runs is None else runs
        r = np.array(runs, dtype=np.uint64).reshape(-1, 2)
        starts, lengths = r[:, 0], r[:, 1]
        h0 = np.asarray(host_ids, dtype=np.uint64)[starts.astype(np.int64)]
        fields = self._rect_fields(span, h0, starts, lengths, host_ids.size)
        return Rects(*(f if isinstance(f, np.ndarray) else np.full(starts.shape, f, dtype=np.uint64) for f in fields))

    def _rect_fields(self, span: LayerSpan, h0, start, length, num_pages: int) -> tuple:
        """(host_off, stg_off, width, height, host_pitch, stg_pitch) of the rectangle of a run of ``length`` host
        blocks from block ``h0``, at page ``start`` of the staged ``num_pages``: ints, or uint64 arrays of runs."""
        geo = self.kv.geometry
        if self.layout == "page_first":
            block_span = span.count * geo.page_bytes  # the span's bytes of one block (a layer is K and V)
            host, stg = h0 * geo.block_bytes + span.start * geo.page_bytes, start * block_span
            if span.count == geo.num_layers:  # whole blocks: one contiguous row
                return host, stg, length * block_span, 1, 0, 0
            return host, stg, block_span, length, geo.block_bytes, block_span
        page, host_pitch = geo.page_bytes, self.layer_pitch
        return (span.start * host_pitch + h0 * page, start * page, length * page, span.count, host_pitch,
                num_pages * page)

    def span_rects(self, plan: ChunkRuns, host_ids: np.ndarray, span: LayerSpan) -> Rects:
        """The batched copy's rectangles of a chunk of ``host_ids`` (runs ``plan.runs``) for ``span``: built once
        per span width from layer 0 and kept in ``plan``, then moved to ``span.start`` (a layer's host rows are a
        fixed distance from the previous layer's; its staging rows do not move)."""
        base = plan.rects.get(span.count)
        if base is None:
            base = plan.rects[span.count] = self.run_rects(host_ids, LayerSpan(0, span.count), plan.runs)
        return base if span.start == 0 else base.shifted(span.start * self.layer_shift())

    def span_rows(self, plan: ChunkRuns, host_ids: np.ndarray, span: LayerSpan, *, to_host: bool) -> Rows:
        """Every row of :meth:`span_rects` (chunk ``host_ids``, runs ``plan.runs``), built once per span width from
        layer 0 and kept in ``plan`` (one copy's: one direction), then moved to ``span.start`` as the rectangles
        are. A ``layer_first`` store's (``to_host``) rows of up to ``Tuning.store_split_max_bytes`` go as
        :func:`scattered_pieces` of :meth:`store_piece_bytes`."""
        base = plan.rows.get(span.count)
        if base is None:
            base = self.span_rects(plan, host_ids, LayerSpan(0, span.count)).rows()
            if to_host and self.layout == "layer_first":
                base = scattered_pieces(base, self.store_piece_bytes(), self.tuning.store_split_max_bytes)
            plan.rows[span.count] = base
        return base if span.start == 0 else base.shifted(span.start * self.layer_shift())

    def store_piece_bytes(self) -> int:
        """Bytes of the pieces a store's narrow rows are cut into: ``Tuning.store_piece_bytes`` in whole pages of a
        layer (at least one)."""
        page = self.kv.geometry.page_bytes
        return max(1, self.tuning.store_piece_bytes // page) * page

    def run_rows(self, host_ids: np.ndarray, span: LayerSpan,
                 runs: Optional[list[tuple[int, int]]] = None) -> Rows:
        """Every row of :meth:`run_rects`, in order."""
        return self.run_rects(host_ids, span, runs).rows()

    def layer_shift(self) -> int:
        """Host bytes between a layer's rows and the next layer's (the staging rows of a span do not move)."""
        return self.kv.geometry.page_bytes if self.layout == "page_first" else self.layer_pitch

    def _run_rects(self, host_ids: np.ndarray, span: LayerSpan, runs: Optional[list[tuple[int, int]]] = None):
        """:meth:`run_rects` one :class:`_Rect` (ints) at a time, in plain Python: a layerwise load of one run
        issues a copy per layer, and building numpy arrays for one rectangle costs more than the copy's issue."""
        for start, length in block_runs(host_ids) if runs is None else runs:
            yield _Rect(*self._rect_fields(span, int(host_ids[start]), start, length, host_ids.size))

    def _run_views(self, staging: torch.Tensor, host_ids: np.ndarray, span: LayerSpan,
                   runs: Optional[list[tuple[int, int]]] = None):
        """(host, staging) 2-D byte views of each of :meth:`_run_rects`."""
        host_bytes = self._host_bytes
        stg_bytes = staging.view(-1).view(torch.uint8)
        for r in self._run_rects(host_ids, span, runs):
            shape = (r.height, r.width)
            # as_strided offsets count from the storage's start, not the view's
            yield (host_bytes.as_strided(shape, (r.host_pitch, 1), host_bytes.storage_offset() + r.host_off),
                   stg_bytes.as_strided(shape, (r.stg_pitch, 1), stg_bytes.storage_offset() + r.stg_off))


@dataclasses.dataclass
class ChunkRuns:
    """A chunk's runs of blocks, and by span width its batched copy's rectangles and rows from layer 0 and its
    gather or scatter launches by staging buffer (built on first use: a copy staged in groups of layers, or
    launched layer by layer, reuses them)."""

    runs: list[tuple[int, int]]
    rects: dict[int, Rects] = dataclasses.field(default_factory=dict)
    rows: dict[int, Rows] = dataclasses.field(default_factory=dict)
    launches: dict[tuple[int, int], KernelLaunch] = dataclasses.field(default_factory=dict)


class SingleCopy(NamedTuple):
    """One ``cudaMemcpy2DAsync`` (one ``cudaMemcpyAsync`` for a single row) from host blocks into staging, for a
    span's first layer 0: a later first layer reads the host side ``src_shift`` bytes a layer further."""

    dst: int
    dst_pitch: int
    src: int
    src_pitch: int
    width: int
    height: int
    src_shift: int

    def issue(self, first_layer: int, stream: int) -> None:
        """Queue the copy of the span from ``first_layer`` on the raw stream ``stream``."""
        rt = _cupy.cuda.runtime
        dst, src = self.dst, self.src + first_layer * self.src_shift
        if self.height > 1:
            rt.memcpy2DAsync(dst, self.dst_pitch, src, self.src_pitch, self.width, self.height, rt.memcpyDefault,
                             stream)
        else:
            rt.memcpyAsync(dst, src, self.width, rt.memcpyDefault, stream)


class _Rect(NamedTuple):
    """One of :class:`Rects`, as ints."""

    host_off: int
    stg_off: int
    width: int
    height: int
    host_pitch: int
    stg_pitch: int


def _copy_2d(host: torch.Tensor, staging: torch.Tensor, *, to_host: bool, stream) -> None:
    """Copy between two 2-D byte views of equal shape, rows contiguous, without CuPy: staging -> host when
    ``to_host``, else host -> staging; asynchronous on ``stream`` (one torch copy per row, each split at host
    registration boundaries), a plain copy without one (CPU). With CuPy, :func:`_copy_rect` issues the copies."""
    if stream is None:
        (host if to_host else staging).copy_(staging if to_host else host)
        return
    for row in range(host.shape[0]):
        _copy(host[row], staging[row], to_host=to_host, stream=stream)


def _copy_batched(host_ptr: int, stg_ptr: int, *, to_host: bool, stream, issuer: Optional[RowIssuer] = None,
                  rects: Optional[Rects] = None, rows: Optional[Rows] = None) -> None:
    """Copies between the host blocks at ``host_ptr`` and the staging buffer at ``stg_ptr`` in batched driver calls:
    of ``rects`` (runs that go pitched, :meth:`StagedTransfer.pitched`), a pitched copy per rectangle of several rows
    whose pitches fit the device's limit and whose host bytes lie in one host registration
    (``cuMemcpy3DBatchAsync``), and a copy per row of the rest; or a copy per row of ``rows``
    (``cuMemcpyBatchAsync``, rows split at host registration boundaries), in one call, or issued by ``issuer`` where
    given."""
    if rects is not None:
        host = rects.host_off + np.uint64(host_ptr)
        extent = host + (rects.height - np.uint64(1)) * rects.host_pitch + rects.width
        two_d = ((rects.height > 1) & (np.maximum(rects.host_pitch, rects.stg_pitch) <= _max_pitch())
                 & ~batch_copy.crosses_registration(host, extent))
        if two_d.any():
            p = rects.select(two_d)
            host, stg = host[two_d], p.stg_off + np.uint64(stg_ptr)
            if to_host:
                batch_copy.memcpy_rects(host, p.host_pitch, stg, p.stg_pitch, p.width, p.height, stream.cuda_stream)
            else:
                batch_copy.memcpy_rects(stg, p.stg_pitch, host, p.host_pitch, p.width, p.height, stream.cuda_stream)
            rects = rects.select(~two_d)
        rows = rects.rows()
    assert rows is not None  # rects or rows is given
    if rows.width.size == 0:
        return
    host, stg, width = batch_copy.split_rows(rows.host_off + np.uint64(host_ptr), rows.stg_off + np.uint64(stg_ptr),
                                             rows.width)
    dst, src = (host, stg) if to_host else (stg, host)
    if issuer is not None:
        issuer.issue(dst, src, width, stream)
    else:
        batch_copy.memcpy_batch(dst, src, width, stream.cuda_stream)


def _copy_rect(host_ptr: int, stg_ptr: int, height: int, width: int, host_pitch: int, stg_pitch: int, *,
               to_host: bool, stream) -> None:
    """CuPy copies of ``height`` rows of ``width`` bytes between host and staging addresses at their pitches.

    One ``cudaMemcpy2DAsync`` when there are several rows, the pitches fit the device's limit and the host rows lie
    in one host registration; otherwise one ``cudaMemcpyAsync`` per row, each split at registration boundaries
    (a chunk-registered pool: a copy may not span two registrations).
    """
    rt = _cupy.cuda.runtime
    if height > 1:
        host_extent = (height - 1) * host_pitch + width
        if (max(host_pitch, stg_pitch) <= _max_pitch()
                and len(split_at_registrations(host_ptr, host_extent)) == 1):
            if to_host:
                rt.memcpy2DAsync(host_ptr, host_pitch, stg_ptr, stg_pitch, width, height, rt.memcpyDefault,
                                 stream.cuda_stream)
            else:
                rt.memcpy2DAsync(stg_ptr, stg_pitch, host_ptr, host_pitch, width, height, rt.memcpyDefault,
                                 stream.cuda_stream)
            return
    for row in range(height):
        h, g = host_ptr + row * host_pitch, stg_ptr + row * stg_pitch
        for off, length in split_at_registrations(h, width):
            dst, src = (h, g) if to_host else (g, h)
            rt.memcpyAsync(dst + off, src + off, length, rt.memcpyDefault, stream.cuda_stream)


@functools.cache
def _max_pitch() -> int:
    """The device's largest pitch for 2-D copies (cudaDevAttrMaxPitch), read once."""
    return _cupy.cuda.runtime.deviceGetAttribute(_CUDA_DEV_ATTR_MAX_PITCH, _cupy.cuda.runtime.getDevice())


def _copy(host: torch.Tensor, staging: torch.Tensor, *, to_host: bool, stream) -> None:
    """Asynchronous torch copy (no CuPy) between two contiguous 1-D byte views of equal size, in the direction of
    ``to_host``, split at host registration boundaries (a copy may not span two registrations)."""
    dst, src = (host, staging) if to_host else (staging, host)
    with torch.cuda.stream(stream):
        for off, length in split_at_registrations(host.data_ptr(), host.numel()):
            dst[off:off + length].copy_(src[off:off + length], non_blocking=True)
