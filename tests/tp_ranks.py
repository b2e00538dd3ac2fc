"""Ranks as real processes for stateful tests: each rank runs the SGLang backend over gloo groups and executes the
operations a test sends to every rank; each rank's copies complete when the test says so for that rank, so the ranks'
GPUs (deferred CPU executors here) finish at different moments.

A :class:`Topology` lays the ranks out as SGLang does: ``pp`` pipeline stages (global rank = stage * tp_size +
TP rank), each of ``dp`` DP-attention ranks times ``tp`` attention-TP ranks. Each rank's cache agrees within its
attention-TP group and along its PP group (:func:`kvtier.sglang.rank_agreement`'s groups). The ranks of a stage run
an operation in lockstep; the stages run it one after another, first stage first, as a pipeline's stages reach the
same scheduling step one behind the other (nothing may make an earlier stage wait for a later one). DP ranks run
their own requests (an operation may apply to some of them only): they must never wait for each other.

:class:`Ranks` (the test side) spawns the ranks once and sends each operation to all of them; :class:`RankState`
(the rank side) holds one rank's backend and runs the operations. A rank's error is returned with its traceback;
the ranks are then restarted for the next example, since a rank left in a collective cannot go on.
"""

from __future__ import annotations

import dataclasses
import datetime
import types
import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Optional

import torch
import torch.multiprocessing as mp

REPLY_TIMEOUT_S = 120.0  # one operation, every rank (a rank stuck in a collective times out after 60 s itself)


class RankError(AssertionError):
    """An operation raised on a rank (the message carries that rank's traceback)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """How the ranks are laid out (see the module docstring); ``mla``: MLA pools instead of MHA."""

    tp: int = 2  # attention-TP ranks of one DP rank
    dp: int = 1  # DP-attention ranks
    pp: int = 1  # pipeline stages
    mla: bool = False
    layers: tuple = (2,)  # layers of each stage (cycled: stages may hold different counts)

    @property
    def tp_size(self) -> int:  # SGLang's --tp-size (DP attention splits it)
        return self.tp * self.dp

    @property
    def world(self) -> int:
        return self.tp_size * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, DP rank, attention-TP rank) of a global rank."""
        stage, tp_rank = divmod(rank, self.tp_size)
        return stage, tp_rank // self.tp, tp_rank % self.tp

    def stage_layers(self, stage: int) -> tuple[int, int]:
        """(first layer, layer count) of a stage."""
        counts = [self.layers[p % len(self.layers)] for p in range(stage + 1)]
        return sum(counts[:-1]), counts[-1]

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp_size, (stage + 1) * self.tp_size))


class TransientFailingExecutor:
    """A :class:`~kvtier.tier.executor.FailingExecutor` whose faults are transient: a copy a later pipeline stage
    issues again (``KVTier.retry``, wrapped by :meth:`attach`) goes through."""

    def __init__(self, inner, rate: float, seed: int) -> None:
        from kvtier.tier.executor import FailingExecutor

        self._failing = FailingExecutor(inner, rate, seed)
        self._repairing = False

    def attach(self, cache) -> None:
        """Let ``cache``'s repairs (a copy issued again) issue without faults."""
        retry = cache.tier.retry

        def reliable_retry(*args, **kwargs):
            self._repairing = True
            try:
                return retry(*args, **kwargs)
            finally:
                self._repairing = False

        cache.tier.retry = reliable_retry

    def run(self, name: str, fn, own_stream: bool = False) -> None:
        (self._failing.inner if self._repairing else self._failing).run(name, fn, own_stream)

    def __getattr__(self, name: str):
        return getattr(self._failing.inner, name)


