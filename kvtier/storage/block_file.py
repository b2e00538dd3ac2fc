"""One preallocated file of fixed-size block slots, read and written with O_DIRECT where the file system takes it.

Layout (:mod:`kvtier.storage.block_format`): a head page, then ``num_slots`` slots of a block header and a padded
payload. Durability is the caller's protocol, in this order: :meth:`BlockFile.forget` (the slots about to be
rewritten are recorded free in the journal, durably, so that no record names a block its slot no longer holds),
:meth:`BlockFile.write_run` (a run of consecutive slots, each one's header and payload, in one request), then
:meth:`BlockFile.commit` (sync the file, append the journal records, sync the journal), and :meth:`BlockFile.seal`
(the head page names the journal's last page as durable) before the blocks are acknowledged. A journal record, the
index a restart reads, therefore names only a block that is on disk. A crash in between leaves slots whose header
or payload is new or torn under no record: free after a restart. Without a journal (recovery scans the headers) a
header can be durable before its payload: the payload checksum makes that slot a miss.

The headers are the authority; the journal makes the start fast. A start replays it only when nothing says it lost
records (:meth:`kvtier.storage.journal.Journal.problem`: its head names this file's store, its pages are whole and in
sequence up to the last, and it reaches the page the seal names), and otherwise rebuilds it from every slot's header.

A file is created under a temporary name and renamed once preallocated and headed, so a crash mid-creation leaves
no half-made file under its name. A store holds its file's lock file (``path + ".lock"``, ``flock``) from before it
checks the file until it closes: a second store over it, in this process or another, fails at open. The journal holds
the most space it can take from the start (:mod:`kvtier.storage.journal`): a disk sized for the block file alone
fails at open, not later with every write.

Errors at open are :class:`BlockFileError` with what to do; a block that fails a check on read is a miss (None).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import logging
import os
from typing import Callable, Optional, Sequence, cast

import numpy as np

from kvtier._cleanup import run_all
from kvtier.storage import payload
from kvtier.storage.block_format import (ALIGN, BlockHeader, FileHeader, Seal, pack_block_header, pack_file_header,
                                         pack_seal, padded, payload_checksum, unpack_block_header, unpack_file_header,
                                         unpack_seals)
from kvtier.storage.aligned_io import aligned as _aligned, read_all, read_all_v, scratch, write_all, write_all_v
from kvtier.storage.journal import BLOCK, FREE, Journal, Record, reserve_bytes
from kvtier.storage.reserve import preallocate

__all__ = ["BlockFile", "BlockFileError", "scratch_sizes"]

logger = logging.getLogger(__name__)

_ZERO_PAGE = _aligned(ALIGN)  # an empty header (never written into)


def scratch_sizes(run: int, span: int) -> dict[str, int]:
    """The per-thread scratch buffers (name -> bytes) that reads and writes of runs of up to ``run`` slots of ``span``
    payload bytes use (:func:`kvtier.storage.aligned_io.use_region`)."""
    return {"payloads": run * span, "run_headers": run * ALIGN}


class BlockFileError(Exception):
    """A block file that cannot be opened as asked (another model's, not a block file, no space, no access)."""


def _record(slot: int, h: BlockHeader) -> Record:
    return Record(BLOCK, slot, h.namespace, h.chain_hash, h.payload_len, h.payload_checksum, h.tokens)


class BlockFile:
    """A file of ``num_slots`` slots of ``slot_payload_bytes`` payload each, for blocks of one ``fingerprint``.

    Args:
        path: the file (created and preallocated if missing; reopened, and its header checked, if present).
        slot_payload_bytes, num_slots: the slot geometry (a present file must have the same).
        fingerprint: 16 bytes naming what the blocks belong to (:func:`kvtier.storage.block_format.fingerprint`).
        direct: open with O_DIRECT (falls back to buffered IO, logged once, where the file system refuses it).
        wipe_mismatch: a present file written for another fingerprint or geometry is recreated empty (by default
            it is left alone and opening fails).
        journal_tokens: keep a journal (``path + ".journal"``, :mod:`kvtier.storage.journal`) of blocks of this
            many tokens, so that :meth:`recover` reads it instead of every slot's header; None: no journal.
        scan_threads: header reads in flight at once when every slot's header is read (no journal, or one that
            cannot be trusted).
    """

    def __init__(self, path: str, *, slot_payload_bytes: int, num_slots: int, fingerprint: bytes,
                 direct: bool = True, wipe_mismatch: bool = False, journal_tokens: Optional[int] = None,
                 scan_threads: int = 1) -> None:
        if slot_payload_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"slot_payload_bytes and num_slots must be > 0, got {slot_payload_bytes}, {num_slots}")
        # every file of the store by its absolute path, fixed now: a later chdir moves none of them
        self.path, self.fingerprint = os.path.abspath(path), fingerprint
        path = self.path
        self.slot_payload_bytes, self.num_slots = slot_payload_bytes, num_slots
        self.scan_threads = max(1, scan_threads)
        self.stride = ALIGN + padded(slot_payload_bytes)
        self.size = ALIGN + num_slots * self.stride
        want = FileHeader(fingerprint, slot_payload_bytes, num_slots)
        self.direct = False
        self._fd = -1
        self.journal: Optional[Journal] = None
        self._head = _aligned(ALIGN)  # the head page as on disk: the file header and its seals
        self._seal: Optional[Seal] = None
        self._recovered: Optional[tuple[np.ndarray, np.ndarray]] = None  # what the start found, until asked
        self._named = np.zeros(num_slots if journal_tokens is not None else 0, dtype=bool)  # slots a record names
        self._freed: list[int] = []  # slots recorded free since the journal's last sync
        self._no_directories(path)
        self._lock_fd = self._lock()
        created = False
        try:
            if os.path.exists(path):
                self._check_existing(want, wipe_mismatch)
            created = not os.path.exists(path)
            if created:
                self._create(want)
            self._fd = self._open(direct)
            self._read_head()
            if journal_tokens is not None:
                self._open_journal(journal_tokens, created)
        except BaseException:
            self.close()
            if created:  # a file this open made and could not finish goes (a retry with other sizes starts clean)
                for leftover in (path, path + ".journal", path + ".journal.reserve"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(leftover)
            raise

    # --- open ---

    def _lock(self) -> int:
        """The file's lock file, locked for this store alone (released when it closes, also by a process's death)."""
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise BlockFileError(f"{directory} is not a directory")
        try:
            fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise BlockFileError(f"cannot create {self.path}.lock: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(fd)
            raise BlockFileError(f"{self.path} is in use by another SSD store (another engine process, or a "
                                 f"directory named twice): give each engine instance and TP rank its own "
                                 f"directory") from e
        return fd

    @staticmethod
    def _no_directories(path: str) -> None:
        """A directory where the store keeps a file is an error naming it (not an IsADirectoryError later)."""
        for name in (path, path + ".lock", path + ".journal", path + ".journal.reserve", path + ".journal.tmp"):
            if os.path.isdir(name):
                raise BlockFileError(f"{name} is a directory where the SSD store keeps a file: remove it or choose "
                                     f"another ssd_cache_dir")

    def _open_journal(self, tokens: int, created: bool) -> None:
        """Open the journal (its reserve held) and recover what the file holds: from the journal when it can be
        trusted, else from every slot's header (the journal is then rebuilt from them)."""
        try:
            j = self.journal = Journal(self.path + ".journal", fingerprint=self.fingerprint, tokens=tokens,
                                       direct=self.direct, num_slots=self.num_slots, store_id=self._store_id)
            sealed = None if self._seal is None else self._seal.journal_seq
            resealed = created
            if created:
                j.rewrite([], first_seq=1, new_generation=True)
                slots, hashes = np.empty(0, np.int64), np.empty(0, np.uint64)
            else:
                if j.valid:
                    slots, hashes = j.replay_hashes()
                why = j.problem(sealed, None if self._seal is None else self._seal.generation)
                if why is None:
                    resealed = j.cut_torn_tail() > 0 or self._seal is None  # else the seal names a page it holds
                else:
                    logger.warning("kvtier: journal of %s is not trusted (%s): rebuilding it from the slot headers",
                                   self.path, why)
                    found = self.scan()
                    j.rewrite([_record(slot, h) for slot, h in found],
                              first_seq=max(sealed or 0, j.last_seq if j.valid else 0) + 1, new_generation=True)
                    slots = np.array([slot for slot, _ in found], dtype=np.int64)
                    hashes = np.array([h.chain_hash for _, h in found], dtype=np.uint64)
                    resealed = True
            if resealed:
                self.seal()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            need = reserve_bytes(self.num_slots, tokens)
            raise BlockFileError(f"not enough space beside {self.path} for its journal: {need / 2**20:.1f} MiB "
                                 f"needed; make ssd_cache_gb smaller or free space") from e
        self._recovered = (slots, hashes)
        self._named[slots] = True

    @property
    def _store_id(self) -> bytes:
        head = unpack_file_header(self._head)
        assert head is not None and head.store_id is not None  # checked and given a store id at open
        return head.store_id

    def _read_head(self) -> None:
        """The head page as on disk (a version 1 header is given a store id first: its journal is then another
        store's and is rebuilt from the headers)."""
        read_all(self._fd, self._head, 0)
        got = unpack_file_header(self._head)
        assert got is not None  # the file was checked (or made) before its head is read
        if got.store_id is None:
            logger.info("kvtier: block file %s is of the previous format: giving it a store id", self.path)
            self._head[:] = np.frombuffer(pack_file_header(got._replace(store_id=os.urandom(16))), dtype=np.uint8)
            write_all(self._fd, self._head, 0)
            os.fsync(self._fd)
        self._seal = unpack_seals(self._head)

    def _check_existing(self, want: FileHeader, wipe: bool) -> None:
        with open(self.path, "rb") as f:
            got = unpack_file_header(f.read(ALIGN))
        if got is not None and got.same_geometry(want):
            actual = os.path.getsize(self.path)
            if actual < self.size:  # truncated: the slots past its end are empty; restore the size
                logger.warning("kvtier: block file %s is %d bytes, %d expected (truncated): the slots past its end "
                               "are empty", self.path, actual, self.size)
                self._allocate_fd(os.open(self.path, os.O_RDWR))
            return
        what = ("is not a kvtier block file (or its header is damaged)" if got is None else
                "was written for another model, layout or TP rank" if got.fingerprint != want.fingerprint else
                f"has another slot geometry ({got.slot_payload_bytes} B x {got.num_slots}, "
                f"{want.slot_payload_bytes} B x {want.num_slots} asked)")
        if not wipe:
            raise BlockFileError(f"{self.path} {what}; it is left alone: remove it, choose another directory, or "
                                 f"allow wiping it")
        logger.warning("kvtier: block file %s %s: wiping it", self.path, what)
        with contextlib.suppress(FileNotFoundError):  # first: its records name the old file's slots
            os.unlink(self.path + ".journal")
        os.unlink(self.path)

    def _create(self, header: FileHeader) -> None:
        """Create the file under a temporary name (a leftover of a crash is replaced), preallocated and headed, then
        rename it to its name."""
        directory = os.path.dirname(os.path.abspath(self.path))
        tmp = self.path + ".creating"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise BlockFileError(f"cannot create {self.path}: {e.strerror}") from e
        try:
            self._allocate_fd(fd, close=False)
            os.pwrite(fd, pack_file_header(header._replace(store_id=os.urandom(16))), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(directory, os.O_RDONLY)  # the new name is durable too
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _allocate_fd(self, fd: int, close: bool = True) -> None:
        """Preallocate the whole file (a full disk fails here, at start, not mid-serving)."""
        try:
            preallocate(fd, self.size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise BlockFileError(f"not enough space for {self.path}: {self.size / 2**30:.2f} GiB needed") from e
            raise BlockFileError(f"cannot allocate {self.path}: {e.strerror}") from e
        finally:
            if close:
                os.close(fd)

    def _open(self, direct: bool) -> int:
        if direct and hasattr(os, "O_DIRECT"):
            fd = -1
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
                # some file systems refuse O_DIRECT only at the first read (the ignore: an ndarray is a buffer)
                os.preadv(fd, [_aligned(ALIGN)], 0)  # type: ignore[list-item]
                self.direct = True
                return fd
            except OSError as e:
                if fd >= 0:
                    os.close(fd)
                if e.errno != errno.EINVAL:
                    raise BlockFileError(f"cannot open {self.path}: {e.strerror}") from e
                logger.info("kvtier: %s does not take O_DIRECT; the SSD tier uses buffered IO there", self.path)
        try:
            return os.open(self.path, os.O_RDWR)
        except OSError as e:
            raise BlockFileError(f"cannot open {self.path}: {e.strerror}") from e

    # --- blocks ---

    def _slot_offset(self, slot: int) -> int:
        return self._run_offset(slot, 1)

    def _run_offset(self, slot: int, n: int) -> int:
        """The file offset of ``slot``, the first of ``n`` consecutive slots (all in range)."""
        if not (0 <= slot and slot + n <= self.num_slots and n >= 1):
            raise IndexError(f"slots {slot}..{slot + n - 1} out of range [0, {self.num_slots})")
        return ALIGN + slot * self.stride

    def write_run(self, slot: int, payloads: Sequence[np.ndarray],
                  header_of: Callable[[int, int, int], BlockHeader]) -> list[BlockHeader]:
        """Write blocks into the consecutive slots ``slot, slot + 1, ...``, each one's header and payload, in one
        request; ``header_of(i, payload_len, checksum)`` names block ``i`` (this file's fingerprint). A payload (at
        most ``slot_payload_bytes``) is any array; a contiguous one of whole aligned pages goes to the disk from
        where it is, others through this thread's aligned buffer (:mod:`kvtier.storage.payload`). Returns the
        headers written. Durable and findable after a restart once :meth:`commit` returns."""
        payloads = [np.asarray(p) for p in payloads]
        for p in payloads:
            if p.nbytes > self.slot_payload_bytes:
                raise ValueError(f"payload of {p.nbytes} B exceeds the slot's {self.slot_payload_bytes} B")
        offset = self._run_offset(slot, len(payloads))
        span = self.stride - ALIGN
        heads = scratch("run_headers", len(payloads) * ALIGN).reshape(len(payloads), ALIGN)
        bounce = None
        iov: list = []
        headers = []
        for i, p in enumerate(payloads):
            if payload.in_place(p, span):
                buf = p.reshape(-1).view(np.uint8)
            else:  # rows, unaligned or short: gathered into the buffer, zero padded
                if bounce is None:
                    bounce = scratch("payloads", len(payloads) * span).reshape(len(payloads), span)
                buf = bounce[i]
                payload.gather(p, buf)
                buf[p.nbytes:] = 0
            h = header_of(i, p.nbytes, payload_checksum(buf[:p.nbytes]))
            if h.fingerprint != self.fingerprint:
                raise ValueError("the header's fingerprint is not this file's")
            heads[i] = np.frombuffer(pack_block_header(h), dtype=np.uint8)
            headers.append(h)
            iov += [heads[i], buf]
        write_all_v(self._fd, iov, offset)
        return headers

    def clear(self, slot: int) -> None:
        """Mark ``slot`` empty (its header zeroed); durable with the next :meth:`sync`."""
        write_all(self._fd, _ZERO_PAGE, self._slot_offset(slot))

    def forget(self, slots: Sequence[int]) -> None:
        """Before ``slots`` are rewritten: those a journal record may name are recorded free, durably (a crash while
        they are rewritten then leaves no record naming a block they no longer hold)."""
        named = [s for s in slots if self._named.size and self._named[s]]
        if not named:
            return
        fresh = set(named).difference(self._freed)
        assert self.journal is not None  # slots are named only with a journal
        self.journal.append(Record(FREE, s, 0, 0, 0, 0, np.empty(0, np.int64)) for s in sorted(fresh))
        self._freed += sorted(fresh)
        self._sync_journal()

    def commit(self, entries: list[tuple[int, BlockHeader]]) -> None:
        """Make blocks that :meth:`write_run` wrote durable, then findable after a restart: sync the file, append
        their journal records, sync the journal. Returns once all of it is durable; :meth:`seal` before
        acknowledging them."""
        os.fdatasync(self._fd)
        self.record(entries)
        self._sync_journal()

    def record(self, entries: list[tuple[int, BlockHeader]]) -> None:
        """Append the journal records of slots whose headers and payloads are durable; :meth:`commit` calls it
        between its two syncs."""
        if self.journal is not None and entries:
            self._named[[slot for slot, _ in entries]] = True  # first: a failed append may still have landed
            self._recovered = None
            self.journal.append(_record(slot, h) for slot, h in entries)

    def free(self, slots: list[int]) -> None:
        """Mark slots empty, in their headers and the journal (durable with :meth:`sync`)."""
        for slot in slots:
            self.clear(slot)
        if self.journal is not None:
            self.journal.append(Record(FREE, s, 0, 0, 0, 0, np.empty(0, np.int64)) for s in slots)
            self._freed += list(slots)
            self._recovered = None

    def _sync_journal(self) -> None:
        if self.journal is not None:
            self.journal.sync()
            self._named[self._freed] = False
            self._freed = []

    def seal(self) -> None:
        """Name the journal's last page as durable in the head page, durably (after the journal's sync): a start
        that finds the journal ending before it rebuilds it from the headers."""
        if self.journal is None:
            return
        count = 0 if self._seal is None else self._seal.count + 1
        self._seal = Seal(count, self.journal.last_seq, self.journal.generation)
        pack_seal(self._head, self._seal)
        write_all(self._fd, self._head, 0)
        os.fdatasync(self._fd)

    def sync(self) -> None:
        """Make every write so far durable (fdatasync of the file and its journal), and seal it."""
        os.fdatasync(self._fd)
        self._sync_journal()
        self.seal()

    def recover(self) -> list[tuple[int, BlockHeader]]:
        """The slots a previous process made durable, with their headers, in slot order: from the journal (one
        sequential read) where there is one, else from every slot's header. Payloads (and the headers themselves,
        when the journal answered) are checked when read."""
        if self.journal is None:
            return self.scan()
        return [(r.slot, BlockHeader(self.fingerprint, r.namespace, r.chain_hash, r.tokens, r.payload_len,
                                     r.payload_checksum)) for r in self.journal.replay().records()]

    def recover_hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`recover` as arrays (slot order): the slots and their blocks' chain hashes (uint64); what the start
        found, without building a header per slot."""
        if self._recovered is not None:
            found, self._recovered = self._recovered, None
            return found
        if self.journal is not None:
            return self.journal.replay_hashes()
        scanned = self.scan()
        return (np.array([s for s, _ in scanned], dtype=np.int64),
                np.array([h.chain_hash for _, h in scanned], dtype=np.uint64))

    def read(self, slot: int, out: np.ndarray) -> Optional[BlockHeader]:
        """Read ``slot`` into ``out`` (uint8, at least the payload's length); its header, or None when the slot is
        empty, its header or payload fails its checksum, or it belongs to another fingerprint (``out`` is then
        unspecified and must not be used)."""
        return self.read_run(slot, [out])[0]

    def read_run(self, slot: int, outs: Sequence[np.ndarray],
                 accept: Optional[Callable[[int, BlockHeader], bool]] = None,
                 rejected: Optional[dict] = None) -> list[Optional[BlockHeader]]:
        """:meth:`read` of the consecutive slots ``slot, slot + 1, ...`` into ``outs``, their headers and payloads
        in one request. An out is an array that is contiguous or has contiguous rows, of at least the payload's
        length (its first ``payload_len`` bytes are filled); a contiguous one of whole aligned pages
        (:mod:`kvtier.storage.payload`) is read into where it is, others through this thread's aligned buffer.
        ``accept(i, header)``, when given, is asked about each block that passes the file's checks, before it is
        copied into its out; a False makes it None too, and puts its header in ``rejected`` (by ``i``) when given
        (a whole block, another than the caller's)."""
        offset = self._run_offset(slot, len(outs))
        span = self.stride - ALIGN
        heads = scratch("run_headers", len(outs) * ALIGN).reshape(len(outs), ALIGN)
        bounce = None
        iov: list = []
        dest: list[np.ndarray] = []  # per out: where its payload is read to (its own pages, or the buffer)
        bounced: list[bool] = []
        for i, out in enumerate(outs):
            rows = payload.byte_rows(out)
            if rows is None:
                raise ValueError("an out buffer must be contiguous or have contiguous rows")
            bounced.append(not payload.in_place(out, span, exact=False))
            if bounced[-1] and bounce is None:
                bounce = scratch("payloads", len(outs) * span).reshape(len(outs), span)
            dest.append(bounce[i] if bounced[-1] and bounce is not None else rows[0][:span])
            iov += [heads[i], dest[-1]]
        read_all_v(self._fd, iov, offset)
        got: list[Optional[BlockHeader]] = []
        for i, buf in enumerate(dest):
            h = unpack_block_header(heads[i])
            whole = (h is not None and h.fingerprint == self.fingerprint
                     and h.payload_len <= min(outs[i].nbytes, self.slot_payload_bytes)
                     and payload_checksum(buf[:h.payload_len]) == h.payload_checksum)
            ok = whole and (accept is None or accept(i, cast(BlockHeader, h)))  # whole: h is a header
            if whole and not ok and rejected is not None:
                rejected[i] = h
            if ok and bounced[i]:
                payload.scatter(buf[:cast(BlockHeader, h).payload_len], outs[i])
            got.append(h if ok else None)
        return got

    def scan(self) -> list[tuple[int, BlockHeader]]:
        """Every slot with a valid header of this fingerprint, in slot order (recovery after a restart; payloads are
        checked when read): a read per slot, ``scan_threads`` of them at once (a disk serves a queue of small reads
        faster than one at a time)."""
        n = self.num_slots
        parts = min(self.scan_threads, n)
        bounds = [n * i // parts for i in range(parts + 1)]
        if parts == 1:
            return self._scan_range(0, n)
        with concurrent.futures.ThreadPoolExecutor(parts, thread_name_prefix="kvtier-ssd-scan") as pool:
            found = pool.map(self._scan_range, bounds[:-1], bounds[1:])
            return [x for part in found for x in part]

    def _scan_range(self, first: int, end: int) -> list[tuple[int, BlockHeader]]:
        header = _aligned(ALIGN)
        out = []
        for slot in range(first, end):
            try:
                read_all(self._fd, header, self._slot_offset(slot))
            except OSError as e:  # a bad sector: that slot is empty, the others are read
                logger.warning("kvtier: %s: slot %d's header could not be read (%s): the slot is empty", self.path,
                               slot, e.strerror)
                continue
            h = unpack_block_header(header)
            if h is not None and h.fingerprint == self.fingerprint:
                out.append((slot, h))
        return out

    def close(self) -> None:
        """Close the file, the journal and the lock, each even if one before it fails; idempotent."""
        fd, self._fd = self._fd, -1
        lock_fd, self._lock_fd = self._lock_fd, -1
        run_all(None if fd < 0 else lambda: os.close(fd),
                None if self.journal is None else self.journal.close,
                # last: nobody else opens the file while this store still has it open
                None if lock_fd < 0 else lambda: os.close(lock_fd))

    def __enter__(self) -> "BlockFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
