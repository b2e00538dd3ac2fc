"""kvtier's SGLang backend against real sglang 0.5.23 classes on CPU (pools, paged allocator, Req, release path)."""

import logging
from array import array

import pytest

pytest.importorskip("sglang")

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

from sglang.srt.mem_cache import registry  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from kvtier.sglang.radix_cache import KVTierRadixCache  # noqa: E402
from kvtier.tier.executor import DeferredExecutor  # noqa: E402
from tests import sglang_helpers as h  # noqa: E402


# --- registration ---

def test_register_is_idempotent_and_registry_finds_kvtier():
    assert ks.register() is True
    assert ks.register() is True  # duplicate name: swallowed
    assert registry.get_radix_cache_factory("kvtier") is ks.factory
    assert "kvtier" in registry.registered_radix_cache_backends()


def test_load_plugins_discovers_the_entry_point(tmp_path, monkeypatch):
    from sglang.srt import plugins

    dist = tmp_path / "kvtier_ep_test-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier-ep-test\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nkvtier = kvtier.sglang:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SGLANG_PLUGINS", "kvtier")
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "_RADIX_CACHE_REGISTRY", {})
    plugins.load_plugins()
    assert registry.get_radix_cache_factory("kvtier") is ks.factory


def test_unsupported_sglang_version(monkeypatch, caplog):
    monkeypatch.setattr(ks, "installed_sglang_version", lambda: "0.5.22")
    with pytest.raises(RuntimeError, match=r"supports sglang==0\.5\.23 only; sglang 0\.5\.22 is installed"):
        ks.check_sglang_version()
    monkeypatch.setattr(registry, "_RADIX_CACHE_REGISTRY", {})
    with caplog.at_level(logging.WARNING, logger="kvtier.sglang"):
        assert ks.register() is False
    assert "0.5.22" in caplog.text and registry.get_radix_cache_factory("kvtier") is None
    with pytest.raises(RuntimeError, match="0.5.22"):
        ks.factory(None)


def _ctx(s, tp_size: int = 1, server_args=None, **flags):
    base = dict(is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=False)
    base.update(flags)
    return registry.TreeCacheBuildContext(server_args=server_args, params=s.cache_params, tp_worker=None,
                                          model_config=None, tp_size=tp_size, tp_rank=0, tp_group=None, **base)


@pytest.fixture
def built():
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    s = h.build()
    s.cache_params = CacheInitParams(disable=False, req_to_token_pool=s.req_to_token_pool,
                                     token_to_kv_pool_allocator=s.allocator, page_size=s.page_size)
    return s


def test_factory_builds_the_cache_with_engine_page_size(built, monkeypatch):
    monkeypatch.delenv("KVTIER_CONFIG", raising=False)
    cache = ks.factory(_ctx(built))
    assert isinstance(cache, KVTierRadixCache) and cache.tier.page_size == built.page_size


def test_factory_rejects_unsupported_setups(built):
    with pytest.raises(ValueError) as e:
        ks.factory(_ctx(built, is_hybrid_swa=True, enable_hierarchical_cache=True, is_hybrid_ssm=True))
    msg = str(e.value)
    assert "SWA" in msg and "Mamba" in msg and "--enable-hierarchical-cache" in msg


