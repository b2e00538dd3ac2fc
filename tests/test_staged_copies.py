"""The copy-engine side of the staged path on the CPU: which copies ``_copy_rect`` issues, and that they move the bytes.

CuPy and the driver's batched copies need CUDA, so these tests put recording stand-ins for ``cupy.cuda.runtime``,
``batch_copy.memcpy_batch`` and the driver's ``cuMemcpy3DBatchAsync`` in their place: each performs its copies with
``ctypes.memmove`` on host memory and records the call (the 3-D one decodes the packed operation records). That
checks the choice between one 2-D copy, per-row copies (host registrations, the pitch limit) and batched calls, and
the pointer and pitch arithmetic, which the GPU tests only see end to end.
"""

from __future__ import annotations

import ctypes
import dataclasses
import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.geometry import KVGeometry
from kvtier.kernels import StagedTransfer, batch_copy
from kvtier.kernels import staged as staged_mod
from kvtier.kernels.checks import LayerSpan
from kvtier.kernels.pinned import register_pinned_range, unregister_pinned_range
from kvtier.kernels.tuning import Tuning
from tests.kv_helpers import make_host, make_kv


class FakeRuntime:
    """Stands in for ``cupy.cuda.runtime``: copies with memmove, records (kind, args) of every call."""

    memcpyDefault = 4

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self.calls.append(("1d", dst, src, size))
        ctypes.memmove(dst, src, size)

    def memcpy2DAsync(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                      stream: int) -> None:
        assert width <= dpitch and width <= spitch, "cudaMemcpy2DAsync requires width <= both pitches"
        self.calls.append(("2d", dst, dpitch, src, spitch, width, height))
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)


