"""bench/bench_serving.py at toy sizes on the CPU (the GPU run's code path, in the SGLang environment): a swe pass
and a multiturn run through two modes, every request served, no loaded page differing from its stored copy, and the
JSON and PNG written."""

import json

import pytest

pytest.importorskip("sglang")
pytest.importorskip("transformers")

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

from bench import bench_serving  # noqa: E402


def test_the_serving_bench_runs_every_workload_shape_at_toy_sizes(tmp_path):
    out = tmp_path / "serving.json"
    assert bench_serving.main(["--plan", "smoke", "--repeats", "1", "--workloads", "swe,multiturn",
                               "--modes", "unified,kvtier", "--qps", "inf", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert not res["swe"]["errors"] and not res["multiturn"]["errors"]
    plan = res["plan"]
    for mode in ("unified", "kvtier"):
        swe = [r for r in res["swe"]["runs"] if r["mode"] == mode]
        assert len(swe) == 1 and swe[0]["requests"] == plan["swe_prompts"]
        mt = [r for r in res["multiturn"]["runs"] if r["mode"] == mode]
        assert len(mt) == 1 and mt[0]["requests"] == plan["mt_clients"] * plan["mt_rounds"]
    kv = next(r for r in res["swe"]["runs"] if r["mode"] == "kvtier")
    assert kv["hit_rate"] == 1.0 and kv["verified_pages"] > 0  # pass 2 after the device flush: all host hits
    assert res["summary"]["loaded_bytes_mismatches"] == 0
    assert (tmp_path / "serving.png").stat().st_size > 0
