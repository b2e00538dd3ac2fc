"""StagedCopy's stream protocol on the CPU: stand-in streams and events record what each operation must follow.

On the GPU a staged chunk hands its staging buffer between two streams. A load copies host -> staging on the copy
stream and scatters staging -> slots on the work stream: the copy into a buffer must follow the scatter that last
read it, and the scatter must follow its copy. A store gathers on the work stream and copies on the copy stream:
the gather into a buffer must follow the copy that last read it, and the copy must follow its gather. StagedCopy
reuses its events across launches, so these tests run many launches through stand-ins and check that every such
dependency is ordered (by stream order or by an event wait that resolves to the right operation).
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.geometry import KVGeometry
from kvtier.kernels import StagedTransfer
from kvtier.kernels.checks import LayerSpan
from kvtier.kernels.staged import chunk_pages
from kvtier.kernels.staged_copy import StagedCopy
from tests.kv_helpers import make_host, make_kv

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-ins for the CUDA streams")


class Log:
    """Operations in issue order: ("copy" | "fire", stream, buffer); waits: (stream, position, op it follows)."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, str, int]] = []
        self.waits: list[tuple[str, int, int]] = []

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


class FakeEvent:
    def __init__(self, log: Log) -> None:
        self.log, self.ref = log, None

    def record(self, stream: FakeStream) -> None:
        self.ref = self.log.last_on(stream.name)


class FakeLaunch:
    def __init__(self, log: Log, buffer: int, names: dict) -> None:
        self.log, self.buffer, self.names = log, buffer, names

    def fire(self, span, programs, handle, blocks_layer0=None) -> None:
        self.log.ops.append(("fire", self.names[handle], self.buffer))


def _run(to_host: bool, num_buffers: int, pages: int, layer_order: list[int]) -> Log:
    geo = KVGeometry(4, 2, 64, torch.float16, page_size=2)
    gen = torch.Generator().manual_seed(0)
    kv = make_kv(geo, 64, "cpu", gen)
    host = make_host(geo, 8, "layer_first", "cpu", gen)
    stager = StagedTransfer(kv, host, layout="layer_first", staging_bytes=geo.page_bytes, num_buffers=num_buffers)
    copy = StagedCopy(stager, torch.arange(pages * 2), torch.arange(pages), to_host=to_host)
    plan = copy._plan(1, True)  # built with the real buffers; its launches are swapped for recorders below
    log = Log()
    work, copy_stream = FakeStream(log, "work", 1), FakeStream(log, "copy", 2)
    names = {1: "work", 2: "copy"}
    d = types.SimpleNamespace(buffers=list(range(num_buffers)), free_events=[None] * num_buffers,
                              copy_stream=copy_stream, next_buffer=0)
    copy._direction = d
    copy._handoff = [FakeEvent(log) for _ in range(num_buffers)]
    copy._free = [FakeEvent(log) for _ in range(num_buffers)]
    copy._copy = lambda staging, chunk, span, stream: log.ops.append(("copy", stream.name, staging))
    for chunk in plan:
        chunk.launches = [FakeLaunch(log, b, names) for b in range(num_buffers)]
    for layer in layer_order:
        for chunk in copy._plan(1, True):
            copy._issue(d, work, chunk, LayerSpan(layer, 1))
    return log


