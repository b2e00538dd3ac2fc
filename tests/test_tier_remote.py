"""The remote tier behind KVTier, against a real ``mooncake_master`` on loopback: two processes sharing a prefix,
the master unreachable at start, killed and hung mid-run, a peer holding the values hung then killed, keys gone
between probe and get, forged values, and the key scheme. Every wait is bounded (``remote_timeout_s``) and checked
against the wall clock."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from kvtier.config import TierConfig
from kvtier.geometry import KVGeometry
from kvtier.index import Namespace, page_hashes
from kvtier.storage.aligned_io import aligned
from kvtier.storage.block_format import ALIGN, BlockHeader, pack_block_header, payload_checksum
from kvtier.storage.mooncake_store import RemoteStoreError
from kvtier.tier import HostBlockPool, KVTier, remote_tier
from kvtier.tier.remote_link import remote_fingerprint
from kvtier.tier.ssd_tier import signed64
from tests.kv_helpers import make_kv
from tests.mooncake_master import Master, free_port, require_mooncake, stop
from tests.tier_helpers import TINY, lower_hit_and_load as fetch_and_load, page_slots, prompt, same, slot_bytes

ROOT = __file__.rsplit("/tests/", 1)[0]
ID = {"model": "tiny-test", "tp_rank": 0, "tp_size": 1}
P = TINY.page_size  # tokens per page = per block here
TIMEOUT = 1.0  # remote_timeout_s of these tests
RETRY = remote_tier.RETRY_S


def make_remote_tier(master: str, *, layout: str = "layer_first", num_blocks: int = 16, seed: int = 0,
                     **cfg) -> KVTier:
    """A tier over a tiny random KV pool (128 slots), CPU blocks of one page, a remote tier on ``master``."""
    kv = make_kv(TINY, 128, "cpu", torch.Generator().manual_seed(seed))
    cfg.setdefault("remote_admission", "always")
    cfg.setdefault("remote_timeout_s", TIMEOUT)
    cfg.setdefault("remote_segment_gb", 1 / 16)
    config = TierConfig(page_size=P, tokens_per_block=P, host_layout=layout, cpu_cache_gb=1.0,
                        remote_backend="mooncake", remote_master=master, remote_local_hostname="127.0.0.1", **cfg)
    pool = HostBlockPool(dataclasses.replace(TINY, page_size=P), num_blocks, layout=layout)
    return KVTier(kv, config, pool=pool, model_identity=ID)


def store_and_put(tier: KVTier, toks: np.ndarray, first_page: int = 0) -> list[torch.Tensor]:
    """Store ``toks`` from device pages ``first_page..`` and wait for its puts; the bytes stored."""
    slots = page_slots(first_page, toks.size // P, P)
    tier.wait(tier.store(toks, None, slots))
    tier.lower_tier("remote").drain(wait=True)
    return slot_bytes(tier, slots)


def put_by_a(master: str, pages: int) -> tuple[KVTier, np.ndarray]:
    """Instance A: a tier that stored ``prompt(1, pages)`` and put it; the tier and the tokens."""
    a = make_remote_tier(master)
    toks = prompt(1, pages)
    store_and_put(a, toks)
    return a, toks


def probed_fetch(tier: KVTier, toks: np.ndarray, found: int):
    """Start a fetch of ``toks`` and wait for its probe only, which must find ``found`` blocks; the task. The
    probe's call waits until the lookup has returned (a probe that returned inside it would have its get started
    there), so the get is started by the next drain or wait, never before."""
    store = tier.lower_tier("remote").medium.store
    exists, looked_up = store.exists, threading.Event()

    def gated(*args):
        assert looked_up.wait(30)
        return exists(*args)
    store.exists = gated
    try:
        task = tier.lookup_tiers(toks, None).read
    finally:
        looked_up.set()
    job = tier.in_flight()[task.id].completion
    assert job.wait(30) and job.found == found
    store.exists = exists
    assert not job.host_ids.size  # no get started
    return task


def assert_accounted(tier: KVTier) -> None:
    """Once every task has ended, each CPU block is free, in the index, or held by lower-tier IO."""
    tier.wait_all()
    s = tier.stats()
    assert tier.pool.num_free + s["pages_held"] + s["held_cpu_blocks"] == tier.pool.num_blocks, s
    assert s["inflight_tasks"] == 0


_INSTANCE_B = textwrap.dedent("""
    import sys, numpy as np, torch
    sys.path.insert(0, {root!r})
    from tests.test_tier_remote import make_remote_tier, fetch_and_load, prompt, P
    b = make_remote_tier({master!r}, layout="page_first", seed=1)  # other device bytes, empty CPU pool
    toks = prompt(1, 6)
    assert b.lookup(toks) == 0  # nothing local: the fetch runs, lookup never waits for it
    pages, got = fetch_and_load(b, toks)
    s = b.stats()
    print("pages", pages, "fetched", s["pages_fetched"], "corrupt", s["remote_blocks_corrupt"])
    torch.save(got, {out!r})
    b.destroy()
