"""Continuous batching through SGLang's own scheduler objects on the CPU (kvtier.sglang.batch_server): several
requests in flight in every mode that runs without CUDA, loads admitted by SGLang's PrefillAdder, a request matched
again while another's load is in flight; afterwards nothing held and nothing leaked, and every output equal to a
replay of the same prompts one at a time over a warm device cache."""

import random

import pytest

pytest.importorskip("sglang")
pytest.importorskip("transformers")

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

import torch  # noqa: E402

from kvtier.e2e.model import PagedDecoder  # noqa: E402
from kvtier.sglang.batch_server import CUDA_MODES, MODES, Arrival, BatchServer, Engine, EngineConfig  # noqa: E402
from kvtier.tier.executor import DeferredExecutor  # noqa: E402
from kvtier.tier.observers import TierObserver  # noqa: E402
from tests.test_e2e_model import CONFIGS  # noqa: E402

PAGE = 16
CPU_MODES = [m for m in MODES if m not in CUDA_MODES]


@pytest.fixture(scope="module")
def model():
    return PagedDecoder.from_config(CONFIGS["qwen3_mha"](), seed=0, dtype=torch.float32)


def prompts(seed: int = 0) -> list:
    """Eight prompts: six share a 48-token prefix (three pages), two share nothing."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 256) for _ in range(48)]
    return ([shared + [rng.randrange(1, 256) for _ in range(rng.randrange(5, 60))] for _ in range(6)]
            + [[rng.randrange(1, 256) for _ in range(rng.randrange(30, 90))] for _ in range(2)])


def config(mode: str, tmp_path) -> EngineConfig:
    # 4 requests at most in flight, chunks of 64 tokens, 96 prefill tokens a batch: requests are chunked, and
    # several ride one batch; a host pool of 64 pages
    return EngineConfig(mode=mode, kv_tokens=768, page_size=PAGE, max_running_requests=4, max_context=256,
                        chunked_prefill_size=64, max_prefill_tokens=96, host_gb=64 * 16 * 256 / 2**30,
                        ssd_dir=str(tmp_path / "ssd"), ssd_gb=1 / 256,
                        tier_overrides={"ssd_admission": "always"} if mode == "kvtier_ssd" else {})


class _Loads(TierObserver):
    """Counts the loads that completed (the tier's stats count those issued and failed)."""

    def __init__(self) -> None:
        self.done = 0

    def transfer_done(self, transfer) -> None:
        self.done += transfer.tier == "cpu" and transfer.op == "load"


def replay(model, ps: list) -> list:
    """Each prompt served alone, over a device cache warmed by the same prompts (SGLang's RadixCache)."""
    engine = Engine(model, EngineConfig(mode="radix", kv_tokens=2048, page_size=PAGE, max_context=256))
    server = BatchServer(engine)
    for p in ps:
        server.run([Arrival(p, 5)])
    out = [server.run([Arrival(p, 5)])[0].output for p in ps]
    engine.close()
    return out


@pytest.mark.parametrize("mode", CPU_MODES)
def test_requests_in_flight_are_served_as_one_at_a_time_and_leave_nothing_behind(model, mode, tmp_path):
    ps = prompts()
    want = replay(model, ps)
    engine = Engine(model, config(mode, tmp_path))
    server = BatchServer(engine, verify_every=1)
    tier = engine.tier
    loads = _Loads()
    rematched_in_flight = [0]
    if tier is not None:
        if mode != "kvtier_layerwise":  # (on the CPU a layer's event is recorded when the copy is issued)
            tier.executor = DeferredExecutor()  # copies run when the forward (or a wait) needs them: loads in flight
        tier.add_observer(loads)
        match = engine.cache.match_prefix

        def spy(params):  # a request matched while an earlier load is issued and not yet completed
            s = tier.stats()
            rematched_in_flight[0] += s["loads"] - s["failed_loads"] - loads.done > 0
            return match(params)
        engine.cache.match_prefix = spy
    in_flight = []
    server.on_step = lambda batch, srv: in_flight.append(len(srv.running.reqs) + len(batch.reqs if batch else []))

    first = server.run([Arrival(p, 5, tag=i) for i, p in enumerate(ps)])  # pass 1: every request at once
    assert [r.output for r in sorted(first, key=lambda r: r.tag)] == want
    engine.flush_device()
    if mode == "kvtier_ssd":  # the SSD alone holds the prefixes: matches promote them while requests wait
        tier.flush_lower()
        tier.evict(1 << 20)
    second = server.run([Arrival(p, 5, tag=i) for i, p in enumerate(ps)])  # pass 2: the device tree empty
    assert [r.output for r in sorted(second, key=lambda r: r.tag)] == want
    assert max(in_flight) >= 3  # several requests in flight at once
    if mode in ("kvtier", "kvtier_layerwise"):
        # every page of every prompt a hit: loaded from the host by PrefillAdder (init_load_back), or on the device
        # from a load admitted earlier in the same pass (requests matched again after it)
        assert all(r.device_hit + r.host_hit >= (r.prompt_len - 1) // PAGE * PAGE for r in second)
        assert sum(r.host_hit for r in second) >= 48 and rematched_in_flight[0] > 0
        assert server.verified_pages >= 5 and server.loaded_mismatches == 0
    if mode == "kvtier_ssd":
        assert tier.stats()["promotions"] > 0
    if tier is not None:
        engine.cache.wait_all()
        s = tier.stats()
        assert s["inflight_tasks"] == 0 and s["pages_locked"] == 0 and s["held_cpu_blocks"] == 0
        assert s["failed_loads"] == s["failed_stores"] == 0
    elif mode != "recompute":
        assert sum(r.device_hit for r in second) >= 5 * 48  # the tree refilled within pass 2
    assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
    assert engine.leaked_slots() == 0
    engine.close()


def test_the_loaded_kv_check_finds_host_bytes_that_changed(model, tmp_path):
    """The harness's check of loaded pages against stored ones is not blind: host blocks altered between the store
    and the load are found."""
    ps = prompts()
    engine = Engine(model, config("kvtier", tmp_path))
    server = BatchServer(engine, verify_every=1)
    server.run([Arrival(p, 5, tag=i) for i, p in enumerate(ps)])
    engine.flush_device()
    engine.tier.pool.host.view(torch.uint8).add_(1)  # every host byte changed
    server.run([Arrival(p, 5, tag=i) for i, p in enumerate(ps)])
    assert server.verified_pages >= 5 and server.loaded_mismatches == server.verified_pages
    engine.close()
