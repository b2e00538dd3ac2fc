"""Observability: Prometheus metrics scraped over real HTTP and through the multiprocess directory SGLang collects,
the transfer log lines, the start-up line, and the observer hooks (blocks entering and leaving the CPU index)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from kvtier.observe.attach import attach
from kvtier.observe.transfer_log import LOGGER_NAME
from kvtier.tier.observers import TierObserver
from tests.test_tier_ssd import make_ssd_tier
from tests.tier_helpers import TINY, make_tier, page_slots

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

P = TINY.page_size
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int64)


def _samples(text: str) -> dict:
    """{(sample name, frozenset of its labels): value} of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return _samples(r.read().decode())


def _store_load_evict(tier) -> None:
    """A store of 3 pages, a lookup and a load of them, then a store of 3 other pages into a 4-block pool: the first
    prefix's last 2 pages are evicted (LRU, leaves first)."""
    a, b = _tokens(3 * P, seed=1), _tokens(3 * P, seed=2)
    tier.wait(tier.store(a, None, page_slots(0, 3, P)))
    assert tier.lookup(a, None) == 3
    tier.wait(tier.load(a, None, page_slots(10, 3, P)))
    tier.wait(tier.store(b, None, page_slots(3, 3, P)))
    assert tier.lookup(np.concatenate([b, a]), None) == 3  # b held; a is another prefix: 3 pages miss


def test_metrics_are_scraped_over_http_with_the_counts_of_a_store_load_sequence():
    tier = make_tier(num_blocks=4)
    obs = attach(tier, dataclasses.replace(tier.config, metrics_port=0), labels={"tp_rank": "0"})
    try:
        _store_load_evict(tier)
        m = _scrape(obs.port)
        block = tier.pool.block_bytes
        cpu = dict(tp_rank="0", tier="cpu")
        assert _value(m, "kvtier_lookups_total", tp_rank="0") == 2
        assert _value(m, "kvtier_lookup_hit_tokens_total", **cpu) == 3 * P + 3 * P
        assert _value(m, "kvtier_lookup_miss_tokens_total", **cpu) == 3 * P
        assert _value(m, "kvtier_transfer_tokens_total", op="store", **cpu) == 6 * P
        assert _value(m, "kvtier_transfer_tokens_total", op="load", **cpu) == 3 * P
        assert _value(m, "kvtier_transfer_bytes_total", op="store", **cpu) == 6 * block
        assert _value(m, "kvtier_transfer_bytes_total", op="load", **cpu) == 3 * block
        assert _value(m, "kvtier_evicted_tokens_total", **cpu) == 2 * P
        assert _value(m, "kvtier_pool_used_bytes", **cpu) == 4 * block
        assert _value(m, "kvtier_pool_capacity_bytes", **cpu) == 4 * block
        assert _value(m, "kvtier_transfer_duration_seconds_count", op="store", **cpu) == 2
        assert _value(m, "kvtier_transfer_duration_seconds_count", op="load", **cpu) == 1
        assert _value(m, "kvtier_inflight_tasks", tp_rank="0") == 0
        # counters only grow between scrapes; a second scrape after one more lookup sees it
        tier.lookup(_tokens(2 * P, seed=9), None)
        m2 = _scrape(obs.port)
        assert _value(m2, "kvtier_lookups_total", tp_rank="0") == 3
        assert _value(m2, "kvtier_lookup_miss_tokens_total", **cpu) == 5 * P
        assert not any(name.startswith("kvtier_") and ("tier", "ssd") in labels for name, labels in m2)
    finally:
        obs.close()
        tier.destroy()