@pytest.fixture
def runtime(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(staged_mod, "_cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt)))
    monkeypatch.setattr(staged_mod, "_max_pitch", lambda: 1 << 20)
    return rt


class FakeBatch:
    """Stands in for the driver's batched copy: memmoves each (dst, src, size), records one call per batch."""

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime

    def memcpy_batch(self, dsts, srcs, sizes, stream) -> None:
        assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64
        self.runtime.calls.append(("batch", dsts.size))
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)


    def memcpy_3d(self, n: int, ops_ptr: int, flags: int, stream) -> int:
        """``cuMemcpy3DBatchAsync_v2(numOps, opList, flags, stream)`` on host memory, from the packed records."""
        ops = np.frombuffer((ctypes.c_char * (n * batch_copy._BATCH_OP.itemsize)).from_address(ops_ptr),
                            dtype=batch_copy._BATCH_OP)
        assert flags == 0 and (ops["src_type"] == 1).all() and (ops["dst_type"] == 1).all()
        assert (ops["depth"] == 1).all() and (ops["order"] == 1).all() and (ops["height"] > 0).all()
        assert (ops["src_pitch"] >= ops["width"]).all() and (ops["dst_pitch"] >= ops["width"]).all()
        assert (ops["src_height"] == ops["height"]).all() and (ops["dst_height"] == ops["height"]).all()
        self.runtime.calls.append(("rects", n))
        for op in ops:
            for row in range(int(op["height"])):
                ctypes.memmove(int(op["dst_ptr"]) + row * int(op["dst_pitch"]),
                               int(op["src_ptr"]) + row * int(op["src_pitch"]), int(op["width"]))
        return 0


@pytest.fixture(params=["one_by_one", "batched", "pitched"])
def copies(request, runtime, monkeypatch):
    """The runtime stand-in, with no batched copy behind it, row batches only, or row and pitched batches."""
    fake = FakeBatch(runtime)
    monkeypatch.setattr(batch_copy, "available", lambda: request.param != "one_by_one")
    monkeypatch.setattr(batch_copy, "memcpy_batch", fake.memcpy_batch)
    driver_3d = batch_copy._Driver(fake.memcpy_3d, None, None) if request.param == "pitched" else None
    monkeypatch.setattr(batch_copy, "_driver_3d", lambda: driver_3d)
    runtime.mode = request.param
    return runtime


STREAM = types.SimpleNamespace(cuda_stream=0)


def _copy_rect(h: torch.Tensor, s: torch.Tensor, to_host: bool) -> None:
    """``staged._copy_rect`` of the bytes of two 2-D views (host, staging)."""
    staged_mod._copy_rect(h.data_ptr(), s.data_ptr(), h.shape[0], h.shape[1], h.stride(0), s.stride(0),
                          to_host=to_host, stream=STREAM)


def _views(host: torch.Tensor, stg: torch.Tensor, height: int, width: int, host_pitch: int, host_off: int):
    h = host.as_strided((height, width), (host_pitch, 1), host.storage_offset() + host_off)
    s = stg.as_strided((height, width), (width, 1), stg.storage_offset())
    return h, s


# the fixture's recorder is cleared at the start of every example; the monkeypatches hold for all of them
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(height=st.integers(2, 6), width=st.integers(1, 64), gap=st.integers(0, 40), host_off=st.integers(0, 50),
       boundary=st.one_of(st.none(), st.integers(1, 600)), to_host=st.booleans())
def test_one_2d_copy_unless_the_rows_cross_a_registration(runtime, height, width, gap, host_off, boundary,
                                                          to_host):
    """A pitched region inside one host registration moves in one 2-D copy; one that crosses a registration
    boundary moves row by row, each row split at the boundary; either way exactly the region's bytes move."""
    runtime.calls.clear()
    host = torch.randint(0, 256, (1024,), dtype=torch.uint8, generator=torch.Generator().manual_seed(width))
    stg = torch.randint(0, 256, (height * width,), dtype=torch.uint8, generator=torch.Generator().manual_seed(gap))
    host_before, stg_before = host.clone(), stg.clone()
    pitch = width + gap
    h, s = _views(host, stg, height, width, pitch, host_off)
    base = host.data_ptr()
    regs = [(base, boundary), (base + boundary, 1024 - boundary)] if boundary else []
    for ptr, n in regs:
        register_pinned_range(ptr, n)
    try:
        _copy_rect(h, s, to_host)
    finally:
        for ptr, _ in regs:
            unregister_pinned_range(ptr)
    # the bytes: the region of the destination equals the source, everything else is untouched
    want_host, want_stg = host_before.clone(), stg_before.clone()
    hw, sw = _views(want_host, want_stg, height, width, pitch, host_off)
    if to_host:
        hw.copy_(sw)
    else:
        sw.copy_(hw)
    assert torch.equal(host, want_host) and torch.equal(stg, want_stg)
    # the calls
    first, last = host_off, host_off + (height - 1) * pitch + width  # host bytes the region spans
    crosses = boundary is not None and first < boundary < last
    if not crosses:
        assert [c[0] for c in runtime.calls] == ["2d"]
        assert runtime.calls[0][2] == (pitch if to_host else width)  # dpitch
    else:
        assert all(c[0] == "1d" for c in runtime.calls)
        rows_split = sum(host_off + r * pitch < boundary < host_off + r * pitch + width for r in range(height))
        assert len(runtime.calls) == height + rows_split


def test_rows_over_the_pitch_limit_copy_row_by_row(runtime, monkeypatch):
    monkeypatch.setattr(staged_mod, "_max_pitch", lambda: 15)
    host = torch.arange(64, dtype=torch.uint8)
    stg = torch.zeros(12, dtype=torch.uint8)
    h, s = _views(host, stg, 3, 4, 16, 0)  # pitch 16 > 15
    _copy_rect(h, s, False)
    assert [c[0] for c in runtime.calls] == ["1d"] * 3
    assert stg.tolist() == [0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35]


def test_one_row_is_one_1d_copy(runtime):
    host = torch.arange(64, dtype=torch.uint8)
    stg = torch.zeros(64, dtype=torch.uint8)
    h = host.as_strided((1, 64), (0, 1), 0)
    s = stg.as_strided((1, 64), (0, 1), 0)
    _copy_rect(h, s, False)
    assert [c[0] for c in runtime.calls] == ["1d"] and torch.equal(stg, host)


# -- StagedTransfer.copy_runs: the offset-only CuPy path against the view path --------------------------------

GEO = KVGeometry(4, 2, 64, torch.float16, page_size=2)


def _expected(stager: StagedTransfer, host_bytes: torch.Tensor, staging: torch.Tensor, host_ids: np.ndarray,
              span: LayerSpan, to_host: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(host bytes, staging) as a copy of ``host_ids``' runs must leave them: the views name the bytes, copied here
    by hand (torch copies, no batched call)."""
    want_host, want_stg = host_bytes.clone(), staging.clone()
    for host_view, stg_view in stager._run_views(want_stg, host_ids, span):
        dst = want_host.as_strided(host_view.shape, host_view.stride(),
                                   host_view.storage_offset() - host_bytes.storage_offset())
        if to_host:
            dst.copy_(stg_view)
        else:
            stg_view.copy_(dst)
    return want_host, want_stg


# pieces: a store's rows of up to 4 pages of a layer cut into pages, shuffled (the default cuts none at GEO's pages)
PIECES = {"whole_rows": Tuning(pitched_min_rows=2),
          "pieces": Tuning(pitched_min_rows=2, store_piece_bytes=GEO.page_bytes,
                           store_split_max_bytes=4 * GEO.page_bytes)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(["page_first", "layer_first"]),
       ids=st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True),
       start=st.integers(0, 3), count=st.integers(1, 4), to_host=st.booleans(),
       boundary=st.one_of(st.none(), st.integers(1, 200)))
@pytest.mark.parametrize("tuning", list(PIECES))
def test_offset_copies_move_what_the_views_name(copies, tuning, layout, ids, start, count, to_host, boundary):
    """With CuPy and a stream, ``copy_runs`` issues its copies from byte offsets (no views), one batched call
    for a chunk of several runs where the driver has it; the bytes they move must be exactly those of the
    (host, staging) views of every run, for any block ids, layers and layout, with or without a host registration
    boundary inside the pool, and with a store's narrow rows cut into shuffled pieces."""
    runtime = copies
    count = min(count, GEO.num_layers - start)
    span = LayerSpan(start, count)
    gen = torch.Generator().manual_seed(len(ids) * 31 + start)
    kv = make_kv(GEO, 16, "cpu", gen)
    host = make_host(GEO, 12, layout, "cpu", gen)
    stager = StagedTransfer(kv, host, layout=layout, tuning=PIECES[tuning])
    staging = torch.randint(0, 256, (stager.staging_bytes,), dtype=torch.uint8, generator=gen)
    host_ids = np.array(ids, dtype=np.int64)
    host_bytes = host.view(-1).view(torch.uint8)
    want_host, want_stg = _expected(stager, host_bytes, staging, host_ids, span, to_host)
    base = host_bytes.data_ptr()
    regs = [(base + boundary * 64, host_bytes.numel() - boundary * 64)] if boundary else []
    for ptr, n in regs:
        register_pinned_range(ptr, n)
    try:
        runtime.calls.clear()
        stager.copy_runs(staging, host_ids, span, to_host=to_host, stream=STREAM)
    finally:
        for ptr, _ in regs:
            unregister_pinned_range(ptr)
    assert runtime.calls, "the CuPy path issued no copy"
    kinds = [c[0] for c in runtime.calls]
    if runtime.mode == "one_by_one" or len(staged_mod.block_runs(host_ids)) == 1:
        assert not {"batch", "rects"} & set(kinds)
    elif runtime.mode == "batched":
        assert kinds == ["batch"]
        if to_host and layout == "layer_first" and not boundary:  # a store's rows: cut where the tuning says
            rows = staged_mod.scattered_pieces(stager.run_rows(host_ids, span), stager.store_piece_bytes(),
                                               PIECES[tuning].store_split_max_bytes)
            assert runtime.calls[0][1] == rows.width.size
    else:  # a pitched copy per layer_first rectangle of several rows, a row batch for the rest
        heights = stager.run_rects(host_ids, span).height
        tall = (heights > 1) if layout == "layer_first" else np.zeros(heights.size, dtype=bool)
        assert len(kinds) == len(set(kinds)) and set(kinds) <= {"batch", "rects"}
        if not boundary:
            assert kinds == ["rects"] * bool(tall.any()) + ["batch"] * bool((~tall).any())
    assert torch.equal(host_bytes, want_host) and torch.equal(staging, want_stg)


@pytest.mark.parametrize("copies", ["pitched"], indirect=True)
@pytest.mark.parametrize("run", [1, 2, 3])
@pytest.mark.parametrize("to_host", [True, False])
def test_wide_store_runs_go_as_rows_and_the_rest_pitched(copies, monkeypatch, run, to_host):
    """A ``layer_first`` store whose runs average ``Tuning.store_rows_min_bytes`` of a layer or more goes as one row
    batch and is staged in layer groups (the copy engine writes separate rows faster than pitched ones once their
    issue keeps ahead); narrower store runs, and loads, go as pitched rectangles over the whole span; the bytes are
    those of the views either way."""
    gen = torch.Generator().manual_seed(run)
    kv = make_kv(GEO, 16, "cpu", gen)
    host = make_host(GEO, 24, "layer_first", "cpu", gen)
    tuning = Tuning(pitched_min_rows=2, store_rows_min_bytes=2 * GEO.page_bytes)
    stager = StagedTransfer(kv, host, layout="layer_first", tuning=tuning)
    host_ids = np.concatenate([np.arange(run) + 5 * i for i in range(4)])  # 4 runs of `run` blocks, gaps between
    span = LayerSpan(0, GEO.num_layers)
    staging = torch.randint(0, 256, (stager.staging_bytes,), dtype=torch.uint8, generator=gen)
    host_bytes = host.view(-1).view(torch.uint8)
    want_host, want_stg = _expected(stager, host_bytes, staging, host_ids, span, to_host)
    copies.calls.clear()
    stager.copy_runs(staging, host_ids, span, to_host=to_host, stream=STREAM)
    rows = to_host and run >= 2
    assert [c[0] for c in copies.calls] == (["batch"] if rows else ["rects"])
    assert stager.pitched(span, host_ids, to_host) is not rows
    assert torch.equal(host_bytes, want_host) and torch.equal(staging, want_stg)
    # the plan: with batched calls (as on CUDA), row stores of short runs go by layer groups, pitched copies whole
    # (staging for 3 blocks: runs of up to 3 blocks are short, and a layer of every page fits one buffer)
    monkeypatch.setattr(StagedTransfer, "batched", property(lambda self: True))
    planner = StagedTransfer(kv, host, layout="layer_first",
                             tuning=dataclasses.replace(tuning, staging_bytes=3 * GEO.block_bytes))
    groups = planner.layer_groups(span, host_ids, to_host)
    assert (len(groups) > 1) is rows and sum(g.count for g in groups) == span.count


@settings(max_examples=100, deadline=None)
@given(layout=st.sampled_from(["page_first", "layer_first"]),
       ids=st.lists(st.integers(0, 11), min_size=1, max_size=8, unique=True),
       start=st.integers(0, 3), count=st.integers(1, 4))
def test_run_rows_are_the_rows_of_the_rects_in_order(layout, ids, start, count):
    """``run_rows`` (numpy, what the batched copy issues) lists exactly the rows of ``_run_rects``, in order, and a
    span's rows are its layer-0 rows moved by ``layer_shift`` per layer on the host side only (how a layerwise
    plan reuses them)."""
    count = min(count, GEO.num_layers - start)
    gen = torch.Generator().manual_seed(0)
    stager = StagedTransfer(make_kv(GEO, 16, "cpu", gen), make_host(GEO, 12, layout, "cpu", gen), layout=layout)
    host_ids = np.array(ids, dtype=np.int64)
    span = LayerSpan(start, count)
    want = [(r.host_off + i * r.host_pitch, r.stg_off + i * r.stg_pitch, r.width)
            for r in stager._run_rects(host_ids, span) for i in range(r.height)]
    rows = stager.run_rows(host_ids, span)
    assert all(a.dtype == np.uint64 for a in rows)
    assert list(zip(rows.host_off.tolist(), rows.stg_off.tolist(), rows.width.tolist())) == want
    base = stager.run_rows(host_ids, LayerSpan(0, count))
    assert (base.host_off + np.uint64(start * stager.layer_shift()) == rows.host_off).all()
    assert (base.stg_off == rows.stg_off).all() and (base.width == rows.width).all()


@settings(max_examples=100, deadline=None)
@given(widths=st.lists(st.integers(1, 12), min_size=1, max_size=12), piece=st.integers(1, 5),
       max_width=st.integers(1, 12))
def test_scattered_pieces_move_the_rows_bytes_in_pieces(widths, piece, max_width):
    """``scattered_pieces`` cuts exactly the rows wider than ``piece`` and at most ``max_width`` wide, into pieces
    no wider than ``piece``; copied in its order, the pieces move every byte the rows move, to the same place."""
    rng = np.random.default_rng(len(widths) * 13 + piece)
    width = np.array(widths, dtype=np.uint64) * np.uint64(7)  # bytes; pieces of whole 7-byte "pages"
    piece_b, max_b = piece * 7, max_width * 7
    gaps = rng.integers(0, 20, width.size).astype(np.uint64)
    host_off = np.cumsum(width + gaps) - width  # rows apart on the host, in a shuffled order
    stg_off = np.cumsum(width) - width
    order = rng.permutation(width.size)
    rows = staged_mod.Rows(host_off[order], stg_off[order], width[order])
    pieces = staged_mod.scattered_pieces(rows, piece_b, max_b)
    cut = (rows.width > piece_b) & (rows.width <= max_b)
    expected = int(sum(-(-int(w) // piece_b) if c else 1 for w, c in zip(rows.width, cut)))
    assert pieces.width.size == expected and all(a.dtype == np.uint64 for a in pieces)
    if not cut.any():
        assert all((a == b).all() for a, b in zip(pieces, rows))
    assert int(pieces.width.sum()) == int(rows.width.sum())
    stg = rng.integers(0, 256, int(width.sum()), dtype=np.uint8)
    want, got = (np.zeros(int((host_off + width).max()), dtype=np.uint8) for _ in range(2))
    for out, r in ((want, rows), (got, pieces)):
        for h, g, w in zip(*(a.tolist() for a in r)):
            out[h:h + w] = stg[g:g + w]
    assert (got == want).all()
    kept = {(h, g, w) for h, g, w, c in zip(*(a.tolist() for a in rows), cut) if not c}
    assert kept <= set(zip(*(a.tolist() for a in pieces)))  # rows not cut go whole
    assert all(w <= piece_b for h, g, w in set(zip(*(a.tolist() for a in pieces))) - kept)


def test_split_rows_cuts_only_rows_that_cross_a_registration():
    buf = torch.zeros(1000, dtype=torch.uint8)
    base = buf.data_ptr()
    host = np.array([base, base + 90, base + 300], dtype=np.uint64)
    other = np.array([7000, 8000, 9000], dtype=np.uint64)
    sizes = np.array([50, 30, 100], dtype=np.uint64)
    register_pinned_range(base, 100)  # [0, 100) and [100, 1000) are two registrations
    register_pinned_range(base + 100, 900)
    try:
        h, o, z = batch_copy.split_rows(host, other, sizes)
    finally:
        unregister_pinned_range(base)
        unregister_pinned_range(base + 100)
    assert (h - np.uint64(base)).tolist() == [0, 90, 100, 300]
    assert o.tolist() == [7000, 8000, 8010, 9000] and z.tolist() == [50, 10, 20, 100]
    assert batch_copy.split_rows(host, other, sizes)[0] is host  # no registrations: unchanged


@settings(max_examples=100, deadline=None)
@given(layout=st.sampled_from(["page_first", "layer_first"]),
       ids=st.lists(st.integers(0, 11), min_size=1, max_size=8, unique=True),
       start=st.integers(0, 3), count=st.integers(1, 4))
def test_run_rects_map_each_staging_byte_to_its_host_byte(layout, ids, start, count):
    """``_run_rects`` against a formula written apart: the rectangles cover the staging bytes of the chunk exactly
    once, and each staging byte of (page i, layer, K/V, offset) pairs with that byte of host block ``ids[i]``."""
    count = min(count, GEO.num_layers - start)
    gen = torch.Generator().manual_seed(0)
    stager = StagedTransfer(make_kv(GEO, 16, "cpu", gen), make_host(GEO, 12, layout, "cpu", gen), layout=layout)
    host_ids = np.array(ids, dtype=np.int64)
    n, kv, plane_page, layer_bytes = len(ids), GEO.kv_count, GEO.page_size * GEO.row_bytes, GEO.page_bytes
    pairs = np.full(n * count * layer_bytes, -1, dtype=np.int64)  # staging byte -> host byte
    for r in stager._run_rects(host_ids, LayerSpan(start, count)):
        for row in range(r.height):
            s0, h0 = r.stg_off + row * r.stg_pitch, r.host_off + row * r.host_pitch
            assert (pairs[s0:s0 + r.width] == -1).all(), "two rectangles write one staging byte"
            pairs[s0:s0 + r.width] = np.arange(h0, h0 + r.width)
    want = np.empty_like(pairs)
    o = np.arange(plane_page)
    for i, block in enumerate(ids):
        for layer in range(count):
            for k in range(kv):
                if layout == "page_first":  # a block holds its layers in turn, K then V, a page of rows each
                    stg = i * count * layer_bytes + layer * layer_bytes + k * plane_page
                    host = block * GEO.block_bytes + (start + layer) * layer_bytes + k * plane_page
                else:  # layers of pages, K then V each: the chunk's pages in order, the pool's blocks by id
                    stg = ((layer * n + i) * kv + k) * plane_page
                    host = (((start + layer) * stager.num_blocks + block) * kv + k) * plane_page
                want[stg + o] = host + o
    assert (pairs == want).all()
