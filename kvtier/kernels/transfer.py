"""Direct page transfers: a persistent Triton kernel copies KV rows between device slots and host blocks.

The kernel reads one side and writes the other; pinned host memory is addressed in place through UVA, so no copy
engine and no staging buffer are involved. It moves raw words (8 B, or narrower when a row or an address is not
8-byte aligned) in 16-byte vectors where alignment allows, so it does not care whether the KV is bf16, fp16, fp8 or
fp32. One launch moves any number of pages of one layer or of a range of layers (offset table in
:class:`~kvtier.kernels.paged_kv.PagedKV`). The same kernel, pointed at a device staging buffer instead of host
blocks, is the gather/scatter half of the staged mode (:mod:`kvtier.kernels.staged`).

:func:`store_pages` and :func:`load_pages` check and launch in one call. :class:`DirectCopy` checks once and
launches many times (a layerwise load: one launch per layer, each about one kernel launch of host time); launches
take the raw stream handle, without entering torch stream or device contexts.

Work is split into tiles of whole 2^k-word chunks of rows (a row is one token of one layer, K or V), K and V of
the same tokens loaded together; a persistent grid of ``num_programs`` programs strides over (layer, tile) items,
layer-major. Host reads (loads) are latency bound over PCIe: throughput is bytes in flight / round-trip time, so
the tile size sets the bandwidth a program can reach, and the program count sets how many SMs the transfer takes
from the forward pass. Both are tuned constants (:class:`~kvtier.kernels.tuning.Tuning`); ``num_programs`` is the
caller's to choose (``TierConfig.num_programs``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Union

import torch
import triton
import triton.language as tl

from kvtier._checks import check_count
from kvtier.kernels.checks import INTERPRETED as _INTERPRETED
from kvtier.kernels.checks import LayerSpan, check_kv, check_transfer, forced_checks, kept_indices, layer_span
from kvtier.kernels.paged_kv import PagedKV, as_words
from kvtier.kernels.tuning import Tuning, check_tuning

try:  # the raw cudaStream_t of a device's current stream, without building a torch Stream (Triton does the same)
    from torch._C import _cuda_getCurrentRawStream as _current_raw_stream
except ImportError:  # pragma: no cover - CPU-only torch builds
    def _current_raw_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream

# The programs, tile and warps of a launch are tuned constants (kvtier.kernels.tuning, docs/DESIGN.md "Tuned
# constants"). Longest contiguous run one lane group copies: longer rows are split into chunks of this many bytes,
# so a tile holds several rows' chunks and the kernel's [KV, SEGS, CHUNK] block stays within a tile.
MAX_CHUNK_BYTES = 2048
# Integer arguments are not specialised on their values (Triton would otherwise compile a variant for n_layers == 1,
# for multiples of 16, ...): one compiled kernel per geometry and direction, no compile stalls mid-serving.
@triton.jit(do_not_specialize=["n_rows", "skip_rows", "layer_start", "n_layers", "stride_block", "stride_layer",
                               "stride_kv", "blocks_layer0"])
def _copy_pages_kernel(
    dev_base,  # word*: the lowest-addressed device KV buffer; every buffer is addressed from it
    dev_offsets,  # int64 [layers * KV]: (buffer address - dev_base) in ALIGN-word units, layer-major, K before V
    blocks,  # word*: host blocks (direct mode) or a device staging buffer (staged mode)
    slots,  # int64 [n_rows]: device slot of each token moved, in block order
    block_ids,  # int64 [(skip_rows + n_rows) / PAGE]: the blocks, in order
    n_rows,  # tokens to move: every token of the blocks but the first skip_rows
    skip_rows,  # tokens of the first block not moved (a load that continues a prefix held mid-block), < PAGE
    layer_start,  # first layer to move
    n_layers,  # layers to move
    stride_block,  # blocks: rows between consecutive blocks
    stride_layer,  # blocks: rows between consecutive layers
    stride_kv,  # blocks: rows between K and V
    blocks_layer0,  # the layer held at layer index 0 of blocks (0 for host blocks; a staging chunk's first layer)
    TO_BLOCKS: tl.constexpr,  # True: device slots -> blocks (store, D2H); False: blocks -> device slots (load, H2D)
    KV: tl.constexpr,  # buffers per layer: 2 (K, V) or 1 (MLA)
    PAGE: tl.constexpr,  # tokens per page
    ROW_WORDS: tl.constexpr,  # words per row (one token, one layer, K or V)
    CHUNK: tl.constexpr,  # words per contiguous chunk: a power of two dividing ROW_WORDS
    SEGS: tl.constexpr,  # chunks per tile and buffer (power of two)
    ALIGN: tl.constexpr,  # dev_offsets unit, in words
):
    CHUNKS_PER_ROW: tl.constexpr = ROW_WORDS // CHUNK
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_segs = n_rows * CHUNKS_PER_ROW
    n_tiles = tl.cdiv(n_segs, SEGS)
    kv = tl.arange(0, KV)
    lane_seg = tl.arange(0, SEGS)
    word = tl.arange(0, CHUNK)
    for item in range(pid, n_layers * n_tiles, nprog):
        layer = (layer_start + item // n_tiles).to(tl.int64)
        seg = (item % n_tiles).to(tl.int64) * SEGS + lane_seg  # [SEGS] chunk index over all rows
        seg_ok = seg < n_segs
        row = seg // CHUNKS_PER_ROW
        col = (seg % CHUNKS_PER_ROW) * CHUNK  # first word of the chunk within its row
        slot = tl.load(slots + row, mask=seg_ok, other=0)
        row = row + skip_rows  # the token's place in the blocks
        block = tl.load(block_ids + row // PAGE, mask=seg_ok, other=0)
        dev_off = tl.load(dev_offsets + layer * KV + kv) * ALIGN  # [KV]
        dev_word = dev_off[:, None] + (slot * ROW_WORDS + col)[None, :]  # [KV, SEGS]
        blk_row = block * stride_block + (layer - blocks_layer0) * stride_layer + row % PAGE
        blk_row = blk_row[None, :] + (kv * stride_kv)[:, None]  # [KV, SEGS]
        blk_word = blk_row * ROW_WORDS + col[None, :]  # [KV, SEGS]
        dev_ptrs = dev_base + dev_word[:, :, None] + word[None, None, :]  # [KV, SEGS, CHUNK]
        blk_ptrs = blocks + blk_word[:, :, None] + word[None, None, :]
        mask = seg_ok[None, :, None]  # broadcast over K/V and the chunk's words
        if TO_BLOCKS:
            tl.store(blk_ptrs, tl.load(dev_ptrs, mask=mask), mask=mask)
        else:
            tl.store(dev_ptrs, tl.load(blk_ptrs, mask=mask), mask=mask)


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


class KernelLaunch:
    """One copy between device slots and ``blocks``, its kernel arguments packed once; :meth:`fire` launches it
    for a span of layers. Arguments must already be checked (no validation here); ``tile_bytes`` and
    ``num_warps`` come from a :class:`~kvtier.kernels.tuning.Tuning`."""

    def __init__(self, kv: PagedKV, blocks: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor,
                 strides: tuple[int, int, int], *, to_blocks: bool, tile_bytes: int, num_warps: int,
                 blocks_layer0: int = 0, skip_rows: int = 0) -> None:
        geo = kv.geometry
        word_bytes = kv.word_bytes
        row_words = geo.row_bytes // word_bytes
        chunk = _pow2_floor(row_words & -row_words)  # largest power of two dividing row_words
        chunk = min(chunk, max(MAX_CHUNK_BYTES // word_bytes, 1))
        segs = _pow2_floor(max(tile_bytes // (chunk * word_bytes * geo.kv_count), 1))
        self.n_rows = slots.numel()
        self.skip_rows = skip_rows
        self.tiles_per_layer = -(-self.n_rows * (row_words // chunk) // segs)
        self.layer_bytes = self.n_rows * geo.kv_count * geo.row_bytes
        self.pointers = (kv.base, kv.offsets, as_words(blocks, word_bytes), slots, block_ids)
        device = self.pointers[0].device
        self._cuda = device.type == "cuda" and not _INTERPRETED
        self._device_index = device.index
        # The launches pass device tensors as their addresses: Triton's launcher asks the driver to translate every
        # tensor argument on every launch (a data_ptr call and cuPointerGetAttribute each). Host blocks stay
        # tensors, translated to their device address; self.pointers keeps every tensor alive.
        self._launch_pointers = tuple(p.data_ptr() if p.is_cuda else p for p in self.pointers)
        self.strides = strides
        self.blocks_layer0 = blocks_layer0
        self.consts = (to_blocks, geo.kv_count, geo.page_size, row_words, chunk, segs, kv.align_words)
        self.num_warps = num_warps
        self.kernel: Any = None  # the compiled kernel (Triton's), found on the first CUDA launch
        self._runners: dict[int, Any] = {}  # grid -> the compiled kernel's launcher for it

    def fire(self, span: LayerSpan, num_programs: int, stream: Optional[int],
             blocks_layer0: Optional[int] = None) -> None:
        """Launch ``num_programs`` programs on ``stream`` (a raw ``cudaStream_t``; default: the current stream of
        the KV's device, which must be the current device); ``blocks_layer0`` overrides the one given at
        construction (a staging chunk reused for other layers)."""
        if self.n_rows == 0 or span.count == 0:
            return
        grid = max(1, min(num_programs, span.count * self.tiles_per_layer))
        layer0 = self.blocks_layer0 if blocks_layer0 is None else blocks_layer0
        scalars = (self.n_rows, self.skip_rows, span.start, span.count, *self.strides, layer0)
        if not self._cuda:
            _copy_pages_kernel[(grid,)](*self.pointers, *scalars, **dict(zip(_CONST_NAMES, self.consts)),
                                        num_warps=self.num_warps)
            return
        runner = self._runners.get(grid)
        if runner is None:
            if self.kernel is None:
                self.kernel = _compiled_kernel((*self.pointers, *scalars), self.consts, self.num_warps, grid)
            runner = self._runners[grid] = self.kernel[(grid, 1, 1)]
        runner(*self._launch_pointers, *scalars, *self.consts,
               stream=_current_raw_stream(self._device_index) if stream is None else stream)


# Compiled kernels by specialisation: Triton's generic launch path binds and hashes every argument on each call
# (tens of microseconds of host time); a transfer per layer per request makes that the scheduler's cost, so launches
# call the compiled kernel directly. Triton specialises pointers on 16-byte alignment (ints are not specialised, see
# do_not_specialize), so the key is the constexprs, the warps, the device, the pointers' alignment and dtypes.
_compiled: dict[tuple, object] = {}
_CONST_NAMES = ("TO_BLOCKS", "KV", "PAGE", "ROW_WORDS", "CHUNK", "SEGS", "ALIGN")


def _compiled_kernel(args: tuple, consts: tuple, num_warps: int, grid: int):
    pointers = args[:5]
    key = (consts, num_warps, pointers[0].device.index, tuple(p.data_ptr() % 16 == 0 for p in pointers),
           tuple(p.dtype for p in pointers))  # the words' and the indices' widths
    kernel = _compiled.get(key)
    if kernel is None:  # compile (on the current device) without launching: the caller launches on its stream
        kernel = _copy_pages_kernel.warmup(*args, **dict(zip(_CONST_NAMES, consts)), num_warps=num_warps,
                                           grid=(grid,))
        kernel = _compiled[key] = kernel.result() if hasattr(kernel, "result") else kernel  # async compile mode
    return kernel


class DirectCopy:
    """A checked direct transfer between device slots and host blocks, ready to launch for any layers.

    Validation, the upload of host-side indices and the packing of kernel arguments run once, here; each
    :meth:`launch` then costs about one kernel launch of host time. A layerwise load builds one and launches it
    per layer, where a ``load_pages`` call per layer would check and pack the same indices every time.

    Args: as :func:`store_pages` (``to_host``: True for D2H); ``stream`` orders the index upload. Launch on that
    stream or on one ordered after it. The caller keeps ``host`` and the indices alive while launches may run.
    """

    def __init__(self, kv: PagedKV, host: torch.Tensor, slots, block_ids, *, to_host: bool,
                 layout: str = "page_first", num_programs: Optional[int] = None, stream=None, check: bool = True,
                 skip_tokens: int = 0, tuning: Optional[Tuning] = None) -> None:
        if num_programs is not None:
            num_programs = check_count("num_programs", num_programs)
        self.tuning = check_tuning(tuning)
        check_kv(kv)
        # Indices already on the device with no range check need no stream: skip the stream and device contexts
        # (tens of microseconds of host time); otherwise their checks and uploads run on ``stream``.
        check = check or forced_checks()
        quiet = kv.is_cuda and not check and _ready(slots, kv) and _ready(block_ids, kv)
        with contextlib.nullcontext() if quiet else on_stream(kv, stream):
            slots, block_ids, num_blocks = check_transfer(kv, host, slots, block_ids, layout=layout,
                                                          host_side=True, writes_blocks=to_host,
                                                          check_indices=check, skip_tokens=skip_tokens)
        skip_tokens = int(skip_tokens)  # checked: an integer in range (a numpy one reaches no launch)
        # launched later: never through the caller's own host indices (device-side ones are the caller's to keep
        # unchanged until the launches are issued)
        slots, block_ids = kept_indices(slots, block_ids)
        self.kv = kv
        self.num_programs = num_programs
        self._launch = KernelLaunch(kv, host, slots, block_ids, kv.geometry.host_row_strides(num_blocks, layout),
                                    to_blocks=to_host, tile_bytes=self.tuning.tile_bytes,
                                    num_warps=self.tuning.num_warps, skip_rows=skip_tokens)

    def launch(self, layers: Union[None, int, range] = None, *, stream=None) -> None:
        """Copy ``layers`` (None: all, an int, or a range) on ``stream`` (default: the current stream)."""
        self._fire(layer_span(layers, self.kv.geometry.num_layers), stream)

    def _fire(self, span: LayerSpan, stream) -> None:
        programs = self.num_programs or self.tuning.programs_for(self._launch.layer_bytes * span.count)
        if not self.kv.is_cuda:
            self._launch.fire(span, programs, None)
            return
        with on_device(self.kv):
            self._launch.fire(span, programs, None if stream is None else raw_stream(stream))


def _transfer(kv: PagedKV, host: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor, *, to_host: bool,
              layout: str, layers: Union[None, int, range], num_programs: Optional[int], stream, check: bool,
              skip_tokens: int, tuning: Optional[Tuning]) -> None:
    check_kv(kv)
    span = layer_span(layers, kv.geometry.num_layers)  # a bad ``layers`` fails before any index is uploaded
    DirectCopy(kv, host, slots, block_ids, to_host=to_host, layout=layout, num_programs=num_programs, stream=stream,
               check=check, skip_tokens=skip_tokens, tuning=tuning)._fire(span, stream)


def _ready(idx, kv: PagedKV) -> bool:
    """Whether an index tensor can go to the kernel as it is: int64, 1-D, contiguous, on the KV's device."""
    return (isinstance(idx, torch.Tensor) and idx.dtype == torch.int64 and idx.dim() == 1 and idx.is_contiguous()
            and idx.device == kv.device)


def on_device(kv: PagedKV):
    """A context making the KV's device current; none when it already is (the usual case)."""
    return contextlib.nullcontext() if torch.cuda.current_device() == kv.device.index else torch.cuda.device(kv.device)


def raw_stream(stream) -> int:
    """The ``cudaStream_t`` of a torch or CuPy stream (or anything with ``cuda_stream`` or ``ptr``)."""
    return int(stream.cuda_stream if hasattr(stream, "cuda_stream") else stream.ptr)


def torch_stream(kv: PagedKV, stream) -> torch.cuda.Stream:
    """``stream`` as a torch stream on the KV's device (a CuPy or other stream is wrapped by its raw handle)."""
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.ExternalStream(raw_stream(stream), device=kv.device)


class on_stream:
    """Context: the kernel's device and, when given, a torch stream (or anything with ``cuda_stream``)."""

    def __init__(self, kv: PagedKV, stream) -> None:
        self._ctx: list[contextlib.AbstractContextManager] = []
        if kv.is_cuda:
            self._ctx.append(torch.cuda.device(kv.device))
            if stream is not None:
                self._ctx.append(torch.cuda.stream(torch_stream(kv, stream)))

    def __enter__(self):
        for c in self._ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self._ctx):
            c.__exit__(*exc)