""")


def test_two_processes_share_a_prefix_through_one_master(mooncake_master, tmp_path):
    a = make_remote_tier(mooncake_master.addr)
    toks = prompt(1, 6)
    want = store_and_put(a, toks)
    assert a.stats()["remote_blocks_put"] == 6
    out = str(tmp_path / "b.pt")
    r = subprocess.run([sys.executable, "-c", _INSTANCE_B.format(root=ROOT, master=mooncake_master.addr, out=out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pages 6 fetched 6 corrupt 0" in r.stdout, r.stdout
    assert same(torch.load(out), want, 6)  # B's device pages hold A's bytes, through B's page_first pool
    a.destroy()


def test_a_master_not_reachable_at_start_is_a_clear_error_unless_not_required():
    require_mooncake()
    addr = f"127.0.0.1:{free_port()}"  # nobody listens
    t0 = time.monotonic()
    with pytest.raises(RemoteStoreError, match=f"Mooncake master at {addr} is not reachable.*remote_required"):
        make_remote_tier(addr)
    t = make_remote_tier(addr, remote_required=False)
    assert time.monotonic() - t0 < 15
    assert t.lower_tier("remote") is None  # runs on the CPU tier alone
    toks = prompt(2, 3)
    t.wait(t.store(toks, None, page_slots(0, 3, P)))
    assert t.lookup(toks) == 3
    t.destroy()


_BUILD_WHILE_STOPPED = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {root!r})
    from kvtier.storage.mooncake_store import RemoteStoreError
    from tests.test_tier_remote import make_remote_tier
    from tests.tier_helpers import make_tier
    make_tier().destroy()  # the index's code loaded: the builds below time the remote tier only
    worst, stop = [0.0], threading.Event()

    def beat():
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            worst[0], last = max(worst[0], now - last - 0.005), now
    threading.Thread(target=beat, daemon=True).start()
    t0 = time.monotonic()
    try:
        make_remote_tier({master!r})
        print("built", flush=True)
    except RemoteStoreError as e:
        print("error", e, flush=True)
    t = make_remote_tier({master!r}, remote_required=False)
    print("remote", t.lower_tier("remote") is not None, "seconds", time.monotonic() - t0, "stall", worst[0], flush=True)
""")


