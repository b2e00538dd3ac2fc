"""The staged path's stream protocol on the CPU: stand-in streams and events record what each operation must follow.

On the GPU a staged chunk hands its staging buffer between two streams. A load copies host -> staging on the copy
stream and scatters staging -> slots on the work stream: the copy into a buffer must follow the scatter that last
read it, and the scatter must follow its copy. A store gathers on the work stream and copies on the copy stream:
the gather into a buffer must follow the copy that last read it, and the copy must follow its gather. These tests
drive :func:`issue_chunks` with :meth:`StagedTransfer._chunk` (and its lazy plan over layer groups) and with
:class:`StagedCopy` (which reuses its events across launches) through stand-ins over many chunks and layers and check
that every such dependency is ordered, by stream order or by an event wait that resolves to the right operation,
that both issue the same operations, and that an issue failing part-way leaves the work stream after every copy
already queued. (The GPU tests see a missed wait only when the timing exposes it.)
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.geometry import KVGeometry
from kvtier.kernels import StagedTransfer, Tuning
from kvtier.kernels.checks import LayerSpan
from kvtier.kernels.staged import ChunkRuns, Rects, block_runs, issue_chunks
from kvtier.kernels.staged_copy import StagedCopy
from tests.kv_helpers import make_host, make_kv

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-ins for the CUDA streams")

GEO = KVGeometry(4, 2, 64, torch.float16, page_size=2)
HOST_BLOCKS = 8


class Log:
    """Operations in issue order, ("copy" | "fire", stream, buffer), and waits, (stream, position, op followed)."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, str, int]] = []
        self.waits: list[tuple[str, int, object]] = []
        self.layer0: list[object] = []  # the first layer each fire names

    def last_on(self, stream: str):
        return max((i for i, op in enumerate(self.ops) if op[1] == stream), default=None)

    def ordered_after(self, later: int, earlier: int) -> bool:
        """Whether op ``later`` starts only after op ``earlier`` finished: stream order plus event waits."""
        seen, todo = set(), [later]
        while todo:
            i = todo.pop()
            if i == earlier:
                return True
            if i in seen:
                continue
            seen.add(i)
            stream = self.ops[i][1]
            todo += [j for j in range(i) if self.ops[j][1] == stream]  # earlier ops on the same stream
            todo += [ref for s, pos, ref in self.waits if s == stream and pos <= i and ref is not None]
        return False


class FakeStream:
    def __init__(self, log: Log, name: str, handle: int) -> None:
        self.log, self.name, self.cuda_stream = log, name, handle

    def wait_event(self, ev: "FakeEvent") -> None:
        self.log.waits.append((self.name, len(self.log.ops), ev.ref))

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.waits.append((self.name, len(self.log.ops), self.log.last_on(other.name)))


class FakeEvent:
    def __init__(self, log: Log) -> None:
        self.log, self.ref = log, None

    def record(self, stream: FakeStream) -> None:
        self.ref = self.log.last_on(stream.name)


def make_stager(num_buffers: int) -> StagedTransfer:
    """A staged path whose chunk holds one block (4 pages of one layer), so buffers are reused within a layer."""
    gen = torch.Generator().manual_seed(0)
    kv = make_kv(GEO, 64, "cpu", gen)
    host = make_host(GEO, HOST_BLOCKS, "layer_first", "cpu", gen)
    return StagedTransfer(kv, host, layout="layer_first",
                          tuning=Tuning(staging_bytes=GEO.page_bytes, num_buffers=num_buffers))


def stand_ins(stager: StagedTransfer, to_host: bool):
    """A log, the work stream, and the direction with a stand-in copy stream; returns (log, work, direction)."""
    log = Log()
    d = stager.buffers(to_host)
    d.copy_stream, d.free_events, d.next_buffer = FakeStream(log, "copy", 2), [None] * len(d.buffers), 0
    return log, FakeStream(log, "work", 1), d


def run_transfer(monkeypatch, to_host: bool, num_buffers: int, pages: int, layer_order: list[int]) -> Log:
    """One-layer transfers of ``pages`` pages, layer after layer, through ``StagedTransfer._chunk`` and
    :func:`issue_chunks`."""
    stager = make_stager(num_buffers)
    log, work, d = recorded_stager(monkeypatch, stager, to_host)
    ids = torch.arange(pages).numpy()
    slots = torch.arange(pages * GEO.page_size)
    for layer in layer_order:
        issue_chunks(d, work, to_host, [
            stager._chunk(d, work, slots[c.slot_lo:c.slot_hi], ids[c.first:c.first + c.pages], LayerSpan(layer, 1),
                          c, to_host, ChunkRuns(block_runs(ids[c.first:c.first + c.pages])))
            for c in stager.chunks(pages, 1, to_host, short_edge=True)])
    return log


