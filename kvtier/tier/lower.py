"""The tiers below the CPU pool behind one protocol: what :class:`~kvtier.tier.KVTier` tells them and asks them.

A :class:`KVTier` holds an ordered list of lower tiers, fastest first (today an SSD, then a shared remote store), built
from the config by :func:`open_lower_tiers` through a registry (:func:`register`): a new medium is a module that
implements :class:`LowerTier` and one :func:`register` call, and the manager names none of them. The CPU pool is the
hub: lower tiers move bytes only between their storage and CPU blocks.

What a lower tier is told (each call under the tier's lock; chain hashes are computed once, by the caller):

* :meth:`LowerTier.entered`: CPU blocks entered the CPU index (from a device store, or from a read of a lower
  tier: ``source`` names it, so a tier does not write back what it just served);
* :meth:`LowerTier.evicted`: CPU blocks are leaving the CPU index (a write-back tier writes them now); the pool
  gets a block back only when no lower-tier IO holds it (:class:`~kvtier.tier.block_holds.BlockHolds`);
* :meth:`LowerTier.used`: a prefix was loaded from the CPU tier (its copies below stay warm);
* room: :meth:`LowerTier.reclaim` (blocks to evict ahead so that allocations find free ones) and
  :meth:`LowerTier.came_short` (an allocation found too few).

A read (one task kind, ``"read"``: an SSD promotion and a remote probe-then-get alike) goes:

1. :meth:`LowerTier.plan_read` at a lookup: the blocks past the CPU hit this tier may hold (a :class:`ReadPlan`,
   admitted by cost where the count is known), a read in flight from the same block (:class:`SharedRead`), or None;
2. :meth:`LowerTier.start_read`: its IO begins (a probe), or nothing yet; the job's ``awaiting_blocks()`` says when it
   wants CPU blocks;
3. :meth:`LowerTier.blocks_wanted` (admission once the count is known), the owner allocates them (within
   :meth:`LowerTier.pinned`, so making room does not evict what is being read), :meth:`LowerTier.fill` reads into
   them;
4. the owner polls the job (``done()``), or waits for it (:meth:`LowerTier.wait_read`, each call bounded by the
   tier's deadline; :meth:`LowerTier.check_deadline` gives up on a job past it);
5. :meth:`LowerTier.end_read` when the task is finalized: how many leading blocks arrived verified (they enter the
   CPU index); blocks an IO given up on still uses stay held.

And: :meth:`LowerTier.drain` (account finished IO, free the CPU blocks it held), :meth:`LowerTier.settle`
(before the CPU index is reset), :meth:`LowerTier.flush` (what is queued made durable), :meth:`LowerTier.stats`,
:meth:`LowerTier.close`.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
from typing import Any, Callable, Generic, Iterator, Mapping, NamedTuple, Optional, Protocol, TypeVar

import numpy as np

__all__ = ["LowerTier", "ReadPlan", "SharedRead", "ReadJob", "register", "unregister", "open_lower_tiers",
           "registered", "asked_for", "shared_read"]


class ReadPlan(NamedTuple):
    """Blocks of a lower tier to read past ``held`` CPU-held blocks: their chain hashes (a probe may find fewer),
    namespace seed and tokens; ``detail`` is the tier's own (an SSD's slots)."""

    held: int
    hashes: np.ndarray
    namespace: int
    tokens: np.ndarray  # (blocks, block_tokens)
    detail: Any = None  # the tier's own type (an array of one entry per block is cut with the plan)

    def head(self, k: int) -> "ReadPlan":
        """The plan's first ``k`` blocks (the count several ranks agreed on)."""
        detail = self.detail[:k] if isinstance(self.detail, np.ndarray) else self.detail
        return self._replace(hashes=self.hashes[:k], tokens=self.tokens[:k], detail=detail)


class SharedRead(NamedTuple):
    """A read in flight from the same first block: its task, and the leading blocks of the query it brings (0 when
    its count is not known yet)."""

    task_id: int
    blocks: int


def shared_read(entry: tuple[int, np.ndarray], hashes: np.ndarray, known: bool = True) -> SharedRead:
    """The :class:`SharedRead` of an in-flight read ``entry`` (task id, its chain hashes) for a query of
    ``hashes``: how many leading blocks they share (0 unless ``known``)."""
    task_id, theirs = entry
    if not known:
        return SharedRead(task_id, 0)
    m = min(theirs.size, hashes.size)
    differ = np.flatnonzero(theirs[:m] != hashes[:m])
    return SharedRead(task_id, int(differ[0]) if differ.size else m)


