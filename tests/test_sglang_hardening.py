"""Failure modes of a real SGLang deployment (issue: production hardening), each pinned by a test named after it,
against sglang 0.5.23's own pools, allocator, Req and release path on the CPU."""

from array import array

import pytest

pytest.importorskip("sglang")

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from kvtier.tier.executor import DeferredExecutor  # noqa: E402
from tests import sglang_helpers as h  # noqa: E402


def _match(s, req):
    toks = req.full_untruncated_fill_ids
    return s.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks)), req=req))


def _load_back(s, req, m):
    lock = s.cache.lock(m.last_device_node)
    try:
        return s.cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                         host_hit_length=m.host_hit_length, req=req))
    finally:
        s.cache.unlock(lock)


def _finish(s, req, node, prefix_len):
    """Lock the prefix, run the forward and release the request as the scheduler would after its admission."""
    req.prefix_len = prefix_len
    req.last_node = node
    req.kv.cache_protected_len = prefix_len
    req.lock = s.cache.lock(node)
    assert h.run_forward(s, req) is not None
    h.release(s, req)


@pytest.mark.parametrize("second_len", [12, 16], ids=["same_prefix", "longer_prompt"])
def test_two_requests_matched_before_admission_do_not_graft_twice(second_len):
    """Both requests match the same host prefix before either is admitted; the second's load-back must reuse the
    node the first grafted (it used to overwrite it in ``parent.children``, leaving an unreachable node whose
    eviction later failed an assertion in ``_delete_leaf``)."""
    s = h.build(kv_size=64)
    free0 = s.allocator.available_size()
    toks = list(range(30, 30 + second_len + 1))
    h.serve(s, toks[:13])  # 3 pages go to the host
    h.flush_device(s)
    a, b = h.make_req(s, toks[:13]), h.make_req(s, toks)
    ma, mb = _match(s, a), _match(s, b)
    assert ma.host_hit_length == mb.host_hit_length == 12
    la, na = _load_back(s, a, ma)
    lb, nb = _load_back(s, b, mb)
    assert la == lb == 12
    assert len(s.cache.root_node.children) == 1  # one child for the prefix, not two under one key
    assert s.cache.total_size() == 12  # the prefix's slots once
    s.cache.wait_all()
    h.check_kv(s, s.cache.path_device_indices(nb)[:12], toks, 0, 0)
    _finish(s, a, na, 12)
    _finish(s, b, nb, 12)
    h.assert_clean(s, free0)  # the flush evicts every node: none is unreachable


def test_a_zero_page_load_does_not_cancel_an_earlier_loads_waits():
    """Two requests of one batch load layerwise; the second's host pages were evicted after its match, so its load
    copies nothing. The forward must still wait for the first request's in-flight load (the zero-page load used to
    set the consumer to -1, and the forward read layers still being copied)."""
    ex = DeferredExecutor()
    s = h.build(kv_size=96, layerwise=True, executor=ex)
    free0 = s.allocator.available_size()
    ta, tb = list(range(10, 23)), list(range(50, 63))
    for t in (ta, tb):
        h.serve(s, t)
    ex.release_all()
    h.flush_device(s)
    a, b = h.make_req(s, ta), h.make_req(s, tb)
    ma = _match(s, a)
    la, na = _load_back(s, a, ma)
    assert la == 12 and ex.pending("load") > 0
    slot = s.cache.tier.counter.consumer_index
    assert slot >= 0
    mb = _match(s, b)
    assert mb.host_hit_length == 12
    s.cache.tier.evict(10**6)  # b's pages leave the host (a's are locked by its load)
    lb, nb = _load_back(s, b, mb)
    assert lb == 0
    assert s.cache.tier.counter.consumer_index == slot  # the batch's forward still waits for a's layers
    ex.release_all()
    h.check_kv(s, s.cache.path_device_indices(na)[:12], ta, 0, 0, via_pool=True)
    assert s.cache.tier.counter.consumer_index == -1  # the forward read every layer: the load is consumed
    _finish(s, a, na, 12)
    s.req_to_token_pool.free(b)
    h.assert_clean(s, free0)