def store_pages(kv: PagedKV, host: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor, *,
                layout: str = "page_first", layers: Union[None, int, range] = None,
                num_programs: Optional[int] = None, stream=None, check: bool = True, skip_tokens: int = 0,
                tuning: Optional[Tuning] = None) -> None:
    """Copy pages from device slots into host blocks (D2H), asynchronously on ``stream``.

    Args:
        kv: the device KV buffers (:class:`PagedKV`).
        host: host blocks in ``layout`` (see :class:`~kvtier.geometry.KVGeometry`), same dtype as the device
            buffers; pinned when the device buffers are on CUDA.
        slots: int64 device slot of every token moved, ``len(block_ids) * page_size - skip_tokens`` of them, in
            block order.
        block_ids: int64 host block of every page moved; distinct.
        skip_tokens: leading tokens of the first block that are not moved (``0 <= skip_tokens < page_size``):
            a load that continues a prefix the device holds up to the middle of a host block.
        layout: ``"page_first"`` or ``"layer_first"``.
        layers: ``None`` for all layers in one launch, an ``int`` for one layer, or a ``range`` of layers.
        num_programs: persistent programs (SMs) to use; default ``tuning.programs``, or ``tuning.burst_programs``
            for transfers of at most ``tuning.burst_bytes`` (:meth:`Tuning.programs_for`).
        stream: torch (or CuPy) stream to launch on; default the current stream.
        check: validate indices (range, distinct destinations) before launching; costs a device sync when the
            indices live on the GPU. Shapes, dtypes, devices and pinning are always checked. With ``check=False``
            an index out of range is an illegal memory access on the GPU and can crash the process on the CPU;
            ``KVTIER_CHECK=1`` turns the checks back on everywhere.
        tuning: the kernel's tuned constants (:class:`~kvtier.kernels.tuning.Tuning`; benchmarks vary them).

    The copy is asynchronous: the caller must keep the slots' KV unchanged until the stream reaches this point.
    """
    _transfer(kv, host, slots, block_ids, to_host=True, layout=layout, layers=layers, num_programs=num_programs,
              stream=stream, check=check, skip_tokens=skip_tokens, tuning=tuning)


def load_pages(kv: PagedKV, host: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor, *,
               layout: str = "page_first", layers: Union[None, int, range] = None,
               num_programs: Optional[int] = None, stream=None, check: bool = True, skip_tokens: int = 0,
               tuning: Optional[Tuning] = None) -> None:
    """Copy pages from host blocks into device slots (H2D), asynchronously on ``stream``.

    Arguments as :func:`store_pages`; here the slots must be distinct and the blocks may repeat.
    """
    _transfer(kv, host, slots, block_ids, to_host=False, layout=layout, layers=layers, num_programs=num_programs,
              stream=stream, check=check, skip_tokens=skip_tokens, tuning=tuning)