class ReadJob(Protocol):
    """A lower tier's read, as its owner polls it."""

    @property
    def host_ids(self) -> np.ndarray:
        """The CPU blocks it fills (empty until :meth:`LowerTier.fill`)."""

    def awaiting_blocks(self) -> bool:
        """Whether it wants CPU blocks now (its count known, none given yet)."""

    def done(self) -> bool:
        """Whether it has ended (read, failed, or given up on)."""

    def verified(self) -> int:
        """Its leading blocks read and verified so far (final once done; 0 for one given up on)."""

    def seconds(self) -> Optional[float]:
        """Its IO time, once done."""

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until it has ended, or at most ``timeout`` seconds; whether it has ended."""


J = TypeVar("J", bound=ReadJob)  # a tier's read job


class LowerTier(abc.ABC, Generic[J]):
    """A tier below the CPU pool (see the module docstring). ``name`` labels its stats, metrics and transfers."""

    name: str = "lower"
    count_at_plan: bool = True  # a plan's count is what it reads; False: a read learns its count after it starts
    # (a probe), and with several ranks (ordered finalization) the owner agrees on it before any CPU block is given

    # --- blocks of the CPU pool ---

    def observe(self, on_written: Callable, on_stored: Callable, on_removed: Callable) -> None:
        """Report this tier's finished writes ``on_written(blocks, bytes, seconds)``, blocks that became findable
        ``on_stored(hashes, cpu_block_ids)`` and blocks that stopped being findable ``on_removed(hashes)``."""

    def entered(self, ids: np.ndarray, tokens: np.ndarray, ns, positions: np.ndarray, hashes: np.ndarray,
                source: Optional[str]) -> None:
        """CPU blocks ``ids`` entered the CPU index as blocks ``positions`` (ascending) of ``tokens``'s chain, whose
        chain hashes are ``hashes``; ``source``: the lower tier that a read brought them from (None: a store from
        the device)."""

    def evicted(self, ids: np.ndarray) -> None:
        """CPU blocks ``ids`` are leaving the CPU index."""

    def used(self, hashes: np.ndarray) -> None:
        """A prefix of these chain hashes was loaded from the CPU tier."""

    def wants_used(self) -> bool:
        """Whether :meth:`used` does anything (the caller hashes the loaded prefix only then)."""
        return False

    def reclaim(self, free: int, freeing: int) -> int:
        """CPU blocks to evict ahead, given ``free`` free ones and ``freeing`` on their way back."""
        return 0

    def came_short(self, n: int, held: int) -> None:
        """An allocation of ``n`` blocks found too few free while ``held`` let-go blocks waited for their IO."""

    def before_close_evict(self) -> int:
        """At destroy: CPU blocks to evict (and so write) a round at a time before closing (0: none)."""
        return 0

    # --- reads ---

    def holds_next(self, hashes: np.ndarray) -> bool:
        """Whether this tier is known to hold the block of ``hashes[0]`` (without IO): a lower tier after it is not
        asked for it."""
        return False

    @abc.abstractmethod
    def plan_read(self, tokens: np.ndarray, ns, held: int, chain: np.ndarray) -> Optional[ReadPlan | SharedRead]:
        """The blocks after ``held`` CPU-held ones of ``tokens``'s first blocks (``chain``: their chain hashes) to
        read; the read in flight from the same block; None when there is nothing to read (or admission refuses)."""

    @abc.abstractmethod
    def start_read(self, plan: ReadPlan, task_id: int) -> Optional[J]:
        """Begin ``plan``'s read for task ``task_id`` (None: it cannot start, e.g. the tier is down)."""

    @contextlib.contextmanager
    def pinned(self, job: J) -> Iterator[None]:
        """While the owner allocates ``job``'s CPU blocks (making room may write back evicted CPU blocks): what the
        job reads stays put."""
        yield

    @abc.abstractmethod
    def blocks_wanted(self, job: J, tokens: int, held_tokens: int) -> int:
        """CPU blocks ``job`` should read into now that its count is known (0: it ends unread); ``tokens``: the
        request's, ``held_tokens``: those the CPU holds."""

    @abc.abstractmethod
    def fill(self, job: J, ids: np.ndarray) -> None:
        """Read ``job``'s leading blocks into CPU blocks ``ids`` (owned by the job's task until it ends)."""

    def wait_read(self, job: J, released: Callable[[], contextlib.AbstractContextManager]) -> bool:
        """Block until ``job`` makes progress (done, or wanting blocks), with the owner's lock let go of
        (``released()``); False when it was given up on (past the tier's deadline)."""
        with released():
            job.wait()
        return True

    def before_discard(self, job: J) -> None:
        """``job``'s task is about to be dropped (a reset): wait for what must not run on (by default, the job)."""
        job.wait()

    def check_deadline(self, job: J) -> None:
        """Give up on ``job`` if it is past the tier's deadline (a poll, never waited for, meets the same bound)."""

    @abc.abstractmethod
    def end_read(self, job: J, cancelled: bool) -> int:
        """``job``'s task is being finalized: the leading blocks that arrived verified (0 when ``cancelled``);
        blocks an IO still uses stay held until it returns."""

    def note_read(self, pages: int, failed_pages: int) -> None:
        """``pages`` of a finished read entered the CPU index, ``failed_pages`` were allocated and not read."""

    # --- life cycle ---

    def drain(self, wait: bool = False, until: Optional[float] = None) -> None:
        """Account finished IO and give back the CPU blocks it held (all of it first, with ``wait``; by ``until``,
        a ``time.monotonic()`` deadline, when given)."""

    def settle(self) -> None:
        """Before the CPU index is emptied (reset): no IO of this tier may go on reading a CPU block, or its blocks
        stay held (quarantined) until it returns."""
        self.drain(wait=True)

    def flush(self) -> None:
        """Make every queued write durable (a clean shutdown calls it)."""

    def note_prefill(self, tokens: int, seconds: float, cached_tokens: int = 0) -> None:
        """The engine prefilled ``tokens`` tokens past ``cached_tokens`` cached ones in ``seconds`` (admission)."""

    def stats(self) -> dict:
        return {}

    def describe(self) -> str:
        return self.name

    @property
    def close_timeout_s(self) -> float:
        """How long :meth:`close` may wait for IO of this tier."""
        return 0.0

    @abc.abstractmethod
    def close(self, until: Optional[float] = None) -> None:
        """Finish or give up on IO by ``until``, stop threads, close files and connections."""


