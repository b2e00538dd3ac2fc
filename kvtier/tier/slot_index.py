"""SlotIndex: which SSD slot holds which block, by the block's chain hash; LRU over unlocked slots.

A block's chain hash (:func:`kvtier.index.page_hashes`: ``h_i = xxh64(tokens of block i, seed=h_{i-1})``, the seed
from the namespace) names the block and its whole prefix, so the SSD tier needs no trie: a query's leading blocks on
the SSD are its leading hashes found here. The tokens are not kept in memory; the slot's header holds them, and a
read compares them with the query's before the payload is used. A promotion reads and checks every block of the
prefix from its first SSD block on, so a wrong block needs a 64-bit chain-hash collision between two prefixes
whose blocks hold the same tokens.

A slot is free, pending (allocated to a write in flight: not findable), or held (findable, in LRU order). Held
slots read by a promotion are locked and never evicted. Touching a prefix orders its blocks last-to-first, so a
prefix's first blocks, shared by more requests, are the last to be evicted.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

import numpy as np

__all__ = ["SlotIndex"]


class SlotIndex:
    """Chain hash -> slot map over ``num_slots`` slots (single-threaded: the tier's lock guards it)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: dict[int, int] = {}  # chain hash -> held slot
        self._lru: collections.OrderedDict[int, int] = collections.OrderedDict()  # held slot -> hash, oldest first
        self._locks = np.zeros(num_slots, np.int32)
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: low slots first
        self._pending = 0
        self._doomed: set[int] = set()  # removed while locked: freed at the last unlock
        self.evicted = 0  # slots evicted since construction
        # called with the chain hashes of held blocks that stop being findable (evicted, removed, cleared)
        self.on_removed: Optional[Callable[[list[int]], None]] = None

    # --- lookup ---

    def match(self, hashes: np.ndarray) -> np.ndarray:
        """Slots of the leading ``hashes`` held (stops at the first one not held)."""
        out = []
        for h in hashes.tolist():
            s = self._slot_of.get(h)
            if s is None:
                break
            out.append(s)
        return np.array(out, dtype=np.int64)

    def contains(self, h: int) -> bool:
        return int(h) in self._slot_of

    def touch(self, slots: np.ndarray) -> None:
        """Mark ``slots`` (a prefix, first block first) most recently used, the first block last."""
        for s in slots[::-1].tolist():
            self._lru.move_to_end(s)

    def lock(self, slots: np.ndarray) -> None:
        np.add.at(self._locks, slots, 1)

    def locked(self, slot: int) -> bool:
        """Whether a read still holds ``slot``."""
        return bool(self._locks[int(slot)])

    def unlock(self, slots: np.ndarray) -> None:
        np.add.at(self._locks, slots, -1)
        if (self._locks[slots] < 0).any():
            raise RuntimeError("kvtier: SSD slot unlocked more often than locked")
        for s in self._doomed.intersection(slots.tolist()):
            if not self._locks[s]:
                self._doomed.discard(s)
                self._free.append(s)

    # --- slots ---

    def alloc(self, n: int) -> np.ndarray:
        """Up to ``n`` slots for a write (pending until :meth:`commit` or :meth:`release`), in ascending order,
        evicting LRU unlocked held slots when none are free; fewer when too many are locked or pending. Ascending:
        a job's blocks, a prefix in order, land in runs of consecutive slots wherever the slots came from (the
        stack gives evicted ones back in reverse), and the store moves each run in one request."""
        if len(self._free) < n:
            self._evict(n - len(self._free))
        k = min(n, len(self._free))
        out = np.sort(np.array([self._free.pop() for _ in range(k)], dtype=np.int64))
        self._pending += k
        return out

    def _evict(self, n: int) -> int:
        victims: list[int] = []
        for s in self._lru:  # LRU first; the walk stops at the n-th unlocked slot (no copy of the whole order)
            if len(victims) == n:
                break
            if not self._locks[s]:
                victims.append(s)
        gone = []
        for s in victims:
            h = self._lru.pop(s)
            del self._slot_of[h]
            self._free.append(s)
            gone.append(h)
        self.evicted += len(gone)
        self._removed(gone)
        return len(gone)

    def _removed(self, hashes: list[int]) -> None:
        if hashes and self.on_removed is not None:
            self.on_removed(hashes)

    def commit(self, slot: int, h: int) -> bool:
        """A pending slot's write is durable: it holds ``h`` (most recently used). Returns False, releasing the
        slot, when another slot already holds ``h``."""
        self._pending -= 1
        return self._hold(int(slot), int(h))

    def _hold(self, slot: int, h: int) -> bool:
        if h in self._slot_of:
            self._free.append(slot)
            return False
        self._slot_of[h] = slot
        self._lru[slot] = h
        return True

    def adopt(self, slot: int, h: int) -> bool:
        """A free ``slot`` found holding the whole block ``h`` (under a record of another block): it holds ``h``
        from now on, least recently used. False (nothing changes) when the slot is not free or ``h`` is held."""
        slot, h = int(slot), int(h)
        if h in self._slot_of or slot not in self._free:
            return False
        self._free.remove(slot)
        self._slot_of[h] = slot
        self._lru[slot] = h
        self._lru.move_to_end(slot, last=False)
        return True

    def release(self, slots: np.ndarray) -> None:
        """Pending slots whose write failed go back to the free list."""
        self._pending -= len(slots)
        self._free.extend(int(s) for s in slots)

    def remove(self, slot: int) -> None:
        """A held slot that failed a check on read: no longer findable, freed once unlocked (now, if it is not)."""
        slot = int(slot)
        h = self._lru.pop(slot, None)
        if h is not None:
            del self._slot_of[h]
            self._removed([h])
            if self._locks[slot]:
                self._doomed.add(slot)
            else:
                self._free.append(slot)

    def recover(self, slots: np.ndarray, hashes: np.ndarray) -> int:
        """Fill a new index with the durable slots found at start (oldest first in LRU order; a hash found twice
        keeps its first slot). Returns how many are held."""
        if self._slot_of or self._pending:
            raise RuntimeError("recover() fills a new index")
        slots = np.asarray(slots, dtype=np.int64)
        sl, hl = slots.tolist(), np.asarray(hashes).tolist()
        self._slot_of = dict(zip(reversed(hl), reversed(sl)))  # a hash found twice keeps its first slot
        unique = len(self._slot_of) == len(sl)
        self._lru = collections.OrderedDict(zip(sl, hl) if unique else
                                            ((s, h) for s, h in zip(sl, hl) if self._slot_of[h] == s))
        untaken = np.ones(self.num_slots, dtype=bool)
        untaken[slots] = False
        dups = [] if unique else [s for s, h in zip(sl, hl) if self._slot_of[h] != s]  # freed after the rest
        self._free = np.flatnonzero(untaken)[::-1].tolist() + dups  # a stack: low slots first
        return len(self._lru)

    def clear(self) -> None:
        """Drop every held slot (locked or pending ones are refused)."""
        if self._locks.any() or self._pending:
            raise RuntimeError("clear() with SSD slots locked or pending")
        held, on_removed = list(self._slot_of), self.on_removed
        self.__init__(self.num_slots)  # type: ignore[misc]  # every field as a new index has it
        self.on_removed = on_removed
        self._removed(held)

    # --- accounting ---

    @property
    def num_held(self) -> int:
        return len(self._slot_of)

    @property
    def num_pending(self) -> int:
        return self._pending

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, h: int) -> Optional[int]:
        return self._slot_of.get(int(h))