def _build_ctx(mla=False, **server_args):
    """SGLang's cache build context over a CPU pool, with ``server_args`` as the server's arguments."""
    import types

    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    s = h.build(mla=mla)
    params = CacheInitParams(disable=False, req_to_token_pool=s.req_to_token_pool,
                             token_to_kv_pool_allocator=s.allocator, page_size=s.page_size)
    return registry.TreeCacheBuildContext(
        server_args=types.SimpleNamespace(**{"disaggregation_mode": "null", **server_args}), params=params,
        is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=False,
        tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_prefill_decode_disaggregation_is_refused(mode):
    """PD disaggregation's early send of cached prefix KV would read slots a kvtier load is still writing."""
    with pytest.raises(ValueError, match=f"--disaggregation-mode {mode}"):
        ks.factory(_build_ctx(disaggregation_mode=mode))


def test_decode_context_parallelism_is_refused():
    """--dcp-size > 1 hands out slot ids that are not rows of this rank's pool (each rank keeps every
    dcp_size-th token): copies would move the wrong rows."""
    with pytest.raises(ValueError, match="--dcp-size"):
        ks.factory(_build_ctx(mla=True, dcp_size=2))


@pytest.mark.parametrize("algo", ["STANDALONE", "dflash", "DSPARK", "UNO"])
def test_a_draft_model_with_its_own_kv_is_refused(algo):
    """A draft model with a KV pool of its own (STANDALONE, the DFLASH family) reads its KV at the slots of a
    prefix kvtier loaded into the target's pool only: the draft's rows there are stale."""
    with pytest.raises(ValueError, match=f"--speculative-algorithm {algo.upper()}: its draft model"):
        ks.factory(_build_ctx(speculative_algorithm=algo))


def test_ngram_speculation_runs_and_eagle_is_reported_once():
    """NGRAM has no draft model, so nothing of it goes stale; EAGLE's refusal comes from its bigram keys alone."""
    assert ks.unsupported_reasons(_build_ctx(speculative_algorithm="NGRAM")) == []
    ctx = _build_ctx(speculative_algorithm="EAGLE")
    ctx.params.is_eagle = True
    reasons = ks.unsupported_reasons(ctx)
    assert len(reasons) == 1 and "EAGLE" in reasons[0]


def test_a_pool_with_kv_scale_buffers_is_refused():
    """An FP4 MLA pool keeps per-token scales beside its KV: kvtier moved the KV only, and a prefix loaded back was
    read with the scales the reused slots last held."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPoolFP4
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from kvtier.sglang.radix_cache import paged_kv_from_pool

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=4))
    pool = MLATokenToKVPoolFP4(size=64, page_size=4, dtype=torch.uint8, kv_lora_rank=16, qk_rope_head_dim=16,
                               layer_num=2, device="cpu", enable_memory_saver=False)
    assert pool.kv_scale_buffer is not None
    with pytest.raises(ValueError, match="kv_scale_buffer"):
        paged_kv_from_pool(pool, 4)


def test_chunked_prefill_copies_each_page_once():
    """Each chunk's checkpoint stores the tree-owned prefix; while the previous chunk's store is in flight its pages
    are not in the host index yet, so the next checkpoint used to copy them again."""
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    ex = DeferredExecutor()
    s = h.build(kv_size=96, executor=ex)
    free0 = s.allocator.available_size()
    toks = list(range(200, 225))  # 6 full pages + 1 token
    req = h.make_req(s, toks)
    h.admit(s, req)
    assert h.run_forward(s, req) is not None  # the KV of every token is written; now replay it as 3 chunks
    for end in (8, 16, 24):
        req.extend_end = req.kv.kv_committed_len = end
        checkpoint_kv_cache(req, s.cache)
    req.extend_end = req.kv.kv_committed_len = len(toks)
    h.release(s, req)
    ex.release_all()
    s.cache.wait_all()
    st = s.cache.tier.stats()
    assert st["pages_stored"] == 6 and s.cache.tier.lookup(toks) == 6
    assert st["pages_store_duplicate"] == 0
    assert st["bytes_d2h"] == 6 * s.cache.tier.pool.block_bytes  # each page crossed PCIe once
    h.flush_device(s)
    a = h.serve(s, toks)  # and what came back is the request's KV
    assert a.loaded == 24
    h.assert_clean(s, free0)


def test_host_pool_is_sized_against_this_ranks_share(monkeypatch, tmp_path):
    """cpu_cache_gb is per rank; each rank used to check machine-wide free memory on its own, so 8 ranks could
    each pin what fits once. The factory now checks SGLang's per-rank budget (available less its reserve, divided
    between the host's ranks): an explicit size that does not fit is refused, the default shrinks to fit."""
    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.pool_host import base as host_base

    s = h.build()
    params = CacheInitParams(disable=False, req_to_token_pool=s.req_to_token_pool,
                             token_to_kv_pool_allocator=s.allocator, page_size=s.page_size)
    ctx = registry.TreeCacheBuildContext(server_args=None, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
                                         enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None,
                                         model_config=None, tp_size=1, tp_rank=0, tp_group=None)
    monkeypatch.setattr(host_base, "available_host_memory_bytes", lambda **kw: (10 << 30) + 8 * (64 << 20))
    monkeypatch.setattr(host_base, "ranks_per_host", lambda: 8)  # (available - 10 GiB) / 8 = 64 MiB per rank
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"cpu_cache_gb: 0.125\npage_size: {s.page_size}\n")
    monkeypatch.setenv("KVTIER_CONFIG", str(cfg))
    with pytest.raises(ValueError, match=r"does not fit this rank's share of host memory, 0\.06 GiB"):
        ks.factory(ctx)
    monkeypatch.delenv("KVTIER_CONFIG")
    cache = ks.factory(ctx)  # the 16 GiB default: 64 MiB here
    assert cache.tier.pool.nbytes <= 64 << 20 and cache.tier.pool.num_blocks > 0
    cfg.write_text(f"page_size: {s.page_size}\n")  # a config that leaves the size to the default: the same
    monkeypatch.setenv("KVTIER_CONFIG", str(cfg))
    cache = ks.factory(ctx)
    assert cache.tier.pool.nbytes <= 64 << 20 and cache.tier.pool.num_blocks > 0