def _run_transfer(monkeypatch, to_host: bool, num_buffers: int, pages: int, layer_order: list[int]) -> Log:
    """The same launches through StagedTransfer's own per-call path (``_chunk``), for comparison."""
    geo = KVGeometry(4, 2, 64, torch.float16, page_size=2)
    gen = torch.Generator().manual_seed(0)
    kv = make_kv(geo, 64, "cpu", gen)
    host = make_host(geo, 8, "layer_first", "cpu", gen)
    stager = StagedTransfer(kv, host, layout="layer_first", staging_bytes=geo.page_bytes, num_buffers=num_buffers)
    log = Log()
    work, copy_stream = FakeStream(log, "work", 1), FakeStream(log, "copy", 2)
    d = stager._store if to_host else stager._load
    d.copy_stream, d.free_events = copy_stream, [None] * num_buffers
    index = {buf.data_ptr(): b for b, buf in enumerate(d.buffers)}
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(log))
    monkeypatch.setattr(stager, "_gather", lambda staging, *a, **k: log.ops.append(
        ("fire", "work", index[staging.data_ptr()])))
    monkeypatch.setattr(stager, "_copy_runs", lambda staging, host_ids, span, *, to_host, stream: log.ops.append(
        ("copy", stream.name, index[staging.data_ptr()])))
    ids = torch.arange(pages).numpy()
    slots = torch.arange(pages * 2)
    span_geo = stager._span_geometry(1)
    for layer in layer_order:
        first = 0
        for n in chunk_pages(pages, stager._pages_per_chunk(1), to_host):
            stager._chunk(d, work, slots[first * 2:(first + n) * 2], ids[first:first + n], LayerSpan(layer, 1),
                          span_geo, to_host)
            first += n
    return log


def _check(log: Log, to_host: bool) -> None:
    producer, consumer = ("fire", "copy") if to_host else ("copy", "fire")  # who writes the buffer, who reads it
    assert {op[1] for op in log.ops if op[0] == "copy"} == {"copy"}
    assert {op[1] for op in log.ops if op[0] == "fire"} == {"work"}
    last_read: dict[int, int] = {}
    last_write: dict[int, int] = {}
    for i, (kind, _, b) in enumerate(log.ops):
        if kind == producer:  # writes buffer b: after the last read of b
            if b in last_read:
                assert log.ordered_after(i, last_read[b]), f"op {i} ({kind}) overwrites buffer {b} still being read"
            last_write[b] = i
        else:  # reads buffer b: after the write it reads
            assert b in last_write and log.ordered_after(i, last_write[b]), f"op {i} ({kind}) reads buffer {b} early"
            last_read[b] = i


@settings(max_examples=40, deadline=None)
@given(to_host=st.booleans(), num_buffers=st.integers(1, 3), pages=st.integers(1, 8),
       layers=st.lists(st.integers(0, 3), min_size=1, max_size=6))
def test_every_buffer_handoff_is_ordered(to_host, num_buffers, pages, layers):
    _check(_run(to_host, num_buffers, pages, layers), to_host)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(to_host=st.booleans(), num_buffers=st.integers(1, 3), pages=st.integers(1, 8),
       layers=st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_staged_transfer_orders_the_same_handoffs_as_staged_copy(monkeypatch, to_host, num_buffers, pages, layers):
    """StagedTransfer's per-call path (run on the GPU since 2026-11-29) and StagedCopy issue the same operations,
    and both order every handoff."""
    ours, theirs = _run(to_host, num_buffers, pages, layers), _run_transfer(monkeypatch, to_host, num_buffers,
                                                                            pages, layers)
    _check(theirs, to_host)
    assert ours.ops == theirs.ops


def test_the_check_sees_a_missing_wait():
    """The checker itself: drop the wait on the free event and a reused buffer is overwritten while read."""
    log = _run(False, 2, 6, [0, 1])  # 3 chunks per layer (a chunk holds 4 pages of one layer): buffers are reused
    log.waits = [w for w in log.waits if w[0] != "copy"]  # the copy stream no longer waits for the scatters
    with pytest.raises(AssertionError, match="overwrites"):
        _check(log, False)


def test_launches_alternate_buffers_and_reuse_the_plan():
    log = _run(False, 2, 6, [2, 0, 3])
    copies = [b for kind, _, b in log.ops if kind == "copy"]
    assert copies == list(itertools.islice(itertools.cycle([0, 1]), 9))  # 3 chunks per layer, buffers alternate