# --- registry ---

OpenFn = Callable[..., Optional[LowerTier]]
_REGISTRY: dict[str, tuple[OpenFn, Callable]] = {}
BUILTIN = ("kvtier.tier.ssd_link", "kvtier.tier.remote_link")  # the media kvtier ships, in their order
BUILTIN_NAMES = ("ssd", "remote")


def register(name: str, opener: OpenFn, asked: Callable) -> None:
    """Register a lower tier: ``asked(config)`` says whether a config asks for it, ``opener(config, pool, holds,
    block_tokens, identity)`` opens it (None: it runs without, as the config allows). Tiers open in the order
    registered (fastest first)."""
    if not name or name in _REGISTRY:
        raise ValueError(f"lower tier name {name!r} is empty or registered already")
    _REGISTRY[name] = (opener, asked)


def unregister(name: str) -> None:
    """Take a lower tier out of the registry (a plug-in unloaded; tiers already open are not affected)."""
    if name in BUILTIN_NAMES:
        raise ValueError(f"lower tier {name!r} ships with kvtier and cannot be unregistered")
    _REGISTRY.pop(name, None)


def _load_builtin() -> None:
    for module in BUILTIN:  # their register() calls, fastest tier first
        importlib.import_module(module)


def registered() -> list[str]:
    _load_builtin()
    return list(_REGISTRY)


def asked_for(config) -> list[str]:
    """The lower tiers ``config`` asks for, by name."""
    _load_builtin()
    return [name for name, (_, asked) in _REGISTRY.items() if asked(config)]


def open_lower_tiers(config, pool, holds, block_tokens: int, identity: Optional[Mapping]) -> list[LowerTier]:
    """The lower tiers ``config`` asks for, opened in registry order; those opened are closed if a later one
    fails."""
    _load_builtin()
    tiers: list[LowerTier] = []
    try:
        for opener, asked in _REGISTRY.values():
            tier = opener(config, pool, holds, block_tokens, identity) if asked(config) else None
            if tier is not None:
                tiers.append(tier)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers
