"""Copy-engine rows issued from several threads (:mod:`kvtier.kernels.row_issue`): how the rows are split, and on
CUDA that every row lands, from several threads, ordered before the caller's next work, and that a worker's failure
reaches the caller."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtier.geometry import KVGeometry
from kvtier.kernels import StagedTransfer, Tuning, batch_copy
from kvtier.kernels.row_issue import RowIssuer, issue_parts
from tests.kv_helpers import as_bytes, make_host, make_kv, staged_store

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@given(n=st.integers(0, 5000), threads=st.integers(1, 6), batch=st.integers(1, 600))
def test_parts_cover_the_rows_in_order(n: int, threads: int, batch: int) -> None:
    """The parts tile ``[0, n)`` in order, one per thread at most, none shorter than a batch unless there is
    one part, their lengths within one of each other."""
    parts = issue_parts(n, threads, batch)
    assert [lo for lo, _ in parts] == [0, *(hi for _, hi in parts[:-1])][:len(parts)]
    assert (parts[-1][1] if parts else 0) == n
    assert len(parts) <= threads and all(hi > lo for lo, hi in parts)
    lengths = [hi - lo for lo, hi in parts]
    if len(parts) > 1:
        assert min(lengths) >= batch and max(lengths) - min(lengths) <= 1
    if n >= batch * threads:
        assert len(parts) == threads  # enough rows: every thread takes a part


def _scattered_rows(rng: np.random.Generator, rows: int, width: int):
    """A device buffer of ``rows`` rows of ``width`` random bytes, a pinned host buffer twice as large, and the
    rows' (host, device) addresses: row i to a shuffled host slot."""
    dev = torch.randint(0, 256, (rows * width,), dtype=torch.uint8, device="cuda")
    host = torch.zeros(2 * rows * width, dtype=torch.uint8).pin_memory()
    slots = rng.permutation(2 * rows)[:rows].astype(np.uint64)
    h = np.uint64(host.data_ptr()) + slots * np.uint64(width)
    d = np.uint64(dev.data_ptr()) + np.arange(rows, dtype=np.uint64) * np.uint64(width)
    return dev, host, slots, h, d


@pytest.mark.gpu
@needs_cuda
def test_rows_from_several_threads_follow_and_precede_the_callers_work(monkeypatch) -> None:
    """Rows split over three threads all land, from workers too, after the caller's earlier work and before its
    next: the device sleeps, then the caller's stream rewrites the source rows, then the rows are issued, then the
    caller's stream copies the host buffer back. A worker that did not wait for the caller's stream would copy the
    old source rows; a caller's stream that did not wait for the workers would copy back stale host rows."""
    assert batch_copy.available(), "the GPU machine's driver has no cuMemcpyBatchAsync"
    threads_seen = set()
    real = batch_copy.memcpy_batch

    def recording(*a):
        threads_seen.add(threading.get_ident())
        return real(*a)
    monkeypatch.setattr(batch_copy, "memcpy_batch", recording)
    rows, width = 48, 1 << 20
    dev, host, slots, h, d = _scattered_rows(np.random.default_rng(0), rows, width)
    fresh = torch.randint(0, 256, dev.shape, dtype=torch.uint8, device="cuda")
    issuer = RowIssuer(torch.device("cuda"), threads=3, batch=4)
    stream = torch.cuda.Stream()
    back = torch.empty_like(host, device="cuda")
    stream.wait_stream(torch.cuda.current_stream())  # dev, fresh and back are made on the current stream
    try:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(2e7))
            dev.copy_(fresh)
            issuer.issue(h, d, np.full(rows, width, dtype=np.uint64), stream)
            back.copy_(host, non_blocking=True)
        stream.synchronize()
    finally:
        issuer.close()
    want = fresh.view(rows, width).cpu()
    got_host = host.view(2 * rows, width)[torch.from_numpy(slots.astype(np.int64))]
    got_back = back.view(2 * rows, width)[torch.from_numpy(slots.astype(np.int64)).cuda()].cpu()
    assert torch.equal(got_host, want), "a worker copied before the caller's earlier work"
    assert torch.equal(got_back, want), "the caller's stream ran ahead of the workers' rows"
    assert len(threads_seen) >= 2, "no worker issued rows"  # a worker done early may take the next part


