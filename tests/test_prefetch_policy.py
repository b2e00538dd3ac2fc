"""The prefetch policy through SGLang's scheduler objects (kvtier.sglang.batch_server, the scheduler's order): a request
reaching an idle server with its prefix only on the SSD waits for its read under ``wait_complete`` and ``timeout``
(all of the prefix served from the SSD), is admitted at once under ``best_effort`` or without SGLang's gate
(``--enable-lmcache``), is admitted at its deadline when the read hangs, and never holds back the requests behind
it. The SSD is real; its reads are held at a gate the test opens (a disk that answers late)."""

import dataclasses
import random
import threading
import time

import pytest

pytest.importorskip("sglang")
pytest.importorskip("transformers")

import kvtier.sglang as ks  # noqa: E402

if ks.installed_sglang_version() != ks.SUPPORTED_SGLANG_VERSION:
    pytest.skip(f"needs sglang=={ks.SUPPORTED_SGLANG_VERSION}", allow_module_level=True)

import torch  # noqa: E402

from kvtier.config import TierConfig  # noqa: E402
from kvtier.e2e.model import PagedDecoder  # noqa: E402
from kvtier.sglang.batch_server import Arrival, BatchServer, Engine, EngineConfig  # noqa: E402
from kvtier.sglang.prefetch import PrefetchWaits  # noqa: E402
from kvtier.storage import SsdStore  # noqa: E402
from kvtier.tier.tasks import TaskKind, TaskStatus, TierTask  # noqa: E402
from kvtier.tier.tier_stats import TierHit  # noqa: E402
from tests.test_e2e_model import CONFIGS  # noqa: E402

PAGE = 16
PREFIX = 20 * PAGE  # over the 256-token prefetch_threshold


@pytest.fixture(scope="module")
def model():
    return PagedDecoder.from_config(CONFIGS["qwen3_mha"](), seed=0, dtype=torch.float32)


class HeldReads:
    """SsdStore.read waits at a gate until the test opens it (writes go through)."""

    def __init__(self, monkeypatch) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        real = SsdStore.read

        def read(store, *a, **kw):
            self.started.set()
            self.gate.wait(30)
            return real(store, *a, **kw)
        monkeypatch.setattr(SsdStore, "read", read)


def ssd_only_server(model, tmp_path, *, gate: bool = True, **tier) -> tuple[Engine, BatchServer, list]:
    """A kvtier_ssd server whose SSD alone holds a 20-page prefix (served once, written through, then the device
    tree and the CPU tier dropped)."""
    tier.setdefault("ssd_admission", "always")
    cfg = EngineConfig(mode="kvtier_ssd", kv_tokens=1024, page_size=PAGE, max_running_requests=4, max_context=512,
                       chunked_prefill_size=256, max_prefill_tokens=512, host_gb=1 / 64,
                       ssd_dir=str(tmp_path / "ssd"), ssd_gb=1 / 32, tier_overrides=tier, prefetch_gate=gate)
    engine = Engine(model, cfg)
    server = BatchServer(engine)
    rng = random.Random(0)
    prefix = [rng.randrange(1, 256) for _ in range(PREFIX)]
    server.run([Arrival(prefix + [rng.randrange(1, 256) for _ in range(9)], 2)])
    engine.wait_host_copies()
    engine.tier.flush_lower()
    engine.flush_device()
    engine.tier.reset()  # the device tree and the CPU tier are empty; the SSD keeps the prefix
    return engine, server, prefix


def served(server: BatchServer, prompts: list, *, open_after_steps: int, reads: HeldReads) -> list:
    """Serve ``prompts`` at once; open the read gate after ``open_after_steps`` steps (0: never while serving)."""
    def step(batch, srv) -> None:
        if open_after_steps and srv.steps >= open_after_steps:
            reads.gate.set()
    server.on_step = step
    server.steps = 0
    try:
        return server.run([Arrival(p, 2, tag=i) for i, p in enumerate(prompts)], timeout_s=60)
    finally:
        reads.gate.set()


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_an_idle_servers_request_waits_for_its_ssd_read_and_is_served_from_it(model, tmp_path, monkeypatch, policy):
    engine, server, prefix = ssd_only_server(model, tmp_path, prefetch_policy=policy, prefetch_timeout_base=30.0)
    reads = HeldReads(monkeypatch)
    (rec,) = served(server, [prefix + [7] * 5], open_after_steps=20, reads=reads)
    assert reads.started.is_set()
    assert rec.host_hit == PREFIX and rec.device_hit == 0  # all of the prefix loaded from the tiers
    counts = engine.cache.prefetch.counts
    assert (counts.waited, counts.completed, counts.timed_out) == (1, 1, 0)
    assert not engine.cache.prefetch.pending and engine.leaked_slots() == 0
    # the prefills were reported to the tier: admission by cost has what to weigh a read against
    assert engine.tier.stats()["ssd_prefill_1k_tokens_s"] is not None
    engine.close()


@pytest.mark.parametrize("how", ["best_effort", "no_gate"])
def test_without_a_waiting_policy_or_sglangs_gate_the_request_recomputes(model, tmp_path, monkeypatch, how):
    """What issue 50 found: on an idle server the request is admitted in the round it arrives and recomputes the
    prefix the SSD holds (its read goes on and lands in the CPU tier for later requests)."""
    tier = {"prefetch_policy": "best_effort"} if how == "best_effort" else {"prefetch_policy": "wait_complete"}
    engine, server, prefix = ssd_only_server(model, tmp_path, gate=how != "no_gate", **tier)
    reads = HeldReads(monkeypatch)
    (rec,) = served(server, [prefix + [7] * 5], open_after_steps=20, reads=reads)
    assert rec.host_hit == 0 and rec.device_hit == 0
    assert engine.cache.prefetch.counts.waited == 0
    engine.close()


def test_a_hung_read_admits_the_request_at_its_deadline_and_the_others_go_first(model, tmp_path, monkeypatch):
    engine, server, prefix = ssd_only_server(model, tmp_path, prefetch_policy="timeout", prefetch_timeout_base=0.3,
                                             prefetch_timeout_per_ki_token=0.0)
    reads = HeldReads(monkeypatch)
    rng = random.Random(1)
    other = [rng.randrange(1, 256) for _ in range(40)]
    recs = served(server, [prefix + [7] * 5, other], open_after_steps=0, reads=reads)
    by_tag = {r.tag: r for r in recs}
    waiting, behind = by_tag[0], by_tag[1]
    assert waiting.host_hit == 0  # the read never finished: recomputed
    assert behind.admitted_s < waiting.admitted_s  # admitted while the first one waited
    assert waiting.admitted_s - waiting.arrival_s >= 0.3
    counts = engine.cache.prefetch.counts
    assert (counts.waited, counts.timed_out, counts.completed) == (1, 1, 0)
    engine.close()


def test_an_idle_scheduler_blocks_for_the_read_instead_of_spinning(model, tmp_path, monkeypatch):
    """With a request waiting for its read and none holding device KV, a scheduler round (``check_hicache_events``)
    blocks up to ``prefetch_idle_poll_s`` for the read, returns as soon as the read's IO does, and does not block
    while a request holds device KV (a batch to run)."""
    engine, server, prefix = ssd_only_server(model, tmp_path, prefetch_policy="wait_complete", prefetch_idle_poll_s=0.3)
    rng = random.Random(2)
    server.run([Arrival([rng.randrange(1, 256) for _ in range(40)], 2)])  # a device node to lock later
    reads = HeldReads(monkeypatch)
    cache = engine.cache
    try:
        server.submit(Arrival(prefix + [7] * 5, 2))
        (req,) = server.waiting
        for _ in range(50):  # the read gets its CPU blocks in a round and reaches the (held) disk
            cache.check_hicache_events()
            if reads.started.wait(0.05):
                break
        assert reads.started.is_set() and not cache.check_prefetch_progress(req.cache_request_handle)

        def round_s() -> float:
            t = time.perf_counter()
            cache.check_hicache_events()
            return time.perf_counter() - t

        assert 0.25 <= round_s() < 2.0  # blocked for the read, up to the bound
        node = next(iter(cache.root_node.children.values()))
        cache.inc_lock_ref(node)  # a request holds device KV: the round must not block
        assert round_s() < 0.1
        cache.dec_lock_ref(node)
        cache.tier_config = dataclasses.replace(cache.tier_config, prefetch_idle_poll_s=20.0)
        threading.Timer(0.2, reads.gate.set).start()
        assert round_s() < 5.0  # returned when the read did, not at the bound
        assert cache.check_prefetch_progress(req.cache_request_handle)  # and the read was finalized
    finally:
        reads.gate.set()
    server.run([], timeout_s=30)
    assert engine.cache.prefetch.counts.completed == 1
    engine.close()


def _read(status=TaskStatus.INFLIGHT, pages: int = 0) -> TierTask:
    return TierTask(1, TaskKind.READ, pages, status=status)


def test_the_policy_alone():
    """Every policy's verdict on one request: a small read is not waited for, a failed one ends the wait with
    nothing loaded, a finished one reports where its tokens start."""
    now = [0.0]
    cfg = TierConfig(prefetch_policy="timeout", prefetch_timeout_base=1.0, prefetch_timeout_per_ki_token=0.5)
    w = PrefetchWaits(cfg, clock=lambda: now[0])
    read = _read(pages=64)
    assert w.start("a", TierHit(2, 64, read))
    assert not w.ready("a")  # the deadline starts here: 1 + 0.5 * 1024 / 1024 s
    now[0] = 1.49
    assert not w.ready("a")
    now[0] = 1.5
    assert w.ready("a") and w.counts.timed_out == 1 and w.pop_loaded("a") == (0, None)
    assert not w.start("b", TierHit(0, 8, _read(pages=8)))  # 128 tokens < the 256-token threshold
    assert w.start("c", TierHit(0, 0, read))  # a count not known yet is waited for
    read.status, read.num_pages = TaskStatus.DONE, 64
    assert w.ready("c") and w.pop_loaded("c") == (1024, 0) and w.pop_loaded("c") == (0, None)
    failed = _read()
    assert w.start("d", TierHit(1, 16, failed))
    failed.status = TaskStatus.FAILED
    assert w.ready("d") and w.counts.failed == 1 and w.pop_loaded("d") == (0, None)
    forever = PrefetchWaits(TierConfig(prefetch_policy="wait_complete"), clock=lambda: now[0])
    assert forever.start("e", TierHit(0, 32, _read()))
    now[0] = 1e9
    assert not forever.ready("e") and forever.pending
    forever.drop("e")
    assert not forever.pending and forever.counts.dropped == 1
    assert not PrefetchWaits(TierConfig(prefetch_policy="best_effort")).start("f", TierHit(0, 32, _read()))


