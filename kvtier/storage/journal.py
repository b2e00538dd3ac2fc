"""A block file's journal: which block each slot holds, read back in one sequential pass on restart.

Reading every slot's 4 KiB header costs one disk round trip per slot (120-240 s per million slots on the CPU
machine's disk); the journal holds the same records side by side. Records are appended after their payloads are
durable (the same rule as the headers), a batch at a time, in whole 4 KiB pages; a record never straddles a page,
so a torn page voids only its own records (each carries a checksum). Replay keeps the last valid record per slot;
a ``free`` record empties it. The journal is a cache of the headers: a slot's header stays the authority when the
block is read, so a record the journal lost or kept too long costs a miss, never wrong data.

When it grows past twice the pages its live records need (plus 256) the journal is rewritten with the live records
only (a new file, synced, renamed over the old one): a batch takes whole pages, so small batches fill it faster.
"""

from __future__ import annotations

import errno
import os
import struct
from typing import Iterable, NamedTuple, Optional

import numpy as np
import xxhash

from kvtier.storage.aligned_io import aligned as _aligned, read_all, write_all as _write_all
from kvtier.storage.block_format import ALIGN, FORMAT_VERSION

__all__ = ["Journal", "Record", "Replay", "BLOCK", "FREE"]

BLOCK, FREE = 1, 2
_MAGIC = 0x524A564B  # "KVJR"
_HEAD_MAGIC = b"KVTJRNL1"
_FIXED = struct.Struct("<IHHqqQQQI4x")  # magic, version, kind, slot, namespace, chain, payload len, checksum, ntok
_DTYPE = np.dtype([("magic", "<u4"), ("version", "<u2"), ("kind", "<u2"), ("slot", "<i8"), ("ns", "<i8"),
                   ("chain", "<u8"), ("plen", "<u8"), ("pcheck", "<u8"), ("ntok", "<u4"), ("pad", "<u4")])
_HEAD = struct.Struct("<8sI16sI")  # magic, version, fingerprint, tokens per record
_CHECK = struct.Struct("<Q")


class Replay(NamedTuple):
    """The live records of a journal as arrays, one row per slot that holds a block, in slot order."""

    slots: np.ndarray  # int64
    namespaces: np.ndarray  # int64
    chain_hashes: np.ndarray  # uint64
    payload_lens: np.ndarray  # uint64
    payload_checksums: np.ndarray  # uint64
    tokens: np.ndarray  # int64 (rows, tokens per record); a row's first ``num_tokens[i]`` are its tokens
    num_tokens: np.ndarray  # uint32

    def records(self):
        """The same as :class:`Record` tuples (slow for millions: the arrays are the fast interface)."""
        for i in range(self.slots.size):
            yield Record(BLOCK, int(self.slots[i]), int(self.namespaces[i]), int(self.chain_hashes[i]),
                         int(self.payload_lens[i]), int(self.payload_checksums[i]),
                         self.tokens[i, :self.num_tokens[i]])


class Record(NamedTuple):
    kind: int
    slot: int
    namespace: int
    chain_hash: int
    payload_len: int
    payload_checksum: int
    tokens: np.ndarray


