"""One host pool in memory several processes map: the shared segment, a pool cut from given memory, the allocation
digest that processes sharing a pool compare, and a tier whose stores copy a share of the layers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvtier.config import TierConfig
from kvtier.geometry import KVGeometry
from kvtier.kernels import PagedKV
from kvtier.tier import KVTier
from kvtier.tier.host_pool import HostBlockPool
from kvtier.tier.shared_memory import SHM_DIR, SharedSegment

GEO = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
HAS_SHM = os.path.isdir(SHM_DIR)
pytestmark = pytest.mark.skipif(not HAS_SHM, reason="needs /dev/shm")


def test_a_segment_is_the_same_memory_in_another_process_and_survives_its_name():
    seg = SharedSegment.create(1 << 20)
    try:
        seg.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        child = textwrap.dedent(f"""
            import sys, torch
            from kvtier.tier.shared_memory import SharedSegment
            seg = SharedSegment.open({seg.name!r}, {1 << 20})
            assert seg.tensor[:4].tolist() == [1, 2, 3, 4], seg.tensor[:4]
            seg.tensor[4:8] = torch.tensor([9, 9, 9, 9], dtype=torch.uint8)
            print(*seg.inode())
        """)
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert tuple(int(x) for x in out.stdout.split()) == seg.inode()  # one file, one inode: one copy
        assert seg.tensor[4:8].tolist() == [9, 9, 9, 9]  # the child's write is here
    finally:
        seg.unlink()
    assert not os.path.exists(seg.path)
    seg.tensor[8] = 7  # the mapping outlives the name
    assert int(seg.tensor[8]) == 7
    seg.unlink()  # idempotent


def test_a_segment_larger_than_dev_shm_is_refused_and_leaves_nothing():
    st = os.statvfs(SHM_DIR)
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(OSError):
        SharedSegment.create(too_big)
    assert set(os.listdir(SHM_DIR)) == before


def test_opening_a_segment_of_another_size_or_name_fails():
    seg = SharedSegment.create(8192)
    try:
        with pytest.raises(ValueError, match="holds 8192 bytes"):
            SharedSegment.open(seg.name, 4096)
        with pytest.raises(FileNotFoundError):
            SharedSegment.open(seg.name + "-other", 8192)
    finally:
        seg.unlink()


def test_a_pool_cut_from_given_memory_uses_it():
    seg = SharedSegment.create(8 * GEO.block_bytes + 4096)
    seg.unlink()
    pool = HostBlockPool(GEO, 8, layout="layer_first", pin=False, memory=seg.tensor)
    pool.host.view(-1)[:] = 3
    assert pool.host.data_ptr() == seg.tensor.data_ptr()
    assert bool((seg.tensor[:pool.nbytes].view(GEO.dtype) == 3).all())
    with pytest.raises(ValueError, match="cannot hold"):
        HostBlockPool(GEO, 9, pin=False, memory=seg.tensor[:8 * GEO.block_bytes])
    with pytest.raises(ValueError, match="1-D CPU uint8"):
        HostBlockPool(GEO, 8, pin=False, memory=seg.tensor.view(torch.float16))


def test_the_block_digest_follows_the_allocations_and_frees_in_order():
    a, b, c = (HostBlockPool(GEO, 16, pin=False) for _ in range(3))
    for p in (a, b):
        p.free(p.alloc(4)[1:3])
        p.alloc(3)
    c.alloc(4)
    c.alloc(3)  # the same ids handed out, without the free
    assert a.block_digest == b.block_digest != c.block_digest
    assert 0 <= a.block_digest < 2**63


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_a_tier_storing_a_share_of_the_layers_writes_only_those(layout, mode):
    """Two tiers over one pool's memory (two ranks' MLA KV) store the same pages, each its share of the layers:
    the first writes layer 0 only, the second layers 1 and 2, and then either loads every layer exactly."""
    kv_buffers = [torch.randn(32, 1, 16).to(torch.float16) for _ in range(3)]
    kv = PagedKV.mla(kv_buffers, page_size=4)
    geo = kv.geometry
    config = TierConfig(cpu_cache_gb=1 / 1024, page_size=4, tokens_per_block=4, host_layout=layout,
                        transfer_mode=mode, layerwise=False)
    seg = SharedSegment.create(8 * geo.block_bytes)
    seg.unlink()
    seg.tensor.fill_(0)
    first, second = (KVTier(kv, config, pool=HostBlockPool(geo, 8, layout=layout, pin=False, memory=seg.tensor),
                            store_layers=share) for share in (range(0, 1), range(1, 3)))
    tokens, slots = list(range(100, 108)), torch.arange(8, 16)
    first.wait(first.store(tokens, None, slots))
    host = first.pool.host
    by_layer = host if layout == "layer_first" else host.transpose(0, 1)
    assert bool(by_layer[0].any()) and not bool(by_layer[1:].any())  # layer 0 only
    second.wait(second.store(tokens, None, slots))
    assert first.pool.block_digest == second.pool.block_digest  # the same blocks on both
    want = [b[8:16].clone() for b in kv_buffers]
    for tier in (first, second):
        for b in kv_buffers:
            b[8:16] = 0
        tier.wait(tier.load(tokens, None, slots))
        for got, w in zip(kv_buffers, want):
            assert torch.equal(got[8:16], w)
    assert [t.stats()["bytes_d2h"] for t in (first, second)] == [2 * geo.block_bytes // 3, 4 * geo.block_bytes // 3]


def test_store_layers_are_checked():
    kv = PagedKV.mla([torch.zeros(32, 1, 16, dtype=torch.float16) for _ in range(3)], page_size=4)
    config = TierConfig(cpu_cache_gb=1 / 1024, page_size=4, tokens_per_block=4, layerwise=False)
    for bad in (range(2, 4), range(0, 3, 2), [0, 1]):
        with pytest.raises(ValueError, match="store_layers must be a range"):
            KVTier(kv, config, store_layers=bad)
    assert "stores copy layers 1..2" in KVTier(kv, config, store_layers=range(1, 3)).describe()