def test_a_stopped_master_at_start_is_a_clear_error_without_freezing_the_process(mooncake_master):
    """Mooncake's set-up holds the GIL while it retries a master that accepts connections but never answers (20
    tries of 30 s): building a tier while the master was stopped froze every thread of the process for minutes. A
    master that does not answer is now an error within the probe's timeout (no remote tier: remote_required false),
    and the process's other threads run meanwhile."""
    mooncake_master.pause()
    try:
        r = subprocess.run([sys.executable, "-c", _BUILD_WHILE_STOPPED.format(root=ROOT, master=mooncake_master.addr)],
                           cwd=ROOT, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("building a tier while the master was stopped froze the process")
    finally:
        mooncake_master.resume()
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"error kvtier: the Mooncake master at {mooncake_master.addr} accepts connections but did not answer" \
        in r.stdout, r.stdout
    words = r.stdout.split()
    remote, seconds, stall = words[-5], float(words[-3]), float(words[-1])
    assert remote == "False" and seconds < 2 * TIMEOUT + 3 and stall < 0.5, r.stdout


def test_a_killed_master_leaves_the_local_tiers_serving_and_the_tier_reconnects(mooncake_master):
    a = make_remote_tier(mooncake_master.addr)
    store_and_put(a, prompt(1, 3))
    mooncake_master.kill()
    t0 = time.monotonic()
    toks = prompt(2, 3)
    store_and_put(a, toks, first_page=10)  # puts fail: the tier goes down, the CPU tier keeps the pages
    task = a.lookup_tiers(prompt(3, 4), None).read  # not local: a probe, or nothing while down
    if task is not None:
        a.wait(task)
        assert task.num_pages == 0
    assert a.lookup(toks) == 3
    assert time.monotonic() - t0 < 4 * TIMEOUT + 10  # Mooncake's put retries for ~4 s before it gives up
    s = a.stats()
    assert not s["remote_up"] and s["remote_times_down"] >= 1
    assert s["remote_blocks_put_failed"] + s["remote_blocks_put_dropped"] >= 3
    mooncake_master.start()  # same port: Mooncake's client reconnects and remounts its segment
    deadline = time.monotonic() + 60
    while not a.stats()["remote_up"] and time.monotonic() < deadline:
        a.poll()
        time.sleep(0.2)
    assert a.stats()["remote_up"]
    toks = prompt(4, 3)
    want = None
    for _ in range(50):  # the first puts after a restart may race the remount
        want = store_and_put(a, toks, first_page=20)
        medium = a.lower_tier("remote").medium
        if medium.store.exists(medium.keys(page_hashes(toks, P, None))) == [1, 1, 1]:
            break
        a.reset()
        time.sleep(0.2)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    pages, got = fetch_and_load(b, toks)
    assert pages == 3 and same(got, want, 3)
    assert_accounted(a)
    assert_accounted(b)
    a.destroy()
    b.destroy()


def test_a_hung_master_bounds_every_wait_and_quarantines_the_fetch_blocks_until_its_calls_return(mooncake_master):
    """reset with a get hung on the master held the tier's lock until Mooncake's own RPC timeout (~29 s) gave the
    get back; it now returns at once, and the get's CPU blocks stay out of the pool (quarantined) until the get
    returns: the pool hands out every other block, never one of those."""
    a, toks = put_by_a(mooncake_master.addr, 4)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    task = probed_fetch(b, toks, 4)  # the probe returned; the get is not started yet
    mooncake_master.pause()  # the get's calls hang
    t0 = time.monotonic()
    b.wait(task)
    assert time.monotonic() - t0 < 2 * TIMEOUT + 1
    assert task.num_pages == 4 and b.lookup(toks) == 0  # abandoned: nothing entered the index
    s = b.stats()
    assert not s["remote_up"] and s["remote_fetches_abandoned"] == 1
    assert s["held_cpu_blocks"] == 4  # the hung get may still write them: not reused
    assert b.lookup_tiers(prompt(2, 3), None).read is None  # down: no probe
    hung = set(b.lower_tier("remote")._abandoned[0].host_ids.tolist())
    t0 = time.monotonic()
    b.reset()
    assert time.monotonic() - t0 < TIMEOUT + 0.5
    assert b.holds.num_deferred == 4 and b.pool.num_free == b.pool.num_blocks - 4
    fill = b.store(prompt(5, 16), None, page_slots(20, 16, P))  # wants every block: gets all but the 4
    b.wait(fill)
    assert fill.num_pages == 12 and not hung & set(b.index.match(prompt(5, 16), None).block_ids)
    mooncake_master.resume()  # the get returns; its blocks go back to the pool
    poll_until(b, lambda: not b.stats()["held_cpu_blocks"], 60)
    assert b.stats()["held_cpu_blocks"] == 0 and b.pool.num_free == b.pool.num_blocks - 12
    assert_accounted(b)
    a.destroy()
    b.destroy()


def test_stats_and_lookups_from_other_threads_never_wait_on_a_hung_master(mooncake_master):
    """While the engine thread waits for a fetch, resets and destroys under a hung master, another thread's stats
    and lookups each return within remote_timeout_s (+0.5 s): they waited on the tier's lock, which reset held until
    the hung get returned (~29 s)."""
    a, toks = put_by_a(mooncake_master.addr, 4)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    task = probed_fetch(b, toks, 4)
    times: list[float] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def other() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            try:
                b.stats()
                b.lookup(prompt(7, 2))  # after destroy too: a closed remote tier starts no call
            except BaseException as e:
                errors.append(e)
                return
            times.append(time.monotonic() - t0)
            time.sleep(0.01)
    mooncake_master.pause()
    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    try:
        engine: list[float] = []
        for call in (lambda: b.wait(task), b.reset, b.stats, b.destroy):  # the other thread's calls go on after
            t0 = time.monotonic()
            call()
            engine.append(time.monotonic() - t0)
        done.set()
        thread.join(60)
        assert not thread.is_alive()
    finally:
        done.set()
        mooncake_master.resume()
    assert not errors, errors
    assert max(engine) < TIMEOUT + 0.5, engine
    assert times and max(times) < TIMEOUT + 0.5, max(times)
    # its get still ran: left
    assert b.pool.destroyed and b.lower_tier("remote").medium.store in remote_tier.LEFT_TO_EXIT
    a.destroy()


def test_a_cancelled_fetch_makes_no_further_get_calls(mooncake_master):
    """A fetch cancelled while its get runs made every remaining call of the get (and cancel waited for them): it
    now ends at once, its get stops after the call in flight, whose blocks stay held until it returns."""
    a, toks = put_by_a(mooncake_master.addr, 4)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    b.lower_tier("remote").medium._batch = 1  # a call a block
    calls = _counted(b.lower_tier("remote").medium.store, "get", 0.5)
    task = probed_fetch(b, toks, 4)
    b.poll()  # the get starts
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert b.cancel(task)
    assert time.monotonic() - t0 < 0.3
    assert b.stats()["held_cpu_blocks"] == 4
    poll_until(b, lambda: not b.stats()["held_cpu_blocks"], 10)
    assert len(calls) == 1 and b.lookup(toks) == 0
    assert_accounted(b)
    a.destroy()
    b.destroy()


def test_a_tier_whose_master_did_not_answer_last_is_destroyed_without_waiting_for_it(mooncake_master):
    """Mooncake's close waits for a hung master (30-60 s) holding the GIL: a tier that found its master not
    answering leaves the client to the process's exit."""
    a, toks = put_by_a(mooncake_master.addr, 4)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    task = probed_fetch(b, toks, 4)
    mooncake_master.pause()
    b.wait(task)  # the get outlasts its timeout: the tier is down
    mooncake_master.resume()
    b.lower_tier("remote").drain(wait=True)  # the hung get returns
    assert not b.stats()["remote_up"]
    mooncake_master.pause()  # hung again at shutdown
    t0 = time.monotonic()
    b.destroy()
    assert time.monotonic() - t0 < 5
    mooncake_master.resume()
    b.lower_tier("remote").medium.store.close()  # the test's own clean-up, the master answering again
    a.destroy()


def test_a_client_left_at_destroy_is_never_closed_by_its_destructor(mooncake_master):
    """A tier destroyed while its master hangs leaves its Mooncake client unclosed; once the tier was dropped, the
    client's destructor closed it, holding the GIL while it waited for the master: every thread of the process
    stopped (16 s in bench_remote_stalls at 4fdb9ea, in the next phase, which had no remote tier at all). The client
    is kept referenced to the process's exit."""
    b = make_remote_tier(mooncake_master.addr, seed=1)
    mooncake_master.pause()
    try:
        b.destroy()  # the master does not answer: the client is left
    finally:
        mooncake_master.resume()
    mooncake_master.kill()  # gone: the probe destroy left behind returns, and a close would wait for the master
    for t in threading.enumerate():
        if t.name == "kvtier-remote-close-probe":
            t.join(60)
    store = weakref.ref(b.lower_tier("remote").medium.store)
    t0 = time.monotonic()
    gc.collect()
    before = time.monotonic() - t0  # a collection of this process's heap, the tier still referenced
    del b
    t0 = time.monotonic()
    gc.collect()
    assert store() is not None and time.monotonic() - t0 < before + 0.5


def test_destroy_does_not_wait_for_a_probe_given_up_on(mooncake_master):
    """A fetch given up on while its probe hung holds no CPU block, yet destroy waited for that call, holding the
    tier's lock (stats and the metrics thread blocked too), for as long as the master hung."""
    a, toks = put_by_a(mooncake_master.addr, 4)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    mooncake_master.pause()  # the probe hangs
    try:
        task = b.lookup_tiers(toks, None).read
        b.wait(task)  # given up on by its timeout
        destroying = threading.Thread(target=b.destroy, daemon=True)
        destroying.start()
        destroying.join(4 * TIMEOUT + 5)
        assert not destroying.is_alive() and b.pool.destroyed
    finally:
        mooncake_master.resume()
    a.destroy()


def test_a_process_exits_while_a_call_given_up_on_still_hangs(mooncake_master):
    """The store calls ran on a ThreadPoolExecutor thread, which the interpreter joins at exit: a process whose
    get was given up on (its master hung) did not exit until the master answered again. Now it exits once
    Mooncake's own clean-up at exit has waited out its RPC timeout (30 s; it then aborts the process)."""
    child = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from tests.mooncake_master import stop
        from tests.test_tier_remote import make_remote_tier, probed_fetch, put_by_a
        a, toks = put_by_a(sys.argv[1], 4)
        b = make_remote_tier(sys.argv[1], seed=1)
        task = probed_fetch(b, toks, 4)
        stop(int(sys.argv[2]))  # the master hangs: the get's call hangs
        b.wait(task)
        print("given up", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child, mooncake_master.addr, str(mooncake_master.proc.pid)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=75)  # raises if it has not exited
        assert "given up" in out, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        mooncake_master.resume()


def test_a_key_gone_between_probe_and_get_is_a_counted_miss(mooncake_master):
    a, toks = put_by_a(mooncake_master.addr, 4)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    task = probed_fetch(b, toks, 4)
    store = a.lower_tier("remote").medium.store
    # the store drops block 2
    assert store.remove(a.lower_tier("remote").medium.keys(page_hashes(toks, P, None)[2:3])) == [0]
    b.wait(task)
    s = b.stats()
    assert s["pages_fetched"] == 2 and s["remote_blocks_missing"] == 1 and s["remote_blocks_corrupt"] == 0
    assert b.lookup(toks) == 2
    assert_accounted(b)
    a.destroy()
    b.destroy()


@pytest.fixture(params=[0, 2], ids=["worker_alone", "prep_threads"])
def prep_threads(request, monkeypatch):
    """The remote tiers built in the test copy and check blocks on the worker alone, or on 2 prep threads (the
    machines with 8 CPUs or more)."""
    monkeypatch.setattr(remote_tier, "PREP_THREADS", request.param)
    return request.param


@pytest.mark.parametrize("forgery", ["short", "checksum", "tokens", "fingerprint"])
def test_a_forged_value_is_a_counted_miss_never_served(mooncake_master, forgery, prep_threads):
    a = make_remote_tier(mooncake_master.addr)
    toks = prompt(1, 3)
    want = store_and_put(a, toks)
    medium = a.lower_tier("remote").medium
    hashes = page_hashes(toks, P, None)
    key = medium.keys(hashes[1:2])
    assert medium.store.remove(key) == [0]
    payload = a.pool.block_rows(int(a.index.match(toks, None).block_ids[1])).reshape(-1).copy()
    head = BlockHeader(medium.fingerprint, signed64(Namespace().seed), int(hashes[1]), toks[P:2 * P].astype(np.int64),
                       medium.block_bytes, payload_checksum(payload))
    if forgery == "checksum":
        payload[0] ^= 1  # the header vouches for other bytes
    elif forgery == "tokens":  # a hash collision or a stale key: same chain hash, other tokens
        head = head._replace(tokens=head.tokens + 1)
    elif forgery == "fingerprint":
        head = head._replace(fingerprint=b"\x01" * 16)
    value = np.concatenate([np.frombuffer(pack_block_header(head), np.uint8), payload])
    if forgery == "short":
        value = value[:ALIGN + medium.block_bytes // 2]
    buf = aligned(value.size)
    buf[:] = value
    medium.store.register(buf.ctypes.data, buf.nbytes)
    assert medium.store.put(key, [[(buf.ctypes.data, buf.nbytes)]]) == [0]
    b = make_remote_tier(mooncake_master.addr, seed=1)
    pages, got = fetch_and_load(b, toks)
    assert pages == 1 and same(got, want, 1)  # the leading good block; the forged one is a miss
    s = b.stats()
    assert s["remote_blocks_corrupt"] == 1 and s["pages_fetched"] == 1
    assert_accounted(b)
    # removed: a put of its key was a no-op the store answered as stored, so the block stayed a miss for everyone
    assert medium.store.exists(key) == [0]
    store_and_put(b, toks)  # b computed the missing blocks: written through
    c = make_remote_tier(mooncake_master.addr, seed=2)
    assert fetch_and_load(c, toks)[0] == 3 and c.stats()["remote_blocks_corrupt"] == 0
    a.destroy()
    b.destroy()
    c.destroy()


def test_a_cancelled_fetch_ends_without_its_get(mooncake_master):
    """A fetch cancelled after its probe returned went on: it evicted CPU pages to make room, ran its get, and
    then threw the blocks away."""
    a, toks = put_by_a(mooncake_master.addr, 4)
    b = make_remote_tier(mooncake_master.addr, seed=1, num_blocks=8)
    local = prompt(2, 6)
    store_and_put(b, local)
    calls = _counted(b.lower_tier("remote").medium.store, "get", 0.0)
    b.cancel(probed_fetch(b, toks, 4))
    assert calls == [] and b.lookup(local) == 6 and b.stats()["pages_evicted"] == 0
    assert_accounted(b)
    a.destroy()
    b.destroy()


def test_puts_hold_at_most_half_of_a_small_pool(mooncake_master):
    """The put queue was capped at max(half the pool, 64 blocks): in a pool under 128 blocks a slow store then held
    every CPU block and stores were dropped. It holds at most half: the other half takes stores."""
    a = make_remote_tier(mooncake_master.addr, num_blocks=16, remote_timeout_s=10.0)
    slowed(a.lower_tier("remote").medium.store, "put", 2.0)  # slow, within its timeout
    a.wait(a.store(prompt(1, 12), None, page_slots(0, 12, P)))
    s = a.stats()
    assert s["remote_blocks_pending_put"] == 8 and s["remote_blocks_put_dropped"] == 4
    a.evict(16)  # every page: the 8 the put holds come back only when it returns
    task = a.store(prompt(2, 8), None, page_slots(20, 8, P))
    a.wait(task)
    assert task.num_pages == 8 and a.stats()["pages_store_dropped"] == 0
    a.destroy()


def test_puts_beyond_the_queue_cap_are_dropped_and_counted(mooncake_master):
    a = make_remote_tier(mooncake_master.addr)
    a.lower_tier("remote").medium._max_pending = 2  # a tiny queue: the first 2 blocks of the store are put
    toks = prompt(1, 5)
    store_and_put(a, toks)
    s = a.stats()
    assert s["remote_blocks_put"] == 2 and s["remote_blocks_put_dropped"] == 3
    medium = a.lower_tier("remote").medium
    assert medium.store.exists(medium.keys(page_hashes(toks, P, None))) == [1, 1, 0, 0, 0]
    a.destroy()


def test_blocks_are_keyed_per_tp_rank_for_mha_and_once_for_mla():
    mha = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
    mla = dataclasses.replace(mha, num_kv_heads=1, is_mla=True)
    r0, r1 = dict(ID, tp_rank=0, tp_size=2), dict(ID, tp_rank=1, tp_size=2)
    assert remote_fingerprint(mha, 4, r0) != remote_fingerprint(mha, 4, r1)
    assert remote_fingerprint(mla, 4, r0) == remote_fingerprint(mla, 4, r1)
    assert remote_fingerprint(mla, 4, r0) != remote_fingerprint(mla, 4, dict(r0, model="other"))
    assert remote_fingerprint(mha, 4, r0) != remote_fingerprint(mha, 8, r0)


def test_a_remote_tier_needs_a_model_identity(mooncake_master):
    kv = make_kv(TINY, 16, "cpu", torch.Generator().manual_seed(0))
    cfg = TierConfig(page_size=P, tokens_per_block=P, cpu_cache_gb=1 / 1024, remote_backend="mooncake",
                     remote_master=mooncake_master.addr)
    with pytest.raises(ValueError, match="remote tier needs model_identity"):
        KVTier(kv, cfg)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])  # staged values, zero-copy values
