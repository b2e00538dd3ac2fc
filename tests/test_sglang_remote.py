"""kvtier's SGLang backend with the remote tier on a real ``mooncake_master``: two instances (two processes) share a
prefix through the store, on real sglang 0.5.23 pools (CPU)."""

import json
import subprocess
import sys
import textwrap
from array import array

import numpy as np
import pytest
import torch

pytest.importorskip("sglang")

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from tests import sglang_helpers as h  # noqa: E402
from tests.test_sglang_backend import _ctx, built  # noqa: E402,F401

ROOT = __file__.rsplit("/tests/", 1)[0]
TOKS = list(range(100, 116))  # 4 pages of 4 tokens


def slot_kv(s: h.Setup, slots) -> np.ndarray:
    """The raw bytes of ``slots``' KV, every layer and K/V: uint8 [layers * kinds, slots, bytes per slot]."""
    idx = slots.to(device=s.device, dtype=torch.int64)
    return np.stack([buf[idx].contiguous().cpu().reshape(len(idx), buf[0].numel()).view(torch.uint8).numpy()
                     for bufs in h.layer_buffers(s) for buf in bufs])


# Instance B: a second server process on the same master. Its device pool is filled with other bytes first, so
# only what it fetches from A's segment (through its CPU tier) can match A's saved KV. It reports what it saw (and
# any error) as one JSON line; the test asserts on it.
INSTANCE_B = textwrap.dedent("""
    import json, sys, traceback
    sys.path.insert(0, {root!r})
    import kvtier.kernels  # noqa: F401  (before sglang imports triton: CPU pools copy through its interpreter)
    from array import array
    import numpy as np
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from tests import sglang_helpers as h
    from tests.test_sglang_remote import STATS, slot_kv

    toks, want = {toks!r}, np.load({kv_file!r})
    s = h.build(kv_size=32, remote_master={master!r})  # empty device tree, empty CPU pool
    out = {{}}
    try:
        for bufs in h.layer_buffers(s):
            for buf in bufs:
                buf.fill_(-3.0)  # not any KV the fake forward writes
        free0 = s.allocator.available_size()
        req = h.make_req(s, toks)
        m = s.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks)), req=req))
        out["first_host_hit"] = m.host_hit_length  # the fetch runs; match_prefix never waits on the network
        s.req_to_token_pool.free(req)
        s.cache.wait_all()  # the fetch: probe, get, checked blocks enter the CPU index
        st = s.cache.tier.stats()
        out["stats"] = {{k: st[k] for k in STATS}}
        out["cpu_pages_after_fetch"] = s.cache.tier.lookup(toks)
        req = h.make_req(s, toks)
        a = h.admit(s, req)
        out["admitted"] = [a.device_len, a.host_hit, a.loaded]
        s.cache.wait_all()
        slots = s.cache.path_device_indices(req.last_node)[:req.prefix_len]
        got = slot_kv(s, slots)
        out["kv_shapes"] = [list(got.shape), list(want.shape)]
        if got.shape == want.shape:
            out["kv_bytes_differing"] = int((got != want).sum())
        h.check_kv(s, slots, toks, 0, 0)  # and equal to what the fake forward writes for these tokens
        assert h.run_forward(s, req) is not None
        h.release(s, req)
        h.assert_clean(s, free0)
    except BaseException:
        out["error"] = traceback.format_exc()
    finally:
        s.cache.tier.destroy()
    print("RESULT " + json.dumps(out), flush=True)
""")
STATS = ("pages_fetched", "pages_fetch_failed", "fetches", "remote_blocks_fetched", "remote_blocks_corrupt",
         "remote_blocks_missing", "remote_errors", "remote_fetches_abandoned")


def run_instance_b(master: str, kv_file: str) -> dict:
    script = INSTANCE_B.format(root=ROOT, toks=TOKS, kv_file=kv_file, master=master)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, \
        f"instance B failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-8000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_two_instances_share_a_prefix_through_the_master_on_real_sglang_pools(tmp_path, mooncake_master):
    s = h.build(kv_size=32, remote_master=mooncake_master.addr)  # instance A: its segment will hold the values
    try:
        free0 = s.allocator.available_size()
        a = h.serve(s, TOKS)  # its checkpoint stores the 4 pages to the CPU tier, which puts them to the remote
        assert (a.device_len, a.host_hit, a.loaded) == (0, 0, 0)
        s.cache.wait_all()
        s.cache.tier.lower_tier("remote").drain(wait=True)  # every put has returned and is accounted
        st = s.cache.tier.stats()
        assert st["pages_held"] == 4 and st["remote_blocks_put"] == 4
        assert st["remote_blocks_put_failed"] == 0 and st["remote_blocks_put_dropped"] == 0
        m = s.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", TOKS)), req=None))
        assert m.device_prefix_len == 16
        kv = slot_kv(s, s.cache.path_device_indices(m.last_device_node)[:16])
        assert kv.shape[1] == 16 and kv.any()
        kv_file = str(tmp_path / "a_prefix_kv.npy")
        np.save(kv_file, kv)
        h.assert_clean(s, free0)

        b = run_instance_b(mooncake_master.addr, kv_file)  # A stays up: the values live in its segment

        assert b.get("first_host_hit") == 0, b  # the fetch was only started
        st = b.get("stats", {})
        assert st.get("fetches") == 1 and st.get("pages_fetched") == 4 and st.get("remote_blocks_fetched") == 4, b
        assert st["pages_fetch_failed"] == 0 and st["remote_blocks_corrupt"] == 0, b
        assert st["remote_blocks_missing"] == 0 and st["remote_errors"] == 0 and st["remote_fetches_abandoned"] == 0, b
        assert b.get("cpu_pages_after_fetch") == 4 and b.get("admitted") == [0, 16, 16], b
        assert b.get("kv_shapes", [None, 0])[0] == list(kv.shape), b
        assert b.get("kv_bytes_differing") == 0, f"{b.get('kv_bytes_differing')} KV bytes loaded on B differ from A's"
        assert "error" not in b, b["error"]
    finally:
        s.cache.tier.destroy()


def test_factory_refuses_a_remote_tier_with_pipeline_stages(built, tmp_path, monkeypatch):  # noqa: F811
    import dataclasses

    built.cache_params = dataclasses.replace(built.cache_params, pp_size=2)
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text("page_size: 4\nremote_backend: mooncake\nremote_master: 127.0.0.1:1\n")
    monkeypatch.setenv("KVTIER_CONFIG", str(cfg))
    with pytest.raises(ValueError, match=r"remote tier .* does not run with pipeline stages yet \(--pp-size 2\)"):
        ks.factory(_ctx(built))