def recorded_stager(monkeypatch, stager: StagedTransfer, to_host: bool):
    """``stager`` with stand-in streams and events, and its gather/scatter launches and copies recorded in a log;
    returns (log, work, direction) as :func:`stand_ins`."""
    log, work, d = stand_ins(stager, to_host)
    index = {buf.data_ptr(): b for b, buf in enumerate(d.buffers)}
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(log))
    monkeypatch.setattr(stager, "chunk_launch", lambda staging, *a, **k: FakeLaunch(log, index[staging.data_ptr()]))
    monkeypatch.setattr(stager, "copy_runs", lambda staging, host_ids, span, *, to_host, stream, **_: log.ops.append(
        ("copy", stream.name, index[staging.data_ptr()])))
    return log, work, d


class FakeLaunch:
    """Stands in for a StagedCopy chunk's gather/scatter launch into staging buffer ``buffer``; logs each fire and
    the first layer it names (``log.layer0``)."""

    def __init__(self, log: Log, buffer: int) -> None:
        self.log, self.buffer = log, buffer

    current = "work"  # the stream a fire on the current stream (handle None) lands on

    def fire(self, span, programs, handle, blocks_layer0=None) -> None:
        self.log.ops.append(("fire", {1: "work", 2: "copy", 3: "work2", None: self.current}[handle], self.buffer))
        self.log.layer0.append(blocks_layer0)


def run_staged_copy(to_host: bool, num_buffers: int, pages: int, layer_order: list[int]) -> Log:
    """The same one-layer transfers through one StagedCopy, launched layer after layer."""
    stager = make_stager(num_buffers)
    copy = StagedCopy(stager, torch.arange(pages * GEO.page_size), torch.arange(pages), to_host=to_host)
    plan = copy._plan(1, True)  # built with the real buffers; its launches are swapped for recorders below
    log, work, d = stand_ins(stager, to_host)
    index = {buf.data_ptr(): b for b, buf in enumerate(d.buffers)}
    copy._handoff = [FakeEvent(log) for _ in range(num_buffers)]
    copy._free = [FakeEvent(log) for _ in range(num_buffers)]
    copy._copy = lambda staging, chunk, span, stream: log.ops.append(("copy", stream.name, index[staging.data_ptr()]))
    for chunk in plan:
        chunk.launches = [FakeLaunch(log, b) for b in range(num_buffers)]
    for layer in layer_order:
        issue_chunks(d, work, to_host,
                     [copy._issue(d, work, chunk, LayerSpan(layer, 1)) for chunk in copy._plan(1, True)])
    return log


def check_handoffs(log: Log, to_host: bool) -> None:
    """Every write of a staging buffer follows its last read, and every read follows the write it reads."""
    assert {op[1] for op in log.ops if op[0] == "copy"} <= {"copy"}
    assert {op[1] for op in log.ops if op[0] == "fire"} <= {"work", "work2"}
    writer = "fire" if to_host else "copy"  # the gather fills a store's buffer, the copy a load's
    last_read: dict[int, int] = {}
    last_write: dict[int, int] = {}
    for i, (kind, _, b) in enumerate(log.ops):
        if kind == writer:
            if b in last_read:
                assert log.ordered_after(i, last_read[b]), f"op {i} ({kind}) overwrites buffer {b} still being read"
            last_write[b] = i
        else:
            assert b in last_write and log.ordered_after(i, last_write[b]), f"op {i} ({kind}) reads buffer {b} early"
            last_read[b] = i


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(to_host=st.booleans(), num_buffers=st.integers(1, 3), pages=st.integers(1, HOST_BLOCKS),
       layers=st.lists(st.integers(0, GEO.num_layers - 1), min_size=1, max_size=4))
def test_staged_transfer_orders_every_buffer_handoff(monkeypatch, to_host, num_buffers, pages, layers):
    check_handoffs(run_transfer(monkeypatch, to_host, num_buffers, pages, layers), to_host)


@pytest.mark.parametrize("to_host", [False, True], ids=["load", "store"])
def test_the_check_sees_a_missing_wait(monkeypatch, to_host):
    """The checker itself: without the waits on the stream that writes, a reused buffer is overwritten while read."""
    log = run_transfer(monkeypatch, to_host, 2, 6, [0, 1])  # 3 chunks a layer on 2 buffers: buffers are reused
    writer_stream = "work" if to_host else "copy"
    log.waits = [w for w in log.waits if w[0] != writer_stream]
    with pytest.raises(AssertionError, match="overwrites"):
        check_handoffs(log, to_host)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(to_host=st.booleans(), num_buffers=st.integers(1, 3), pages=st.integers(1, HOST_BLOCKS),
       layers=st.lists(st.integers(0, GEO.num_layers - 1), min_size=1, max_size=4))
