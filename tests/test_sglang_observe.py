"""The SGLang backend's observability: kvtier's CPU-tier stores and evictions, SSD writes and evictions and remote
puts in SGLang's KV event stream (a real ZMQ socket, SGLang's own publisher and message format), with SGLang's block
hashes; metrics on with --enable-metrics."""

from __future__ import annotations

import atexit
import socket
import time

import numpy as np
import pytest

pytest.importorskip("sglang")
pytest.importorskip("zmq")

import msgspec  # noqa: E402
import zmq  # noqa: E402
from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher  # noqa: E402

from tests.sglang_helpers import build, flush_device, serve  # noqa: E402

PAGE = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publish_and_receive(events: list) -> list:
    """Publish ``events`` through SGLang's ZmqEventPublisher on loopback; what a subscriber decodes (bounded:
    at most 50 publish attempts, 10 s)."""
    port = _free_port()
    pub = ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{port}", bind=True)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    try:
        deadline = time.monotonic() + 10
        for _ in range(50):  # a PUB drops what it sends before the subscription arrives: resend until one lands
            pub.publish(KVEventBatch(ts=time.time(), events=events))
            if sub.poll(200):
                _topic, _seq, payload = sub.recv_multipart()
                return decoder.decode(payload).events
            assert time.monotonic() < deadline, "no KV event batch arrived"
        raise AssertionError("no KV event batch arrived")
    finally:
        sub.close(linger=0)
        pub.shutdown()
        # SGLang registers shutdown with atexit as well; a second one at exit finds its stop marker unread (the
        # thread is gone), waits 1 s and warns "Queue still has 1 items": once per publisher, after the summary
        atexit.unregister(pub.shutdown)


def _hashes(events, kind: str, medium: str) -> list:
    return [h for e in events if type(e).__name__ == kind and e.medium == medium for h in e.block_hashes]


def test_host_stores_and_evictions_reach_the_kv_event_stream_with_sglangs_hashes():
    # 8 host blocks of one page: a second 8-page prompt evicts the first's pages from the host
    s = build(page_size=PAGE, kv_size=64, host_blocks_kb=4, kv_events=True)  # 8 blocks of 512 bytes
    assert s.cache.tier.pool.num_blocks == 8
    a = np.arange(1, 8 * PAGE + 1)
    serve(s, a)
    s.cache.wait_all()  # the host store completes: its pages enter the CPU index
    events = _publish_and_receive(s.cache.take_events())
    gpu = _hashes(events, "BlockStored", "GPU")
    cpu = _hashes(events, "BlockStored", "CPU_PINNED")
    assert len(gpu) == 8 and cpu == gpu  # the same pages, the same (SGLang's) hashes
    stored = [e for e in events if type(e).__name__ == "BlockStored" and e.medium == "CPU_PINNED"]
    assert [t for e in stored for t in e.token_ids] == a.tolist()
    assert stored[0].parent_block_hash is None

    flush_device(s)  # the device drops them; the host keeps them
    b = np.arange(1000, 1000 + 8 * PAGE)
    serve(s, b)
    s.cache.wait_all()
    events = _publish_and_receive(s.cache.take_events())
    assert sorted(_hashes(events, "BlockRemoved", "GPU")) == sorted(gpu)
    assert sorted(_hashes(events, "BlockRemoved", "CPU_PINNED")) == sorted(gpu)  # b's store evicted all of a
    assert len(_hashes(events, "BlockStored", "CPU_PINNED")) == 8


def test_namespaced_host_events_match_the_device_events():
    s = build(page_size=PAGE, kv_size=64, kv_events=True)
    serve(s, np.arange(1, 4 * PAGE + 1), cache_salt="tenant-a", extra_key="lora-x")
    s.cache.wait_all()
    events = s.cache.take_events()
    gpu = _hashes(events, "BlockStored", "GPU")
    assert len(gpu) == 4 and _hashes(events, "BlockStored", "CPU_PINNED") == gpu
    salts = {e.cache_salt for e in events if type(e).__name__ == "BlockStored"}
    assert salts == {"tenant-a"}


def test_no_host_events_without_kv_events():
    s = build(page_size=PAGE, kv_size=64)
    serve(s, np.arange(1, 4 * PAGE + 1))
    s.cache.wait_all()
    assert s.cache.take_events() == []
    assert len(s.cache.tier.observers) == 1  # the transfer log only


def _pages(events, medium: str) -> list:
    """(hash, the hash it links to, tokens) of every page ``BlockStored`` on ``medium`` published, in order."""
    out = []
    for e in events:
        if type(e).__name__ == "BlockStored" and e.medium == medium:
            parent = e.parent_block_hash
            for k, h in enumerate(e.block_hashes):
                out.append((h, parent, tuple(e.token_ids[k * e.block_size:(k + 1) * e.block_size]), e.cache_salt))
                parent = h
    return out


def _settle(s) -> None:
    """Every store finalized and every lower-tier write accounted."""
    s.cache.wait_all()
    s.cache.tier.flush_lower()
    if s.cache.tier.lower_tier("remote") is not None:
        s.cache.tier.lower_tier("remote").drain(wait=True)


def test_ssd_writes_and_evictions_reach_the_kv_event_stream_as_disk(tmp_path):
    # 16 host blocks (an SSD write queue of 8, a prefix's worth), 128 SSD slots (1 MiB of 8 KiB slots),
    # write_through: every block reaches the SSD
    s = build(page_size=PAGE, kv_size=64, host_blocks_kb=8, kv_events=True, ssd_dir=str(tmp_path))
    assert s.cache.tier.lower_tier("ssd").medium.index.num_slots == 128
    a = np.arange(1, 8 * PAGE + 1)
    serve(s, a)
    _settle(s)  # a's CPU blocks are free to reuse once written
    flush_device(s)
    serve(s, np.arange(500, 500 + 8 * PAGE), cache_salt="tenant-a", extra_key="lora-x")  # a namespaced prefix
    _settle(s)
    events = _publish_and_receive(s.cache.take_events())
    cpu, disk = _pages(events, "CPU_PINNED"), _pages(events, "DISK")
    assert len(disk) == 16 and disk == cpu  # SGLang's hashes, parents, tokens and salts, as the CPU blocks had
    assert disk[0][1] is None and [t for p in disk[:8] for t in p[2]] == a.tolist()
    assert {p[3] for p in disk[8:]} == {"tenant-a"}
    assert _hashes(events, "BlockStored", "GPU") == [p[0] for p in cpu]

    for i in range(14):  # 14 more prefixes of 8 blocks: 128 slots held, then the 8 oldest (a's) are evicted
        flush_device(s)
        serve(s, np.arange(1000 + 100 * i, 1000 + 100 * i + 8 * PAGE))
        _settle(s)
        events = _publish_and_receive(s.cache.take_events())
        assert len(_pages(events, "DISK")) == 8 and not _hashes(events, "BlockRemoved", "DISK")
    flush_device(s)
    serve(s, np.arange(9000, 9000 + 8 * PAGE))
    _settle(s)
    events = _publish_and_receive(s.cache.take_events())
    assert s.cache.tier.stats()["ssd_blocks_evicted"] == 8
    assert sorted(_hashes(events, "BlockRemoved", "DISK")) == sorted(p[0] for p in disk[:8])


def test_remote_puts_reach_the_kv_event_stream_as_external(mooncake_master):
    s = build(page_size=PAGE, kv_size=64, kv_events=True, remote_master=mooncake_master.addr)
    try:
        serve(s, np.arange(1, 8 * PAGE + 1), cache_salt="tenant-b")
        _settle(s)
        events = _publish_and_receive(s.cache.take_events())
        cpu, external = _pages(events, "CPU_PINNED"), _pages(events, "EXTERNAL")
        assert len(external) == 8 and external == cpu
        assert s.cache.tier.stats()["remote_blocks_put"] == 8
    finally:
        s.cache.tier.destroy()
