"""KVTier: byte-exact store -> lookup -> load round trips, and the bookkeeping around in-flight copies.

CPU tests run the kernels in the Triton interpreter with the host layer signal. Tests of in-flight behaviour use
the DeferredExecutor: copies are queued and run only when released, so "in flight" is real (a block reused too
early would show up as wrong bytes). GPU tests (``gpu`` marker) repeat the round trips on CUDA and check the
layerwise load against a deliberately slowed load stream.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import pytest
import torch

from kvtier.config import TierConfig
from kvtier.geometry import KVGeometry
from kvtier.index import Namespace
from kvtier.tier import CudaExecutor, HostBlockPool, KVTier
from kvtier.tier.executor import DeferredExecutor
from tests.tier_helpers import TINY, accounted_blocks, fill_random_, make_tier, page_slots, slot_bytes

P = TINY.page_size
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter off")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
MODES = ["auto", "direct", "staged"]
LAYOUTS = ["layer_first", "page_first"]


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_round_trip_is_byte_exact(device, layout, mode):
    tier = make_tier(device=device, layout=layout, mode=mode)
    toks = _tokens(5 * P + 1)  # 5 full pages and a partial one (ignored)
    src = torch.randperm(64)[:5 * P] + 64  # scattered source slots in the upper half
    want = slot_bytes(tier, src)
    host_before = tier.pool.host.clone()
    task = tier.store(toks, None, src)
    assert task.num_pages == 5 and task.num_held == 0
    tier.wait(task)
    assert tier.poll() == [task.id] and tier.poll() == []
    assert tier.lookup(toks, None) == 5
    assert tier.pool.num_used == 5
    dst = page_slots(2, 6, P)  # room for 6 pages: only the 5 held load
    before = slot_bytes(tier, torch.arange(128))
    load = tier.load(toks, None, dst)
    assert load.num_pages == 5
    tier.wait(load)
    assert all(torch.equal(a, b) for a, b in zip(slot_bytes(tier, dst[:5 * P]), want))
    after = slot_bytes(tier, torch.arange(128))
    untouched = torch.ones(128, dtype=torch.bool)
    untouched[dst[:5 * P]] = False
    row = TINY.row_bytes
    for a, b in zip(before, after):  # every slot outside the destination is unchanged (the source included)
        assert torch.equal(a.view(128, row)[untouched], b.view(128, row)[untouched])
    # host blocks other than the 5 written are untouched
    used = set(np.flatnonzero([not tier.pool.is_free(i) for i in range(tier.pool.num_blocks)]).tolist())
    dim = 0 if layout == "page_first" else 1
    for blk in range(tier.pool.num_blocks):
        if blk not in used:
            assert torch.equal(host_before.select(dim, blk).view(torch.uint8),
                               tier.pool.host.select(dim, blk).view(torch.uint8))
    s = tier.stats()
    assert s["bytes_d2h"] == s["bytes_h2d"] == 5 * TINY.block_bytes and s["pages_loaded"] == 5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_layerwise_load_round_trip(device, layout, mode):
    tier = make_tier(device=device, layout=layout, mode=mode)
    toks = _tokens(4 * P)
    src = page_slots(10, 4, P)
    want = slot_bytes(tier, src)
    tier.wait(tier.store(toks, None, src))
    dst = page_slots(20, 4, P)
    task = tier.load_layerwise(toks, None, dst)
    assert task.num_pages == 4 and task.producer_index == 0
    tier.counter.set_consumer(task.producer_index)
    for layer in range(TINY.num_layers):
        tier.counter.wait_until(layer)
    tier.wait(task)
    assert all(torch.equal(a, b) for a, b in zip(slot_bytes(tier, dst), want))
    miss = tier.load_layerwise(_tokens(4 * P, seed=9), None, dst)
    assert miss.num_pages == 0 and miss.producer_index == -1 and miss.done


def test_store_copies_only_pages_not_held_and_extends_the_prefix():
    tier = make_tier()
    toks = _tokens(6 * P)
    src = page_slots(0, 6, P)
    t1 = tier.store(toks[:3 * P], None, src[:3 * P])
    tier.wait(t1)
    t2 = tier.store(toks, None, src)
    assert (t2.num_held, t2.num_pages) == (3, 3)
    assert tier.lookup(toks, None) == 6  # lookup drains completed copies first (immediate on CPU)
    t3 = tier.store(toks, None, src)
    assert (t3.num_held, t3.num_pages, t3.done) == (6, 0, True)
    dst = page_slots(30, 6, P)
    tier.wait(tier.load(toks, None, dst))
    assert all(torch.equal(a, b) for a, b in zip(slot_bytes(tier, dst), slot_bytes(tier, src)))
    s = tier.stats()
    assert (s["pages_stored"], s["pages_store_skipped"], s["bytes_d2h"]) == (6, 9, 6 * TINY.block_bytes)


def test_namespaces_do_not_share_pages():
    tier = make_tier()
    toks = _tokens(2 * P)
    tier.wait(tier.store(toks, Namespace(lora_id=1), page_slots(0, 2, P)))
    assert tier.lookup(toks, Namespace(lora_id=1)) == 2
    assert tier.lookup(toks, None) == 0 and tier.lookup(toks, Namespace(lora_id=2)) == 0
    assert tier.load(toks, None, page_slots(4, 2, P)).num_pages == 0
    s = tier.stats()
    assert (s["hit_pages"], s["miss_pages"], s["lookups"]) == (2, 4, 3)


def test_store_not_visible_until_its_copy_completes():
    ex = DeferredExecutor()
    tier = make_tier(executor=ex)
    toks = _tokens(3 * P)
    src = page_slots(0, 3, P)
    task = tier.store(toks, None, src)
    assert not task.done and tier.lookup(toks, None) == 0 and tier.poll() == []
    assert accounted_blocks(tier) == (13, 0, 3)
    ex.release("store")
    assert tier.poll() == [task.id] and tier.lookup(toks, None) == 3
    assert accounted_blocks(tier) == (13, 3, 0)


def test_pool_full_evicts_lru_unlocked_pages():
    tier = make_tier(num_blocks=6)
    a, b, c = (_tokens(2 * P, seed=s) for s in (1, 2, 3))
    for i, t in enumerate((a, b, c)):
        tier.wait(tier.store(t, None, page_slots(2 * i, 2, P)))
    assert tier.pool.num_free == 0
    tier.wait(tier.load(a, None, page_slots(20, 2, P)))  # touch a: b is now the least recent
    d = _tokens(2 * P, seed=4)
    tier.wait(tier.store(d, None, page_slots(10, 2, P)))
    assert [tier.lookup(t, None) for t in (a, b, c, d)] == [2, 0, 2, 2]
    assert tier.stats()["pages_evicted"] == 2


def test_pages_read_by_an_inflight_load_are_never_evicted():
    ex = DeferredExecutor()
    tier = make_tier(num_blocks=4, executor=ex)
    a = _tokens(4 * P, seed=1)
    src = page_slots(0, 4, P)
    want = slot_bytes(tier, src)
    tier.store(a, None, src)
    ex.release_all()
    tier.poll()
    dst = page_slots(20, 4, P)
    load = tier.load(a, None, dst)  # queued: reads blocks of a later
    b = _tokens(2 * P, seed=2)
    fill_random_(tier, page_slots(8, 2, P), seed=5)
    st = tier.store(b, None, page_slots(8, 2, P))  # pool full, a locked: nothing to evict
    assert st.num_pages == 0 and tier.stats()["pages_store_dropped"] == 2
    assert tier.evict(10) == 0
    ex.release_all()
    tier.poll()
    assert load.status == "done" and load.num_pages == 4
    assert all(torch.equal(x, y) for x, y in zip(slot_bytes(tier, dst), want))
    assert tier.evict(1) == 1  # unlocked now: the leaf goes


def test_held_prefix_of_an_inflight_store_is_locked():
    ex = DeferredExecutor()
    tier = make_tier(num_blocks=4, executor=ex)
    toks = _tokens(4 * P)
    tier.store(toks[:2 * P], None, page_slots(0, 2, P))
    ex.release_all()
    tier.poll()
    task = tier.store(toks, None, page_slots(0, 4, P))  # extends the held 2 pages by 2
    assert task.num_held == 2 and task.num_pages == 2
    assert tier.evict(4) == 0  # the prefix it hangs from cannot go while the copy is in flight
    ex.release_all()
    tier.poll()
    assert tier.lookup(toks, None) == 4


def test_two_inflight_stores_of_the_same_pages():
    ex = DeferredExecutor()
    tier = make_tier(executor=ex)
    toks = _tokens(3 * P)
    src = page_slots(0, 3, P)
    t1 = tier.store(toks, None, src)
    t2 = tier.store(toks, None, src)
    assert t1.num_pages == t2.num_pages == 3 and accounted_blocks(tier) == (10, 0, 6)
    tier.wait(t2)  # the second completes first: it inserts; the first's blocks come back
    tier.wait(t1)
    assert accounted_blocks(tier) == (13, 3, 0)
    assert tier.stats()["pages_store_duplicate"] == 3
    assert sorted(tier.poll()) == [t1.id, t2.id]


def test_cancel_and_reset_wait_for_copies_then_free():
    ex = DeferredExecutor()
    tier = make_tier(executor=ex)
    toks = _tokens(3 * P)
    task = tier.store(toks, None, page_slots(0, 3, P))
    assert tier.cancel(task) and ex.pending("store") == 0  # the copy ran before the blocks were freed
    assert task.status == "cancelled" and tier.lookup(toks, None) == 0 and tier.pool.num_free == 16
    assert not tier.cancel(task)
    tier.store(toks, None, page_slots(0, 3, P))
    ex.release_all()
    tier.poll()
    load = tier.load(toks, None, page_slots(10, 3, P))
    tier.store(_tokens(2 * P, seed=7), None, page_slots(20, 2, P))
    tier.reset()
    assert ex.pending("store") == ex.pending("load") == 0 and load.status == "cancelled"
    assert tier.pool.num_free == 16 and tier.lookup(toks, None) == 0 and tier.poll() == []
    assert tier.stats()["inflight_tasks"] == 0


def test_load_on_current_stream_and_slot_count_caps_pages():
    tier = make_tier()
    toks = _tokens(4 * P)
    tier.wait(tier.store(toks, None, page_slots(0, 4, P)))
    task = tier.load(toks, None, page_slots(10, 2, P))
    assert task.num_pages == 2
    tier.wait_on_current_stream(task)
    with pytest.raises(ValueError, match="slot indices for 4 full blocks"):
        tier.store(toks, None, page_slots(0, 3, P))


def test_config_and_pool_must_match_the_kv_pool():
    from tests.kv_helpers import make_kv

    kv = make_kv(TINY, 16, "cpu", torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="page_size 2, the kvtier config 16"):
        KVTier(kv, TierConfig(), pool=HostBlockPool(TINY, 4))
    with pytest.raises(ValueError, match="does not match"):
        KVTier(kv, TierConfig(page_size=2, host_layout="page_first"), pool=HostBlockPool(TINY, 4))


# --- GPU ---

QWEN_LIKE = KVGeometry(num_layers=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)


class SlowLoads(CudaExecutor):
    """Spins the load stream for ``spin`` GPU cycles before each copy issued on it (one per layer of a layerwise
    load), so the load is still in flight while the forward reads."""

    def __init__(self, device, spin: int) -> None:
        super().__init__(device)
        self.spin = spin

    def run(self, name, fn, own_stream=False):
        if name == "load":
            with torch.cuda.stream(self.stream("load")):
                torch.cuda._sleep(self.spin)
        super().run(name, fn, own_stream)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "torch"])
@pytest.mark.parametrize("wait", [True, False])
def test_gpu_layerwise_never_reads_stale_bytes(backend, wait):
    if backend == "cupy":
        pytest.importorskip("cupy")
    geo = QWEN_LIKE
    pages = 64  # 1024 tokens, 4 MiB per layer
    # the backend at construction: the tier's copies signal the counter it was built with
    tier = make_tier(geo, num_slots=4 * pages * geo.page_size, num_blocks=2 * pages, device="cuda",
                     layout="layer_first", mode="auto", counter_backend=backend)
    toks = _tokens(pages * geo.page_size)
    src = page_slots(0, pages, geo.page_size)
    tier.wait(tier.store(toks, None, src))
    want = slot_bytes(tier, src)
    dst = page_slots(2 * pages, pages, geo.page_size).cuda()
    props = torch.cuda.get_device_properties(0)
    spin = int(2e-3 * getattr(props, "clock_rate", 1_980_000) * 1e3)  # ~2 ms before each layer's copy
    tier.executor = SlowLoads(tier.kv.device, spin)
    for _rep in range(2):  # warm-up, then measured
        for b in tier.kv.buffers:
            b[dst] = 0  # stale content the forward must never see
        torch.cuda.synchronize()
        task = tier.load_layerwise(toks, None, dst)
        tier.counter.set_consumer(task.producer_index if wait else -1)
        reads, host = [], []
        t0 = time.perf_counter()
        for layer in range(geo.num_layers):
            t = time.perf_counter()
            tier.counter.wait_until(layer)
            host.append(time.perf_counter() - t)
            reads.append([b[dst].clone() for b in tier.kv.layer_buffers(layer)])  # the simulated forward
        issued_s = time.perf_counter() - t0
        in_flight = not tier.counter.is_done(task.producer_index)
        tier.wait(task)
    got = [r.contiguous().view(-1).view(torch.uint8).cpu() for layer in reads for r in layer]
    assert in_flight and issued_s < geo.num_layers * 2e-3 / 2  # the host never waited on the load
    fresh = [torch.equal(g, w) for g, w in zip(got, want)]
    if wait:
        assert all(fresh)
        assert statistics.median(host) < 50e-6 and max(host) < 2e-3
    else:  # negative control: the same forward without waiting reads stale bytes
        assert not all(fresh)


@pytest.mark.parametrize("short_slices", [False, True], ids=["long_slices", "short_slices"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_auto_mode_loads_large_copies_through_the_staged_path(monkeypatch, layerwise, layout, short_slices):
    """``auto``: stores always staged; a load copy of >= AUTO_STAGED_LOAD_BYTES staged, a smaller one direct
    (one layer of a layerwise load: AUTO_STAGED_LAYER_BYTES, the other threshold kept out of reach); layerwise loads
    from a ``page_first`` pool direct when a block's layer slice is shorter than AUTO_STAGED_MIN_SLICE_BYTES."""
    import kvtier.tier.device_copies as device_copies
    import kvtier.tier.transfer_policy as policy

    monkeypatch.setattr(policy, "AUTO_STAGED_MIN_SLICE_BYTES", TINY.page_bytes + 1 if short_slices else 1)
    calls = []
    for name in ("store", "load"):
        real = getattr(device_copies.StagedTransfer, name)
        monkeypatch.setattr(device_copies.StagedTransfer, name,
                            lambda self, *a, _real=real, _name=name, **k: calls.append(_name) or _real(self, *a, **k))
    real_launch = device_copies.StagedCopy.launch  # a layerwise staged load: one planned copy, launched per layer
    monkeypatch.setattr(device_copies.StagedCopy, "launch", lambda self, *a, **k: calls.append(
        "store" if self.to_host else "load") or real_launch(self, *a, **k))
    tier = make_tier(mode="auto", layout=layout)
    toks = _tokens(4 * P)
    src = page_slots(0, 4, P)
    want = slot_bytes(tier, src)
    tier.wait(tier.store(toks, None, src))
    assert calls == ["store"]
    per_copy = 4 * TINY.block_bytes // (TINY.num_layers if layerwise else 1)
    load = tier.load_layerwise if layerwise else tier.load
    never = layerwise and layout == "page_first" and short_slices
    knob, other = ("AUTO_STAGED_LAYER_BYTES", "AUTO_STAGED_LOAD_BYTES") if layerwise else \
        ("AUTO_STAGED_LOAD_BYTES", "AUTO_STAGED_LAYER_BYTES")
    monkeypatch.setattr(policy, other, 1 << 62)  # the threshold of the other kind of load must not decide
    for threshold, staged in ((per_copy + 1, False), (per_copy, not never)):
        calls.clear()
        monkeypatch.setattr(policy, knob, threshold)
        dst = page_slots(8 if staged else 16, 4, P)
        tier.wait(load(toks, None, dst))
        assert calls == (["load"] * (TINY.num_layers if layerwise else 1) if staged else [])
        assert all(torch.equal(a, b) for a, b in zip(slot_bytes(tier, dst), want))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_whole_load_the_policy_sends_direct_per_layer_launches_each_layer(monkeypatch, layout):
    """``direct_layers`` (a fragmented whole load): one DirectCopy checked once and launched per layer, bytes
    exact, stats as for any load."""
    import kvtier.tier.device_copies as device_copies
    from kvtier.tier.transfer_policy import Path

    launched = []
    real_launch = device_copies.DirectCopy.launch
    monkeypatch.setattr(device_copies.DirectCopy, "launch",
                        lambda self, layers=None, **k: launched.append(layers) or real_launch(self, layers, **k))
    tier = make_tier(mode="auto", layout=layout)
    monkeypatch.setattr(tier.policy, "path", lambda plan: Path.STAGED if plan.to_host else Path.DIRECT_LAYERS)
    toks = _tokens(4 * P)
    src = page_slots(0, 4, P)
    want = slot_bytes(tier, src)
    tier.wait(tier.store(toks, None, src))
    dst = page_slots(8, 4, P)
    task = tier.load(toks, None, dst)
    tier.wait(task)
    assert launched == list(range(TINY.num_layers))
    assert task.status == "done" and tier.stats()["pages_loaded"] == 4
    assert all(torch.equal(a, b) for a, b in zip(slot_bytes(tier, dst), want))


@pytest.mark.parametrize("layerwise", [False, True])
def test_load_from_a_start_page_copies_only_the_pages_after_it(layerwise):
    """An engine holding the first pages on the device loads only the rest: those slots, nothing else."""
    tier = make_tier()
    toks = _tokens(5 * P)
    src = page_slots(0, 5, P)
    want = slot_bytes(tier, src)
    tier.wait(tier.store(toks, None, src))
    dst = page_slots(10, 4, P)  # room for 4 pages; pages 0-1 are "on the device", 2-4 are held: 3 copy
    before = slot_bytes(tier, torch.arange(128))
    load = tier.load_layerwise if layerwise else tier.load
    task = load(toks, None, dst, start_page=2)
    assert task.num_pages == 3
    tier.wait(task)
    got = slot_bytes(tier, dst[:3 * P])
    per_slot = lambda t: t.view(-1, TINY.row_bytes)  # noqa: E731  (bytes of one slot per row)
    assert all(torch.equal(per_slot(g), per_slot(w)[2 * P:]) for g, w in zip(got, want))  # pages 2-4 of the source
    untouched = torch.ones(128, dtype=torch.bool)
    untouched[dst[:3 * P]] = False
    after = slot_bytes(tier, torch.arange(128))
    assert all(torch.equal(per_slot(a)[untouched], per_slot(b)[untouched]) for a, b in zip(before, after))
    assert load(toks, None, dst, start_page=5).num_pages == 0  # nothing past the held prefix
    with pytest.raises(ValueError, match="start_page"):
        tier.load(toks, None, dst, start_page=-1)


class _FailOnce:
    """An executor whose next ``run`` raises (after issuing its copy when ``after``), then behaves."""

    def __init__(self, inner, after: bool) -> None:
        self.inner, self.after, self.armed = inner, after, True

    def run(self, name, fn, own_stream=False):
        if self.armed and not self.after:
            self.armed = False
            raise RuntimeError("CUDA error: out of memory (injected)")
        self.inner.run(name, fn, own_stream)
        if self.armed:
            self.armed = False
            raise RuntimeError("launch failed (injected)")

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("after", [False, True], ids=["before_issue", "after_issue"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_a_failed_copy_is_unwound_and_the_tier_carries_on(after, layerwise):
    """An exception while issuing a store or a load used to propagate with the task's blocks allocated and its
    index path locked, for ever. Now the task fails, gives everything back, and the next copies work."""
    ex = DeferredExecutor()
    tier = make_tier(num_blocks=8, executor=ex)
    toks = np.arange(6)  # 3 pages
    src = page_slots(0, 3, TINY.page_size)
    fill_random_(tier, src, seed=3)
    tier.executor = _FailOnce(ex, after)
    task = tier.store(toks, None, src)
    assert task.status == "failed" and task.done and task.num_pages == 0
    assert tier.pool.num_free == 8 and tier.index.total_pages == 0 and ex.pending("store") == 0
    assert tier.stats()["failed_stores"] == 1 and task.id in tier.poll()
    ok = tier.store(toks, None, src)  # the tier carries on
    tier.wait(ok)
    assert ok.status == "done" and tier.lookup(toks) == 3
    want = slot_bytes(tier, src)
    dst = page_slots(4, 3, TINY.page_size)
    tier.executor = _FailOnce(ex, after)
    load = (tier.load_layerwise if layerwise else tier.load)(toks, None, dst)
    assert load.status == "failed" and load.num_pages == 0 and load.producer_index == -1
    assert tier.index.protected_pages == 0 and ex.pending("load") == 0  # unlocked, nothing left to run
    assert tier.stats()["failed_loads"] == 1
    load = (tier.load_layerwise if layerwise else tier.load)(toks, None, dst)
    tier.wait(load)
    assert load.num_pages == 3 and all(torch.equal(a, b) for a, b in zip(slot_bytes(tier, dst), want))
    assert accounted_blocks(tier) == (5, 3, 0)


@pytest.mark.parametrize("after", [False, True], ids=["before_issue", "after_issue"])
def test_an_ordered_tier_keeps_a_failed_copys_blocks_and_lock_until_it_is_finalized(after):
    """TP ranks finalize in an agreed order (finalize="ordered"). A copy that failed while being issued on one rank
    used to give its blocks back at once while the same copy was still in flight on another: the ranks' next
    allocations then evicted different host pages and their trees diverged. Now a failed copy keeps its blocks and
    lock until it is finalized, and finalizing discards it whatever ``keep`` says."""
    ex = DeferredExecutor()
    tier = make_tier(num_blocks=8, executor=ex, finalize="ordered")
    toks = np.arange(6)  # 3 pages
    src = page_slots(0, 3, TINY.page_size)
    fill_random_(tier, src, seed=3)
    tier.executor = _FailOnce(ex, after)
    task = tier.store(toks, None, src)
    assert task.status == "failed" and tier.completed(task)
    assert tier.pool.num_free == 5 and task.id not in tier.poll()  # held, as the other ranks' copy is
    tier.finalize(task, keep=True)
    assert task.status == "failed" and task.id in tier.poll()
    assert tier.pool.num_free == 8 and tier.index.total_pages == 0  # discarded: a failed copy is never kept
    ok = tier.store(toks, None, src)
    tier.finalize(ok)
    assert ok.status == "done" and tier.lookup(toks) == 3
    tier.executor = _FailOnce(ex, after)
    load = tier.load(toks, None, page_slots(4, 3, TINY.page_size))
    assert load.status == "failed" and tier.index.protected_pages == 3  # the path stays locked until finalized
    tier.finalize(load)
    assert load.status == "failed" and tier.index.protected_pages == 0
    assert accounted_blocks(tier) == (5, 3, 0)


@pytest.mark.parametrize("after", [False, True], ids=["before_issue", "after_issue"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_retry_issues_a_kept_failed_copy_again_into_the_same_blocks_and_slots(after, layerwise):
    """A later pipeline stage repairs a copy that failed there only by issuing it again. Issuing a new store at
    repair time allocated blocks when the pool's state differed from the first stage's at issue time (other stores
    had taken blocks since): it evicted other pages and the stages' host indexes diverged. ``retry`` issues the
    kept copy again between the same blocks and slots, so the pool sees nothing new: the same allocations and frees
    as a tier whose copy went through, and the same pages and bytes."""
    def run(fail: bool):
        ex = DeferredExecutor()
        tier = make_tier(num_blocks=4, executor=ex, finalize="ordered")
        src = page_slots(0, 4, TINY.page_size)
        fill_random_(tier, src, seed=5)
        if fail:
            tier.executor = _FailOnce(ex, after)
        first = tier.store(np.arange(6), None, src)  # 3 pages
        tier.executor = ex
        other = tier.store(np.arange(100, 102), None, src[6:])  # the last free block, taken before the repair
        if fail:
            assert first.status == "failed" and first.num_pages == 0
            assert tier.retry(first) and first.status == "inflight" and first.num_pages == 3
        ex.release_all()
        tier.finalize(first)
        tier.finalize(other)
        assert first.status == "done" and tier.lookup(np.arange(6)) == 3 and tier.lookup(np.arange(100, 102)) == 1
        if fail:
            tier.executor = _FailOnce(ex, after)
        dst = page_slots(8, 3, TINY.page_size)
        load = (tier.load_layerwise if layerwise else tier.load)(np.arange(6), None, dst)
        tier.executor = ex
        if fail:
            assert load.status == "failed" and tier.retry(load)
        ex.release_all()
        tier.finalize(load)
        assert load.status == "done" and load.num_pages == 3
        return tier.pool.block_digest, slot_bytes(tier, dst), slot_bytes(tier, src[:6])

    (d_ok, loaded_ok, src_ok), (d_rep, loaded_rep, src_rep) = run(False), run(True)
    assert d_rep == d_ok  # the same blocks handed out and freed, in the same order
    assert all(torch.equal(a, b) for a, b in zip(loaded_rep, src_rep))
    assert all(torch.equal(a, b) for a, b in zip(loaded_ok, src_ok))


def test_retry_refuses_a_task_that_is_not_a_kept_failed_copy():
    ex = DeferredExecutor()
    tier = make_tier(num_blocks=4, executor=ex, finalize="ordered")
    task = tier.store(np.arange(4), None, page_slots(0, 2, TINY.page_size))
    with pytest.raises(ValueError, match="not a failed copy"):
        tier.retry(task)  # in flight
    tier.executor = _FailOnce(ex, False)
    bad = tier.store(np.arange(10, 14), None, page_slots(2, 2, TINY.page_size))
    tier.executor = _FailOnce(ex, False)
    assert not tier.retry(bad) and bad.status == "failed"  # failed again: still kept, still failed
    ex.release("store", 1)
    tier.finalize(task)
    tier.finalize(bad)
    with pytest.raises(ValueError, match="not a failed copy"):
        tier.retry(bad)  # finalized: its blocks are given back
    assert accounted_blocks(tier) == (2, 2, 0)


@pytest.mark.parametrize("after", [False, True], ids=["before_issue", "after_issue"])
def test_failed_layerwise_loads_never_take_the_slot_a_forward_waits_on(after):
    """A layerwise load takes the layer counter's next slot; one whose issue fails gives it back. Else, after as
    many failures as the counter has slots, a failed load took the slot of the batch's good load, whose forward
    pass then waited on cleared events."""
    ex = DeferredExecutor()
    tier = make_tier(num_blocks=16, executor=ex)
    src = page_slots(0, 2, P)
    fill_random_(tier, src, seed=1)
    tier.wait(tier.store(np.arange(4), None, src))
    want = slot_bytes(tier, src)
    dst = page_slots(4, 2, P)
    good = tier.load_layerwise(np.arange(4), None, dst)  # the batch's good load: the forward waits on it
    tier.counter.set_consumer(good.producer_index)
    for i in range(tier.counter.num_slots + 1):  # the batch's next loads fail (their forward leaves the consumer)
        tier.executor = _FailOnce(ex, after)
        bad = tier.load_layerwise(np.arange(4), None, page_slots(8 + 2 * i, 2, P))
        assert bad.status == "failed" and bad.producer_index == -1
        assert tier.counter.producer_index == good.producer_index
    ex.release_all()
    for layer in range(TINY.num_layers):
        tier.counter.wait_until(layer)
    tier.wait(good)
    assert all(torch.equal(a, b) for a, b in zip(slot_bytes(tier, dst), want))
    tier.executor = ex
    nxt = tier.load_layerwise(np.arange(4), None, page_slots(20, 2, P))  # the next load takes the next slot
    assert nxt.producer_index == (good.producer_index + 1) % tier.counter.num_slots
    ex.release_all()
    tier.wait(nxt)


class _IssueNow:
    """Issues each copy at once, as the CUDA executor does, and reports it in flight until told otherwise (the GPU
    has not run it)."""

    class _Fence:
        def __init__(self, owner) -> None:
            self.owner = owner

        def done(self) -> bool:
            return self.owner.finished

        def wait(self) -> None:
            self.owner.finished = True

        def seconds(self):
            return None

    def __init__(self) -> None:
        self.finished = False

    def stream(self, name):
        return None

    def begin(self, name) -> None:
        pass

    def run(self, name, fn, own_stream=False) -> None:
        fn()

    def fence(self, name):
        return self._Fence(self)

    def wait_current(self, completion) -> None:
        pass


@pytest.mark.parametrize("op", ["store", "load", "load_layerwise"])
def test_the_slot_indices_a_copy_reads_live_until_it_is_finalized(monkeypatch, op):
    """int32 slots (SGLang's ``req_to_token`` rows) are converted to a new int64 tensor, allocated on the caller's
    stream. Dropped when the call returned, its memory went to the caller's next allocation while the copy, on the
    tier's stream, could still read it."""
    import weakref

    import kvtier.tier.device_copies as device_copies
    given = []
    for name in ("store_pages", "load_pages", "DirectCopy"):
        real = getattr(device_copies, name)

        def spy(kv, host, slots, *a, _real=real, **kw):
            given.append(weakref.ref(slots._base if slots._base is not None else slots))
            return _real(kv, host, slots, *a, **kw)
        monkeypatch.setattr(device_copies, name, spy)
    ex = _IssueNow()
    tier = make_tier(num_blocks=8, mode="direct", executor=ex)
    src = page_slots(0, 3, P)
    if op != "store":
        tier.wait(tier.store(np.arange(6), None, src))
        ex.finished = False
    slots = (src if op == "store" else page_slots(4, 3, P)).to(torch.int32)
    task = getattr(tier, op)(np.arange(6), None, slots)
    import gc
    gc.collect()
    assert not tier.completed(task) and given[-1]() is not None  # in flight: what the copy reads is alive
    tier.wait(task)
    if op == "load_layerwise":
        tier.counter.set_consumer(-1)
    gc.collect()
    assert given[-1]() is None  # finalized: let go


@pytest.mark.gpu
def test_gpu_int32_slots_of_a_store_in_flight_stay_its_own():
    """A store of int32 slots, its stream held back: the caller's next allocation, filled with other slots,
    must not take the memory of the int64 slots the tier made (the store would then copy those other pages)."""
    geo = QWEN_LIKE
    pages = 16
    tier = make_tier(geo, num_slots=4 * pages * geo.page_size, num_blocks=2 * pages, device="cuda", mode="direct")
    src, other = page_slots(0, pages, geo.page_size), page_slots(pages, pages, geo.page_size)
    fill_random_(tier, src, seed=1)
    fill_random_(tier, other, seed=2)
    want = slot_bytes(tier, src)
    toks = _tokens(pages * geo.page_size)
    # The first store compiles the copy kernel (longer than any sleep below): compile it with another prefix first.
    tier.wait(tier.store(_tokens(pages * geo.page_size, seed=9), None, other.cuda()))
    props = torch.cuda.get_device_properties(0)
    with torch.cuda.stream(tier.executor.stream("store")):
        torch.cuda._sleep(int(100e-3 * getattr(props, "clock_rate", 1_980_000) * 1e3))  # ~100 ms
    task = tier.store(toks, None, src.cuda().to(torch.int32))
    decoy = torch.empty(src.numel(), dtype=torch.int64, device="cuda")  # the caller's next allocation
    decoy.copy_(other.cuda())
    assert not tier.completed(task)
    tier.wait(task)
    dst = page_slots(2 * pages, pages, geo.page_size)
    tier.wait(tier.load(toks, None, dst.cuda()))
    assert all(torch.equal(a, b) for a, b in zip(slot_bytes(tier, dst), want))
    del decoy


def test_the_first_lookup_after_start_up_does_not_compile():
    """The index's numba code compiled on the first request (9.05 s for the first lookup of a fresh process
    without numba's disk cache); KVTier now compiles it when it is built, so the first lookup compiles nothing."""
    import subprocess
    import sys

    code = """
import numpy as np
from kvtier.index import page_trie
from tests.tier_helpers import make_tier
tier = make_tier()
entry = [page_trie._match, page_trie._insert, page_trie._lock, page_trie._evict]
before = [len(f._by_key) for f in entry]
assert tier.lookup(np.arange(8)) == 0  # what SGLang's match_prefix calls first
print("compiled on the first lookup:", sum(len(f._by_key) for f in entry) - sum(before))
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert "compiled on the first lookup: 0" in out.stdout, out.stdout


def test_a_store_whose_room_making_raises_leaves_its_prefix_unlocked(monkeypatch):
    """An eviction policy that raised while a store extending a held prefix made room left that prefix locked for
    good (its pages could never be evicted again)."""
    from kvtier.index import EvictionPolicy, eviction, register_eviction_policy

    monkeypatch.setattr(eviction, "_POLICIES", dict(eviction._POLICIES))  # the registration ends with the test

    class Failing(EvictionPolicy):
        def evict(self, n: int) -> np.ndarray:
            raise RuntimeError("policy bug")

    register_eviction_policy("failing-for-test", Failing)
    tier = make_tier(num_blocks=4, eviction_policy="failing-for-test")
    P = tier.page_size
    first = _tokens(2 * P, seed=1)
    tier.wait(tier.store(first, None, page_slots(0, 2, P)))
    tier.wait(tier.store(_tokens(2 * P, seed=2), None, page_slots(2, 2, P)))  # the pool is full
    with pytest.raises(RuntimeError, match="policy bug"):
        tier.store(np.concatenate([first, _tokens(2 * P, seed=3)]), None, page_slots(0, 4, P))
    assert tier.index.protected_pages == 0 and not tier.inflight_ids
    tier.destroy()


@pytest.mark.parametrize("bad", ["5", -5, 2.5, None])
def test_evict_refuses_what_is_no_page_count_naming_num_pages(bad):
    """evict("5") failed with a TypeError about a unary minus and evict(-5) with an error about another name."""
    tier = make_tier()
    with pytest.raises(ValueError, match=r"num_pages must be an int >= 0, got"):
        tier.evict(bad)
    assert tier.evict(0) == 0
    tier.destroy()


def test_an_empty_token_list_is_no_hit():
    """lookup([]) failed with 'tokens must be integers, got dtype float64' (numpy's dtype of an empty list)."""
    tier = make_tier()
    P = tier.page_size
    tier.wait(tier.store(np.arange(4 * P), None, page_slots(0, 4, P)))
    for empty in ([], np.array([]), torch.tensor([])):
        assert tier.lookup(empty) == 0
        assert tier.lookup_tiers(empty).cpu_pages == 0
        assert tier.load(empty, None, []).num_pages == 0
        assert tier.store(empty, None, []).num_pages == 0
    tier.destroy()


@pytest.mark.parametrize("op", ["store", "load"])
@pytest.mark.parametrize("slots", ["list", "numpy", "torch", "bool"])
def test_float_or_bool_slot_indices_are_an_error_naming_the_argument(op, slots):
    """Float slot indices were truncated silently (0.5, 1.7 -> slots 0, 1): the copy ran on other slots than the
    engine meant. They are a TypeError naming slot_indices, raised before anything is allocated or launched."""
    tier = make_tier()
    P = tier.page_size
    toks = np.arange(4 * P)
    if op == "load":
        tier.wait(tier.store(toks, None, page_slots(0, 4, P)))
    good = page_slots(10, 4, P)
    bad = {"list": [float(s) + 0.5 for s in good.tolist()], "numpy": good.numpy() + 0.0,
           "torch": good.to(torch.float32), "bool": np.ones(good.numel(), bool)}[slots]
    before = (tier.stats(), tier.pool.num_free, tier.index.protected_pages)
    with pytest.raises(TypeError, match="slot_indices must hold integers"):
        getattr(tier, op)(toks, None, bad)
    assert (tier.stats(), tier.pool.num_free, tier.index.protected_pages) == before
    assert not tier.inflight_ids
    tier.destroy()