def test_staged_copy_issues_what_staged_transfer_issues(monkeypatch, to_host, num_buffers, pages, layers):
    """StagedCopy, planned once with reused events, orders every handoff and issues the same operations, in the
    same order, as StagedTransfer's per-call path (run on the GPU since 2026-11-29)."""
    ours = run_staged_copy(to_host, num_buffers, pages, layers)
    check_handoffs(ours, to_host)
    assert ours.ops == run_transfer(monkeypatch, to_host, num_buffers, pages, layers).ops


def test_staged_copy_alternates_buffers_across_launches():
    copies = [b for kind, _, b in run_staged_copy(False, 2, 6, [2, 0, 3]).ops if kind == "copy"]
    assert copies == list(itertools.islice(itertools.cycle([0, 1]), 9))  # 3 chunks a layer, buffers alternate


@pytest.mark.parametrize("to_host", [False, True], ids=["load", "store"])
def test_each_chunk_is_written_before_the_previous_chunk_is_read(monkeypatch, to_host):
    """With two buffers, a chunk's first step (a store's gather, a load's copy) is issued before the previous chunk's
    second step: the stream of the second step never waits for the host to issue the next chunk's first."""
    ops = [(kind, b) for kind, _, b in run_transfer(monkeypatch, to_host, 2, 6, [0]).ops]
    w, r = ("fire", "copy") if to_host else ("copy", "fire")
    # 3 chunks (1, 4, 1 pages for a store; 4, 1, 1 for a load) through buffers 0, 1, 0
    assert ops == [(w, 0), (w, 1), (r, 0), (w, 0), (r, 1), (r, 0)]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(to_host=st.booleans(), num_buffers=st.integers(1, 3), pages=st.integers(1, HOST_BLOCKS),
       group=st.sampled_from([1, 2]), order=st.permutations(range(HOST_BLOCKS)))
def test_layer_groups_through_the_lazy_plan(monkeypatch, to_host, num_buffers, pages, group, order):
    """A copy staged in groups of layers, its chunks built lazily and their plans and launches shared between groups
    (``StagedTransfer._span_chunks``): every handoff is ordered, and each chunk's launch names its group's first
    layer."""
    stager = make_stager(num_buffers)
    log, work, d = recorded_stager(monkeypatch, stager, to_host)
    ids = np.array(order[:pages])
    subs = [LayerSpan(layer, group) for layer in range(0, GEO.num_layers, group)]
    issue_chunks(d, work, to_host, stager._span_chunks(d, work, torch.arange(pages * GEO.page_size), ids, subs,
                                                        to_host, 0))
    check_handoffs(log, to_host)
    want = [sub.start for i, sub in enumerate(subs)
            for _ in stager.chunks(pages, group, to_host, short_edge=i == (0 if to_host else len(subs) - 1))]
    assert log.layer0 == want


class Injected(RuntimeError):
    pass


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(to_host=st.booleans(), num_buffers=st.integers(1, 3), pages=st.integers(2, HOST_BLOCKS),
       failing=st.sampled_from(["copy", "fire"]), at=st.integers(0, 3))
def test_a_failed_issue_leaves_the_work_stream_after_every_copy(monkeypatch, to_host, num_buffers, pages, failing,
                                                                 at):
    """A copy or launch that raises after part of its work reached its stream (a batch call failing after the first,
    a launch error): the error propagates, and a fence on the work stream then follows every op already on the copy
    stream, so the caller's unwind waits for copies that may still touch the host blocks."""
    stager = make_stager(num_buffers)
    log, work, d = recorded_stager(monkeypatch, stager, to_host)
    calls = {"copy": 0, "fire": 0}
    index = {buf.data_ptr(): b for b, buf in enumerate(d.buffers)}

    def copy_runs(staging, host_ids, span, *, to_host, stream, **_):
        log.ops.append(("copy", stream.name, index[staging.data_ptr()]))
        calls["copy"] += 1
        if failing == "copy" and calls["copy"] == at + 1:
            raise Injected("batch call failed")
    monkeypatch.setattr(stager, "copy_runs", copy_runs)

    class FailingLaunch(FakeLaunch):
        def fire(self, *a, **k) -> None:
            super().fire(*a, **k)
            calls["fire"] += 1
            if failing == "fire" and calls["fire"] == at + 1:
                raise Injected("launch failed")
    monkeypatch.setattr(stager, "chunk_launch", lambda staging, *a, **k: FailingLaunch(log, index[staging.data_ptr()]))
    ids = np.arange(pages)
    subs = [LayerSpan(layer, 1) for layer in range(GEO.num_layers)]
    try:
        issue_chunks(d, work, to_host, stager._span_chunks(d, work, torch.arange(pages * GEO.page_size), ids, subs,
                                                            to_host, 0))
    except Injected:
        pass
    else:
        return  # fewer calls than ``at``: nothing failed
    log.ops.append(("fence", "work", -1))
    fence = len(log.ops) - 1
    for i, (_, stream, _) in enumerate(log.ops[:-1]):
        assert stream != "copy" or log.ordered_after(fence, i), f"op {i} on the copy stream is not fenced"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(1, 1 << 20),
                          st.integers(1, 40), st.integers(0, 1 << 22), st.integers(0, 1 << 22)), max_size=12),
       st.booleans())