def test_puts_and_gets_in_many_batches_round_trip_and_stop_at_a_missing_block(mooncake_master, layout, prep_threads):
    a = make_remote_tier(mooncake_master.addr, layout=layout)
    b = make_remote_tier(mooncake_master.addr, layout=layout, seed=1)
    assert (a.lower_tier("remote").medium._prep is not None) == bool(prep_threads)
    for t in (a, b):
        t.lower_tier("remote").medium._batch = 2  # 7 blocks: 4 calls, each prepared or checked while another runs
    assert a.lower_tier("remote").medium.staged == (layout == "layer_first")
    toks = prompt(1, 7)
    want = store_and_put(a, toks)
    assert a.stats()["remote_blocks_put"] == 7
    pages, got = fetch_and_load(b, toks)
    assert pages == 7 and same(got, want, 7)
    toks = prompt(2, 7)
    want = store_and_put(a, toks, first_page=10)
    task = probed_fetch(b, toks, 7)
    medium = a.lower_tier("remote").medium
    assert medium.store.remove(medium.keys(page_hashes(toks, P, None)[4:5])) == [0]
    b.wait(task)  # batch [4, 6) misses its first block: 4 verified, the call after it waited for
    assert task.num_pages == 7 and b.stats()["pages_fetched"] == 7 + 4
    pages, got = fetch_and_load(b, toks)
    assert pages == 4 and same(got, want, 4)
    assert_accounted(b)
    a.destroy()
    b.destroy()