def test_ssd_series_appear_with_an_ssd_tier(tmp_path):
    tier = make_ssd_tier(tmp_path, num_blocks=6)  # the SSD write queue holds half the pool: the 3 blocks
    obs = attach(tier, dataclasses.replace(tier.config, metrics_port=0))
    try:
        toks = _tokens(3 * P)
        tier.wait(tier.store(toks, None, page_slots(0, 3, P)))
        tier.flush_lower()
        tier.poll()
        m = _scrape(obs.port)
        assert _value(m, "kvtier_transfer_tokens_total", tier="ssd", op="store") == 3 * P
        assert _value(m, "kvtier_transfer_bytes_total", tier="ssd", op="store") == 3 * tier.pool.block_bytes
        assert _value(m, "kvtier_transfer_duration_seconds_count", tier="ssd", op="store") >= 1
        assert _value(m, "kvtier_integrity_failures_total", tier="ssd") == 0
        assert _value(m, "kvtier_pool_used_bytes", tier="ssd") == 3 * tier.pool.block_bytes
    finally:
        obs.close()
        tier.destroy()


_MULTIPROC_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from kvtier.observe.attach import attach
from tests.test_observe import _store_load_evict
from tests.tier_helpers import make_tier
tier = make_tier(num_blocks=4)
obs = attach(tier, labels={{"tp_rank": sys.argv[1]}}, multiprocess=True)
_store_load_evict(tier)
obs.close()  # a last sync into the directory
print(json.dumps({{"block_bytes": tier.pool.block_bytes}}))
"""


def test_metrics_reach_sglangs_multiprocess_collection_directory(tmp_path):
    """Two processes (two TP ranks) write into one PROMETHEUS_MULTIPROC_DIR, as SGLang's schedulers do; a
    MultiProcessCollector over it (what SGLang's /metrics runs) sees both ranks' series."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    code = _MULTIPROC_CHILD.format(root=ROOT)
    outs = [subprocess.run([sys.executable, "-c", code, str(rank)], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=300) for rank in (0, 1)]
    for out in outs:
        assert out.returncode == 0, out.stderr[-3000:]
    block = json.loads(outs[0].stdout.strip().splitlines()[-1])["block_bytes"]
    assert any(f.endswith(".db") for f in os.listdir(tmp_path))
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    m = _samples(generate_latest(registry).decode())
    for rank in ("0", "1"):
        cpu = dict(tp_rank=rank, tier="cpu")
        assert _value(m, "kvtier_transfer_tokens_total", op="store", **cpu) == 6 * P
        assert _value(m, "kvtier_transfer_tokens_total", op="load", **cpu) == 3 * P
        assert _value(m, "kvtier_evicted_tokens_total", **cpu) == 2 * P
        assert _value(m, "kvtier_transfer_duration_seconds_count", op="store", **cpu) == 2
    gauges = [v for (name, labels), v in m.items() if name == "kvtier_pool_used_bytes"]
    assert gauges and all(v == 4 * block for v in gauges)


def test_one_log_line_per_completed_transfer(caplog):
    tier = make_tier(num_blocks=4)
    attach(tier)  # log_transfers defaults to true
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        _store_load_evict(tier)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]
    assert len(lines) == 3, lines
    assert lines[0].startswith("kvtier: cpu store (GPU->CPU): 3 pages, ")
    assert lines[1].startswith("kvtier: cpu load (CPU->GPU): 3 pages, ")
    assert " GB/s)" in lines[1]  # CPU copies are timed by the wall clock
    tier2 = make_tier(num_blocks=4)
    attach(tier2, dataclasses.replace(tier2.config, log_transfers=False))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        _store_load_evict(tier2)
    assert not [r for r in caplog.records if r.name == LOGGER_NAME]


def test_the_startup_line_states_the_configuration_in_force(caplog):
    with caplog.at_level(logging.INFO, logger="kvtier.tier.manager"):
        tier = make_tier(num_blocks=4, layout="page_first", mode="direct")
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvtier: host pool")]
    assert len(line) == 1
    want = (f"host pool {4 * tier.pool.block_bytes / 2**30:.2f} GiB (4 blocks of {P} tokens", "page_first",
            "2 layers on cpu", f"page {P} tokens", "transfer direct", "finalize auto")
    for part in want:
        assert part in line[0], (part, line[0])


