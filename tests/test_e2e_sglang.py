"""End to end on the CPU: a tiny real decoder served through SGLang's pools and scheduler sequence in every mode.

kvtier's outputs and every step's logits must equal the warm device cache's bit for bit (the KV it brings back is
exact; a tiny random model's argmax alone barely depends on its attention), its hits
must be every page-aligned prompt token after a device flush, and no device slot may leak; for MHA and MLA pools,
whole and layerwise loads, and a device pool too small for the working set (LRU evicts, kvtier serves the rest).
"""

import random

import pytest

pytest.importorskip("sglang")
pytest.importorskip("transformers")

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

import torch  # noqa: E402

from kvtier.e2e.model import PagedDecoder  # noqa: E402
from kvtier.sglang.serving import MODES, Server  # noqa: E402
from tests.test_e2e_model import CONFIGS  # noqa: E402

PAGE = 4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return PagedDecoder.from_config(CONFIGS[request.param](), seed=0, dtype=torch.bfloat16)


def _prompts(seed: int = 0):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 256) for _ in range(45)]
    return ([shared + [rng.randrange(1, 256) for _ in range(rng.randrange(3, 30))] for _ in range(3)]
            + [[rng.randrange(1, 256) for _ in range(rng.randrange(20, 70))] for _ in range(3)])


def _aligned(n: int) -> int:
    return (n - 1) // PAGE * PAGE


def test_every_mode_serves_the_same_tokens_and_kvtier_hits_every_page(model):
    prompts, outputs, logits = _prompts(), {}, {}
    for mode in MODES:
        server = Server(model, mode, kv_tokens=1024, page_size=PAGE, max_context=256, cpu_cache_gb=1 / 256,
                        tokens_per_block=PAGE)
        for p in prompts:  # pass 1 fills
            server.serve(p, 6)
        results = []
        for p in prompts:  # pass 2 measures; kvtier modes start every request from an empty device tree
            if mode.startswith("kvtier"):
                server.flush_device()
            results.append(server.serve(p, 6, keep_logits=True))
        outputs[mode] = [r.output for r in results]
        logits[mode] = [torch.stack(r.logits) for r in results]
        if mode == "device":
            assert [r.device_len for r in results] == [_aligned(len(p)) for p in prompts]
        if mode.startswith("kvtier"):
            assert [r.device_len for r in results] == [0] * len(prompts)
            assert [r.loaded for r in results] == [_aligned(len(p)) for p in prompts]
            assert [r.computed for r in results] == [len(p) - _aligned(len(p)) for p in prompts]
        if mode == "recompute":
            assert [r.computed for r in results] == [len(p) for p in prompts]
        assert server.leaked_slots() == 0, mode
        server.close()
    for mode in ("kvtier_whole", "kvtier_layerwise"):
        assert outputs[mode] == outputs["device"], mode
        for i, (got, want) in enumerate(zip(logits[mode], logits["device"])):
            assert torch.equal(got, want), f"{mode}, prompt {i}: logits differ from the warm device cache's"


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_small_device_pool_lru_evicts_and_kvtier_serves_the_rest(model, layerwise):
    """Round-robin conversations whose history outgrows the device pool: the device tree keeps little, kvtier
    loads the rest, and every output equals a device cache with room for everything."""
    rng = random.Random(5)
    system = [rng.randrange(1, 256) for _ in range(16)]
    convs = [[[rng.randrange(1, 256) for _ in range(rng.randrange(5, 15))] for _ in range(3)] for _ in range(4)]
    big = Server(model, "device", kv_tokens=2048, page_size=PAGE, max_context=256)
    small = Server(model, "kvtier_layerwise" if layerwise else "kvtier_whole", kv_tokens=96, page_size=PAGE,
                   tokens_per_block=PAGE, max_context=256, cpu_cache_gb=1 / 256)
    history = [list(system) for _ in convs]
    loaded = 0
    for turn in range(3):
        for c, conv in enumerate(convs):
            prompt = history[c] + conv[turn]
            want, got = big.serve(prompt, 4, keep_logits=True), small.serve(prompt, 4, keep_logits=True)
            assert got.output == want.output, (turn, c)
            assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits)), (turn, c)
            assert got.device_len + got.loaded >= want.device_len  # kvtier covers what the device tree lost
            loaded += got.loaded
            history[c] = prompt + want.output
    assert loaded > 0 and small.tier.stats()["pages_loaded"] > 0
    assert small.leaked_slots() == 0 and big.leaked_slots() == 0


def test_bench_smoke_runs_every_workload(tmp_path):
    from bench import bench_e2e

    out = tmp_path / "e2e.json"
    assert bench_e2e.main(["--smoke", "--out", str(out)]) == 0
    import json

    summary = json.loads(out.read_text())["summary"]
    assert summary["outputs_equal_kvtier_vs_device"] == 1.0
    assert summary["host_hit_fraction_pass2"] == 1.0
    assert {c["prefix_len"] for c in summary["fixed_cells"]} == {32, 64}


def test_bench_runs_split_by_workload_merge_into_one_summary(tmp_path):
    """A device machine runs at most 10 minutes a command: the workloads run apart and merge. A long run whose
    recompute pass reached its deadline before any prompt still summarizes (no speedup to report)."""
    import json

    from bench import bench_e2e

    a, b, merged = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    assert bench_e2e.main(["--smoke", "--workloads", "fixed,chat", "--out", str(a)]) == 0
    assert bench_e2e.main(["--smoke", "--workloads", "long", "--deadline-s", "0", "--out", str(b)]) == 0
    long_only = json.loads(b.read_text())["summary"]
    assert long_only["long_recompute_prompts"] == 0 and long_only["ttft_speedup_vs_recompute_p50"] is None
    assert bench_e2e.main(["--merge", str(a), str(b), "--out", str(merged)]) == 0
    res = json.loads(merged.read_text())
    s = res["summary"]
    assert [r["workloads"] for r in res["runs"]] == [["chat", "fixed"], ["long"]]
    assert s["outputs_equal_kvtier_vs_device"] == 1.0 and s["host_hit_fraction_pass2"] == 1.0
    assert {c["prefix_len"] for c in s["fixed_cells"]} == {32, 64} and "chat_ttft" in s
    assert set(s["copy_engine_h2d_gbps"]) == {"chat,fixed", "long"}
    with pytest.raises(SystemExit, match="more than one run"):
        bench_e2e.main(["--merge", str(a), str(a), "--out", str(tmp_path / "x.json")])