def before_calls(store, method: str, before) -> None:
    """Make every call of the real client's ``method`` run ``before()`` first, on the calling thread."""
    real = getattr(store, method)

    def call(*args):
        before()
        return real(*args)
    setattr(store, method, call)


def slowed(store, method: str, seconds: float) -> None:
    """Make every call of the real client's ``method`` start ``seconds`` late (a slow or hung peer)."""
    before_calls(store, method, lambda: time.sleep(seconds))


def poll_until(tier: KVTier, done, seconds: float) -> None:
    """Poll ``tier`` as an engine does until ``done()`` holds or ``seconds`` have passed."""
    t0 = time.monotonic()
    while not done() and time.monotonic() - t0 < seconds:
        tier.poll()
        time.sleep(0.05)


def two_prompts_put(master: str) -> tuple[KVTier, np.ndarray, np.ndarray]:
    """A tier that stored two prompts of two pages each and put them; the tier and the prompts."""
    a = make_remote_tier(master)
    t1, t2 = prompt(1, 2), prompt(2, 2)
    store_and_put(a, t1)
    store_and_put(a, t2, first_page=4)
    return a, t1, t2


def test_a_fetch_that_returns_after_it_was_abandoned_is_counted_once(mooncake_master):
    a, toks = put_by_a(mooncake_master.addr, 4)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    slowed(b.lower_tier("remote").medium.store, "get", 2.5 * TIMEOUT)  # the get succeeds, after its timeout
    b.wait(b.lookup_tiers(toks, None).read)
    poll_until(b, lambda: not b.stats()["held_cpu_blocks"], 10)  # the get returns; its blocks come back
    s = b.stats()
    assert s["remote_fetches_abandoned"] == 1 and s["pages_fetch_failed"] == 4 and s["pages_fetched"] == 0
    assert s["remote_blocks_fetched"] == 0 and s["remote_bytes_fetched"] == 0  # what it brought was never used
    assert b.lookup(toks) == 0
    assert_accounted(b)
    a.destroy()
    b.destroy()