def _agreement(topo: Topology, rank: int):
    """This rank's :class:`~kvtier.sglang.agreement.RankAgreement`, as the factory builds it
    (:func:`kvtier.sglang.rank_agreement`) from SGLang's cache groups: the TP group of a stage, the attention-TP
    group of a DP rank (SGLang's ``tp_cache_group`` with DP attention), an attention-CP group (one rank here) and the
    PP group. Every rank creates every group, in one order."""
    import torch.distributed as dist
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext
    from sglang.srt.server_args import ServerArgs

    import kvtier.sglang as ks

    def group(ranks):
        g = dist.new_group(ranks, backend="gloo")
        return g if rank in ranks else None

    stage, dp, _ = topo.coords(rank)
    tp = attn_tp = attn_cp = pp = None
    for p in range(topo.pp):
        tp = group(topo.stage_ranks(p)) or tp
        for d in range(topo.dp):
            attn_tp = group([p * topo.tp_size + d * topo.tp + i for i in range(topo.tp)]) or attn_tp
    for r in range(topo.world):
        attn_cp = group([r]) or attn_cp
    for t in range(topo.tp_size):
        pp = group([p * topo.tp_size + t for p in range(topo.pp)]) or pp
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=4,
                             tp_cache_group=attn_tp if topo.dp > 1 else tp, attn_tp_cache_group=attn_tp,
                             attn_cp_cache_group=attn_cp, pp_cache_group=pp, pp_rank=stage, pp_size=topo.pp)
    ctx = TreeCacheBuildContext(server_args=ServerArgs(model_path="dummy", page_size=4), params=params,
                                is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False,
                                disable_radix_cache=False, tp_worker=None, model_config=None, tp_size=topo.tp_size,
                                tp_rank=rank % topo.tp_size, tp_group=types.SimpleNamespace(cpu_group=tp))
    return ks.rank_agreement(ctx)