def test_rect_rows_are_each_rectangles_rows_top_to_bottom(rects, one_height):
    """Rects.rows (outer sums when every rectangle has one height, repeats otherwise) lists rectangle after rectangle,
    row after row, each at its pitches."""
    if one_height:
        rects = [(h, s, w, rects[0][3], hp, sp) for h, s, w, _, hp, sp in rects]
    cols = [np.array(c, dtype=np.uint64) for c in zip(*rects)] if rects else [np.zeros(0, np.uint64)] * 6
    got = Rects(*cols).rows()
    want = [(h + i * hp, s + i * sp, w) for h, s, w, n, hp, sp in rects for i in range(n)]
    assert [tuple(map(int, r)) for r in zip(*got)] == want
    assert all(a.dtype == np.uint64 for a in got)


class FakeRawEvent:
    """Stands in for a RawEvent: records and waits on raw handles (1: work, 2: copy)."""

    NAMES = {1: "work", 2: "copy", 3: "work2"}

    def __init__(self, log: Log) -> None:
        self.log, self.ref = log, None

    def record(self, stream: int) -> None:
        self.ref = self.log.last_on(self.NAMES[stream])

    def wait(self, stream: int) -> None:
        self.log.waits.append((self.NAMES[stream], len(self.log.ops), self.ref))


class FakeSingleCopy:
    """Stands in for a SingleCopy into staging buffer ``buffer``."""

    def __init__(self, log: Log, buffer: int) -> None:
        self.log, self.buffer = log, buffer

    def issue(self, first_layer: int, stream: int) -> None:
        self.log.ops.append(("copy", FakeRawEvent.NAMES[stream], self.buffer))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_buffers=st.integers(1, 3), pages=st.integers(1, 4),
       layers=st.lists(st.integers(0, GEO.num_layers - 1), min_size=1, max_size=6),
       between=st.lists(st.booleans(), min_size=6, max_size=6))
def test_one_chunk_loads_order_every_handoff_beside_staged_transfers(monkeypatch, num_buffers, pages, layers,
                                                                     between):
    """A StagedCopy load of one chunk of one run goes through raw events (``_launch_one_chunk``); launched layer
    after layer, some launches followed by a StagedTransfer load through the same staging buffers on another work
    stream (torch events), every buffer's copy follows its last scatter (either path's, either stream's) and every
    scatter its copy."""
    from kvtier.kernels.staged_copy import _OneChunk
    stager = make_stager(num_buffers)  # a chunk holds 4 pages of one layer: pages <= 4 is one chunk
    copy = StagedCopy(stager, torch.arange(pages * GEO.page_size), torch.arange(pages), to_host=False)
    log, work, d = recorded_stager(monkeypatch, stager, False)
    one = _OneChunk([FakeSingleCopy(log, b) for b in range(num_buffers)],
                    [FakeLaunch(log, b) for b in range(num_buffers)],
                    [FakeRawEvent(log) for _ in range(num_buffers)], [FakeRawEvent(log) for _ in range(num_buffers)],
                    FakeRawEvent(log))
    ids = np.arange(HOST_BLOCKS - pages, HOST_BLOCKS)
    slots = torch.arange(pages * GEO.page_size)
    work2 = FakeStream(log, "work2", 3)
    monkeypatch.setattr(FakeLaunch, "current", "work2")  # the StagedTransfer's scatters run on work2
    for layer, other in zip(layers, between):
        copy._launch_one_chunk(one, LayerSpan(layer, 1), work.cuda_stream)
        if other:
            issue_chunks(d, work2, False, [
                stager._chunk(d, work2, slots[c.slot_lo:c.slot_hi], ids[c.first:c.first + c.pages],
                              LayerSpan(layer, 1), c, False, ChunkRuns(block_runs(ids[c.first:c.first + c.pages])))
                for c in stager.chunks(pages, 1, False, short_edge=True)])
    check_handoffs(log, False)
    fires = [op for op in log.ops if op[0] == "fire"]
    assert len(fires) == len(layers) + sum(between[:len(layers)]) * -(-pages // 4)