def test_config_check_and_the_factory_use_sglangs_share_of_host_memory(monkeypatch, tmp_path, capsys):
    """config check judged a pool by kvtier's own rule (available less 2 GiB) where the server uses SGLang's (less
    10 GiB, shared by the host's ranks), so it passed pools the server refused; with no share left, the factory's
    error named a negative cpu_cache_gb the config never set."""
    from sglang.srt.mem_cache.pool_host import base as host_base

    from kvtier import cli
    from kvtier.commands import config_check

    available = (10 << 30) + 8 * (64 << 20)
    monkeypatch.setattr(host_base, "available_host_memory_bytes", lambda **kw: available)
    monkeypatch.setattr(host_base, "ranks_per_host", lambda: 8)  # 64 MiB a rank
    # config check reads SGLang's measure from its file (importing sglang takes seconds): the same figure here
    monkeypatch.setattr(config_check, "_sglang_rule", lambda: (available, host_base.HICACHE_HOST_MEMORY_RESERVE_BYTES))
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text("cpu_cache_gb: 0.125\n")
    assert cli.main(["config", "check", "--ranks", "8", str(cfg)]) == 1
    assert ("8 ranks' host pools of 0.125 GiB do not fit this host (by SGLang's rule: 10.5 GiB available (its "
            "measure: bounded by the cgroup limits) - 10 GiB reserve = 0.5 GiB for this host's ranks, / 8 ranks = "
            "0.062 GiB a rank)") in capsys.readouterr().err
    cfg.write_text("page_size: 16\n")  # the default size, which the server shrinks
    assert cli.main(["config", "check", "--ranks", "8", str(cfg)]) == 0
    assert "under SGLang the default host pool of 16 GiB shrinks to 0.062 GiB a rank" in capsys.readouterr().out
    monkeypatch.setattr(host_base, "available_host_memory_bytes", lambda **kw: 9 << 30)  # below the reserve
    with pytest.raises(ValueError, match=r"this rank's share of host memory for a host pool is -0\.12 GiB"):
        ks.factory(_build_ctx())


def test_release_host_resources_unpins_the_pool():
    s = h.build()
    h.serve(s, list(range(1, 10)))
    s.cache.release_host_resources()
    assert s.cache.tier.pool.destroyed is True and s.cache.tier.pool.host is None
    s.cache.release_host_resources()  # idempotent, as SGLang's contract says


def test_wait_all_returns_after_release_host_resources_with_a_checkpoint_held():
    """A chunked request's second checkpoint waits for its first store; after release_host_resources (which
    destroys the tier, whose poll never reports that store again) wait_all spun forever."""
    import threading

    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    s = h.build(kv_size=96, executor=DeferredExecutor())
    req = h.make_req(s, list(range(200, 225)))
    h.admit(s, req)
    h.run_forward(s, req)
    for end in (8, 16):  # two chunks: the second checkpoint is held behind the first's store
        req.extend_end = req.kv.kv_committed_len = end
        checkpoint_kv_cache(req, s.cache)
    assert s.cache.num_held_checkpoints == 1
    s.cache.release_host_resources()
    waiter = threading.Thread(target=s.cache.wait_all, daemon=True)
    waiter.start()
    waiter.join(timeout=20)
    assert not waiter.is_alive()


def test_multimodal_pad_ids_are_matched_stored_and_loaded():
    """SGLang puts image pad values (MM_PAD_SHIFT_VALUE + a 62-bit hash, up to 2**62 + 10**6) into the radix key;
    the index took ids < 2**32 only and match_prefix raised ValueError, killing the scheduler."""
    from sglang.srt.managers.schedule_batch import MM_PAD_SHIFT_VALUE

    pads = [MM_PAD_SHIFT_VALUE + (0x3FFF_FFFF_FFFF_0000 + k) for k in range(4)]
    s = h.build(kv_size=64)
    free0 = s.allocator.available_size()
    toks = [11, 12, 13, 14] + pads * 2 + [15, 16, 17]  # 15 tokens: 3 full pages, two of them pads
    a = h.serve(s, toks)
    assert a.host_hit == 0
    h.flush_device(s)
    a = h.serve(s, toks)  # serve() checks every loaded element against the KV the pads produced
    assert (a.device_len, a.host_hit, a.loaded) == (0, 12, 12)
    other = toks[:4] + [pads[0] + 1] + toks[5:]  # another image
    h.flush_device(s)
    assert h.serve(s, other).loaded == 4
    h.assert_clean(s, free0)
