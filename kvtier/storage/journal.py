"""A block file's journal: which block each slot holds, read back in one sequential pass on restart.

The slot headers are the authority on what the file holds; the journal is what makes a start fast. Reading every
slot's 4 KiB header costs one disk round trip per slot (``bench/results/ssd_cpu.json``, ``recovery``); the journal
holds the same records side by side. Records are appended after their payloads are durable (the same rule as the
headers), a batch at a time, in whole 4 KiB pages; a record never straddles a page, and each page ends with its
sequence number and the xxh3-64 checksum of the rest of it. Replay keeps the last record per slot; a ``free`` record
empties it.

A start trusts the journal only when nothing says it lost records (:meth:`Journal.problem`); otherwise the caller
rebuilds it from the headers. The head names the block file's store id (a journal copied from another store of the
same model is another store's), and the page sequence numbers run on from the head's first one, page after page, so
a damaged page before the last whole one, pages out of sequence (a compaction in place torn by a crash, pieces of
another copy) and a journal that ends before the last page the block file's seal names as durable (cut short,
rolled back) all show. Whole pages past the last intact one are an append a crash tore (never acknowledged) and are
cut off at open.

When it holds more than twice the pages a record per slot of its file takes (plus 256), the journal is rewritten
with the live records only (a new file, synced, renamed over the old one; its pages continue the sequence): a batch
takes whole pages, so small batches fill it faster. The most space the journal can take (:func:`reserve_bytes`) is
held from the start in a reserve file beside it (:class:`~kvtier.storage.reserve.Reserve`): an append that finds the
disk full (another program took the rest) writes into pages the reserve gives back, or into what a compaction frees
(in place when the new file's copy finds no room either), and a compaction takes the reserve back.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
from typing import Iterable, NamedTuple, Optional

import numpy as np
import xxhash

from kvtier._cleanup import run_all
from kvtier.storage.aligned_io import aligned as _aligned, read_all, write_all as _write_all
from kvtier.storage.block_format import ALIGN
from kvtier.storage.reserve import Reserve

logger = logging.getLogger(__name__)

__all__ = ["Journal", "Record", "Replay", "PageHealth", "BLOCK", "FREE", "head_tokens", "reserve_bytes"]

BLOCK, FREE = 1, 2
# 3: the store id in the head, a sequence number per page; 2: a checksum per page; 1: one per record (a journal of
# an earlier version is invalid here and rebuilt from the headers)
_VERSION = 3
_MAGIC = 0x524A564B  # "KVJR"
_HEAD_MAGIC = b"KVTJRNL3"
_FIXED = struct.Struct("<IHHqqQQQI4x")  # magic, version, kind, slot, namespace, chain, payload len, checksum, ntok
_FIELDS = [("magic", "<u4"), ("version", "<u2"), ("kind", "<u2"), ("slot", "<i8"), ("ns", "<i8"), ("chain", "<u8"),
           ("plen", "<u8"), ("pcheck", "<u8"), ("ntok", "<u4"), ("pad", "<u4")]
# magic, version, fingerprint, store id, tokens per record, first page's seq, the seq its rewrite's records reach,
# generation (16 random bytes drawn when the journal is rebuilt from the headers; compactions keep it)
_HEAD = struct.Struct("<8sI16s16sIQQ16s")
_CHECK = struct.Struct("<Q")
_SEQ = struct.Struct("<Q")
_BODY = ALIGN - _SEQ.size - _CHECK.size  # a page's record bytes (then its sequence number, then its checksum)
_SUMMED = ALIGN - _CHECK.size  # the bytes a page's checksum covers
_CHUNK = 1024 * ALIGN  # bytes read and parsed at a time by a replay
_SLACK_PAGES = 256  # record pages a journal may hold beyond twice what its live records need


def _record_bytes(tokens: int) -> int:
    return _FIXED.size + 8 * tokens


def _live_pages(num_slots: int, tokens: int) -> int:
    """Record pages the records of ``num_slots`` slots fill."""
    return -(-num_slots // (_BODY // _record_bytes(tokens)))


def reserve_bytes(num_slots: int, tokens: int) -> int:
    """The most disk space the journal of a file of ``num_slots`` slots takes: its head, its record pages up to the
    compaction bound, one append past it (at most a record per slot), and the compacted copy written beside it."""
    live = _live_pages(num_slots, tokens)
    return ALIGN * ((1 + 2 * live + _SLACK_PAGES + live) + (1 + live))


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
    """The journal at ``path`` for blocks of ``fingerprint`` with ``tokens`` tokens each, of the block file whose
    store id is ``store_id``.

    ``valid`` is False when the file is missing or its head is damaged, of another version, or another model's or
    store's (``invalid_reason`` says which): the caller rebuilds it from the headers (:meth:`rewrite`). A valid
    journal may still have lost records: :meth:`problem` says so after a replay. ``read_only``: opened for reading
    (replays and :meth:`page_health`) and never written. ``num_slots``: the block file's slots; records of other
    slots (a journal left beside a recreated file) are void, the journal compacts itself past its bound and holds its
    room (``path + ".reserve"``; OSError ENOSPC when the disk has not that much). None (read-only surveys): every slot
    counts, no bound, no reserve."""

    def __init__(self, path: str, *, fingerprint: bytes, tokens: int, direct: bool, store_id: bytes,
                 read_only: bool = False, num_slots: Optional[int] = None) -> None:
        self.path, self.fingerprint, self.tokens, self.store_id = path, fingerprint, tokens, store_id
        self.num_slots = num_slots
        self.record_bytes = _record_bytes(tokens)
        self.per_page = _BODY // self.record_bytes
        if self.per_page < 1:
            raise ValueError(f"a journal record of {tokens} tokens does not fit a {ALIGN}-byte page")
        self._dtype = np.dtype(_FIELDS + [("toks", "<i8", (tokens,))])  # a record, as numpy parses it
        self._direct, self._read_only = direct, read_only
        self.valid = False
        self.invalid_reason: Optional[str] = "missing"
        self.first_seq = 1  # the sequence number of the first record page
        self.must_reach = 0  # the sequence number of the last page the rewrite that made this file wrote
        self.generation = bytes(16)
        self.pages = 0  # record pages in the file (compaction counts them)
        self.end = ALIGN
        self.health: Optional[PageHealth] = None  # of the last replay
        # compacted past this many record pages
        self.bound_pages = None if num_slots is None else 2 * _live_pages(num_slots, tokens) + _SLACK_PAGES
        self._fd = -1
        if os.path.exists(path):
            with open(path, "rb") as f:
                buf = f.read(ALIGN)
            head = _read_head(buf) if len(buf) == ALIGN else None  # a head page cut short is no head
            self.invalid_reason = self._head_problem(head)
            self.valid = self.invalid_reason is None
            if head is not None and self.valid:
                self.first_seq, self.must_reach, self.generation = head.first_seq, head.must_reach, head.generation
        if self.valid:
            self._fd = self._open(path)
            try:
                self.end = max(ALIGN, os.fstat(self._fd).st_size // ALIGN * ALIGN)
            except BaseException:
                self.close()
                raise
            self.pages = (self.end - ALIGN) // ALIGN
        self._reserve: Optional[Reserve] = None
        if num_slots is not None and not read_only:
            try:
                self._reserve = Reserve(path + ".reserve", self._room())
            except BaseException:
                self.close()
                raise

    @property
    def next_seq(self) -> int:
        """The sequence number the next appended page takes."""
        return self.first_seq + self.pages

    @property
    def last_seq(self) -> int:
        """The sequence number of the last page in the file (``first_seq - 1`` when it has none)."""
        return self.next_seq - 1

    def _room(self) -> int:
        """Bytes the reserve holds: the most the journal can take, less what it takes now."""
        assert self.num_slots is not None  # a journal that writes knows its block file's slots
        return reserve_bytes(self.num_slots, self.tokens) - (self.end if self.valid else 0)

    def _head(self, first_seq: int, must_reach: int, generation: bytes) -> np.ndarray:
        body = _HEAD.pack(_HEAD_MAGIC, _VERSION, self.fingerprint, self.store_id, self.tokens, first_seq, must_reach,
                          generation)
        page = _aligned(ALIGN)
        page[:len(body) + _CHECK.size] = np.frombuffer(body + _CHECK.pack(xxhash.xxh3_64_intdigest(body)),
                                                       dtype=np.uint8)
        return page

    def _head_problem(self, head: Optional["_Head"]) -> Optional[str]:
        if head is None:
            return "its head is damaged or of another format version"
        if head.fingerprint != self.fingerprint or head.tokens != self.tokens:
            return "it was written for another model or block size"
        if head.store_id != self.store_id:
            return "it belongs to another store (copied from another directory?)"
        return None

    def _open(self, path: str) -> int:
        flags = os.O_RDONLY if self._read_only else os.O_RDWR
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
        return _FIXED.pack(_MAGIC, _VERSION, r.kind, r.slot, r.namespace, r.chain_hash, r.payload_len,
                           r.payload_checksum, toks.size) + toks.tobytes()

    def _pages(self, records: list[Record], first_seq: int) -> np.ndarray:
        """``records`` packed in whole pages numbered from ``first_seq``, each page's number and checksum last."""
        pages = _aligned(-(-len(records) // self.per_page) * ALIGN).reshape(-1, ALIGN)
        rb = self.record_bytes
        for i, r in enumerate(records):
            p, k = divmod(i, self.per_page)
            rec = np.frombuffer(self._pack(r), dtype=np.uint8)
            pages[p, k * rb:k * rb + rec.size] = rec
        for p, page in enumerate(pages):
            page[_BODY:_SUMMED] = np.frombuffer(_SEQ.pack(first_seq + p), dtype=np.uint8)
            # the ignore: an ndarray is a buffer (numpy's stubs say so from Python 3.12 on)
            digest = xxhash.xxh3_64_intdigest(page[:_SUMMED])  # type: ignore[arg-type]
            page[_SUMMED:] = np.frombuffer(_CHECK.pack(digest), dtype=np.uint8)
        return pages.reshape(-1)

    def append(self, records: Iterable[Record]) -> None:
        """Append records in whole pages (durable with :meth:`sync`; write them only after their payloads are); past
        the bound, compact. On a full disk, tries once more in the room :meth:`_make_room` finds, else raises
        (ENOSPC)."""
        records = list(records)
        if not records or not self.valid:
            return
        self._writable()
        buf = self._pages(records, self.next_seq)
        try:
            try:
                _write_all(self._fd, buf, self.end)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                self._cut_back()
                self._make_room(buf.size)
                buf = self._pages(records, self.next_seq)  # a compaction renumbered the pages before them
                _write_all(self._fd, buf, self.end)
        except BaseException:
            self._cut_back()  # no intact page of a failed append stays past the end (a later append would not
            raise             # overwrite it all, and a replay would take its records)
        self.end += buf.size
        self.pages += buf.size // ALIGN
        if self.bound_pages is not None and self.pages > self.bound_pages:  # mostly superseded records
            self._compact()

    def _cut_back(self) -> None:
        """Cut the file back to :attr:`end` (what a failed write put past it goes), as far as the disk lets."""
        try:
            os.ftruncate(self._fd, self.end)
        except OSError:
            logger.warning("kvtier: journal %s could not be cut back after a failed append", self.path)

    def _make_room(self, nbytes: int) -> None:
        """Room for ``nbytes`` more on a full disk: pages the reserve gives back when it holds that many, else what
        a compaction frees, else whatever the reserve still holds."""
        if self._reserve is not None and self._reserve.nbytes >= nbytes:
            self._reserve.release(nbytes)
        elif not self._compact() and self._reserve is not None:
            self._reserve.release(nbytes)

    def _compact(self) -> bool:
        """Rewrite the journal with its live records only, when that makes it smaller; whether it did. A disk with
        no room for the new file's copy gets them in place instead (:meth:`_rewrite_in_place`)."""
        live = list(self.replay().records())
        if -(-len(live) // self.per_page) >= self.pages:
            return False
        try:
            self.rewrite(live)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            self._rewrite_in_place(live)
        return True

    def _rewrite_in_place(self, live: list[Record]) -> None:
        """Write ``live`` records over the oldest pages, numbered on from the last, then the head that names their
        first number, and cut the file after them. A crash in between leaves pages out of sequence, which a start
        does not trust (:meth:`problem`): it rebuilds the journal from the headers."""
        first = self.next_seq
        pages = self._pages(live, first) if live else _aligned(0)
        reach = first + pages.size // ALIGN - 1
        _write_all(self._fd, pages, ALIGN)
        _write_all(self._fd, self._head(first, reach, self.generation), 0)
        os.fdatasync(self._fd)
        os.ftruncate(self._fd, ALIGN + pages.size)
        self.first_seq, self.must_reach = first, reach
        self.end = ALIGN + pages.size
        self.pages = pages.size // ALIGN
        self._refill()

    def _refill(self) -> None:
        """Take back the reserve the journal's present size leaves (as much as the disk has room for)."""
        if self._reserve is not None:
            self._reserve.refill(self._room())

    def sync(self) -> None:
        if self._fd >= 0:
            os.fdatasync(self._fd)

    def replay(self) -> Replay:
        """The last record of every slot that holds a block (slots freed last are left out), from the intact pages,
        as arrays in slot order."""
        live = self._live(("ns", "chain", "plen", "pcheck", "toks", "ntok"))
        return Replay(live["slot"], live["ns"], live["chain"], live["plen"], live["pcheck"], live["toks"],
                      live["ntok"])

    def replay_hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`replay`'s slots and chain hashes only (what a restart's index needs; no tokens are gathered)."""
        live = self._live(("chain",))
        return live["slot"], live["chain"]

    def problem(self, sealed_seq: Optional[int], sealed_generation: Optional[bytes] = None) -> Optional[str]:
        """Why the last replay may have missed records (None: it did not): the head, a damaged page before the last
        intact one, pages out of sequence, an end before the last page of the rewrite that made the file (its head
        names it), or before page ``sealed_seq``, which the block file's seal names as durable, or another generation
        than the seal's (a journal from before a rebuild; None, None: no seal was written)."""
        if not self.valid:
            return self.invalid_reason
        h = self.health
        if h is None:
            raise RuntimeError("problem() reads the health of a replay: replay first")
        last = self.first_seq + h.last_intact
        if h.first_bad < h.last_intact:
            return f"its page {h.first_bad + 1} of {h.pages} is damaged"
        if h.out_of_order:
            return "its pages are out of sequence (a compaction torn by a crash, or pieces of two copies)"
        if sealed_generation is not None and sealed_generation != self.generation:
            return "it is of another generation than the block file's seal (a copy from before a rebuild)"
        if last < self.must_reach:
            return f"it ends at page {last}, before page {self.must_reach}, where its last compaction ended (cut short)"
        if sealed_seq is not None and last < sealed_seq:
            return (f"it ends at page {last}, before page {sealed_seq}, which the block file names as durable (cut "
                    f"short or rolled back)")
        return None

    def cut_torn_tail(self) -> int:
        """Cut off the pages past the last intact one of the last replay (an append a crash tore: never
        acknowledged), so that appends follow the intact pages; returns the pages cut."""
        self._writable()
        assert self.health is not None, "cut_torn_tail() before a replay"
        keep = self.health.last_intact + 1
        cut = self.pages - keep
        if cut > 0:
            os.ftruncate(self._fd, ALIGN * (1 + keep))
            self.end, self.pages = ALIGN * (1 + keep), keep
        return cut

    def _live(self, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
        """``slot`` and ``fields`` of each slot's last record, where that record holds a block, in slot order."""
        recs = self._scan(fields)
        _, last_rev = np.unique(recs["slot"][::-1], return_index=True)  # each slot's last record (slot order)
        last = recs["slot"].size - 1 - last_rev
        last = last[recs["kind"][last] == BLOCK]
        return {k: recs[k][last] for k in ("slot",) + fields}

    def _scan(self, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
        """``slot``, ``kind`` and ``fields`` of every well-formed record of the intact pages (of a slot of the file,
        where the journal knows its slots), in append order; the pages' health goes to :attr:`health`. Read and
        parsed a chunk at a time through one buffer: new memory costs more than the parsing."""
        names = ("slot", "kind") + fields
        parts = {k: [np.empty(0, self._dtype)[k]] for k in names}
        end = self.end if self.valid else ALIGN
        buf = _aligned(min(end - ALIGN, _CHUNK))
        first_bad, last_intact, out_of_order, whole = self.pages, -1, False, 0
        for off in range(ALIGN, end, _CHUNK):
            pages = buf[:min(_CHUNK, end - off)].reshape(-1, ALIGN)
            read_all(self._fd, pages.reshape(-1), off)
            at = (off - ALIGN) // ALIGN  # the chunk's first page
            intact = _intact(pages)
            seqs = np.ascontiguousarray(pages[:, _BODY:_SUMMED]).view("<u8").reshape(-1)
            out_of_order |= bool((seqs[intact] != self.first_seq + at + np.flatnonzero(intact)).any())
            bad = np.flatnonzero(~intact)
            if bad.size:
                first_bad = min(first_bad, at + int(bad[0]))
            good = np.flatnonzero(intact)
            whole += good.size
            if good.size:
                last_intact = at + int(good[-1])
            recs = pages[:, :self.per_page * self.record_bytes].view(self._dtype)
            keep = (intact[:, None] & (recs["magic"] == _MAGIC) & (recs["version"] == _VERSION)
                    & ((recs["kind"] == BLOCK) | (recs["kind"] == FREE)) & (recs["ntok"] <= self.tokens)
                    & (recs["slot"] >= 0) & (recs["slot"] < (self.num_slots or np.iinfo(np.int64).max)))
            for k in names:
                parts[k].append(recs[k][keep])
        self.health = PageHealth(self.pages, first_bad, last_intact, out_of_order, whole)
        return {k: np.concatenate(v) for k, v in parts.items()}

    def rewrite(self, live: Iterable[Record], first_seq: Optional[int] = None, new_generation: bool = False) -> None:
        """Replace the journal with ``live`` records only, its pages numbered from ``first_seq`` (default: on from
        this journal's last page), its head naming where they end: a new file, synced, renamed over this one; its
        room comes out of the reserve, which :func:`reserve_bytes` sizes for it. ``new_generation``: the records were
        rebuilt from the headers (a journal copy from before is of another generation)."""
        self._writable()
        first = (self.next_seq if self.valid else 1) if first_seq is None else first_seq
        generation = os.urandom(16) if new_generation or not self.valid else self.generation
        tmp = self.path + ".tmp"
        records = list(live)
        pages = self._pages(records, first) if records else _aligned(0)
        reach = first + pages.size // ALIGN - 1
        if self._reserve is not None:
            self._reserve.release(ALIGN + pages.size)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, self._head(first, reach, generation), 0)
                if records:
                    _write_all(fd, pages, ALIGN)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a failed copy leaves nothing behind; the journal stays as it was
            self._refill()
            raise
        # the new file is the journal from here on, whatever fails next
        old, self._fd = self._fd, -1
        self.end, self.pages = ALIGN + pages.size, pages.size // ALIGN
        self.valid, self.invalid_reason = True, None
        self.first_seq, self.must_reach, self.generation = first, reach, generation
        self.health = PageHealth(self.pages, self.pages, self.pages - 1, False, self.pages)
        if old >= 0:
            os.close(old)
        self._fd = self._open(self.path)
        dfd = os.open(os.path.dirname(self.path), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self._refill()

    def page_health(self) -> tuple[int, int]:
        """(record pages, pages that fail their checksum) of a valid journal."""
        self._scan(())
        assert self.health is not None  # set by the scan
        return self.health.pages, self.health.pages - self.health.intact

    def _writable(self) -> None:
        if self._read_only:
            raise PermissionError(f"journal {self.path} is open read-only")

    def close(self) -> None:
        """Close the journal file and its reserve, the reserve even if the file's close fails; idempotent."""
        fd, self._fd = self._fd, -1
        run_all(None if fd < 0 else lambda: os.close(fd), None if self._reserve is None else self._reserve.close)

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PageHealth(NamedTuple):
    """The pages a replay read: how many, the first that fails its checksum and the last that passes (page
    positions from 0; ``pages`` and -1 when there is none), whether an intact page's number is not its place's, and
    how many pass."""

    pages: int
    first_bad: int
    last_intact: int
    out_of_order: bool
    intact: int


class _Head(NamedTuple):
    fingerprint: bytes
    store_id: bytes
    tokens: int
    first_seq: int
    must_reach: int
    generation: bytes


def _read_head(buf: bytes) -> Optional[_Head]:
    """The head in ``buf`` (a journal's first bytes), or None when it is not a whole one of this version."""
    if len(buf) < _HEAD.size + _CHECK.size or buf[:8] != _HEAD_MAGIC:
        return None
    magic, version, fp, store_id, tokens, first_seq, must_reach, generation = _HEAD.unpack_from(buf)
    (check,) = _CHECK.unpack_from(buf, _HEAD.size)
    if version != _VERSION or xxhash.xxh3_64_intdigest(buf[:_HEAD.size]) != check:
        return None
    return _Head(fp, store_id, tokens, first_seq, must_reach, generation)


def head_tokens(path: str) -> Optional[int]:
    """Tokens per record named by the head of the journal at ``path``; None when the file is missing or its head
    is not a whole one of this version (its fingerprint and store are checked by opening it as a :class:`Journal`)."""
    try:
        with open(path, "rb") as f:
            head = _read_head(f.read(ALIGN))
    except FileNotFoundError:
        return None
    return None if head is None else head.tokens


def _intact(pages: np.ndarray) -> np.ndarray:
    """Which of ``pages`` (rows of :data:`ALIGN` bytes) match the checksum they end with."""
    stored = np.ascontiguousarray(pages[:, _SUMMED:]).view("<u8").reshape(-1).tolist()
    flat = memoryview(pages.reshape(-1))  # type: ignore[arg-type]  # an ndarray is a buffer (numpy's stubs: 3.12+)
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter((digest(flat[i * ALIGN:i * ALIGN + _SUMMED]) == c for i, c in enumerate(stored)), dtype=bool,
                       count=len(stored))
