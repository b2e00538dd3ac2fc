"""How the ranks that hold one cache agree on what differs between them: how many copies each has completed, which
failed, how many pages a load brought.

The ranks of one cache are the attention ranks of one batch (TP, attention CP, DP attention's TP group) times the
pipeline stages. Their host tiers must evolve identically: same pages, same locks, same evictions, whatever each
GPU's timing. kvtier gets there by agreeing on the values that differ and then acting alike.

* **Within a stage** (TP / attention CP ranks run the same batch in lockstep): a blocking all-reduce over each of
  the stage's groups in turn (MIN of counts, MAX of failure flags), as SGLang's own HiCache does
  (``UnifiedRadixCache._all_reduce_attn_groups``). With DP attention a stage's group is its DP rank's attention-TP
  group: other DP ranks run other batches and are never waited for.
* **Across pipeline stages** the first stage decides and its verdict flows down the pipeline point to point (an
  asynchronous send, a blocking receive), as HiCache's ``_pp_sync``: a later stage runs the same scheduling
  sequence behind it and follows its decisions; it never holds up an earlier stage (a blocking collective across
  stages would stall the pipeline for every round). A later stage then waits for its own copies of what was
  decided (they were issued at the same point of its own sequence, so they are usually done).

Every call is made by every rank of the cache at the same point of the scheduling sequence; messages carry a kind,
so a rank whose sequence drifted fails with a clear error instead of reading another call's values.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["RankAgreement", "AgreementError"]

PP_TAG = int.from_bytes(b"PpKv", byteorder="big")  # beside SGLang's P2PTag values on the same PP group
MAX_PENDING_SENDS = 1024  # unconsumed downstream messages kept before a send waits for the oldest

_KIND_MIN, _KIND_COMPLETED, _KIND_CHECK, _KIND_READS, _KIND_COUNTS = 1, 2, 3, 4, 5


class AgreementError(RuntimeError):
    """The ranks' scheduling sequences drifted apart (a message of another kind arrived)."""


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class RankAgreement:
    """The agreement of one cache's ranks (see the module docstring).

    Args:
        stage_groups: the process groups that together span this stage's ranks of the cache (e.g. the attention-TP
            and attention-CP groups; one TP group); groups of one rank are ignored.
        pp_group: the pipeline group of this rank (one rank per stage), or None.
        pp_rank, pp_size: this rank's stage and the number of stages.
    """

    def __init__(self, stage_groups: Sequence = (), *, pp_group=None, pp_rank: int = 0, pp_size: int = 1) -> None:
        self.stage_groups = [g for g in stage_groups if g is not None and _size(g) > 1]
        self.pp_size = int(pp_size) if pp_group is not None else 1
        self.pp_rank = int(pp_rank) if self.pp_size > 1 else 0
        if self.pp_size > 1 and _size(pp_group) != self.pp_size:
            raise ValueError(f"the PP group has {_size(pp_group)} ranks, pp_size is {pp_size}")
        self.pp_group = pp_group if self.pp_size > 1 else None
        self._pending: list[tuple[Any, list[torch.Tensor]]] = []  # sends (torch's Work) not yet received downstream

    @property
    def active(self) -> bool:
        """Whether there is another rank to agree with."""
        return bool(self.stage_groups) or self.pp_size > 1

    @property
    def decides(self) -> bool:
        """Whether this rank's stage decides (the first stage); later stages follow its verdicts."""
        return self.pp_rank == 0

    @property
    def stage_size(self) -> int:
        """Ranks of this stage (the product of its groups' sizes)."""
        n = 1
        for g in self.stage_groups:
            n *= _size(g)
        return n

    @property
    def stage_position(self) -> int:
        """This rank's place among its stage's ranks, 0 .. stage_size - 1 (0: the stage's leader)."""
        p = 0
        for g in self.stage_groups:
            p = p * _size(g) + dist.get_rank(g)
        return p

    @property
    def world(self) -> int:
        """Ranks of the cache: the stage's ranks times the stages."""
        return self.stage_size * self.pp_size

    # --- decisions ---

    def min(self, value: int) -> int:
        """The MIN of ``value`` over the first stage's ranks, on every rank (a later stage's own value is ignored)."""
        return self.mins([value])[0]

    def mins(self, values: Sequence[int]) -> list[int]:
        """The element-wise MIN of ``values`` over the first stage's ranks, on every rank (a later stage's own
        values are ignored)."""
        if not self.decides:
            return self._receive(_KIND_MIN)
        out = self._reduce([int(v) for v in values], dist.ReduceOp.MIN)
        self._send(_KIND_MIN, out)
        return out

    def completed(self, local: int, failed: Callable[[int], list[int]]) -> tuple[int, list[int]]:
        """How many of the oldest tracked copies every deciding rank has completed, and which of those failed on
        any of them: ``(n, flags)`` with ``flags[i]`` 1 for a failed copy. ``failed(n)`` gives this rank's flags of
        its ``n`` oldest copies (called on the first stage only; ``local`` too is read there only)."""
        return self._completed(_KIND_COMPLETED, local, failed, dist.ReduceOp.MAX)

    def completed_reads(self, local: int, verified: Callable[[int], list[int]]) -> tuple[int, list[int]]:
        """How many of the oldest lower-tier reads every deciding rank has completed, and for each the MIN over
        the ranks of its leading blocks verified: ``(n, kept)``; ``verified(n)`` gives this rank's counts of its
        ``n`` oldest reads (first stage only, as ``local``)."""
        return self._completed(_KIND_READS, local, verified, dist.ReduceOp.MIN)

    def counted_reads(self, local: int, wanted: Callable[[int], list[int]]) -> tuple[int, list[int]]:
        """How many of the oldest reads still to be counted every deciding rank knows the count of (a probe
        returned), and for each the MIN over the ranks of the blocks it would read: ``(n, counts)``;
        ``wanted(n)`` gives this rank's (first stage only, as ``local``)."""
        return self._completed(_KIND_COUNTS, local, wanted, dist.ReduceOp.MIN)

    def _completed(self, kind: int, local: int, values: Callable[[int], list[int]], op) -> tuple[int, list[int]]:
        if not self.decides:
            out = self._receive(kind)
            return len(out), out
        n = self._reduce([int(local)], dist.ReduceOp.MIN)[0]
        out = self._reduce(values(n), op) if n else []
        self._send(kind, out)
        return n, out

    def stage_reduce(self, values: Sequence[int], op) -> list[int]:
        """All-reduce ``values`` over this stage's ranks (blocking; every stage's ranks run in lockstep)."""
        return self._reduce([int(v) for v in values], op)

    def stage_barrier(self) -> None:
        """Return once every rank of this stage has called it (one all-reduce)."""
        self._reduce([0], dist.ReduceOp.MAX)

    def check_stage_same(self, values: Sequence[int], what: str) -> None:
        """Raise :class:`AgreementError` unless ``values`` are equal on every rank of this stage."""
        vals = [int(v) for v in values]
        hi = self._reduce(vals + [-v for v in vals], dist.ReduceOp.MAX)
        if hi[:len(vals)] != [-v for v in hi[len(vals):]]:
            raise AgreementError(f"kvtier: the ranks of pipeline stage {self.pp_rank} disagree on {what}")

    def check_same(self, values: Sequence[int], what: str) -> None:
        """Raise :class:`AgreementError` unless ``values`` are equal on every rank of the cache (start-up checks:
        a blocking collective across the stages too)."""
        vals = [int(v) for v in values]
        lo = self.startup_reduce(vals, dist.ReduceOp.MIN)
        hi = self.startup_reduce(vals, dist.ReduceOp.MAX)
        if lo != hi:
            raise AgreementError(f"kvtier: the ranks of this cache disagree on {what}: {lo} .. {hi}")

    def startup_reduce(self, values: Sequence[int], op) -> list[int]:
        """All-reduce ``values`` over every rank of the cache, blocking (construction only: every rank builds its
        cache at start-up, so the stages meet there)."""
        out = self._reduce([int(v) for v in values], op)
        if self.pp_group is not None:
            t = torch.tensor(out, dtype=torch.int64)
            dist.all_reduce(t, op=op, group=self.pp_group)
            out = t.tolist()
        return out

    # --- transport ---

    def _reduce(self, values: list[int], op) -> list[int]:
        if not self.stage_groups or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        for g in self.stage_groups:
            dist.all_reduce(t, op=op, group=g)
        return t.tolist()

    def _peer(self, stage: int) -> int:
        assert self.pp_group is not None  # asked only with pipeline stages
        return dist.get_global_rank(self.pp_group, stage)

    def _send(self, kind: int, values: list[int]) -> None:
        """Pass a verdict to the next stage (asynchronously; the tensors live until it is received)."""
        if self.pp_group is None or self.pp_rank + 1 >= self.pp_size:
            return
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        while len(self._pending) >= MAX_PENDING_SENDS:
            work, _ = self._pending.pop(0)
            work.wait()
        dst = self._peer(self.pp_rank + 1)
        header = torch.tensor([kind, len(values)], dtype=torch.int64)
        tensors = [header]
        works = [dist.isend(header, dst, group=self.pp_group, tag=PP_TAG)]
        if values:
            body = torch.tensor(values, dtype=torch.int64)
            tensors.append(body)
            works.append(dist.isend(body, dst, group=self.pp_group, tag=PP_TAG))
        for w in works:
            self._pending.append((w, tensors))

    def _receive(self, kind: int) -> list[int]:
        """The previous stage's verdict of this ``kind`` (blocking), passed on to the next stage."""
        src = self._peer(self.pp_rank - 1)
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, src, group=self.pp_group, tag=PP_TAG)
        got, n = int(header[0]), int(header[1])
        if got != kind:
            raise AgreementError(f"kvtier: pipeline stage {self.pp_rank} expected a verdict of kind {kind} from "
                                 f"stage {self.pp_rank - 1} and got kind {got}: the stages' scheduling sequences "
                                 "drifted apart")
        values: list[int] = []
        if n:
            body = torch.empty(n, dtype=torch.int64)
            dist.recv(body, src, group=self.pp_group, tag=PP_TAG)
            values = body.tolist()
        self._send(kind, values)
        return values

    def close(self, timeout_s: float = 5.0) -> None:
        """Give the next stage up to ``timeout_s`` to receive what was sent to it, then let the sends go (shutdown:
        a process group torn down under a send in flight resets the next stage's connection)."""
        deadline = time.monotonic() + timeout_s
        for work, _ in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                work.wait(datetime.timedelta(seconds=left))
            except RuntimeError:  # timed out or the next stage is gone: nothing more to wait for
                break
        self._pending.clear()