def test_ranks_admit_a_timed_out_request_together():
    """Several ranks wait for one read by their own clocks: rank 1's passes the deadline first, and both admit the
    request in that same round, through ``agree_late`` (each rank asks it at the same point; any late rank decides).
    Without it rank 1 admits the request a round before rank 0, and their batches differ."""
    clocks = [[0.0], [0.0]]
    cfg = TierConfig(prefetch_policy="timeout", prefetch_timeout_base=1.0, prefetch_timeout_per_ki_token=0.0)
    waits = [PrefetchWaits(cfg, clock=lambda r=r: clocks[r][0]) for r in range(2)]
    barrier, lates = threading.Barrier(2), [False, False]

    def agree_late(rank: int, late: bool) -> bool:
        lates[rank] = late
        barrier.wait()
        out = any(lates)
        barrier.wait()
        return out
    for r, w in enumerate(waits):
        w.agree_late = lambda late, r=r: agree_late(r, late)
        assert w.start("a", TierHit(0, 64, _read(pages=64)))

    def round_(times: tuple) -> list[bool]:
        for r, t in enumerate(times):
            clocks[r][0] = t
        out = [False, False]

        def ask(r: int) -> None:
            out[r] = waits[r].ready("a")
        threads = [threading.Thread(target=ask, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        return out
    assert round_((0.0, 0.0)) == [False, False]  # the deadline starts (no agreement asked: the same round)
    assert round_((0.5, 0.9)) == [False, False]
    assert round_((0.9, 1.2)) == [True, True]  # rank 1 is late: both admit
    assert [w.counts.timed_out for w in waits] == [1, 1] and not any(w.pending for w in waits)


def test_the_start_up_log_says_whether_a_request_waits():
    import logging
    import types

    ssd = dict(ssd_cache_gb=1.0, ssd_cache_dir="/tmp/x")
    gate, no_gate = types.SimpleNamespace(enable_lmcache=True), types.SimpleNamespace(enable_lmcache=False)
    assert ks.prefetch_gate_note(TierConfig(), no_gate) is None  # no lower tier: nothing to wait for
    level, text = ks.prefetch_gate_note(TierConfig(**ssd), no_gate)
    assert level == logging.WARNING and "acts as best_effort" in text and "--enable-lmcache" in text
    level, text = ks.prefetch_gate_note(TierConfig(**ssd), gate)
    assert level == logging.INFO and "held back" in text
    level, text = ks.prefetch_gate_note(TierConfig(prefetch_policy="best_effort", **ssd), no_gate)
    assert level == logging.INFO and "never waits" in text


def test_an_idle_servers_request_waits_for_its_prefix_in_the_shared_store(model, tmp_path):
    """The prefix only in the remote store (a real mooncake_master; the device tree and the CPU tier dropped, the
    values stay in this instance's segment): the request waits for the probe and the get, and is served from them."""
    from tests.mooncake_master import Master

    master = Master(str(tmp_path))
    try:
        cfg = EngineConfig(mode="kvtier", kv_tokens=1024, page_size=PAGE, max_running_requests=4, max_context=512,
                           chunked_prefill_size=256, max_prefill_tokens=512, host_gb=1 / 64,
                           tier_overrides=dict(remote_backend="mooncake", remote_master=master.addr,
                                               remote_segment_gb=1 / 16, remote_admission="always",
                                               prefetch_policy="wait_complete"))
        engine = Engine(model, cfg)
        server = BatchServer(engine)
        rng = random.Random(0)
        prefix = [rng.randrange(1, 256) for _ in range(PREFIX)]
        server.run([Arrival(prefix + [3] * 9, 2)])
        engine.wait_host_copies()
        engine.tier.flush_lower()
        engine.flush_device()
        engine.tier.reset()  # the store keeps the prefix
        assert engine.tier.stats()["remote_blocks_put"] == PREFIX // PAGE
        (rec,) = server.run([Arrival(prefix + [7] * 5, 2)], timeout_s=60)
        assert rec.host_hit == PREFIX and rec.device_hit == 0
        assert engine.cache.prefetch.counts.completed == 1
        assert engine.leaked_slots() == 0
        engine.close()
    finally:
        master.kill()