def test_pipeline_and_context_parallelism_are_supported_and_decode_attention_tp_is_refused(built):
    """PP stages and attention-CP ranks agree through kvtier.sglang.agreement (tests/test_sglang_parallel.py); what
    stays refused says why."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    built.cache_params = dataclasses.replace(built.cache_params, pp_size=2, pp_rank=1, attn_cp_size=2)
    assert ks.unsupported_reasons(_ctx(built)) == []
    args = ServerArgs(model_path="dummy")
    args.enable_cp_decode_attn_tp = True
    reasons = ks.unsupported_reasons(_ctx(built, server_args=args))
    assert len(reasons) == 1 and "--enable-cp-decode-attn-tp" in reasons[0]


def test_factory_refuses_an_ssd_tier_with_pipeline_stages(built, tmp_path, monkeypatch):
    import dataclasses

    built.cache_params = dataclasses.replace(built.cache_params, pp_size=2)
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"page_size: 4\nssd_cache_gb: 0.001\nssd_cache_dir: {tmp_path}\n")
    monkeypatch.setenv("KVTIER_CONFIG", str(cfg))
    with pytest.raises(ValueError, match=r"SSD tier .* does not run with pipeline stages yet \(--pp-size 2\)"):
        ks.factory(_ctx(built))


def test_factory_rejects_page_size_mismatch(built, tmp_path, monkeypatch):
    cfg = tmp_path / "kvtier.json"
    cfg.write_text('{"page_size": 16}')
    monkeypatch.setenv("KVTIER_CONFIG", str(cfg))
    with pytest.raises(ValueError, match="page_size 16 but SGLang runs with --page-size 4"):
        ks.factory(_ctx(built))


# --- the scheduler's sequence ---

@pytest.mark.parametrize("mla,layerwise,mode",
                         [(False, False, "direct"), (False, True, "staged"), (True, True, "auto")],
                         ids=["mha-whole-direct", "mha-layerwise-staged", "mla-layerwise-auto"])
def test_page_1_engine_gets_host_blocks_of_16_and_loads_from_mid_block(mla, layerwise, mode):
    """At SGLang's --page-size 1 the tier's default host block is 16 tokens: host hits are whole blocks, and a
    device prefix that ends inside a block is continued from there (only the tokens after it are copied)."""
    s = h.build(mla=mla, page_size=1, kv_size=160, max_context=96, layerwise=layerwise, transfer_mode=mode,
                tokens_per_block=0)
    assert s.cache.tier.block_tokens == 16
    free0 = s.allocator.available_size()
    toks = list(range(200, 260))  # 60 tokens: 3 full blocks and 12 tokens the host does not keep
    a = h.serve(s, toks)
    assert (a.device_len, a.host_hit, a.loaded) == (0, 0, 0)
    s.cache.wait_all()
    assert s.cache.tier.stats()["pages_held"] == 48
    h.flush_device(s)
    a = h.serve(s, toks[:21])  # one host block
    assert (a.device_len, a.host_hit, a.loaded) == (0, 16, 16)
    a = h.serve(s, toks)  # the device holds 21 tokens (5 into block 2), the host 48: 27 tokens load, bytes checked
    assert (a.device_len, a.host_hit, a.loaded) == (21, 27, 27)
    h.assert_clean(s, free0)


@pytest.mark.parametrize("mla,page_size", [(False, 4), (True, 4), (False, 1)], ids=["mha-p4", "mla-p4", "mha-p1"])
def test_round_trip_through_host(mla, page_size):
    s = h.build(mla=mla, page_size=page_size, kv_size=32)
    free0 = s.allocator.available_size()
    toks = list(range(100, 114))  # 14 tokens
    full = len(toks) // page_size * page_size
    a = h.serve(s, toks)
    assert (a.device_len, a.host_hit, a.loaded) == (0, 0, 0)
    h.flush_device(s)
    assert s.cache.total_size() == 0 and s.allocator.available_size() == free0
    a = h.serve(s, toks)  # checks the loaded KV bytes
    assert (a.device_len, a.host_hit, a.loaded) == (0, full, full)
    a = h.serve(s, toks)
    assert (a.device_len, a.host_hit, a.loaded) == (full, 0, 0)
    h.assert_clean(s, free0)


def test_an_ssd_hit_after_a_restart_serves_the_prefix_on_real_sglang_pools(tmp_path):
    s = h.build(kv_size=32, ssd_dir=str(tmp_path))
    toks = list(range(100, 116))  # 4 pages
    h.serve(s, toks)
    s.cache.tier.destroy()  # the server stops (its SSD writes flushed)
    s = h.build(kv_size=32, ssd_dir=str(tmp_path))  # a new server: empty device tree, empty CPU tier
    req = h.make_req(s, toks)
    m = s.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks)), req=req))
    assert m.host_hit_length == 0  # the SSD pages are being promoted; match_prefix never waits on the disk
    s.req_to_token_pool.free(req)
    s.cache.wait_all()
    a = h.serve(s, toks)  # checks the loaded KV bytes
    assert (a.device_len, a.host_hit, a.loaded) == (0, 16, 16)
    st = s.cache.tier.stats()
    assert st["pages_promoted"] == 4 and st["ssd_blocks_recovered"] == 4
    s.cache.tier.destroy()


def test_each_tp_rank_keeps_its_ssd_blocks_in_a_directory_of_its_own(built, tmp_path, monkeypatch):
    """Every rank reads one config: under TP each rank's SSD directories are ``tp<rank>`` under the configured ones
    (one store per directory: two ranks over one failed at start)."""
    a, b = tmp_path / "a", tmp_path / "b"
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"page_size: 4\nssd_cache_gb: 0.001\nssd_cache_dir: {a};{b}\n")
    monkeypatch.setenv("KVTIER_CONFIG", str(cfg))
    ctx = _ctx(built, tp_size=2)
    ctx.tp_rank = 1
    cache = ks.factory(ctx)
    try:
        assert cache.tier.lower_tier("ssd").medium.store.dirs == [str(a / "tp1"), str(b / "tp1")]
        assert cache.tier.config.ssd_cache_dir == f"{a / 'tp1'};{b / 'tp1'}"
    finally:
        cache.release_host_resources()
    one = ks.factory(_ctx(built))  # one rank: the directories as configured
    try:
        assert one.tier.lower_tier("ssd").medium.store.dirs == [str(a), str(b)]
    finally:
        one.release_host_resources()


def test_device_prefix_plus_host_hit():
    s = h.build(kv_size=48)
    free0 = s.allocator.available_size()
    toks = list(range(7, 23))  # 16 tokens, 4 pages
    h.serve(s, toks)
    h.flush_device(s)
    a = h.serve(s, toks[:9])  # 2 pages back from the host
    assert (a.device_len, a.host_hit, a.loaded) == (0, 8, 8)
    a = h.serve(s, toks)  # 2 pages on device, 2 more from the host
    assert (a.device_len, a.host_hit, a.loaded) == (8, 8, 8)
    h.assert_clean(s, free0)


def test_namespaces_do_not_share_pages():
    s = h.build(kv_size=48)
    free0 = s.allocator.available_size()
    toks = list(range(40, 52))
    h.serve(s, toks, ns_tag=1, extra_key="lora-a")
    h.flush_device(s)
    assert h.serve(s, toks, ns_tag=2, extra_key="lora-b").host_hit == 0
    assert h.serve(s, toks, ns_tag=3, extra_key="lora-a", cache_salt="salt").host_hit == 0
    h.flush_device(s)
    a = h.serve(s, toks, ns_tag=1, extra_key="lora-a")  # checks namespace 1's bytes came back
    assert (a.host_hit, a.loaded) == (12, 12)
    h.assert_clean(s, free0)


def test_host_pages_evicted_between_match_and_load_give_all_or_nothing():
    s = h.build(kv_size=48)
    free0 = s.allocator.available_size()
    toks = list(range(60, 72))  # 3 pages
    h.serve(s, toks)
    h.flush_device(s)
    req = h.make_req(s, toks)
    m = s.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks)), req=req))
    assert m.host_hit_length == 12
    assert s.cache.tier.evict(1) == 1  # the last page leaves the host
    loaded, node = s.cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=12,
                                                             req=req))
    assert (loaded, node) == (0, m.best_match_node)  # SGLang 0.5.23 rejects partial loads
    assert s.cache.total_size() == 8  # the 2 pages that did arrive stay cached on device
    h.check_kv(s, s.cache.path_device_indices(next(iter(s.cache.root_node.children.values()))), toks, 0, 0)
    s.req_to_token_pool.free(req)
    h.assert_clean(s, free0)


def test_store_keeps_node_locked_until_it_completes():
    ex = DeferredExecutor()
    s = h.build(kv_size=48, executor=ex)
    free0 = s.allocator.available_size()
    toks = list(range(80, 90))  # 2 full pages + 2
    h.serve(s, toks)
    assert s.cache.num_inflight == 1 and s.cache.protected_size() == 8
    s.cache.evict(EvictParams(num_tokens=100))
    assert s.cache.total_size() == 8  # locked: the store still reads these slots
    ex.release("store", 10)
    s.cache.evict(EvictParams(num_tokens=100))  # drains the completion first, then evicts
    assert s.cache.num_inflight == 0 and s.cache.total_size() == 0
    assert s.cache.tier.lookup(toks) == 2
    h.assert_clean(s, free0)


def test_reset_fences_inflight_transfers():
    ex = DeferredExecutor()
    s = h.build(kv_size=48, executor=ex)
    h.serve(s, list(range(80, 90)))
    assert s.cache.num_inflight == 1
    s.cache.reset()
    assert s.cache.num_inflight == 0 and ex.pending("store") == 0
    assert s.cache.tier.stats()["inflight_tasks"] == 0 and s.cache.tier.stats()["pages_held"] == 0


def test_abort_drops_state_and_leaks_nothing():
    s = h.build(kv_size=48)
    free0 = s.allocator.available_size()
    toks = list(range(1, 13))
    h.serve(s, toks)
    h.flush_device(s)
    req = h.make_req(s, toks)
    a = h.admit(s, req)
    assert a.loaded == 12
    h.run_forward(s, req)
    s.cache.release_aborted_request(req.cache_request_handle)
    h.release(s, req, checkpoint=False)
    h.assert_clean(s, free0)


def test_layerwise_registers_counter_on_kv_pool():
    s = h.build(kv_size=32, layerwise=True)
    assert s.kv_pool.layer_transfer_counter is s.cache.tier.counter
    free0 = s.allocator.available_size()
    toks = list(range(5, 17))
    h.serve(s, toks)
    h.flush_device(s)
    a = h.serve(s, toks)
    assert a.loaded == 12 and s.cache.tier.counter.consumer_index >= 0
    s.kv_pool.get_key_buffer(1)  # the attention path's per-layer wait
    h.assert_clean(s, free0)


def test_tp_min_over_a_process_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        s = h.build(kv_size=32, tp_group=dist.group.WORLD)
        free0 = s.allocator.available_size()
        toks = list(range(3, 15))
        h.serve(s, toks)
        h.flush_device(s)
        assert h.serve(s, toks).loaded == 12
        h.assert_clean(s, free0)
    finally:
        dist.destroy_process_group()


def test_tp_ranks_whose_copies_complete_at_different_times_keep_identical_trees(tmp_path):
    """Two real TP ranks (gloo). Each rank used to drop a store's lock when its own GPU finished, so the next
    eviction freed different nodes on different ranks (and their batches and collectives diverged). Now the ranks
    release only what both completed, once per round: identical trees after every round and eviction."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(h.tp_skew_worker, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    assert r0["digests"] == r1["digests"]
    assert r0["digests"][0][2] > 0  # the first round kept the store's path locked on both ranks
    assert (r0["host_hit"], r0["loaded"]) == (r1["host_hit"], r1["loaded"]) == (12, 12)
    assert r0["kv_ok"] and r1["kv_ok"] and r0["no_leak"] and r1["no_leak"]
