"""One preallocated file of fixed-size block slots, read and written with O_DIRECT where the file system takes it.

Layout (:mod:`kvtier.storage.block_format`): a file header, then ``num_slots`` slots of a block header and a padded
payload. Durability is the caller's protocol, in this order: :meth:`BlockFile.write_payload` for each block,
:meth:`BlockFile.sync`, :meth:`BlockFile.commit` (the journal records, then the headers), :meth:`BlockFile.sync`; a
header therefore never names a payload that is not on disk. A crash in between leaves slots whose header is old or
missing: an old header over a new payload fails the payload checksum, a missing header is an empty slot; neither is
ever read back as KV.

Errors at open are :class:`BlockFileError` with what to do; a block that fails a check on read is a miss (None).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Iterator, Optional

import numpy as np

from kvtier.storage.block_format import (ALIGN, BlockHeader, FileHeader, pack_block_header, pack_file_header,
                                         padded, payload_checksum, unpack_block_header, unpack_file_header)
from kvtier.storage.aligned_io import aligned as _aligned, read_all, write_all
from kvtier.storage.journal import BLOCK, FREE, Journal, Record

__all__ = ["BlockFile", "BlockFileError"]

logger = logging.getLogger(__name__)


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
    """

    def __init__(self, path: str, *, slot_payload_bytes: int, num_slots: int, fingerprint: bytes,
                 direct: bool = True, wipe_mismatch: bool = False, journal_tokens: Optional[int] = None) -> None:
        if slot_payload_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"slot_payload_bytes and num_slots must be > 0, got {slot_payload_bytes}, {num_slots}")
        self.path, self.fingerprint = path, fingerprint
        self.slot_payload_bytes, self.num_slots = slot_payload_bytes, num_slots
        self.stride = ALIGN + padded(slot_payload_bytes)
        self.size = ALIGN + num_slots * self.stride
        want = FileHeader(fingerprint, slot_payload_bytes, num_slots)
        if os.path.exists(path):
            self._check_existing(want, wipe_mismatch)
        created = not os.path.exists(path)
        if created:
            self._create(want)
        self.direct = False
        self._fd = self._open(direct)
        self._local = threading.local()  # per thread: reads and writes of several slots may run at once
        self.journal: Optional[Journal] = None
        if journal_tokens is not None:
            self.journal = Journal(path + ".journal", fingerprint=fingerprint, tokens=journal_tokens,
                                   direct=self.direct)
            if created or not self.journal.valid:  # rebuilt from the headers (none in a new file)
                if not created:
                    logger.warning("kvtier: journal of %s is missing or damaged: rebuilding it from the slot "
                                   "headers", path)
                self.journal.rewrite([] if created else [_record(slot, h) for slot, h in self.scan()])

    # --- open ---

    def _check_existing(self, want: FileHeader, wipe: bool) -> None:
        with open(self.path, "rb") as f:
            got = unpack_file_header(f.read(ALIGN))
        if got == want:
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
        os.unlink(self.path)

    def _create(self, header: FileHeader) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise BlockFileError(f"{directory} is not a directory")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as e:
            raise BlockFileError(f"cannot create {self.path}: {e.strerror}") from e
        try:
            self._allocate_fd(fd, close=False)
            os.pwrite(fd, pack_file_header(header), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        dfd = os.open(directory, os.O_RDONLY)  # the new name is durable too
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _allocate_fd(self, fd: int, close: bool = True) -> None:
        """Preallocate the whole file (a full disk fails here, at start, not mid-serving)."""
        try:
            os.posix_fallocate(fd, 0, self.size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise BlockFileError(f"not enough space for {self.path}: {self.size / 2**30:.2f} GiB needed") from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise BlockFileError(f"cannot allocate {self.path}: {e.strerror}") from e
            os.ftruncate(fd, self.size)  # a file system without fallocate: a sparse file of the full size
        finally:
            if close:
                os.close(fd)

    def _open(self, direct: bool) -> int:
        if direct and hasattr(os, "O_DIRECT"):
            fd = -1
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
                os.preadv(fd, [_aligned(ALIGN)], 0)  # some file systems refuse O_DIRECT only at the first read
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

    def _buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """This thread's aligned header buffer and payload bounce buffer (made on first use)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = (_aligned(ALIGN), _aligned(padded(self.slot_payload_bytes)))
        return bufs

    # --- blocks ---

    def _slot_offset(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return ALIGN + slot * self.stride

    def write_payload(self, slot: int, payload: np.ndarray) -> int:
        """Write a block's payload (contiguous bytes, at most ``slot_payload_bytes``) into ``slot``; returns its
        checksum (for the header). Not durable until :meth:`sync`."""
        data = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        if data.size > self.slot_payload_bytes:
            raise ValueError(f"payload of {data.size} B exceeds the slot's {self.slot_payload_bytes} B")
        check = payload_checksum(data)
        n = padded(data.size)
        if data.ctypes.data % ALIGN == 0 and data.size == n:
            buf = data
        else:  # unaligned or short: through the aligned bounce buffer
            buf = self._buffers()[1][:n]
            buf[:data.size] = data
            buf[data.size:] = 0
        self._write_all(buf, self._slot_offset(slot) + ALIGN)
        return check

    def write_header(self, slot: int, header: BlockHeader) -> None:
        """Write ``slot``'s header (after its payload is durable: see the module docstring)."""
        if header.fingerprint != self.fingerprint:
            raise ValueError("the header's fingerprint is not this file's")
        buf = self._buffers()[0]
        buf[:] = np.frombuffer(pack_block_header(header), dtype=np.uint8)
        self._write_all(buf, self._slot_offset(slot))

    def clear(self, slot: int) -> None:
        """Mark ``slot`` empty (its header zeroed); durable with the next :meth:`sync`."""
        buf = self._buffers()[0]
        buf[:] = 0
        self._write_all(buf, self._slot_offset(slot))

    def commit(self, entries: list[tuple[int, BlockHeader]]) -> None:
        """Write the journal records of slots whose payloads are durable, then their headers (durable with
        :meth:`sync`)."""
        self.record(entries)
        for slot, h in entries:
            self.write_header(slot, h)

    def record(self, entries: list[tuple[int, BlockHeader]]) -> None:
        """Append the journal records of slots whose payloads are durable, before their headers are written
        (:meth:`commit`, or :meth:`write_header` from several threads): a process killed in between leaves records
        without headers (a miss on read), never a header that recovery does not list. Durable with :meth:`sync`."""
        j = self.journal
        if j is None:
            return
        j.append(_record(slot, h) for slot, h in entries)
        if j.pages > 2 * -(-self.num_slots // j.per_page) + 256:  # mostly superseded records: keep the live ones
            j.rewrite(j.replay().records())

    def free(self, slots: list[int]) -> None:
        """Mark slots empty, in their headers and the journal (durable with :meth:`sync`)."""
        for slot in slots:
            self.clear(slot)
        if self.journal is not None:
            self.journal.append(Record(FREE, s, 0, 0, 0, 0, np.empty(0, np.int64)) for s in slots)

    def sync(self) -> None:
        """Make every write so far durable (fdatasync of the file and its journal)."""
        os.fdatasync(self._fd)
        if self.journal is not None:
            self.journal.sync()

    def recover(self) -> list[tuple[int, BlockHeader]]:
        """The slots a previous process made durable, with their headers, in slot order: from the journal (one
        sequential read) where there is one, else from every slot's header. Payloads (and the headers themselves,
        when the journal answered) are checked when read."""
        if self.journal is None:
            return list(self.scan())
        return [(r.slot, BlockHeader(self.fingerprint, r.namespace, r.chain_hash, r.tokens, r.payload_len,
                                     r.payload_checksum)) for r in self.journal.replay().records()]

    def recover_hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`recover` as arrays (slot order): the slots and their blocks' chain hashes (uint64); from the
        journal without building a header per slot."""
        if self.journal is not None:
            return self.journal.replay_hashes()
        found = list(self.scan())
        return (np.array([s for s, _ in found], dtype=np.int64),
                np.array([h.chain_hash for _, h in found], dtype=np.uint64))

    def read(self, slot: int, out: np.ndarray) -> Optional[BlockHeader]:
        """Read ``slot`` into ``out`` (uint8, at least the payload's length); its header, or None when the slot is
        empty, its header or payload fails its checksum, or it belongs to another fingerprint (``out`` is then
        unspecified and must not be used)."""
        off = self._slot_offset(slot)
        n = padded(min(out.size, self.slot_payload_bytes))
        direct_ok = out.ctypes.data % ALIGN == 0 and out.size >= n
        header, bounce = self._buffers()
        buf = out[:n] if direct_ok else bounce[:n]
        self._read_all_v([header, buf], off)  # header and payload in one request
        h = unpack_block_header(header)
        if h is None or h.fingerprint != self.fingerprint or h.payload_len > n:
            return None
        if not direct_ok:
            out[:h.payload_len] = buf[:h.payload_len]
        if payload_checksum(out[:h.payload_len]) != h.payload_checksum:
            return None
        return h

    def scan(self) -> Iterator[tuple[int, BlockHeader]]:
        """Every slot with a valid header of this fingerprint (recovery after a restart; payloads are checked when
        read)."""
        header = self._buffers()[0]
        for slot in range(self.num_slots):
            self._read_all(header, self._slot_offset(slot))
            h = unpack_block_header(header)
            if h is not None and h.fingerprint == self.fingerprint:
                yield slot, h

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.journal is not None:
            self.journal.close()

    def __enter__(self) -> "BlockFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- IO ---

    def _write_all(self, buf: np.ndarray, offset: int) -> None:
        write_all(self._fd, buf, offset)

    def _read_all_v(self, bufs: list, offset: int) -> None:
        """Fill consecutive buffers from ``offset``, in one request where the kernel completes it."""
        n = os.preadv(self._fd, [memoryview(b) for b in bufs], offset)
        for b in bufs:
            if n < b.size:  # a short read: finish this buffer and the next ones piecewise
                self._read_all(b[n:], offset + n)
            n = max(n - b.size, 0)
            offset += b.size

    def _read_all(self, buf: np.ndarray, offset: int) -> None:
        read_all(self._fd, buf, offset)