def test_time_queued_behind_healthy_gets_does_not_count_against_a_fetch(mooncake_master):
    a, t1, t2 = two_prompts_put(mooncake_master.addr)
    b = make_remote_tier(mooncake_master.addr, seed=1, remote_timeout_s=2.0)
    slowed(b.lower_tier("remote").medium.store, "get", 1.2)  # each get within its timeout (2 s); two in a row are not
    k1, k2 = (b.lookup_tiers(t, None).read for t in (t1, t2))
    for k in (k1, k2):
        assert b.in_flight()[k.id].completion.wait(30)  # both probes returned
    b.poll()  # both gets start, one behind the other on the fetch thread
    b.wait(k2)
    b.wait(k1)
    s = b.stats()
    assert s["remote_fetches_abandoned"] == 0 and s["remote_up"] and s["pages_fetched"] == 4
    assert b.lookup(t1) == 2 and b.lookup(t2) == 2
    assert_accounted(b)
    a.destroy()
    b.destroy()


def test_a_polled_fetch_whose_get_hangs_ends_by_its_timeout(mooncake_master):
    """An engine that only polls (SGLang's backend) never waits for a fetch: the fetch still ends by its
    timeout, the tier goes down, and the CPU blocks stay held until the hung call returns."""
    a, toks = put_by_a(mooncake_master.addr, 4)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    slowed(b.lower_tier("remote").medium.store, "get", 4 * TIMEOUT)
    task = b.lookup_tiers(toks, None).read
    t0 = time.monotonic()
    poll_until(b, lambda: b.completed(task), 3 * TIMEOUT)
    assert b.completed(task) and time.monotonic() - t0 < 2 * TIMEOUT + 1
    s = b.stats()
    assert not s["remote_up"] and s["remote_fetches_abandoned"] == 1 and s["pages_fetch_failed"] == 4
    assert s["held_cpu_blocks"] == 4 and b.lookup(toks) == 0  # the late get may still write them
    poll_until(b, lambda: not b.stats()["held_cpu_blocks"], 10)
    assert_accounted(b)
    a.destroy()
    b.destroy()


def test_puts_queued_behind_a_hung_put_are_skipped_once_it_outlasts_its_timeout(mooncake_master):
    a = make_remote_tier(mooncake_master.addr, num_blocks=32)
    slowed(a.lower_tier("remote").medium.store, "put", 3.0)  # every put call hangs for 3 s
    for i in range(3):  # three stores, three put jobs: one runs, two queue behind it
        a.wait(a.store(prompt(10 + i, 2), None, page_slots(2 * i, 2, P)))
    t0 = time.monotonic()
    a.reset()  # waits for none of them: their blocks stay held until each has run
    assert time.monotonic() - t0 < 0.5 and a.stats()["held_cpu_blocks"] == 6
    poll_until(a, lambda: not a.stats()["held_cpu_blocks"], 3.0 + 2 * TIMEOUT)
    s = a.stats()  # the running put lands late; the queued ones are skipped, counted failed
    assert s["remote_times_down"] == 1 and s["remote_blocks_put"] == 2 and s["remote_blocks_put_failed"] == 4
    assert s["held_cpu_blocks"] == 0 and a.pool.num_free == a.pool.num_blocks
    a.destroy()


def test_a_probe_queued_behind_a_hung_probe_ends_by_the_timeout(mooncake_master):
    a, t1, t2 = two_prompts_put(mooncake_master.addr)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    # the first probe hangs; the second queues behind it
    slowed(b.lower_tier("remote").medium.store, "exists", 4 * TIMEOUT)
    b.lookup_tiers(t1, None)
    task = b.lookup_tiers(t2, None).read
    t0 = time.monotonic()
    b.wait(task)
    assert time.monotonic() - t0 < TIMEOUT + 1
    s = b.stats()
    assert not s["remote_up"] and s["remote_fetches_abandoned"] == 2 and b.lookup(t2) == 0
    b.lower_tier("remote").drain(wait=True)  # the hung probe returns
    assert_accounted(b)
    a.destroy()
    b.destroy()


def test_no_fetch_starts_while_a_get_given_up_on_still_runs(mooncake_master):
    """The master answers while a peer's get hangs: the tier comes back up after its health probe, and no fetch
    starts (its get would queue behind the hung call) until that call returns; the tier does not go down again."""
    a, t1, t2 = two_prompts_put(mooncake_master.addr)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    store = b.lower_tier("remote").medium.store
    slowed(store, "get", 8 * TIMEOUT)
    b.wait(b.lookup_tiers(t1, None).read)  # abandoned by its timeout; the call runs on
    poll_until(b, lambda: b.stats()["remote_up"], 5)  # the health probe finds the master
    for _ in range(3):  # within the call's 8 s
        assert b.lookup_tiers(t2, None).read is None  # not started: the fetch thread is still in the call
        poll_until(b, lambda: False, RETRY)
    s = b.stats()
    assert s["remote_up"] and s["remote_times_down"] == 1 and s["remote_fetches_skipped"] == 3
    b.lower_tier("remote").drain(wait=True)  # the hung get returns
    del store.get  # the client's own method again
    pages, got = fetch_and_load(b, t2)
    assert pages == 2 and b.stats()["remote_fetches_abandoned"] == 1
    assert_accounted(b)
    a.destroy()
    b.destroy()


def _counted(store, method: str, seconds: float) -> list:
    """Make every call of the real client's ``method`` take ``seconds`` longer; the list of their start times."""
    calls: list = []
    before_calls(store, method, lambda: (calls.append(time.monotonic()), time.sleep(seconds)))
    return calls


@pytest.mark.parametrize("kind", ["put", "get"])
def test_a_job_given_up_on_makes_no_further_calls(mooncake_master, kind):
    """A put or get of several calls, each hanging: once the owner gives up on it (the tier goes down), its
    remaining calls are not made, and a reset waits for the one that runs only. The job went on calling batch after
    batch, and the reset waited for all of them."""
    a = make_remote_tier(mooncake_master.addr, num_blocks=32)
    toks = prompt(1, 4)
    if kind == "get":
        store_and_put(a, toks)
    t = a if kind == "put" else make_remote_tier(mooncake_master.addr, seed=1)
    t.lower_tier("remote").medium._batch = 1  # a call a block
    calls = _counted(t.lower_tier("remote").medium.store, kind, 3 * TIMEOUT)
    if kind == "put":
        t.wait(t.store(prompt(10, 4), None, page_slots(0, 4, P)))
        poll_until(t, lambda: not t.stats()["remote_up"], 3 * TIMEOUT)
    else:
        t.wait(probed_fetch(t, toks, 4))
    assert not t.stats()["remote_up"]
    given_up, t0 = len(calls), time.monotonic()
    t.reset()
    assert len(calls) == given_up == 1 and time.monotonic() - t0 < 3 * TIMEOUT + 1
    t.destroy()
    if t is not a:
        a.destroy()


def test_slow_batch_preparation_between_calls_is_no_hung_call(mooncake_master, monkeypatch):
    """The deadline runs while a call runs only: a put whose next batch takes longer than the timeout to prepare
    (a busy host, the preparing thread niced) after a quick call is not given up on."""
    checksum = remote_tier._checksum
    monkeypatch.setattr(remote_tier, "_checksum", lambda rows: (time.sleep(1.5 * TIMEOUT), checksum(rows))[1])
    a = make_remote_tier(mooncake_master.addr, num_blocks=32)
    a.lower_tier("remote").medium._batch = 1
    a.wait(a.store(prompt(10, 3), None, page_slots(0, 3, P)))
    poll_until(a, lambda: a.stats()["remote_blocks_put"] == 3, 10 * TIMEOUT)
    s = a.stats()
    assert s["remote_up"] and s["remote_blocks_put"] == 3
    a.destroy()


def test_one_hung_call_of_a_many_call_get_ends_by_its_own_timeout(mooncake_master):
    """remote_timeout_s bounds each call: the first call of an eight-call get hanging, the owner gives up after one
    timeout. The stage's deadline was the timeout times its calls, counted from its start (eight here; 19 for an 8k
    Qwen3-8B prefix at 5 s each: a hung peer's minute fit in it)."""
    a, toks = put_by_a(mooncake_master.addr, 8)
    b = make_remote_tier(mooncake_master.addr, seed=1)
    b.lower_tier("remote").medium._batch = 1
    calls: list = []

    def first_hangs() -> None:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(6 * TIMEOUT)
    before_calls(b.lower_tier("remote").medium.store, "get", first_hangs)
    task = probed_fetch(b, toks, 8)
    t0 = time.monotonic()
    b.wait(task)
    assert time.monotonic() - t0 < 2 * TIMEOUT + 0.5
    s = b.stats()
    assert not s["remote_up"] and s["remote_fetches_abandoned"] == 1
    b.lower_tier("remote").drain(wait=True)
    assert_accounted(b)
    a.destroy()
    b.destroy()


def test_the_read_rate_counts_the_get_not_the_probe(mooncake_master):
    """read_gbps (what admission by cost compares with the prefill) took the probe's time as read time too."""
    a, toks = put_by_a(mooncake_master.addr, 4)
    b = make_remote_tier(mooncake_master.addr, seed=1, remote_timeout_s=5.0)
    slowed(b.lower_tier("remote").medium.store, "exists", 0.5)  # a slow probe; the get itself as it is
    pages, _ = fetch_and_load(b, toks)
    assert pages == 4 and b.stats()["remote_seconds_fetch"] < 0.25
    a.destroy()
    b.destroy()