class _Recorder(TierObserver):
    def __init__(self):
        self.held: dict[int, tuple] = {}  # block id -> its tokens
        self.events = []

    def blocks_entered(self, block_ids, tokens, ns, positions):
        B = P
        for b, pos in zip(block_ids.tolist(), positions.tolist()):
            assert b not in self.held
            self.held[b] = tuple(tokens[pos * B:(pos + 1) * B].tolist())
        self.events.append(("entered", len(block_ids)))

    def blocks_evicted(self, block_ids):
        for b in block_ids.tolist():
            del self.held[b]
        self.events.append(("evicted", len(block_ids)))

    def cleared(self):
        self.held.clear()
        self.events.append(("cleared", 0))


def test_observers_see_every_block_enter_and_leave_the_index():
    tier = make_tier(num_blocks=4)
    rec = _Recorder()
    tier.add_observer(rec)
    _store_load_evict(tier)
    assert rec.events == [("entered", 3), ("evicted", 2), ("entered", 3)]
    # what the observer holds is what the index holds: a's first page (LRU evicts leaves first) and b's three
    a, b = _tokens(3 * P, seed=1), _tokens(3 * P, seed=2)
    want = [tuple(a[:P].tolist())] + [tuple(b[i * P:(i + 1) * P].tolist()) for i in range(3)]
    assert sorted(rec.held.values()) == sorted(want)
    assert len(rec.held) == tier.pool.num_used
    tier.reset()
    assert rec.events[-1] == ("cleared", 0) and not rec.held


def test_an_observer_that_raises_is_dropped_and_the_tier_carries_on(caplog):
    class Broken(TierObserver):
        calls = 0

        def transfer_done(self, transfer):
            Broken.calls += 1
            raise RuntimeError("observer bug")

    tier = make_tier(num_blocks=4)
    tier.add_observer(Broken())
    with caplog.at_level(logging.ERROR, logger="kvtier.tier.manager"):
        _store_load_evict(tier)
    assert Broken.calls == 1
    assert any("observer" in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)
    assert tier.stats()["pages_loaded"] == 3


def test_a_metrics_port_in_use_is_a_clear_error():
    import socket

    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen(1)
    port = s.getsockname()[1]
    tier = make_tier(num_blocks=4)
    try:
        with pytest.raises(ValueError, match=f"metrics_port {port}.*cannot serve on port {port}"):
            attach(tier, dataclasses.replace(tier.config, metrics_port=port))
    finally:
        s.close()
        tier.destroy()


def test_close_takes_the_observers_off_and_a_second_attach_counts_once():
    """close() left the transfer log and the metrics on the tier (and so did a failed attach): attached again,
    every transfer was logged and counted twice."""
    tier = make_tier(num_blocks=4)
    first = attach(tier, dataclasses.replace(tier.config, metrics_port=0))
    first.close()
    first.close()  # idempotent
    assert tier.observers == ()
    obs = attach(tier, dataclasses.replace(tier.config, metrics_port=0))
    tier.wait(tier.store(_tokens(2 * P), None, page_slots(0, 2, P)))
    assert len(tier.observers) == 2
    assert _value(_scrape(obs.port), "kvtier_transfer_tokens_total", tier="cpu", op="store") == 2 * P
    obs.close()
    tier.destroy()


def test_metrics_port_zero_is_a_free_port_on_every_rank_and_past_65535_is_refused():
    """Port 0 plus the rank offset bound rank 3 to port 3; 65535 plus one raised an uncaught OverflowError."""
    tier = make_tier(num_blocks=4)
    obs = attach(tier, dataclasses.replace(tier.config, metrics_port=0), port_offset=3)
    assert obs.port > 1024
    obs.close()
    with pytest.raises(ValueError, match="metrics_port 65535 \\(\\+1 for this rank\\) is past 65535"):
        attach(tier, dataclasses.replace(tier.config, metrics_port=65535), port_offset=1)
    assert tier.observers == ()
    tier.destroy()


# --- warnings that say what to do: stores dropped for lack of room ---

ROOM_LOGGER = "kvtier.room"


def _room_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ROOM_LOGGER and r.levelno == logging.WARNING]


def test_a_host_pool_smaller_than_one_prefix_says_to_raise_cpu_cache_gb(caplog):
    tier = make_tier(num_blocks=4)
    caplog.set_level(logging.WARNING, logger=ROOM_LOGGER)
    task = tier.wait(tier.store(_tokens(6 * P), None, page_slots(0, 6, P)))
    assert task.num_pages == 4 and tier.stats()["pages_store_dropped"] == 2
    (line,) = _room_lines(caplog)
    assert "fewer than one request's prefix (6 blocks)" in line and "2 blocks of such stores" in line
    need = 6 * tier.pool.block_bytes / 2**30
    assert f"Raise cpu_cache_gb above {need:.3g}" in line


def test_stores_dropped_for_lack_of_room_warn_once_per_interval_with_a_count(caplog):
    from kvtier.tier.executor import DeferredExecutor

    ex = DeferredExecutor()
    tier = make_tier(num_blocks=4, executor=ex)
    now = [1000.0]
    tier.room_advice.clock = lambda: now[0]
    caplog.set_level(logging.WARNING, logger=ROOM_LOGGER)
    inflight = tier.store(_tokens(4 * P, seed=1), None, page_slots(0, 4, P))  # owns every block until it lands

    def dropped_store(seed: int) -> None:
        t = tier.store(_tokens(2 * P, seed=seed), None, page_slots(4, 2, P))
        assert t.num_pages == 0

    dropped_store(2)
    assert len(_room_lines(caplog)) == 1 and "2 blocks of host-tier stores were dropped for lack of room" in \
        _room_lines(caplog)[0] and "Raise cpu_cache_gb" in _room_lines(caplog)[0]
    now[0] += 30
    dropped_store(3)
    dropped_store(4)
    assert len(_room_lines(caplog)) == 1  # within the interval: counted, not logged
    now[0] += 31
    dropped_store(5)
    lines = _room_lines(caplog)
    assert len(lines) == 2 and "6 blocks of host-tier stores were dropped for lack of room in the last 61 s" in lines[1]
    assert tier.stats()["pages_store_dropped"] == 8
    tier.wait(inflight)


def test_ssd_writes_dropped_without_a_free_slot_say_to_raise_ssd_cache_gb(tmp_path, caplog):
    tier = make_ssd_tier(tmp_path, ssd_slots=4)
    caplog.set_level(logging.WARNING, logger=ROOM_LOGGER)
    try:
        tier.wait(tier.store(_tokens(6 * P), None, page_slots(0, 6, P)))  # write-through: 6 blocks, 4 slots
        tier.flush_lower()
        assert tier.stats()["ssd_blocks_write_dropped"] == 2
        (line,) = _room_lines(caplog)
        assert "2 blocks of SSD writes were dropped" in line and "Raise ssd_cache_gb" in line
    finally:
        tier.destroy()


def test_bench_observe_smoke_alternates_the_observed_instance(tmp_path):
    """The overhead bench on the CPU: for each set of observers each repeat observes the other instance, and every
    figure is a ratio of paired cycles."""
    out = tmp_path / "observe.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_observe.py"), "--smoke", "--out",
                        str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"metrics", "log", "metrics+log"}
    for runs in res["runs"].values():
        assert [run["observed_instance"] for run in runs] == [0, 1, 0, 1]
    assert res["log_lines"] > 0 and all(v > 0 for r in res["observed_over_bare"].values() for v in r.values())
    assert res["metrics_worst_ratio"] == max(res["observed_over_bare"]["metrics"][k] for k in ("issue_us", "lookup_us"))