class RankState:
    """One rank's backend (``tests.sglang_helpers.build`` over the TP group) and the operations a test runs on it.

    Args:
        rank: this rank.
        fail_rate: fraction of copies that fail while being issued (0: none), or one per pipeline stage; each
            rank draws its own failures.
        seed: the failure draws' seed (each rank adds its rank: the ranks fail different copies).
        topo: the layout of the ranks (default: two TP ranks).
        lasting: failures on a later pipeline stage recur when the copy is issued again (default: transient).
        ssd: an SSD tier below each rank's host pool (a directory of its own, written through at each rank's own
            moments by its write threads).
        remote: the address of a Mooncake master: a remote tier below each rank's host pool, its keys of this
            example's own (``seed`` names them).

    A DP rank's requests use tokens of its own (``dp_rank * 100000`` added), so two DP ranks never hold alike.
    Failures on a later pipeline stage are transient (:class:`TransientFailingExecutor`): the stage issues the copy
    again when the first stage's went through.
    """

    BASES = [list(range(1000 * b + 1, 1000 * b + 17)) for b in range(2)]  # 16 tokens each
    NAMESPACES = [None, "lora-a"]

    def __init__(self, rank: int, fail_rate: float, seed: int, lasting: bool = False, ssd: bool = False,
                 remote: Optional[str] = None, *, topo: Optional[Topology] = None) -> None:
        from kvtier.tier.executor import DeferredExecutor, FailingExecutor
        from tests import sglang_helpers as h

        topo = topo or Topology()
        self.h, self.rank, self.topo = h, rank, topo
        self.stage, self.dp_rank, _ = topo.coords(rank)
        agreement = _agreement(topo, rank)
        self.deferred = DeferredExecutor()
        executor = self.deferred
        if isinstance(fail_rate, (tuple, list)):
            fail_rate = fail_rate[self.stage]
        if fail_rate:
            failing = TransientFailingExecutor if self.stage > 0 and not lasting else FailingExecutor
            executor = failing(self.deferred, fail_rate, seed + rank)
        # 16 device pages of 4 tokens; 4 KiB of host blocks on every rank (8 blocks of 2 MHA layers, fewer of more
        # layers: the ranks agree on the smallest count), so the host evicts too
        start, layers = topo.stage_layers(self.stage)
        self.ssd_dir = tempfile.mkdtemp(prefix=f"kvtier_ssd_rank{rank}_") if ssd else None
        self.lower = bool(ssd or remote)
        identity = {"model": f"tp-ranks-{seed}", "tp_rank": rank % topo.tp_size, "tp_size": topo.tp_size}
        self.s = h.build(kv_size=64, page_size=4, host_blocks_kb=4, max_reqs=8, executor=executor,
                         agreement=agreement, mla=topo.mla, layers=layers, start_layer=start, ssd_dir=self.ssd_dir,
                         remote_master=remote,
                         metrics_labels={"tp_rank": str(rank % topo.tp_size), "pp_rank": str(self.stage)},
                         **({"model_identity": identity} if self.lower else {}))
        if isinstance(executor, TransientFailingExecutor):
            executor.attach(self.s.cache)
        self.ssd_delay_s = 0.0
        for name in ("ssd", "remote") if self.lower else ():  # each write takes ssd_delay_s longer (ssd_delay):
            medium = self.s.cache.tier.lower_tier(name)  # this rank's blocks reach its lower tiers late
            if medium is not None:
                self._slow_puts(medium.medium.store)
        self.free0 = self.s.allocator.available_size()
        self.host_free0 = self.s.cache.tier.pool.num_free
        self.running = []
        self.kv_checks = self.host_loads = 0

    # --- operations (the same on every rank, in the same order) ---

    def _tokens(self, tokens) -> list:
        return [t + 100000 * self.dp_rank for t in tokens]

    def _admit_and_forward(self, tokens, ns):
        req, a = self.h.admit_checked(self.s, self._tokens(tokens), extra_key=self.NAMESPACES[ns], ns_tag=ns)
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

    def steps(self, ops):
        """Run ``(op, args)`` pairs in order, in one call (no rank waits for another between them)."""
        return [getattr(self, op)(*args) for op, args in ops]

    def slow_verdicts(self, rank, seconds):
        """Rank ``rank`` learns each round's agreed completions ``seconds`` late (a rank of a later stage whose
        scheduler runs behind); no-op elsewhere."""
        if self.rank == rank:
            agreement = self.s.cache.agreement
            completed = agreement.completed

            def late(*args, **kwargs):
                time.sleep(seconds)
                return completed(*args, **kwargs)
            agreement.completed = late

    def _slow_puts(self, store) -> None:
        put = store.put

        def slow_put(*args, **kwargs):
            time.sleep(self.ssd_delay_s)
            return put(*args, **kwargs)
        store.put = slow_put

    def ssd_delay(self, per_rank):
        """Each rank's lower-tier writes (SSD writes, remote puts) take ``per_rank[rank]`` seconds longer from now
        on (no agreement)."""
        self.ssd_delay_s = per_rank[self.rank]

    def wait_ssd_writes(self):
        """Every SSD write of this rank queued so far is durable and accounted."""
        self.s.cache.tier.flush_lower()

    def wait_reads(self):
        """This rank's lower-tier reads in flight have ended (no agreement: they are finalized by a round)."""
        tier = self.s.cache.tier
        for rec in tier.in_flight().values():
            if rec.task.kind == "read":
                rec.completion.wait(10)

    def ssd_read_counts(self) -> list:
        """(reads started, pages they brought in) on this rank."""
        st = self.s.cache.tier.stats()
        return [st["reads"], st.get("pages_promoted", 0) + st.get("pages_fetched", 0)]

    def on_dp(self, dp_rank, op, *args):
        """``op(*args)`` on the ranks of DP rank ``dp_rank`` only (None: on every rank); None elsewhere."""
        if dp_rank is None or dp_rank == self.dp_rank:
            return getattr(self, op)(*args)
        return None

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
        real = {name: getattr(dist, name)
                for name in ("all_reduce", "all_gather", "broadcast", "barrier", "send", "recv", "isend", "irecv")}

        def counted(name):
            def call(*a, **k):
                calls.append(name)
                return real[name](*a, **k)
            return call

        tokens = self._tokens(self.BASES[base][:n])
        req = self.h.make_req(self.s, tokens, extra_key=self.NAMESPACES[ns])
        for name in real:
            setattr(dist, name, counted(name))
        try:
            m = self.s.cache.match_prefix(MatchPrefixParams(
                key=RadixKey(array("q", tokens), req.extra_key), req=req))
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)
        self.s.req_to_token_pool.free(req)
        return [m.host_hit_length, len(calls)]

    def describe_ranks(self) -> str:
        return self.s.cache.describe_ranks()

    def pool_memory(self) -> dict:
        """Where this rank's host pool lives: shared or private, the segment's (device, inode) as this process maps
        it, bytes, blocks, and the layers its stores copy."""
        tier, shared = self.s.cache.tier, self.s.cache.shared
        return {"shared": shared is not None, "inode": list(shared.segment.inode()) if shared else None,
                "nbytes": tier.pool.nbytes, "num_blocks": tier.pool.num_blocks, "block_bytes": tier.pool.block_bytes,
                "store_layers": [tier.store_layers.start, tier.store_layers.stop],
                "bytes_stored": tier.stats()["bytes_d2h"]}

    def digest(self) -> list:
        """What every rank must hold alike: the device tree, its sizes and locks, the host index, tracked copies,
        and the host pool's every allocation and free in order (its block digest: the same blocks given to the same
        copies, whatever failed where)."""
        s = self.s
        pool = s.cache.tier.pool  # with lower tiers a block held by a write goes back at this rank's own moment
        return [self.h.tree_digest(s), s.allocator.available_size(), s.cache.num_inflight, len(self.running),
                pool.num_blocks, 0 if self.lower else pool.block_digest, s.cache.num_reads]

    def teardown(self) -> dict:
        """Release everything and report the leaks (each must be 0) and the KV checks made."""
        s = self.s
        while self.running:
            self.h.release(s, self.running.pop())
        s.cache.wait_all()
        inflight, protected = s.cache.num_inflight, s.cache.protected_size()
        self.h.flush_device(s)
        tier = s.cache.tier
        tier.evict(tier.pool.num_blocks)
        tier.flush_lower()  # SSD writes hold the blocks they read until they are durable
        tier.poll()
        out = {"inflight": inflight, "protected": protected, "device_tokens": s.cache.total_size(),
               "slots_leaked": self.free0 - s.allocator.available_size(),
               "host_blocks_leaked": self.host_free0 - tier.pool.num_free, "reads_tracked": s.cache.num_reads,
               "host_pages": tier.index.total_pages, "kv_checks": self.kv_checks, "host_loads": self.host_loads,
               "repairs": s.cache.repairs, "lower_reads": tier.stats()["reads"],
               "pages_read": tier.stats().get("pages_promoted", 0) + tier.stats().get("pages_fetched", 0)}
        if self.lower:
            s.cache.release_host_resources()  # the lower tiers' threads, files and store clients
        if self.ssd_dir:
            shutil.rmtree(self.ssd_dir, ignore_errors=True)
        return out


def _rank_main(rank: int, world: int, init_file: str, commands, replies, topo: Topology) -> None:
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
                    state = RankState(rank, *args, topo=topo)
                    out = None
                else:
                    out = getattr(state, op)(*args)
                replies.put((rank, True, out))
            except BaseException:
                replies.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class Ranks:
    """The rank processes of ``topo`` (default: ``world`` TP ranks); :meth:`call` runs one operation on all of them
    and returns each rank's result."""

    def __init__(self, world: int = 2, topo: Optional[Topology] = None) -> None:
        self.topo = topo or Topology(tp=world)
        self.world = self.topo.world
        self.procs = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.dir = tempfile.mkdtemp(prefix="kvtier_tp_")
        self.commands = [ctx.Queue() for _ in range(self.world)]
        self.replies = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, daemon=True,
                                  args=(r, self.world, os.path.join(self.dir, "pg"), self.commands[r], self.replies,
                                        self.topo))
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def call(self, op: str, *args, lockstep: bool = False) -> list:
        """Run ``op(*args)`` on every rank: the stages one after another, first stage first (``lockstep``: every
        rank at once, for operations that are collective across the stages, such as building the caches)."""
        if not self.procs:
            self._start()
        if op == "new":
            lockstep = True
        waves = [list(range(self.world))] if lockstep else [self.topo.stage_ranks(p) for p in range(self.topo.pp)]
        out, errors = [None] * self.world, []
        for ranks in waves:
            for r in ranks:
                self.commands[r].put((op, args))
            for _ in ranks:
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
        deadline = time.monotonic() + 10  # one bound for all: ranks that hang on exit are killed together
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []
