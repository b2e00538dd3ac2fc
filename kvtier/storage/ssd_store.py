"""Host blocks on local disks: block files striped over one or more directories, slots, durable batches, recovery.

The store is a medium: it keeps bytes with their identity (namespace, chain hash, tokens) and hands back only bytes
that pass every check. Which blocks go to disk, when, and which come back is the tier's policy, not the store's.

A store of ``capacity_bytes`` over directories ``d_0 .. d_{k-1}`` has one :class:`~kvtier.storage.BlockFile` per
directory (``kvtier_blocks.bin``), its slots dealt round robin (slot ``s`` lives in file ``s % k``), so a batch of
consecutive slots reads and writes every disk at once. A run of consecutive slots of one file is one request (up to
:data:`RUN_BYTES`), its blocks' payloads read from or written to where the caller holds them when they are whole
aligned pages. :meth:`SsdStore.put` writes batches by the durability protocol (headers and payloads on the IO
threads; per file a sync, journal records, a sync of the journal: :meth:`BlockFile.commit`), the next batch's blocks
while one commits, and returns only once every batch is durable; :meth:`SsdStore.read` checks every block on the IO
threads; :meth:`SsdStore.recover` lists what a previous process made durable.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import queue
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from kvtier._checks import directories, same_directory
from kvtier._cleanup import run_all
from kvtier.storage import payload
from kvtier.storage.aligned_io import aligned, use_region
from kvtier.storage.block_file import BlockFile, scratch_sizes
from kvtier.storage.block_format import ALIGN, BlockHeader, padded

__all__ = ["SsdStore", "Block", "ReadResult", "FILE_NAME", "RUN_BYTES"]

FILE_NAME = "kvtier_blocks.bin"


class Block(NamedTuple):
    """A block to store: its identity and its bytes (an array, read where it is: :mod:`kvtier.storage.payload`)."""

    namespace: int
    chain_hash: int
    tokens: np.ndarray
    payload: np.ndarray


# Tuned constants: docs/DESIGN.md, "Tuned constants".
RUN_BYTES = 16 << 20  # one request reads or writes at most this many bytes of consecutive slots
_DUPLICATE_READS = 64  # slots of a hash recorded twice read back at a time at start
MAX_RUN = 256  # and at most this many slots (two buffers each: under the kernel's IOV_MAX of 1024)


class _Piece(NamedTuple):
    """A run of consecutive slots of one file: one request."""

    file: BlockFile
    local: int  # the file's slot of the first block
    positions: list  # the blocks' places in the caller's request


class _Skipped(Exception):
    """A piece not written because another piece of the call failed."""


class ReadResult(NamedTuple):
    """What :meth:`SsdStore.read` found: a header per block (None: a miss), and the first IO error, if any, with
    the first block of the run it ended; ``others``: the headers of whole blocks that ``accept`` refused, by
    position (the slot holds another block than the caller's)."""

    headers: list
    error: Optional[BaseException]
    error_at: int  # -1: no error
    others: dict


def _all(pool: concurrent.futures.Executor, fn: Callable[[Any], Any], items: list) -> list:
    """``fn`` of each item on ``pool``, waiting for every one before returning or raising the first error: a
    failed part never leaves the others still writing into buffers or files the caller reuses."""
    futures = [pool.submit(fn, x) for x in items]
    _settle(futures)
    return [f.result() for f in futures]


def _settle(futures: list, raise_error: bool = True) -> bool:
    """Wait for every future; raise the first error (or, without ``raise_error``, return whether none failed)."""
    concurrent.futures.wait(futures)
    for f in futures:
        if f.exception() is not None:
            if raise_error:
                raise f.exception()
            return False
    return True


class SsdStore:
    """Fixed-size block slots on disk.

    Args:
        dirs: directories (a ``;``-separated string, as FlexKV's ``ssd_cache_dir``, or a list: each entry stripped,
            ``~`` expanded, made absolute); each gets one file.
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
        self.dirs = directories(dirs)
        if not self.dirs:
            raise ValueError("an SSD store needs at least one directory")
        twice = same_directory(self.dirs)
        if twice:
            raise ValueError(f"SSD directories {twice[0]!r} and {twice[1]!r} are one directory: name each once")
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.block_bytes = block_bytes
        per_dir = capacity_bytes // len(self.dirs) // (ALIGN + padded(block_bytes))
        if per_dir < 1:
            raise ValueError(f"capacity_bytes {capacity_bytes} holds no {block_bytes}-byte block per directory")
        self.files: list[BlockFile] = []
        try:
            for d in self.dirs:
                self.files.append(BlockFile(os.path.join(d, FILE_NAME), slot_payload_bytes=block_bytes,
                                            num_slots=per_dir, fingerprint=fingerprint, direct=direct,
                                            wipe_mismatch=wipe_mismatch, journal_tokens=tokens_per_block,
                                            scan_threads=4 * io_threads))
        except BaseException:  # the files opened so far are closed (and unlocked)
            for f in self.files:
                f.close()
            raise
        try:
            self._start(fingerprint, per_dir, io_threads, block_bytes)
        except BaseException:  # the files opened are closed (and unlocked): a retry in this process can open them
            run_all(*(f.close for f in self.files))
            raise

    def _start(self, fingerprint: bytes, per_dir: int, io_threads: int, block_bytes: int) -> None:
        """The IO threads' buffers and pools."""
        self.fingerprint = fingerprint
        self.num_slots = per_dir * len(self.files)
        self._threads = io_threads
        self._run_cap = max(1, min(MAX_RUN, RUN_BYTES // (ALIGN + padded(block_bytes))))  # blocks of one request
        # each IO thread's scratch buffers: its share of one region mapped now (aligned_io.use_region says why)
        sizes = scratch_sizes(self._run_cap, padded(block_bytes))
        share = sum(sizes.values())
        region = aligned(2 * io_threads * share)
        region.fill(0)
        shares: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(2 * io_threads):
            shares.put(region[i * share:(i + 1) * share])
        self._shares = shares  # emptied at close: the region's memory goes with the IO threads, not a later GC

        def take_share() -> None:
            with contextlib.suppress(queue.Empty):  # (a thread beyond the pools' own maps its buffers itself)
                use_region(shares.get_nowait(), sizes)

        def pool(prefix: str) -> concurrent.futures.ThreadPoolExecutor:
            return concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix=prefix, initializer=take_share)
        # reads never queue behind a batch of writes and its syncs; a batch commits while the next one's blocks
        # are written
        self._pool = pool("kvtier-ssd-w")
        self._read_pool = pool("kvtier-ssd-r")
        self._commit_pool = concurrent.futures.ThreadPoolExecutor(len(self.files), thread_name_prefix="kvtier-ssd-c")

    @property
    def direct(self) -> bool:
        """Whether every file takes O_DIRECT."""
        return all(f.direct for f in self.files)

    def _where(self, slot: int) -> tuple[BlockFile, int]:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        k = len(self.files)
        return self.files[slot % k], slot // k

    def put(self, slots: Sequence[int], blocks: Sequence[Block], *, batch: Optional[int] = None,
            on_durable: Optional[Callable[[int], None]] = None) -> None:
        """Store ``blocks[i]`` in ``slots[i]`` and return once all are durable. Batches of ``batch`` blocks (all of
        them by default) go by the durability protocol (headers and payloads, sync, journal records, sync); the
        next batch's blocks are written while one commits. ``on_durable(n)`` is called (on this thread) each time
        the first ``n`` blocks are durable; acknowledge them once the call returns (or raises): every file written is
        sealed then. A block's payload is read from where it is, on the IO threads, until the call returns. The
        slots are recorded free first (a crash while they are rewritten leaves no record naming their old blocks).
        An exception (a disk error, the disk full) ends the call once no IO is left running; the slots past the
        last ``on_durable`` count are unspecified: the caller treats them as empty and frees them."""
        if len(slots) != len(blocks):
            raise ValueError(f"{len(slots)} slots for {len(blocks)} blocks")
        for block in blocks:
            if np.asarray(block.payload).nbytes > self.block_bytes:
                raise ValueError(
                    f"a payload of {np.asarray(block.payload).nbytes} B exceeds the {self.block_bytes} B block")
        where = [self._where(s) for s in slots]
        n = len(slots)
        step = max(1, batch or n)
        headers: list[Optional[BlockHeader]] = [None] * n
        failed = threading.Event()
        errors: list[BaseException] = []  # the writes' own errors (not the skipped pieces')

        def write(piece: _Piece) -> None:
            if failed.is_set():  # its batch must not commit: it fails too
                raise _Skipped()

            def header_of(j: int, nbytes: int, checksum: int) -> BlockHeader:
                blk = blocks[piece.positions[j]]
                return BlockHeader(self.fingerprint, blk.namespace, blk.chain_hash,
                                   np.asarray(blk.tokens, dtype=np.int64), nbytes, checksum)
            try:
                got = piece.file.write_run(piece.local, [blocks[i].payload for i in piece.positions], header_of)
            except BaseException as e:
                errors.append(e)
                failed.set()
                raise
            for i, h in zip(piece.positions, got):
                headers[i] = h

        def commit(a: int, b: int) -> list:
            per_file: dict[int, list] = {}
            for i in range(a, b):
                f, local = where[i]
                per_file.setdefault(id(f), [f, []])[1].append((local, headers[i]))
            return [self._commit_pool.submit(f.commit, entries) for f, entries in per_file.values()]

        todo = collections.deque((a, min(a + step, n)) for a in range(0, n, step))
        writing: collections.deque = collections.deque()  # (first, end, block writes) of batches, 2 at most
        committing: Optional[tuple[int, list]] = None  # (end, commits) of the batch being made durable
        touched = list({id(f): f for f, _ in where}.values())
        try:
            for f in touched:
                f.forget([local for g, local in where if g is f])
            while todo or writing:
                while todo and len(writing) < 2:
                    a, b = todo.popleft()
                    writing.append((a, b, [self._pool.submit(write, p) for p in self._pieces(where, a, b)]))
                a, b, futures = writing.popleft()
                _settle(futures)
                if committing is not None:
                    _settle(committing[1])
                    if on_durable is not None:
                        on_durable(committing[0])
                committing = (b, commit(a, b))
            if committing is not None:
                _settle(committing[1])
                if on_durable is not None:
                    on_durable(committing[0])
            for f in touched:
                f.seal()
        except BaseException as e:
            failed.set()
            for _, _, futures in writing:
                concurrent.futures.wait(futures)
            if committing is not None and _settle(committing[1], raise_error=False) and on_durable is not None:
                on_durable(committing[0])  # the batch before the failed one became durable all the same
            try:  # what became durable is acknowledged only once sealed
                for f in touched:
                    f.seal()
            except OSError:
                if on_durable is not None:
                    on_durable(0)
            if isinstance(e, _Skipped):  # the write that failed first says why
                raise errors[0] from None
            raise

    def read(self, slots: Sequence[int], outs: Sequence[np.ndarray], *,
             accept: Optional[Callable[[int, BlockHeader], bool]] = None, stop_at_bad: bool = False) -> "ReadResult":
        """Read ``slots[i]`` into ``outs[i]`` (arrays of at least ``block_bytes``, contiguous or with contiguous
        rows: see :meth:`BlockFile.read_run`), runs of consecutive slots in one request each, on the IO threads.
        A block that fails a check, or ``accept(i, header)`` (asked on an IO thread), has no header; with
        ``stop_at_bad`` the runs after the first such block are not read. An IO error ends its run (its blocks
        have no header) and is returned with the run's first block. Returns once no read is running."""
        if len(slots) != len(outs):
            raise ValueError(f"{len(slots)} slots for {len(outs)} buffers")
        for o in outs:
            if payload.byte_rows(o) is None or o.nbytes < self.block_bytes:
                raise ValueError(f"an out buffer must hold {self.block_bytes} B, contiguous or in contiguous rows")
        where = [self._where(s) for s in slots]
        n = len(slots)
        headers: list[Optional[BlockHeader]] = [None] * n
        lock = threading.Lock()
        first_bad = [n]  # the first block without a header so far
        errors: list[tuple[int, BaseException]] = []
        others: dict[int, BlockHeader] = {}

        def read(piece: _Piece) -> None:
            pos = piece.positions
            if stop_at_bad and pos[0] > first_bad[0]:
                return
            check = None if accept is None else (lambda j, h: accept(pos[j], h))
            refused: dict[int, BlockHeader] = {}
            try:
                got = piece.file.read_run(piece.local, [outs[i] for i in pos], check, refused)
            except Exception as e:  # noqa: BLE001 - any error ends the run; the caller sees it
                with lock:
                    errors.append((pos[0], e))
                    first_bad[0] = min(first_bad[0], pos[0])
                return
            for i, h in zip(pos, got):
                headers[i] = h
            bad = [i for i, h in zip(pos, got) if h is None]
            with lock:
                others.update((pos[j], h) for j, h in refused.items())
                if bad:
                    first_bad[0] = min(first_bad[0], bad[0])

        _settle([self._read_pool.submit(read, p) for p in self._pieces(where, 0, n)])
        error_at, error = min(errors, key=lambda e: e[0]) if errors else (-1, None)
        return ReadResult(headers, error, error_at, others)

    def get(self, slots: Sequence[int], outs: Sequence[np.ndarray]) -> list[Optional[BlockHeader]]:
        """Read ``slots[i]`` into ``outs[i]`` (uint8 buffers of at least ``block_bytes``); each one's header, or
        None where the slot is empty or fails a check (the caller also compares the tokens with its own). Raises
        the first IO error, once no read is running."""
        got = self.read(slots, outs)
        if got.error is not None:
            raise got.error
        return got.headers

    def _pieces(self, where: list[tuple[BlockFile, int]], a: int, b: int) -> list["_Piece"]:
        """Blocks ``a..b`` of a request as runs of consecutive slots of one file (one IO each), at most
        :data:`RUN_BYTES` and an even share of the IO threads' work each, ordered by their first block."""
        cap = max(1, min(self._run_cap, -(-(b - a) // self._threads)))
        pieces: list[_Piece] = []
        open_run: dict[int, _Piece] = {}  # file -> its run being extended
        for i in range(a, b):
            f, local = where[i]
            run = open_run.get(id(f))
            if run is not None and local == run.local + len(run.positions) and len(run.positions) < cap:
                run.positions.append(i)
                continue
            run = open_run[id(f)] = _Piece(f, local, [i])
            pieces.append(run)
        return pieces

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
        """Make every write and free so far durable, and seal it."""
        list(self._pool.map(BlockFile.sync, self.files))

    def recover(self) -> list[tuple[int, BlockHeader]]:
        """Every slot a previous process made durable, with its header (payloads are checked when read)."""
        k = len(self.files)
        per_file = self._pool.map(lambda fi: [(local * k + fi[0], h) for local, h in fi[1].recover()],
                                  enumerate(self.files))
        return sorted((x for part in per_file for x in part), key=lambda x: x[0])

    def recover_hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`recover` as arrays: store slots (ascending) and their blocks' chain hashes, each hash once. A hash
        found in several slots (a record left naming a block its slot lost, a block stored again elsewhere) keeps a
        slot whose block reads back whole; the others are freed."""
        k = len(self.files)
        parts = list(self._pool.map(lambda f: f.recover_hashes(), self.files))
        slots = np.concatenate([local * k + fi for fi, (local, _) in enumerate(parts)])
        hashes = np.concatenate([h for _, h in parts]).astype(np.uint64)
        order = np.argsort(slots, kind="stable")
        slots, hashes = slots[order], hashes[order]
        unique, counts = np.unique(hashes, return_counts=True)
        if (counts > 1).any():
            drop = self._duplicates(slots, hashes, set(unique[counts > 1].tolist()))
            keep = ~np.isin(slots, drop)
            slots, hashes = slots[keep], hashes[keep]
        return slots, hashes

    def _duplicates(self, slots: np.ndarray, hashes: np.ndarray, twice: set) -> list[int]:
        """The slots to free among those of the chain hashes in ``twice``: every one but the first whose block reads
        back whole under that hash (all of them when none does), read a few at a time; freed durably before
        returning. A read that fails with an IO error frees nothing of its hash (a read of the block decides later,
        as for any record)."""
        cand = [(int(s), int(h)) for s, h in zip(slots.tolist(), hashes.tolist()) if h in twice]
        whole: dict[int, int] = {}  # hash -> the first slot that reads back whole
        unsure: set = set()  # hashes a read of which failed with an IO error
        outs = [aligned(padded(self.block_bytes)) for _ in range(min(len(cand), _DUPLICATE_READS))]
        for a in range(0, len(cand), _DUPLICATE_READS):
            part = cand[a:a + _DUPLICATE_READS]

            def accept(i: int, hd: BlockHeader, part: list[tuple[int, int]] = part) -> bool:
                return hd.chain_hash == part[i][1]
            got = self.read([s for s, _ in part], outs[:len(part)], accept=accept)
            for i, ((slot, h), hd) in enumerate(zip(part, got.headers)):
                if hd is not None:
                    whole.setdefault(h, slot)
                elif got.error is not None and i >= got.error_at:
                    unsure.add(h)
        drop = [slot for slot, h in cand if h not in unsure and whole.get(h) != slot]
        if drop:
            self.free(drop)
            self.sync()
        return drop

    def adopt(self, slot: int, header: BlockHeader) -> None:
        """Record that ``slot`` holds the block ``header`` names (read back whole under a record of another
        block), durably."""
        f, local = self._where(slot)
        f.record([(local, header)])
        f.sync()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)
        self._commit_pool.shutdown(wait=True)
        with contextlib.suppress(queue.Empty):
            while True:
                self._shares.get_nowait()
        run_all(*(f.close for f in self.files))

    def __enter__(self) -> "SsdStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