@pytest.mark.gpu
@needs_cuda
def test_a_workers_failure_raises_to_the_caller(monkeypatch) -> None:
    """A driver error on a worker thread is raised by ``issue``, after the caller's own part is issued."""
    assert batch_copy.available(), "the GPU machine's driver has no cuMemcpyBatchAsync"
    caller = threading.get_ident()
    real = batch_copy.memcpy_batch

    def failing(*a):
        if threading.get_ident() != caller:
            raise RuntimeError("cuMemcpyBatchAsync failed: injected")
        return real(*a)
    monkeypatch.setattr(batch_copy, "memcpy_batch", failing)
    rows, width = 16, 4096
    dev, host, slots, h, d = _scattered_rows(np.random.default_rng(1), rows, width)
    issuer = RowIssuer(torch.device("cuda"), threads=2, batch=4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with pytest.raises(RuntimeError, match="injected"):
            issuer.issue(h, d, np.full(rows, width, dtype=np.uint64), stream)
        stream.synchronize()
    finally:
        issuer.close()
    first = host.view(2 * rows, width)[torch.from_numpy(slots[:rows // 2].astype(np.int64))]
    assert torch.equal(first, dev.view(rows, width)[:rows // 2].cpu()), "the caller's part was not issued"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layerwise", [False, True])
def test_a_fragmented_layer_first_store_from_several_threads_is_byte_exact(monkeypatch, layerwise: bool) -> None:
    """A staged ``layer_first`` store of blocks in runs of two goes as rows from ``store_row_threads`` threads, not
    pitched (the default rule: runs of a 64 KiB page of a layer and wider, here where the span is tall enough for
    pitched copies), and writes exactly the reference bytes, all layers at once and a layer at a time."""
    threads_seen = set()
    real = batch_copy.memcpy_batch

    def recording(*a):
        threads_seen.add(threading.get_ident())
        return real(*a)
    monkeypatch.setattr(batch_copy, "memcpy_batch", recording)
    monkeypatch.setattr(batch_copy, "memcpy_rects", lambda *a: pytest.fail("a pitched store"))
    geo = KVGeometry(4, 8, 128, torch.bfloat16, page_size=16)
    gen = torch.Generator().manual_seed(7)
    kv = make_kv(geo, 4096, "cuda", gen)
    host = make_host(geo, 160, "layer_first", "cuda", gen)
    tuning = Tuning(store_row_threads=3, row_batch=8, pitched_min_rows=2)  # a layer's 30 rows: 3 parts
    stager = StagedTransfer(kv, host, layout="layer_first", tuning=tuning)
    assert stager.batched, "the staged path has no batched copies here (CuPy and a CUDA 12.8+ driver)"
    n = 60
    pairs = np.random.default_rng(2).permutation(80)[:n // 2]  # runs of two blocks, shuffled
    blocks = torch.from_numpy(np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1))
    src = torch.randperm(4096, device="cuda")[:n * 16]
    before = host.clone()
    expect = staged_store(stager, src, blocks, layerwise=layerwise)
    assert torch.equal(as_bytes(host), as_bytes(expect))
    assert len(threads_seen) >= 2, "no worker issued rows"
    stager.close()  # its issuing threads stop; a later store starts them again
    assert not [t for t in threading.enumerate() if t.name.startswith("kvtier-rows")], "close left a row thread"
    host.copy_(before)
    stager.store(src, blocks)
    torch.cuda.synchronize()
    stager.close()
    assert torch.equal(as_bytes(host), as_bytes(expect))