def remote_thread_priorities(master: str, monkeypatch) -> tuple[dict, dict]:
    """The niceness each store call ran at (put, exists, get: a tier A puts a prefix, a tier B fetches it) and that
    of each remote worker thread, prep threads included (as on a machine of 8 CPUs or more)."""
    nice: dict[str, set] = {}
    monkeypatch.setattr(remote_tier, "PREP_THREADS", 2)

    def recorded(store, method: str) -> None:
        before_calls(store, method, lambda: nice.setdefault(method, set()).add(
            os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    before = {t.ident for t in threading.enumerate()}  # other tests' tiers' threads, if any outlived them
    a = make_remote_tier(master)
    b = make_remote_tier(master, seed=1)
    recorded(a.lower_tier("remote").medium.store, "put")
    for method in ("exists", "get"):
        recorded(b.lower_tier("remote").medium.store, method)
    toks = prompt(1, 3)
    store_and_put(a, toks)
    pages, _ = fetch_and_load(b, toks)
    assert pages == 3
    workers: dict[str, set] = {}
    for t in threading.enumerate():
        name = t.name.rsplit("_", 1)[0]  # a pool's threads: PREFIX_i
        if t.ident not in before and name in ("kvtier-remote-put", "kvtier-remote-fetch", "kvtier-remote-probe",
                                              "kvtier-remote-prep"):
            try:
                workers.setdefault(name, set()).add(os.getpriority(os.PRIO_PROCESS, t.native_id))
            except ProcessLookupError:  # another test's tier's thread, ended since
                pass
    a.destroy()
    b.destroy()
    return nice, workers


def test_every_remote_thread_runs_at_the_creators_priority(mooncake_master, monkeypatch):
    """Every thread of the tier takes the GIL: one nicer than the engine's, preempted while it holds the GIL's
    hand-off mutex, would hold every Python thread of the process until the scheduler runs it again (30-90 ms on 2
    loaded cores at niceness 10). By default no remote thread runs nicer than the tier's creator."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    nice, workers = remote_thread_priorities(mooncake_master.addr, monkeypatch)
    assert nice == {"put": {base}, "exists": {base}, "get": {base}}
    assert workers == {"kvtier-remote-put": {base}, "kvtier-remote-fetch": {base}, "kvtier-remote-probe": {base},
                       "kvtier-remote-prep": {base}}


def test_put_niceness_applies_to_the_put_threads_only(mooncake_master, monkeypatch):
    """PUT_CALL_NICE and PUT_PREP_NICE (the bench's ``on:nice=N`` phases) make the put calls and the put worker
    that much nicer than the tier's creator; probes and gets, the fetch worker and the prep threads (which check
    gets as well) keep its priority, and every pool's threads start from the creator."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    call, prep = 3, 2
    if base + max(call, prep) >= 19:
        pytest.skip("the test runs too nice: a thread that inherited the put worker's niceness (capped at 19) would "
                    "look the same as one set right")
    monkeypatch.setattr(remote_tier, "PUT_CALL_NICE", call)
    monkeypatch.setattr(remote_tier, "PUT_PREP_NICE", prep)
    nice, workers = remote_thread_priorities(mooncake_master.addr, monkeypatch)
    assert nice == {"put": {base + call}, "exists": {base}, "get": {base}}
    assert workers == {"kvtier-remote-put": {base + prep}, "kvtier-remote-fetch": {base},
                       "kvtier-remote-probe": {base}, "kvtier-remote-prep": {base}}


def test_a_tier_that_fails_to_start_leaves_no_thread_running(mooncake_master, monkeypatch):
    """The fetch worker's buffer cannot be registered (the client's fourth registration fails: the pool, the put
    worker's two buffers, then this): the tier's start fails with that error, and the threads already started for
    it (the put worker, its call thread, the prep threads) end."""
    monkeypatch.setattr(remote_tier, "PREP_THREADS", 2)
    real, calls = remote_tier.MooncakeStore.register, []

    def register(self, address: int, nbytes: int) -> None:
        calls.append(nbytes)
        if len(calls) == 4:
            raise RemoteStoreError("kvtier test: registration refused")
        real(self, address, nbytes)
    monkeypatch.setattr(remote_tier.MooncakeStore, "register", register)
    before = set(threading.enumerate())
    with pytest.raises(RemoteStoreError, match="registration refused"):
        make_remote_tier(mooncake_master.addr)
    assert len(calls) == 4
    deadline = time.monotonic() + 5
    while (left := [t.name for t in set(threading.enumerate()) - before if t.name.startswith("kvtier-remote")]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == []


_PEER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.test_tier_remote import make_remote_tier, store_and_put, prompt
    a = make_remote_tier({master!r})  # the only segment: the values live in this process
    store_and_put(a, prompt(1, 4))
    print("stored", a.stats()["remote_blocks_put"], flush=True)
    time.sleep(120)
""")


def test_a_hung_then_dead_peer_is_a_counted_transfer_failure_never_corruption(tmp_path):
    """The values' holder (another instance's segment) hangs, then dies, while the master still lists its keys
    (until its client TTL, 60 s here so that a slow machine keeps them): the hung get ends by its timeout and takes
    the tier down once; the dead holder's values fail at once as transfer failures (``remote_blocks_fetch_failed``),
    not as corrupt ones, and the tier stays up."""
    master = Master(str(tmp_path), flags=("--client_ttl=60",))
    peer = subprocess.Popen([sys.executable, "-c", _PEER.format(root=ROOT, master=master.addr)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert peer.stdout.readline().split() == ["stored", "4"]
        b = make_remote_tier(master.addr, seed=1)
        toks = prompt(1, 4)
        stop(peer.pid)  # hung: its sockets open, nothing served
        t0 = time.monotonic()
        b.wait(b.lookup_tiers(toks, None).read)
        assert time.monotonic() - t0 < 2 * TIMEOUT + 1
        assert b.stats()["remote_fetches_abandoned"] == 1 and b.lookup(toks) == 0
        peer.kill()  # dead: the hung call fails
        peer.wait(10)
        t0 = time.monotonic()
        b.lower_tier("remote").drain(wait=True)
        assert time.monotonic() - t0 < 10
        poll_until(b, lambda: b.stats()["remote_up"], 5)
        t0 = time.monotonic()
        pages, _ = fetch_and_load(b, toks)  # the master still lists the keys: the get fails at once
        assert pages == 0 and time.monotonic() - t0 < TIMEOUT
        s = b.stats()
        assert s["remote_blocks_corrupt"] == 0 and s["remote_blocks_fetch_failed"] == 1
        assert s["remote_up"] and s["remote_times_down"] == 1
        assert_accounted(b)
        b.destroy()
    finally:
        peer.kill()
        peer.wait(10)
        master.kill()


def test_flush_lower_waits_for_the_queued_puts(mooncake_master):
    """flush_lower makes every queued put land (the remote tier had no flush: puts were still pending after it)."""
    a = make_remote_tier(mooncake_master.addr, num_blocks=32)
    slowed(a.lower_tier("remote").medium.store, "put", 0.3)
    a.wait(a.store(prompt(7, 4), None, page_slots(0, 4, P)))
    assert a.stats()["remote_blocks_pending_put"] == 4
    a.flush_lower()
    s = a.stats()
    assert s["remote_blocks_pending_put"] == 0 and s["remote_blocks_put"] == 4
    a.destroy()


def test_flush_lower_gives_up_on_a_hung_put_by_the_timeout(mooncake_master):
    a = make_remote_tier(mooncake_master.addr, num_blocks=32)
    slowed(a.lower_tier("remote").medium.store, "put", 3 * TIMEOUT + 2)
    a.wait(a.store(prompt(8, 2), None, page_slots(0, 2, P)))
    t0 = time.monotonic()
    a.flush_lower()
    assert time.monotonic() - t0 < TIMEOUT + 1.0
    a.destroy()