class Journal:
    """The journal at ``path`` for blocks of ``fingerprint`` with ``tokens`` tokens each.

    ``valid`` is False when the file is missing, damaged or another's: the caller rebuilds it from the headers
    (:meth:`rewrite`)."""

    def __init__(self, path: str, *, fingerprint: bytes, tokens: int, direct: bool) -> None:
        self.path, self.fingerprint, self.tokens = path, fingerprint, tokens
        self.record_bytes = -(-(_FIXED.size + 8 * tokens + _CHECK.size) // 8) * 8
        self.per_page = ALIGN // self.record_bytes
        if self.per_page < 1:
            raise ValueError(f"a journal record of {tokens} tokens does not fit a {ALIGN}-byte page")
        self._direct = direct
        self.valid = False
        self.pages = 0  # pages appended since the last rewrite (compaction counts them)
        self._fd = -1
        if os.path.exists(path):
            with open(path, "rb") as f:
                self.valid = self._head_ok(f.read(ALIGN))
        if self.valid:
            self._fd = self._open(path)
            self.end = os.fstat(self._fd).st_size // ALIGN * ALIGN

    def _head(self) -> bytes:
        body = _HEAD.pack(_HEAD_MAGIC, FORMAT_VERSION, self.fingerprint, self.tokens)
        return (body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))).ljust(ALIGN, b"\0")

    def _head_ok(self, buf: bytes) -> bool:
        return len(buf) >= ALIGN and buf[:ALIGN] == self._head()

    def _open(self, path: str) -> int:
        flags = os.O_RDWR
        if self._direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, flags | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        return os.open(path, flags)

    # --- records ---

    def _pack(self, r: Record) -> bytes:
        toks = np.ascontiguousarray(r.tokens, dtype="<i8")
        if toks.size > self.tokens:
            raise ValueError(f"a record holds at most {self.tokens} tokens, got {toks.size}")
        body = _FIXED.pack(_MAGIC, FORMAT_VERSION, r.kind, r.slot, r.namespace, r.chain_hash, r.payload_len,
                           r.payload_checksum, toks.size) + toks.tobytes()
        body = body.ljust(self.record_bytes - _CHECK.size, b"\0")
        return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))

    def _pages(self, records: list[Record]) -> np.ndarray:
        pages = -(-len(records) // self.per_page)
        buf = _aligned(pages * ALIGN)
        for i, r in enumerate(records):
            p, k = divmod(i, self.per_page)
            off = p * ALIGN + k * self.record_bytes
            buf[off:off + self.record_bytes] = np.frombuffer(self._pack(r), dtype=np.uint8)
        return buf

    def append(self, records: Iterable[Record]) -> None:
        """Append records in whole pages (durable with :meth:`sync`; write them only after their payloads are)."""
        records = list(records)
        if not records or not self.valid:
            return
        buf = self._pages(records)
        _write_all(self._fd, buf, self.end)
        self.end += buf.size
        self.pages += buf.size // ALIGN

    def sync(self) -> None:
        if self._fd >= 0:
            os.fdatasync(self._fd)

    def replay(self) -> Replay:
        """The last valid record of every slot that holds a block (slots freed last are left out), as arrays.
        Parsed with numpy; only each record's checksum is a per-record call."""
        empty = np.empty(0, np.int64)
        none = Replay(empty, empty, empty.astype(np.uint64), empty.astype(np.uint64), empty.astype(np.uint64),
                      np.empty((0, self.tokens), np.int64), empty.astype(np.uint32))
        if not self.valid or self.end <= ALIGN:
            return none
        raw = _aligned(self.end - ALIGN)  # whole pages: end is page-aligned
        read_all(self._fd, raw, ALIGN)
        rb, body = self.record_bytes, self.record_bytes - _CHECK.size
        recs = raw.reshape(-1, ALIGN)[:, :self.per_page * rb].reshape(-1, rb)
        fixed = np.ascontiguousarray(recs[:, :_FIXED.size]).view(_DTYPE).reshape(-1)
        cand = np.flatnonzero((fixed["magic"] == _MAGIC) & (fixed["version"] == FORMAT_VERSION)
                              & ((fixed["kind"] == BLOCK) | (fixed["kind"] == FREE)) & (fixed["ntok"] <= self.tokens))
        checks = np.ascontiguousarray(recs[cand, body:]).view("<u8").reshape(-1).tolist()
        rows = memoryview(np.ascontiguousarray(recs[cand, :body])).cast("B")
        digest = xxhash.xxh3_64_intdigest
        good = np.fromiter((digest(rows[i * body:(i + 1) * body]) == c for i, c in enumerate(checks)),
                           dtype=bool, count=cand.size)
        idx = cand[good]
        if idx.size == 0:
            return none
        slots = fixed["slot"][idx]
        uniq, last_rev = np.unique(slots[::-1], return_index=True)  # each slot's last record (slot order)
        last = idx[idx.size - 1 - last_rev]
        last = last[fixed["kind"][last] == BLOCK]
        f = fixed[last]
        toks = np.ascontiguousarray(recs[last, _FIXED.size:_FIXED.size + 8 * self.tokens]).view("<i8")
        return Replay(f["slot"].copy(), f["ns"].copy(), f["chain"].copy(), f["plen"].copy(), f["pcheck"].copy(),
                      toks.reshape(-1, self.tokens), f["ntok"].copy())

    def rewrite(self, live: Iterable[Record]) -> None:
        """Replace the journal with ``live`` records only (a new file, synced, renamed over this one)."""
        tmp = self.path + ".tmp"
        records = list(live)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            head = _aligned(ALIGN)
            head[:] = np.frombuffer(self._head(), dtype=np.uint8)
            _write_all(fd, head, 0)
            if records:
                _write_all(fd, self._pages(records), ALIGN)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = self._open(self.path)
        self.end = os.fstat(self._fd).st_size
        self.valid, self.pages = True, (self.end - ALIGN) // ALIGN

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

