"""TP ranks as real processes for stateful tests: each rank runs the SGLang backend over a gloo group and executes,
in lockstep, the operations a test sends to every rank; each rank's copies complete when the test says so for that
rank, so the ranks' GPUs (deferred CPU executors here) finish at different moments.

:class:`Ranks` (the test side) spawns the ranks once and sends each operation to all of them; :class:`RankState`
(the rank side) holds one rank's backend and runs the operations. A rank's error is returned with its traceback;
the ranks are then restarted for the next example, since a rank left in a collective cannot go on.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from typing import Optional

import torch
import torch.multiprocessing as mp

REPLY_TIMEOUT_S = 120.0  # one operation, every rank (a rank stuck in a collective times out after 60 s itself)


class RankError(AssertionError):
    """An operation raised on a rank (the message carries that rank's traceback)."""


class RankState:
    """One rank's backend (``tests.sglang_helpers.build`` over the TP group) and the operations a test runs on it.

    Args:
        rank: this rank.
        fail_rate: fraction of copies that fail while being issued (0: none); each rank draws its own failures.
        seed: the failure draws' seed (each rank adds its rank: the ranks fail different copies).
    """

    BASES = [list(range(1000 * b + 1, 1000 * b + 17)) for b in range(2)]  # 16 tokens each
    NAMESPACES = [None, "lora-a"]

    def __init__(self, rank: int, fail_rate: float, seed: int) -> None:
        import torch.distributed as dist

        from kvtier.tier import DeferredExecutor, FailingExecutor
        from tests import sglang_helpers as h

        self.h, self.rank = h, rank
        self.deferred = DeferredExecutor()
        executor = FailingExecutor(self.deferred, fail_rate, seed + rank) if fail_rate else self.deferred
        # 16 device pages of 4 tokens; 8 host blocks, so the host evicts too
        self.s = h.build(kv_size=64, page_size=4, host_blocks_kb=4, max_reqs=8, executor=executor,
                         tp_group=dist.group.WORLD)
        self.free0 = self.s.allocator.available_size()
        self.host_free0 = self.s.cache.tier.pool.num_free
        self.running = []
        self.kv_checks = self.host_loads = 0

    # --- operations (the same on every rank, in the same order) ---

    def _admit_and_forward(self, tokens, ns):
        req, a = self.h.admit_checked(self.s, tokens, extra_key=self.NAMESPACES[ns], ns_tag=ns)
        self.kv_checks += a.device_len + a.loaded > 0
        self.host_loads += a.loaded > 0
        return req

    def finished_request(self, base, n, suffix, ns, flush_first):
        if flush_first:
            self.h.flush_device(self.s)
        req = self._admit_and_forward(self.BASES[base][:n] + [5000 + t for t in suffix], ns)
        if req is not None:
            self.h.release(self.s, req)

    def start_request(self, base, n, ns):
        req = self._admit_and_forward(self.BASES[base][:n], ns)
        if req is not None:
            self.running.append(req)

    def end_request(self, abort):
        req = self.running.pop(0)
        if abort:
            self.s.cache.release_aborted_request(req.cache_request_handle)
        self.h.release(self.s, req, checkpoint=not abort)

    def flush_device(self):
        self.h.flush_device(self.s)

    def evict_device(self, n):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.s.cache.evict(EvictParams(num_tokens=n))

    def evict_host(self, n):
        self.s.cache.tier.evict(n)

    def complete(self, per_rank):
        """This rank's GPU finishes its next ``per_rank[rank]`` copies on each stream (no agreement)."""
        for name in ("store", "load"):
            self.deferred.release(name, per_rank[self.rank])

    def round(self):
        """The end of a scheduling round: SGLang's flush_pending_backups, where the ranks agree."""
        self.s.cache.flush_pending_backups()

    def collectives_in_match(self, base, n, ns) -> list:
        """``match_prefix`` of a request: (host hit, how many collectives it issued on this rank)."""
        import torch.distributed as dist
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        from array import array

        calls = []
        real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast", "barrier")}

        def counted(name):
            def call(*a, **k):
                calls.append(name)
                return real[name](*a, **k)
            return call

        req = self.h.make_req(self.s, self.BASES[base][:n], extra_key=self.NAMESPACES[ns])
        for name in real:
            setattr(dist, name, counted(name))
        try:
            m = self.s.cache.match_prefix(MatchPrefixParams(
                key=RadixKey(array("q", self.BASES[base][:n]), req.extra_key), req=req))
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)
        self.s.req_to_token_pool.free(req)
        return [m.host_hit_length, len(calls)]

    def digest(self) -> list:
        """What every rank must hold alike: the device tree, its sizes and locks, the host index, tracked copies."""
        s = self.s
        return [self.h.tree_digest(s), s.allocator.available_size(), s.cache.num_inflight, len(self.running)]

    def teardown(self) -> dict:
        """Release everything and report the leaks (each must be 0) and the KV checks made."""
        s = self.s
        while self.running:
            self.h.release(s, self.running.pop())
        s.cache.wait_all()
        inflight, protected = s.cache.num_inflight, s.cache.protected_size()
        self.h.flush_device(s)
        s.cache.tier.evict(s.cache.tier.pool.num_blocks)
        return {"inflight": inflight, "protected": protected, "device_tokens": s.cache.total_size(),
                "slots_leaked": self.free0 - s.allocator.available_size(),
                "host_blocks_leaked": self.host_free0 - s.cache.tier.pool.num_free,
                "host_pages": s.cache.tier.index.total_pages, "kv_checks": self.kv_checks,
                "host_loads": self.host_loads}


def _rank_main(rank: int, world: int, init_file: str, commands, replies) -> None:
    """A rank's process: join the gloo group, then run the commands it receives until ``stop``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # tests talk over loopback only
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    state: Optional[RankState] = None
    try:
        while True:
            op, args = commands.get()
            if op == "stop":
                break
            try:
                if op == "new":
                    state = RankState(rank, *args)
                    out = None
                else:
                    out = getattr(state, op)(*args)
                replies.put((rank, True, out))
            except BaseException:
                replies.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class Ranks:
    """``world`` rank processes; :meth:`call` runs one operation on all of them and returns each rank's result."""

    def __init__(self, world: int = 2) -> None:
        self.world = world
        self.procs = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.dir = tempfile.mkdtemp(prefix="kvtier_tp_")
        self.commands = [ctx.Queue() for _ in range(self.world)]
        self.replies = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, daemon=True,
                                  args=(r, self.world, os.path.join(self.dir, "pg"), self.commands[r], self.replies))
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def call(self, op: str, *args) -> list:
        if not self.procs:
            self._start()
        for q in self.commands:
            q.put((op, args))
        out, errors = [None] * self.world, []
        for _ in range(self.world):
            try:
                rank, ok, value = self.replies.get(timeout=REPLY_TIMEOUT_S)
            except queue.Empty:
                errors.append(f"no reply to {op}{args} within {REPLY_TIMEOUT_S} s")
                break
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}, {op}{args}:\n{value}")
        if errors:
            self.close()  # a rank may be left inside a collective: start afresh next time
            raise RankError("\n".join(errors))
        return out

    def close(self) -> None:
        for q, p in zip(self.commands, self.procs):
            if p.is_alive():
                q.put(("stop", ()))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []
