"""Host blocks on local disks: block files striped over one or more directories, slots, durable batches, recovery.

The store is a medium: it keeps bytes with their identity (namespace, chain hash, tokens) and hands back only bytes
that pass every check. Which blocks go to disk, when, and which come back is the tier's policy, not the store's.

A store of ``capacity_bytes`` over directories ``d_0 .. d_{k-1}`` has one :class:`~kvtier.storage.BlockFile` per
directory (``kvtier_blocks.bin``), its slots dealt round robin (slot ``s`` lives in file ``s % k``), so a batch of
consecutive slots reads and writes every disk at once. :meth:`SsdStore.put` writes a batch by the durability
protocol (payloads on IO threads, a sync per file, journal records then headers on IO threads, a sync per file)
and returns only once the batch is durable; :meth:`SsdStore.recover` lists what a previous process made durable.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from kvtier.storage.block_file import BlockFile
from kvtier.storage.block_format import ALIGN, BlockHeader, padded

__all__ = ["SsdStore", "Block", "FILE_NAME"]

FILE_NAME = "kvtier_blocks.bin"


class Block(NamedTuple):
    """A block to store: its identity and its bytes (any contiguous array)."""

    namespace: int
    chain_hash: int
    tokens: np.ndarray
    payload: np.ndarray


def _all(pool: concurrent.futures.Executor, fn: Callable[[Any], Any], items: list) -> list:
    """``fn`` of each item on ``pool``, waiting for every one before returning or raising the first error: a
    failed part never leaves the others still writing into buffers or files the caller reuses."""
    futures = [pool.submit(fn, x) for x in items]
    concurrent.futures.wait(futures)
    return [f.result() for f in futures]


class SsdStore:
    """Fixed-size block slots on disk.

    Args:
        dirs: directories (a ``;``-separated string, as FlexKV's ``ssd_cache_dir``, or a list); each gets one file.
        capacity_bytes: the store's size on disk over all directories (slots of ``block_bytes`` plus a 4 KiB header
            each, rounded down to whole slots per directory).
        block_bytes: payload bytes of a block.
        fingerprint: what the blocks belong to (:func:`kvtier.storage.fingerprint`).
        io_threads: threads issuing the reads and writes of a batch (the disks see this many requests at once).
        direct, wipe_mismatch: as :class:`~kvtier.storage.BlockFile`.
        tokens_per_block: tokens of a block; with it every file keeps a journal and :meth:`recover` reads the
            journals (one sequential pass) instead of every slot's header.
    """

    def __init__(self, dirs, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes, io_threads: int = 4,
                 direct: bool = True, wipe_mismatch: bool = False, tokens_per_block: Optional[int] = None) -> None:
        self.dirs = [d for d in (dirs.split(";") if isinstance(dirs, str) else list(dirs)) if d]
        if not self.dirs:
            raise ValueError("an SSD store needs at least one directory")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.block_bytes = block_bytes
        per_dir = capacity_bytes // len(self.dirs) // (ALIGN + padded(block_bytes))
        if per_dir < 1:
            raise ValueError(f"capacity_bytes {capacity_bytes} holds no {block_bytes}-byte block per directory")
        self.files = [BlockFile(os.path.join(d, FILE_NAME), slot_payload_bytes=block_bytes, num_slots=per_dir,
                                fingerprint=fingerprint, direct=direct, wipe_mismatch=wipe_mismatch,
                                journal_tokens=tokens_per_block)
                      for d in self.dirs]
        self.fingerprint = fingerprint
        self.num_slots = per_dir * len(self.files)
        self._threads = io_threads
        # reads never queue behind a batch of writes and its syncs
        self._pool = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-ssd-w")
        self._read_pool = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-ssd-r")

    @property
    def direct(self) -> bool:
        """Whether every file takes O_DIRECT."""
        return all(f.direct for f in self.files)

    def _where(self, slot: int) -> tuple[BlockFile, int]:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        k = len(self.files)
        return self.files[slot % k], slot // k

    def put(self, slots: Sequence[int], blocks: Sequence[Block]) -> None:
        """Store ``blocks[i]`` in ``slots[i]`` and return once all are durable (payloads, sync, journal records and
        headers, sync).
        An exception (a disk error, the disk full) leaves the batch's slots unspecified: the caller treats them as
        empty and frees them."""
        if len(slots) != len(blocks):
            raise ValueError(f"{len(slots)} slots for {len(blocks)} blocks")
        for b in blocks:
            if np.asarray(b.payload).nbytes > self.block_bytes:
                raise ValueError(f"a payload of {np.asarray(b.payload).nbytes} B exceeds the {self.block_bytes} B block")
        where = [self._where(s) for s in slots]
        checks = self._spread(lambda wb: wb[0][0].write_payload(wb[0][1], wb[1].payload), list(zip(where, blocks)))
        touched = list({id(f): f for f, _ in where}.values())
        _all(self._pool, BlockFile.sync, touched)
        headers = [BlockHeader(self.fingerprint, b.namespace, b.chain_hash, np.asarray(b.tokens, dtype=np.int64),
                               np.asarray(b.payload).nbytes, c) for b, c in zip(blocks, checks)]
        per_file: dict[int, list] = {}
        for (f, local), h in zip(where, headers):
            per_file.setdefault(id(f), [f, []])[1].append((local, h))
        _all(self._pool, lambda fe: fe[0].record(fe[1]), list(per_file.values()))  # records before headers
        # a 4 KiB write per slot, io_threads at once: the disks see them together, not one round trip each
        self._spread(lambda wh: wh[0][0].write_header(wh[0][1], wh[1]), list(zip(where, headers)))
        _all(self._pool, BlockFile.sync, touched)

    def get(self, slots: Sequence[int], outs: Sequence[np.ndarray]) -> list[Optional[BlockHeader]]:
        """Read ``slots[i]`` into ``outs[i]`` (uint8 buffers of at least ``block_bytes``); each one's header, or
        None where the slot is empty or fails a check (the caller also compares the tokens with its own)."""
        if len(slots) != len(outs):
            raise ValueError(f"{len(slots)} slots for {len(outs)} buffers")
        return self._spread(lambda so: self._read(so[0], so[1]), list(zip(slots, outs)), self._read_pool)

    def _spread(self, fn: Callable[[Any], Any], items: list, pool=None) -> list:
        """``fn`` of each item, in order, on the IO threads: a contiguous share of the items per thread (a task per
        thread, not per item: fewer handoffs)."""
        n = max(1, -(-len(items) // self._threads))
        shares = _all(pool or self._pool, lambda share: [fn(x) for x in share],
                      [items[i:i + n] for i in range(0, len(items), n)])
        return [r for share in shares for r in share]

    def _read(self, slot: int, out: np.ndarray) -> Optional[BlockHeader]:
        f, local = self._where(slot)
        return f.read(local, out)

    def free(self, slots: Sequence[int]) -> None:
        """Mark slots empty (durable with the next :meth:`put` or :meth:`sync`); a slot may also simply be
        overwritten: a new payload under an old header fails the payload checksum."""
        per_file: dict[int, list] = {}
        for s in slots:
            f, local = self._where(s)
            per_file.setdefault(id(f), [f, []])[1].append(local)
        for f, local in per_file.values():
            f.free(local)

    def sync(self) -> None:
        list(self._pool.map(BlockFile.sync, self.files))

    def recover(self) -> list[tuple[int, BlockHeader]]:
        """Every slot a previous process made durable, with its header (payloads are checked when read)."""
        k = len(self.files)
        per_file = self._pool.map(lambda fi: [(local * k + fi[0], h) for local, h in fi[1].recover()],
                                  enumerate(self.files))
        return sorted((x for part in per_file for x in part), key=lambda x: x[0])

    def recover_hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`recover` as arrays: store slots (ascending) and their blocks' chain hashes."""
        k = len(self.files)
        parts = list(self._pool.map(lambda f: f.recover_hashes(), self.files))
        slots = np.concatenate([local * k + fi for fi, (local, _) in enumerate(parts)])
        hashes = np.concatenate([h for _, h in parts])
        order = np.argsort(slots, kind="stable")
        return slots[order], hashes[order]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)
        for f in self.files:
            f.close()

    def __enter__(self) -> "SsdStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
