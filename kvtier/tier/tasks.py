"""The tier's tasks as the engine sees them (:class:`TierTask`, its kind and status), and the records the tier
keeps of each copy in flight until it is finalized (:class:`TaskTable`).

Kinds and statuses are string enums: a task's ``kind == "store"`` and ``status == "done"`` still hold, and they
print as their values.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Union

import numpy as np

if TYPE_CHECKING:
    from kvtier.index import InsertResult, MatchResult, Namespace
    from kvtier.tier.lower import LowerTier

__all__ = ["TaskKind", "TaskStatus", "TierTask", "CopyRecord", "LoadRecord", "InsertRecord", "COMPLETED", "InFlight",
           "TaskTable"]


class _Named(str, enum.Enum):
    """A string enum that prints (and formats) as its value."""

    def __str__(self) -> str:
        return self.value


class TaskKind(_Named):
    """What a task copies."""

    STORE = "store"  # device slots to new CPU blocks
    LOAD = "load"  # CPU blocks to device slots, all layers at once
    LOAD_LAYERWISE = "load_layerwise"  # the same, layer by layer through the LayerDoneCounter
    READ = "read"  # a lower tier's blocks (an SSD promotion, a remote fetch) read into new CPU blocks

    @property
    def reads_lower_tier(self) -> bool:
        """Whether the task reads a lower tier (IO jobs, not copies on a stream)."""
        return self is TaskKind.READ

    @property
    def stream(self) -> str:
        """The executor stream its copy runs on: ``"store"`` (device to host) or ``"load"``."""
        return "store" if self is TaskKind.STORE else "load"

    @property
    def inserts(self) -> bool:
        """Whether its blocks enter the CPU index when it is finalized (a store, a read)."""
        return self not in (TaskKind.LOAD, TaskKind.LOAD_LAYERWISE)


class TaskStatus(_Named):
    """Where a task stands."""

    INFLIGHT = "inflight"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"  # issuing its copy raised: nothing was stored or loaded, and what it took is given back


@dataclasses.dataclass
class TierTask:
    """A store or load handed back to the engine.

    Attributes:
        id: task id (reported once by ``poll``).
        kind: a :class:`TaskKind`.
        num_pages: pages this task copies (store: new pages; load: hit pages loaded; read: 0 until its count is
            known and it has CPU blocks, then the pages it reads).
        num_held: store and read: leading pages already held on the CPU, not copied.
        producer_index: layerwise loads: the LayerDoneCounter slot to set as consumer (-1: nothing to wait for).
        status: a :class:`TaskStatus` (``failed``: ``num_pages`` is 0).
        source: a read's lower tier (``"ssd"``, ``"remote"``); None for the others.
    """

    id: int
    kind: TaskKind
    num_pages: int
    num_held: int = 0
    producer_index: int = -1
    status: TaskStatus = TaskStatus.INFLIGHT
    source: Optional[str] = None

    @property
    def done(self) -> bool:
        return self.status != TaskStatus.INFLIGHT


@dataclasses.dataclass
class CopyRecord:
    """What the tier keeps of a task until it is finalized.

    Attributes:
        task: the task.
        completion: an executor's fence, or a read's job (:class:`~kvtier.tier.lower.ReadJob`).
        block_ids: a load's blocks read; a store's or read's new blocks, owned by the task.
        handle: the locked index path (a MatchResult) or None.
        nbytes: bytes the copy moves.
        ns: the namespace of its pages.
        retry: a copy whose issue failed, kept for ordered finalization: issues the same copy again (the same
            blocks and slots) and returns its record (:meth:`~kvtier.tier.KVTier.retry`).
        retry_pages: the pages that copy moves.
        reads: the device slot indices the copy reads (a tensor the tier may have made from the caller's), kept
            until the copy is finalized: freed earlier, the caching allocator could hand its memory to the
            caller's stream while the tier's stream still reads it.
    """

    task: TierTask
    completion: Any  # an executor's fence (each executor's own type) or a lower tier's read job
    block_ids: np.ndarray
    handle: Optional[Union[MatchResult, InsertResult]]
    nbytes: int
    ns: Optional[Namespace] = None
    retry: Optional[Callable[[], "CopyRecord"]] = dataclasses.field(default=None, repr=False)
    retry_pages: int = 0
    reads: Optional[object] = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass
class LoadRecord(CopyRecord):
    """A load in flight: its path stays locked until it is finalized."""


@dataclasses.dataclass
class InsertRecord(CopyRecord):
    """A store or read in flight: its new blocks enter the index behind the held prefix when it is finalized.

    Attributes:
        tokens: tokens of the held prefix and the new blocks.
        prefix_ids: blocks of the held prefix.
        tier: a read's lower tier.
    """

    tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    prefix_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.empty(0, np.int64))
    tier: Optional[LowerTier] = dataclasses.field(default=None, repr=False)


class _Completed:
    """The completion of a copy that has nothing left to run (a failed issue kept for ordered finalization)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def seconds(self) -> Optional[float]:
        return None


COMPLETED = _Completed()


class InFlight(NamedTuple):
    """A task in flight, as :meth:`KVTier.in_flight` shows it (read-only: ``block_ids`` and ``tokens`` are copies)."""

    task: TierTask
    block_ids: np.ndarray  # a store's or read's new CPU blocks (owned by the task); a load's blocks read
    tokens: Optional[np.ndarray]  # a store's or read's tokens (the held prefix and the new blocks); None for a load
    prefix_ids: Optional[np.ndarray]  # a store's or read's held prefix (locked blocks); None for a load
    ns: object  # the namespace of its pages
    completion: object  # what it waits on: an executor's fence, or a read's job (its tier's ReadJob)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


class TaskTable:
    """A tier's records of its tasks in flight, by id, and the ids finalized since the last poll."""

    def __init__(self) -> None:
        self.records: dict[int, CopyRecord] = {}
        self.finished: list[int] = []
        self._next_id = 0

    def new(self, kind: TaskKind, num_pages: int, num_held: int = 0) -> TierTask:
        task = TierTask(self._next_id, kind, num_pages, num_held)
        self._next_id += 1
        return task

    def finish_now(self, task: TierTask) -> TierTask:
        """``task`` had nothing to copy: done, and reported by the next poll."""
        task.status = TaskStatus.DONE
        self.finished.append(task.id)
        return task

    def take_finished(self) -> list[int]:
        out, self.finished = self.finished, []
        return out

    def view(self) -> dict[int, InFlight]:
        """Every task in flight by id, as read-only copies."""
        return {tid: InFlight(rec.task, _frozen(rec.block_ids),
                              _frozen(rec.tokens) if isinstance(rec, InsertRecord) else None,
                              _frozen(rec.prefix_ids) if isinstance(rec, InsertRecord) else None, rec.ns,
                              rec.completion)
                for tid, rec in self.records.items()}
