"""kvtier's SGLang backend on CUDA pools: the scheduler-sequence round trip on ``cuda`` (sglang 0.5.23's real
MHA/MLA pools, paged allocator and req-to-token pool on the GPU, pinned host pool, CUDA streams, CuPy layer counter
when CuPy is installed), and two TP ranks on two GPUs.

Every test is marked ``gpu`` (skipped without CUDA, see conftest.py); the TP test also needs two GPUs. On the GPU
machine run ``bash tests/gpu_sglang.sh`` (it installs the carried sglang wheels and runs these).
"""

import json
import sys

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

from tests import sglang_helpers as h  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [  # (mla, page_size)
    pytest.param(False, 16, id="mha-p16"),
    pytest.param(False, 1, id="mha-p1"),
    pytest.param(True, 16, id="mla-p16"),
]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("mla,page_size", CASES)
def test_round_trip_on_cuda_pools(mla, page_size, layerwise):
    s = h.build(mla=mla, page_size=page_size, kv_size=8 * page_size + 32, device="cuda", layerwise=layerwise)
    assert s.kv_pool.kv_buffer[0].is_cuda if mla else s.kv_pool.k_buffer[0].is_cuda
    probe = s.allocator.alloc(page_size)
    assert probe.is_cuda and s.req_to_token_pool.req_to_token.is_cuda
    s.allocator.free(probe)
    tier = s.cache.tier
    assert tier.kv.is_cuda and tier.pool.pinned_bytes > 0  # pinned host pool, CUDA executor
    if layerwise:
        assert s.kv_pool.layer_transfer_counter is tier.counter
        print(f"layer counter backend: {tier.counter.backend}", file=sys.stderr)
    free0 = s.allocator.available_size()
    n = 3 * page_size + page_size // 2 if page_size > 1 else 14  # 3 full pages + a partial one (page 16)
    toks = list(range(100, 100 + n))
    full = n // page_size * page_size

    a = h.serve(s, toks)
    assert (a.device_len, a.host_hit, a.loaded) == (0, 0, 0)
    s.cache.wait_all()
    assert tier.lookup(toks) == full // page_size  # the checkpoint stored every full page
    h.flush_device(s)
    assert s.cache.total_size() == 0 and s.allocator.available_size() == free0

    # served from the host: the prefix is checked on the current stream without a host-side wait, so only the
    # stream wait (whole loads) or the pool's per-layer counter wait (layerwise) orders the read after the copy
    a = h.serve(s, toks, host_wait=False)
    assert (a.device_len, a.host_hit, a.loaded) == (0, full, full)
    a = h.serve(s, toks)
    assert (a.device_len, a.host_hit, a.loaded) == (full, 0, 0)
    stats = tier.stats()
    assert stats["pages_loaded"] == full // page_size and stats["bytes_h2d"] > 0 and stats["bytes_d2h"] > 0
    h.assert_clean(s, free0)


@pytest.mark.parametrize("transfer_mode", ["direct", "staged"])
def test_device_prefix_plus_host_hit_on_cuda(transfer_mode):
    """2 pages on device + 2 from the host: only the 2 new pages are copied, into fresh slots, bytes exact."""
    P = 16
    s = h.build(page_size=P, kv_size=12 * P, device="cuda", transfer_mode=transfer_mode)
    free0 = s.allocator.available_size()
    toks = list(range(7, 7 + 4 * P))
    h.serve(s, toks)
    h.flush_device(s)
    a = h.serve(s, toks[:2 * P + 3], host_wait=False)
    assert (a.device_len, a.host_hit, a.loaded) == (0, 2 * P, 2 * P)
    a = h.serve(s, toks, host_wait=False)
    assert (a.device_len, a.host_hit, a.loaded) == (2 * P, 2 * P, 2 * P)
    s.cache.wait_all()
    assert s.cache.tier.stats()["pages_loaded"] == 4  # 2 + 2, the device-held pages were not copied again
    h.assert_clean(s, free0)


@pytest.mark.parametrize("transfer_mode", ["direct", "staged"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_copies_are_ordered_after_the_forward_stream(transfer_mode, layerwise):
    """The forward runs on its own stream and writes the KV late (a long kernel first). The store (issued from
    the scheduler's current stream, which did not wait) must copy the written bytes, as SGLang fences its own host
    copies on the forward stream."""
    P = 16
    forward = torch.cuda.Stream()
    s = h.build(page_size=P, kv_size=16 * P, device="cuda", transfer_mode=transfer_mode, layerwise=layerwise,
                forward_stream=forward)
    warm = list(range(500, 500 + 2 * P))  # a store and a load first: no kernel compiles while the forward runs
    for _ in range(2):
        h.serve(s, warm)
        h.flush_device(s)
    free0 = s.allocator.available_size()
    toks = list(range(3, 3 + 4 * P))
    req = h.make_req(s, toks)
    h.admit(s, req)
    n = len(toks)
    slots = s.allocator.alloc(n).to(torch.int64)
    s.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, n)), slots.to(torch.int32))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = req.extend_end = n
    write = h.kv_writer(s, slots, toks, 0, 0)  # the KV values are on the GPU before the forward starts
    forward.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(forward):  # the forward: busy for ~50 ms, then writes the request's KV
        torch.cuda._sleep(100_000_000)
        write()
    h.release(s, req)  # checkpoint -> store, issued while the forward is still running
    assert not forward.query(), "the forward finished before the store was issued: the test would prove nothing"
    s.cache.wait_all()
    forward.synchronize()
    h.flush_device(s)
    a = h.serve(s, toks)  # checks the loaded bytes against the forward's KV
    assert a.loaded == 4 * P
    h.assert_clean(s, free0)


@pytest.mark.parametrize("transfer_mode", ["direct", "staged"])
def test_a_whole_load_makes_the_schedulers_stream_wait_too(transfer_mode):
    """Without overlap scheduling SGLang runs the forward on the scheduler's current stream, not on the model
    runner's forward stream; a whole load made only the forward stream wait, so such a forward could read its
    prefix before the copy landed."""
    P = 16
    forward = torch.cuda.Stream()
    s = h.build(page_size=P, kv_size=16 * P, device="cuda", transfer_mode=transfer_mode, layerwise=False,
                forward_stream=forward)
    toks = list(range(3, 3 + 4 * P))
    for _ in range(2):  # a store and a load first: nothing compiles below
        h.serve(s, toks)
        h.flush_device(s)
    free0 = s.allocator.available_size()
    for bufs in h.layer_buffers(s):  # freed slots keep their bytes: a read before the copy lands must see others
        for buf in bufs:
            buf.fill_(-1)
    torch.cuda.synchronize()
    with torch.cuda.stream(s.cache.tier.executor.stream("load")):
        torch.cuda._sleep(100_000_000)  # the load's copy starts ~50 ms late
    a = h.serve(s, toks, host_wait=False)  # reads the prefix on the current stream, as a non-overlap forward
    assert a.loaded == 4 * P
    h.assert_clean(s, free0)


def test_namespaces_and_eviction_pressure_on_cuda():
    """Two namespaces through a device pool that only fits one request: every load is checked byte for byte."""
    P = 16
    s = h.build(page_size=P, kv_size=5 * P, device="cuda", host_blocks_kb=64)
    free0 = s.allocator.available_size()
    toks = list(range(40, 40 + 3 * P))
    for rnd in range(3):
        for tag, key in ((1, "lora-a"), (2, "lora-b")):
            a = h.serve(s, toks, ns_tag=tag, extra_key=key, host_wait=False)
            if rnd == 0 and tag == 1:
                assert a.host_hit == 0
            h.flush_device(s)
    a = h.serve(s, toks, ns_tag=1, extra_key="lora-a", host_wait=False)
    assert (a.host_hit, a.loaded) == (3 * P, 3 * P)
    h.assert_clean(s, free0)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_ranks_with_skewed_copies_keep_identical_trees_on_two_gpus(tmp_path):
    """Two TP ranks, rank r on cuda:r with a gloo TP CPU group; rank 1's copies start 50 ms late: after every
    round and eviction both ranks hold identical trees, load the same pages with exact bytes, and leak nothing."""
    import torch.multiprocessing as mp

    P = 16
    try:
        mp.spawn(h.tp_skew_worker, args=(2, str(tmp_path / "pg"), str(tmp_path), "cuda", P), nprocs=2, join=True)
    finally:
        for r in range(2):
            f = tmp_path / f"rank{r}.json"
            print(f"rank {r}: {f.read_text() if f.exists() else '(no report)'}", file=sys.stderr)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    assert r0["digests"] == r1["digests"]
    assert (r0["host_hit"], r0["loaded"]) == (r1["host_hit"], r1["loaded"]) == (3 * P, 3 * P)
    assert r0["kv_ok"] and r1["kv_ok"] and r0["no_leak"] and r1["no_leak"]


def _two_ranks_on_cuda(tmp_path, P: int, **topo) -> list[dict]:
    """Two rank processes on CUDA (one GPU each, or both on the one there is), the last rank's copies 50 ms late;
    their reports."""
    import torch.multiprocessing as mp

    try:
        mp.spawn(h.tp_skew_worker, args=(2, str(tmp_path / "pg"), str(tmp_path), "cuda", P, topo.get("tp"),
                                         topo.get("pp", 1), topo.get("mla", False)), nprocs=2, join=True)
    finally:
        for r in range(2):
            f = tmp_path / f"rank{r}.json"
            print(f"rank {r}: {f.read_text() if f.exists() else '(no report)'}", file=sys.stderr)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in reports:
        assert "error" not in r, r["error"]
    return reports


def test_pp2_stages_with_skewed_copies_keep_identical_trees_on_cuda(tmp_path):
    """Two pipeline stages (layers 0-1 and 2-3), each its own process on CUDA; stage 1's copies start 50 ms late:
    the first stage decides, stage 1 waits for its own copies, and both hold the same tree after every round, load
    the same pages with the exact KV of their layers, and leak nothing."""
    P = 16
    r0, r1 = _two_ranks_on_cuda(tmp_path, P, tp=1, pp=2)
    assert r0["digests"] == r1["digests"]
    assert (r0["host_hit"], r0["loaded"]) == (r1["host_hit"], r1["loaded"]) == (3 * P, 3 * P)
    assert r0["kv_ok"] and r1["kv_ok"] and r0["no_leak"] and r1["no_leak"]


def test_mla_tp2_ranks_share_one_pinned_pool_on_cuda(tmp_path):
    """MLA under TP=2, each rank its own process on CUDA: one host pool in shared memory, registered with CUDA by
    both processes, each rank's stores copying half the layers (rank 1's 50 ms late); both load every layer with
    the exact KV, hold the same tree after every round, and leak nothing."""
    P = 16
    r0, r1 = _two_ranks_on_cuda(tmp_path, P, tp=2, mla=True)
    assert r0["shared_inode"] is not None and r0["shared_inode"] == r1["shared_inode"]
    assert r0["digests"] == r1["digests"]
    assert (r0["host_hit"], r0["loaded"]) == (r1["host_hit"], r1["loaded"]) == (3 * P, 3 * P)
    assert r0["kv_ok"] and r1["kv_ok"] and r0["no_leak"] and r1["no_leak"]

