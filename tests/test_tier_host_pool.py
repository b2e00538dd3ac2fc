"""HostBlockPool: sizing, layouts, the block allocator (runs, None when full, double free), chunk planning, pinning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.geometry import KVGeometry
from kvtier.kernels.pinned import is_pinned
from kvtier.tier import host_pool as hp
from kvtier.tier.host_pool import GiB, HostBlockPool, plan_chunks

GEO = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_sizing_and_shape(layout):
    gb = 64 * GEO.block_bytes / GiB + 1e-9  # 64 blocks and a bit
    pool = HostBlockPool(GEO, cpu_cache_gb=gb, layout=layout, pin=False)
    assert pool.num_blocks == 64 and pool.nbytes == 64 * GEO.block_bytes
    assert tuple(pool.host.shape) == GEO.host_shape(64, layout) and pool.host.dtype == GEO.dtype
    assert pool.host.data_ptr() % hp.PAGE_ALIGN == 0 and pool.host.is_contiguous()
    assert pool.pinned_bytes == 0 and not pool.is_pinned
    assert (pool.num_free, pool.num_used, pool.occupancy) == (64, 0, 0.0)


def test_bad_sizes():
    with pytest.raises(ValueError, match="exactly one"):
        HostBlockPool(GEO, 4, cpu_cache_gb=1, pin=False)
    with pytest.raises(ValueError, match="holds no block"):
        HostBlockPool(GEO, cpu_cache_gb=1e-9, pin=False)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1"):
        HostBlockPool(GEO, 0, pin=False)
    with pytest.raises(ValueError, match="host layout must be one of"):
        HostBlockPool(GEO, 4, layout="rows", pin=False)


def test_memory_check_quotes_gib(monkeypatch):
    monkeypatch.setattr(hp, "available_memory_bytes", lambda: 3 * GiB)
    with pytest.raises(ValueError, match=r"host pool of 2\.00 GiB does not fit: 3\.00 GiB available, 2\.00 GiB kept"):
        HostBlockPool(GEO, cpu_cache_gb=2.0, pin=False)
    HostBlockPool(GEO, cpu_cache_gb=0.5, pin=False, reserve_gb=2.0).destroy()  # 0.5 + 2 <= 3 fits


def test_available_memory_is_known_here():
    avail = hp.available_memory_bytes()
    assert avail is None or avail > 0


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA behaviour")
def test_pin_true_without_cuda_is_an_error():
    with pytest.raises(RuntimeError, match="cannot pin host memory: CUDA is not available"):
        HostBlockPool(GEO, 4, pin=True)
    assert HostBlockPool(GEO, 4).pinned_bytes == 0  # pin=None: plain memory here


def test_alloc_prefers_runs_and_returns_none_when_full():
    pool = HostBlockPool(GEO, 16, pin=False)
    a = pool.alloc(5)
    assert a.tolist() == [0, 1, 2, 3, 4] and a.dtype == np.int64
    b = pool.alloc(3)
    assert b.tolist() == [5, 6, 7]
    pool.free([1, 2, 6])
    c = pool.alloc(4)  # the cursor run 8..11 is free and contiguous
    assert c.tolist() == [8, 9, 10, 11]
    d = pool.alloc(3)  # the cursor moved on to 12: run 12..14
    assert d.tolist() == [12, 13, 14]
    e = pool.alloc(2)  # cursor at 15: run 15..16 does not exist; first fit finds 1..2
    assert e.tolist() == [1, 2]
    assert pool.alloc(3) is None and pool.num_free == 2  # 6 and 15 left: nothing taken
    f = pool.alloc(2)  # no run of 2: the lowest free ids
    assert f.tolist() == [6, 15] and pool.num_free == 0
    assert pool.alloc(1) is None
    assert pool.alloc(0).size == 0


def test_free_errors_leave_the_pool_unchanged():
    pool = HostBlockPool(GEO, 8, pin=False)
    ids = pool.alloc(4)
    with pytest.raises(ValueError, match="double free of host blocks \\[5\\]"):
        pool.free([0, 5])
    assert pool.num_free == 4 and not pool.is_free(0)  # nothing freed by the failed call
    with pytest.raises(ValueError, match="out of range"):
        pool.free([8])
    with pytest.raises(ValueError, match="repeated"):
        pool.free([1, 1])
    pool.free(ids)
    assert pool.num_free == 8
    with pytest.raises(ValueError, match="double free"):
        pool.free(ids[:1])
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        pool.alloc(-1)


def test_reset_and_destroy_is_idempotent():
    pool = HostBlockPool(GEO, 8, pin=False)
    pool.alloc(6)
    pool.reset()
    assert pool.num_free == 8
    pool.destroy()
    pool.destroy()
    assert pool.host is None
    with pytest.raises(RuntimeError, match="destroyed"):
        pool.alloc(1)


@pytest.mark.parametrize("nbytes,unit,limit", [(10_000_000, 12_288, 1 << 20), (10_000_000, 3_000, 1 << 20),
                                               (10_000_000, 5 << 20, 1 << 20), (4096, 4096, 4096),
                                               (123_456_789, 2_359_296, 64 << 20)])
def test_plan_chunks_cover_the_range_on_aligned_boundaries(nbytes, unit, limit):
    chunks = plan_chunks(nbytes, unit=unit, limit=limit)
    assert chunks[0][0] == 0 and sum(n for _, n in chunks) == nbytes
    assert all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:]))
    assert all(0 < n <= limit for _, n in chunks)
    step = unit * 4096 // np.gcd(unit, 4096)
    for off, _ in chunks[1:]:
        assert off % 4096 == 0
        if step <= limit:
            assert off % unit == 0  # between units whenever a unit-aligned chunk fits the limit


def test_runs_never_cross_page_first_chunk_boundaries():
    # block_bytes = 768 B; chunks of 16 blocks = 12288 B = lcm(768, 4096): boundaries fall between blocks
    chunked = type("Chunked", (HostBlockPool,), {"register_chunk_bytes": 16 * GEO.block_bytes})
    pool = chunked(GEO, 64, layout="page_first", pin=False)
    assert len(pool.chunks) == 4 and pool._segment_blocks == 16
    assert pool.alloc(12).tolist() == list(range(12))
    run = pool.alloc(8)  # 12..19 would cross block 16: the next segment's run
    assert run.tolist() == list(range(16, 24))
    assert pool.alloc(17) is not None  # longer than a segment: not one run, but still served


class SmallChunks(HostBlockPool):
    """Always registered (never torch-pinned), in chunks of at most 1 MiB."""

    pin_memory_max_bytes = 0
    register_chunk_bytes = 1 << 20


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_registered_chunks_are_pinned_and_transfer_exactly(layout):
    from kvtier.kernels import StagedTransfer, load_pages, store_pages
    from tests.kv_helpers import as_bytes, make_kv

    geo = KVGeometry(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)
    # force the cudaHostRegister path with 1 MiB chunks: a layer of 64 blocks is 4 MiB
    pool = SmallChunks(geo, 64, layout=layout, pin=True)
    assert len(pool.chunks) > 4 and pool.pinned_bytes == pool.nbytes and is_pinned(pool.host)
    assert pool.stats()["register_chunks"] == len(pool.chunks)
    gen = torch.Generator().manual_seed(1)
    kv = make_kv(geo, 64 * 16, "cuda", gen)
    ids = torch.arange(64)
    slots = torch.randperm(64 * 16, generator=gen)
    store_pages(kv, pool.host, slots, ids, layout=layout)
    torch.cuda.synchronize()
    dst = torch.roll(slots, 16 * 7)
    want = [as_bytes(b[slots.cuda()]) for b in kv.buffers]
    StagedTransfer(kv, pool.host, layout=layout).load(dst, ids)  # copy-engine copies over every chunk boundary
    torch.cuda.synchronize()
    assert all(torch.equal(as_bytes(b[dst.cuda()]), w) for b, w in zip(kv.buffers, want))
    dst2 = torch.roll(slots, 16 * 3)
    load_pages(kv, pool.host, dst2, ids, layout=layout)  # direct kernel over UVA across the boundaries
    torch.cuda.synchronize()
    assert all(torch.equal(as_bytes(b[dst2.cuda()]), w) for b, w in zip(kv.buffers, want))
    pool.destroy()
    pool.destroy()
    assert pool.pinned_bytes == 0
