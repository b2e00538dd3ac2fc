"""Every engine call's deadline with the remote tier, searched exhaustively: a real ``mooncake_master`` stopped
(SIGSTOP), killed (then restarted) or a peer stopped at each step of a put, a probe and a get, and every engine call
timed against its bound.

A peer process mounts the store's only segment and puts two prompts (so every value, the tier's own puts included,
crosses to the peer); each case builds a fresh tier (no segment of its own, ``remote_timeout_s`` :data:`TIMEOUT`)
and runs one script of engine calls: store (a put), lookup (a probe), poll (the get starts), wait, load, a second
fetch, stats, wait_all, reset, store, lookup, destroy. The fault fires at one point of that script: before an engine
call, or inside the first call of the real client's ``put``, ``exists`` (the probe) or ``get``, on the thread that
makes it. Every engine call must return within ``remote_timeout_s`` + :data:`SLACK_S` (``destroy``: plus the time
spent in Mooncake's own close, which joins the client's threads, about a second, when the master answers); what was
loaded must be the peer's bytes; every CPU block must be accounted for.

The default run is every single fault at every point (27 cases); ``KVTIER_REMOTE_DEADLINE_PAIRS=1`` adds every
ordered pair of faults at two points of the script.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import time
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from kvtier.index import page_hashes
from kvtier.tier import KVTier, remote_tier
from tests.kv_helpers import as_bytes, make_kv
from tests.mooncake_master import Master, require_mooncake, stop
from tests.test_tier_remote import ROOT, before_calls, make_remote_tier
from tests.tier_helpers import TINY, page_slots, prompt, slot_bytes

P = TINY.page_size
TIMEOUT = 1.0  # remote_timeout_s of the tier under test
SLACK_S = 0.5  # over the timeout: the bound of every engine call
FAULTS = ("stop_master", "kill_master", "stop_peer")
# the script's points, in its order: before an engine call, or inside the first call of a client method
POINTS = ("store", "put", "lookup", "exists", "start_get", "get", "wait", "reset", "destroy")
CALL_POINTS = {"put", "exists", "get"}
PEER_PROMPTS = [(prompt(1, 4), 0), (prompt(2, 4), 10)]  # (tokens, first device page) the peer stores from


def _cases() -> list[tuple]:
    single = [((f, p),) for p in POINTS for f in FAULTS]
    if os.environ.get("KVTIER_REMOTE_DEADLINE_PAIRS") != "1":
        return single
    pairs = [((f1, p1), (f2, p2)) for (i, p1), (j, p2) in itertools.combinations(enumerate(POINTS), 2)
             for f1 in FAULTS for f2 in FAULTS if f1 != f2]
    return single + pairs


_PEER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.test_tier_remote import make_remote_tier, store_and_put
    from tests.test_tier_remote_deadlines import PEER_PROMPTS, peer_keys
    tier = None
    for line in sys.stdin:  # one line per (re)put: a new client, after the master restarted
        if tier is not None:
            tier.destroy()
        tier = make_remote_tier({master!r}, remote_timeout_s=5.0)  # the store's only segment
        for attempt in range(50):  # the first puts after a restart may race the master's start
            for toks, page in PEER_PROMPTS:
                store_and_put(tier, toks, first_page=page)
            if tier.lower_tier("remote").medium.store.exists(peer_keys(tier)) == [1] * 8:
                break
            tier.reset()
            time.sleep(0.2)
        print("stored", tier.stats()["remote_blocks_put"], flush=True)
""")


def peer_keys(tier: KVTier) -> list[str]:
    """The keys of the peer's prompts."""
    return [k for toks, _ in PEER_PROMPTS for k in tier.lower_tier("remote").medium.keys(page_hashes(toks, P, None))]


class World:
    """The master and the peer of the module's cases; :meth:`ready` puts the peer's prompts again after the master
    restarted."""

    def __init__(self, log_dir: str) -> None:
        self.master = Master(log_dir)
        self.peer = subprocess.Popen([sys.executable, "-c", _PEER.format(root=ROOT, master=self.master.addr)],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.stale = True  # the peer's prompts are not in the store (yet, or after a restart)
        kv = make_kv(TINY, 128, "cpu", torch.Generator().manual_seed(0))  # the peer's device bytes (its seed)
        self.want = {toks.tobytes(): [as_bytes(b[page_slots(page, 4, P)]).clone() for b in kv.buffers]
                     for toks, page in PEER_PROMPTS}

    def ready(self) -> None:
        if self.stale:
            self.peer.stdin.write("put\n")
            self.peer.stdin.flush()
            line = self.peer.stdout.readline().split()
            assert line == ["stored", "8"], f"the peer did not put its prompts: {line}"
            self.stale = False

    def fire(self, fault: str) -> None:
        if fault == "stop_master":
            self.master.pause()
        elif fault == "kill_master":
            self.master.kill()
        else:
            stop(self.peer.pid)

    def heal(self) -> None:
        """Everything answers again: the master resumed or restarted (the peer's prompts then put again), the peer
        resumed."""
        os.kill(self.peer.pid, 18)  # SIGCONT
        if self.master.proc is None:
            self.master.start()
            self.stale = True
        else:
            self.master.resume()

    def close(self) -> None:
        os.kill(self.peer.pid, 18)
        self.peer.kill()
        self.peer.wait(10)
        if self.master.proc is not None:
            self.master.resume()
        self.master.kill()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    require_mooncake()
    left = len(remote_tier.LEFT_TO_EXIT)
    w = World(str(tmp_path_factory.mktemp("deadlines")))
    try:
        yield w
    finally:
        for store in remote_tier.LEFT_TO_EXIT[left:]:  # their calls returned when the world healed: closed here,
            if _answers(store):  # not at the process's exit (after the master is gone)
                store.close()
        del remote_tier.LEFT_TO_EXIT[left:]
        w.close()


def _answers(store, seconds: float = 10.0) -> bool:
    """Whether a client's master answers it within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        codes = store.exists(["deadline-test/health"])
        if codes and codes[0] >= 0:
            return True
        time.sleep(0.2)
    return False


class Script:
    """One case: the engine calls of the script on ``tier``, each timed; the armed faults fire at their points."""

    def __init__(self, world: World, tier: KVTier, faults: tuple) -> None:
        self.world, self.tier = world, tier
        self.armed = {point: fault for fault, point in faults}
        self.fired: list[str] = []
        self.times: list[tuple[str, float]] = []
        self.loaded: list[int] = []  # pages of each load of a peer's prompt
        self.close_s = 0.0  # inside Mooncake's own close (destroy): it joins the client's threads holding the GIL
        store = tier.lower_tier("remote").medium.store
        for method in CALL_POINTS & set(self.armed):
            before_calls(store, method, lambda m=method: self.at(m))
        real_close = store.close

        def close() -> None:
            t0 = time.monotonic()
            try:
                real_close()
            finally:
                self.close_s += time.monotonic() - t0
        store.close = close

    def at(self, point: str) -> None:
        fault = self.armed.pop(point, None)
        if fault is not None:
            self.world.fire(fault)
            self.fired.append(f"{fault}@{point}")

    def call(self, name: str, fn: Callable, *args):
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.times.append((name, time.monotonic() - t0))

    def fetch_started(self, task) -> Optional[object]:
        """The fetch's job once its probe stage has returned or been given up on (not an engine call)."""
        rec = self.tier.in_flight().get(task.id) if task is not None else None
        if rec is not None:
            rec.completion.wait(TIMEOUT + 1)
        return rec

    def run(self) -> None:
        t, own = self.tier, prompt(3, 4)
        self.at("store")
        self.call("store", lambda: t.wait(t.store(own, None, page_slots(0, 4, P))))
        self.at("lookup")
        first = self.call("lookup", t.lookup_tiers, PEER_PROMPTS[0][0], None).read
        self.fetch_started(first)
        self.at("start_get")
        self.call("poll", t.poll)
        self.at("wait")
        if first is not None:
            self.call("wait", t.wait, first)
        self.load(PEER_PROMPTS[0][0])
        second = self.call("lookup", t.lookup_tiers, PEER_PROMPTS[1][0], None).read
        if second is not None:
            self.call("wait", t.wait, second)
        self.load(PEER_PROMPTS[1][0])
        self.call("stats", t.stats)
        self.call("wait_all", t.wait_all)
        self.at("reset")
        self.call("reset", t.reset)
        self.call("store", lambda: t.wait(t.store(prompt(4, 4), None, page_slots(4, 4, P))))
        self.call("lookup", t.lookup_tiers, PEER_PROMPTS[0][0], None)
        self.accounted()

    def load(self, toks: np.ndarray) -> None:
        """Load what the tier holds of ``toks``: the peer's bytes, page for page."""
        dst = page_slots(40, 4, P)
        task = self.call("load", self.tier.load, toks, None, dst)
        self.call("wait", self.tier.wait, task)
        got, want = slot_bytes(self.tier, dst), self.world.want[toks.tobytes()]
        self.loaded.append(task.num_pages)
        n = task.num_pages * P
        assert all(torch.equal(g[:n], w[:n]) for g, w in zip(got, want)), f"wrong bytes in {task.num_pages} pages"

    def accounted(self) -> None:
        """Every CPU block is free, held by the index, owned by a task in flight or held by remote IO."""
        t = self.tier
        s = t.stats()
        owned = sum(r.block_ids.size for r in t.in_flight().values())
        assert t.pool.num_free + s["pages_held"] + owned + s["held_cpu_blocks"] == t.pool.num_blocks, s

    def end(self) -> None:
        """Destroy the tier and heal the world: destroy under the fault armed at "destroy" (a client whose master
        does not answer is left to the process's exit), after healing otherwise (the calls that hung return, the
        client closes)."""
        if "destroy" in self.armed:
            self.at("destroy")
            self.call("destroy", self.tier.destroy)
            self.world.heal()
        else:
            self.world.heal()
            self.call("destroy", self.tier.destroy)


@pytest.mark.parametrize("faults", _cases(), ids=lambda fs: "+".join(f"{f}@{p}" for f, p in fs))
def test_every_engine_call_returns_within_its_bound(world, faults):
    world.ready()
    tier = make_remote_tier(world.master.addr, seed=1, remote_segment_gb=0, remote_timeout_s=TIMEOUT)
    script = Script(world, tier, faults)
    try:
        script.run()
    finally:
        script.end()
    if len(faults) == 1:
        assert not script.armed, f"the script never reached {script.armed}"
        if faults[0][1] in ("reset", "destroy"):  # healthy until then: both prompts fetched and loaded whole
            assert script.loaded == [4, 4], script.loaded
    bound = TIMEOUT + SLACK_S
    slow = [(name, round(s, 3)) for name, s in script.times
            if s > bound + (script.close_s if name == "destroy" else 0.0)]
    assert not slow, f"calls past {bound} s with {script.fired} (Mooncake's close {script.close_s:.3f} s): {slow}"
