"""A read-only survey of an SSD cache: what each block file holds and whether it is sound (``kvtier inspect``).

Nothing is written, created, truncated or rebuilt: the files are opened read-only, and what a starting tier would
repair (a missing or damaged journal, a truncated file) is reported instead. The blocks held are those a starting
tier recovers: the journal's live records where the journal is sound, else every slot's valid header. With
``verify``, every held block is read back and checked as a read would check it (header checksum and fingerprint,
the header agreeing with its journal record, payload checksum).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np

from kvtier._checks import directories
from kvtier.storage.aligned_io import aligned, read_all
from kvtier.storage.block_format import (ALIGN, BlockHeader, FileHeader, padded, payload_checksum,
                                         unpack_block_header, unpack_file_header, unpack_seals)
from kvtier.storage.journal import Journal, head_tokens
from kvtier.storage.ssd_store import FILE_NAME

__all__ = ["SurveyError", "Verification", "JournalState", "FileSurvey", "survey_file", "survey_dirs", "namespace_hex"]

BAD_SLOTS_LISTED = 16  # a verification names at most this many bad slots


class SurveyError(Exception):
    """A path that is not an SSD cache (missing, not a directory, no block file, not a kvtier block file)."""


@dataclasses.dataclass
class Verification:
    """Held blocks read back and checked: how many, how many failed, and why (``header``: missing or damaged;
    ``record``: the header names another block than the journal's record; ``payload``: checksum)."""

    checked: int = 0
    bad: int = 0
    reasons: dict = dataclasses.field(default_factory=lambda: {"header": 0, "record": 0, "payload": 0})
    bad_slots: list = dataclasses.field(default_factory=list)  # the first BAD_SLOTS_LISTED, file-local


@dataclasses.dataclass
class JournalState:
    """The journal beside a block file. ``state``: ``ok``, ``missing``, ``invalid`` (damaged head, another
    format version, another fingerprint or store) or ``untrusted`` (a damaged page, pages out of sequence, or an end
    before the page the block file's seal names: ``problem`` says which); a starting tier rebuilds all but an ``ok``
    one from the slot headers."""

    path: str
    state: str
    bytes: int = 0
    tokens_per_record: Optional[int] = None
    pages: int = 0
    damaged_pages: int = 0  # fail their checksum
    problem: Optional[str] = None  # why a start does not trust it


@dataclasses.dataclass
class FileSurvey:
    """One block file: its identity, slot geometry, size, what it holds (per namespace) and its health."""

    path: str
    fingerprint: str  # hex of the 16-byte digest of the identity (the fields themselves are not stored)
    slot_payload_bytes: int
    num_slots: int
    slot_bytes: int  # header plus padded payload
    file_bytes: int  # the file's length
    expected_bytes: int  # its length by the header's geometry (shorter: truncated, the slots past its end empty)
    allocated_bytes: int  # on the disk
    blocks: int  # held: what a starting tier recovers
    payload_bytes: int  # the held blocks' payloads
    namespaces: dict  # namespace (the signed 64-bit seed on disk) -> blocks
    tokens_per_block: Optional[int]
    source: str  # "journal" or "headers": where the held blocks were read from
    journal: JournalState
    verification: Optional[Verification] = None

    @property
    def truncated(self) -> bool:
        return self.file_bytes < self.expected_bytes

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["namespaces"] = {namespace_hex(k): v for k, v in self.namespaces.items()}
        out["truncated"] = self.truncated
        return out


def namespace_hex(ns: int) -> str:
    """A namespace as on disk (a signed 64-bit seed) in hex, as the unsigned seed."""
    return f"{ns & ((1 << 64) - 1):016x}"


def survey_dirs(dirs, *, verify: bool = False) -> list[FileSurvey]:
    """The survey of every directory of ``dirs`` (``;``-separated, as ``ssd_cache_dir``, or a list).

    Raises:
        SurveyError: a directory is missing or holds no kvtier block file.
    """
    given = directories(dirs)
    names: list[str] = []
    for d in given:  # each directory once (as ssd_cache_dir is read), in the order given
        if all(os.path.realpath(d) != os.path.realpath(n) for n in names):
            names.append(d)
    if not names:
        raise SurveyError("no directory given")
    for d in names:
        if not os.path.isdir(d):
            raise SurveyError(f"{d}: no such directory")
        if not os.path.isfile(os.path.join(d, FILE_NAME)):
            raise SurveyError(f"{d} holds no kvtier SSD cache (no {FILE_NAME} in it)")
    return [survey_file(os.path.join(d, FILE_NAME), verify=verify) for d in names]


def survey_file(path: str, *, verify: bool = False) -> FileSurvey:
    """The survey of the block file at ``path`` (and its journal), read-only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        head = aligned(ALIGN)
        read_all(fd, head, 0)
        fh = unpack_file_header(head)
        if fh is None:
            raise SurveyError(f"{path} is not a kvtier block file (or its header is damaged)")
        st = os.fstat(fd)
        stride = ALIGN + padded(fh.slot_payload_bytes)
        journal = _journal_state(path + ".journal", fh)
        if journal.state == "ok":
            assert journal.tokens_per_record is not None  # known when the journal is valid
            # store_id: a version 1 file has none, read as _journal_state read it
            with Journal(journal.path, fingerprint=fh.fingerprint, tokens=journal.tokens_per_record, direct=False,
                         read_only=True, num_slots=fh.num_slots, store_id=fh.store_id or bytes(16)) as j:
                held = [(r.slot, _header(fh.fingerprint, r)) for r in j.replay().records()]
                health = j.health
                assert health is not None  # set by the replay
                journal.pages, journal.damaged_pages = health.pages, health.pages - health.intact
                seal = unpack_seals(head)
                journal.problem = j.problem(None if seal is None else seal.journal_seq,
                                            None if seal is None else seal.generation)
            if journal.problem is not None:  # a start rebuilds it from the headers
                journal.state = "untrusted"
        if journal.state == "ok":
            source = "journal"
        else:
            held = list(_scan(fd, fh.fingerprint, fh.num_slots, stride, st.st_size))
            source = "headers"
        namespaces: dict[int, int] = {}
        for _, h in held:
            namespaces[h.namespace] = namespaces.get(h.namespace, 0) + 1
        tokens = journal.tokens_per_record if source == "journal" else (held[0][1].tokens.size if held else None)
        out = FileSurvey(path=path, fingerprint=fh.fingerprint.hex(), slot_payload_bytes=fh.slot_payload_bytes,
                         num_slots=fh.num_slots, slot_bytes=stride, file_bytes=st.st_size,
                         expected_bytes=ALIGN + fh.num_slots * stride, allocated_bytes=st.st_blocks * 512,
                         blocks=len(held), payload_bytes=sum(h.payload_len for _, h in held),
                         namespaces=dict(sorted(namespaces.items(), key=lambda kv: -kv[1])),
                         tokens_per_block=tokens, source=source, journal=journal)
        if verify:
            out.verification = _verify(fd, fh.fingerprint, stride, fh.slot_payload_bytes, held)
        return out
    finally:
        os.close(fd)


def _journal_state(path: str, fh: FileHeader) -> JournalState:
    if not os.path.exists(path):
        return JournalState(path, "missing")
    size = os.path.getsize(path)
    tokens = head_tokens(path)
    if tokens is None:
        return JournalState(path, "invalid", size, problem="its head is damaged or of another format version")
    with Journal(path, fingerprint=fh.fingerprint, tokens=tokens, direct=False, read_only=True,
                 store_id=fh.store_id or bytes(16)) as j:
        valid, why = j.valid, j.invalid_reason  # the head names this file's fingerprint and store
    return JournalState(path, "ok" if valid else "invalid", size, tokens if valid else None, problem=why)


def _header(fp: bytes, r) -> BlockHeader:
    return BlockHeader(fp, r.namespace, r.chain_hash, r.tokens, r.payload_len, r.payload_checksum)


def _scan(fd: int, fp: bytes, num_slots: int, stride: int, size: int):
    """Every slot with a valid header of ``fp`` (slots past the end of a truncated file are empty)."""
    buf = aligned(ALIGN)
    for slot in range(num_slots):
        off = ALIGN + slot * stride
        if off + ALIGN > size:
            return
        read_all(fd, buf, off)
        h = unpack_block_header(buf)
        if h is not None and h.fingerprint == fp:
            yield slot, h


def _verify(fd: int, fp: bytes, stride: int, slot_payload: int, held) -> Verification:
    """Read every held slot's header and payload and check them against the listed headers."""
    out = Verification()
    head, payload = aligned(ALIGN), aligned(padded(slot_payload))
    for slot, want in held:
        off = ALIGN + slot * stride
        read_all(fd, head, off)
        got = unpack_block_header(head)
        reason = None
        if got is None or got.fingerprint != fp or got.payload_len > slot_payload:
            reason = "header"
        elif (got.namespace, got.chain_hash, got.payload_len, got.payload_checksum) != (
                want.namespace, want.chain_hash, want.payload_len, want.payload_checksum) or not np.array_equal(
                got.tokens, want.tokens):
            reason = "record"
        else:
            n = padded(got.payload_len)
            read_all(fd, payload[:n], off + ALIGN)
            if payload_checksum(payload[:got.payload_len]) != got.payload_checksum:
                reason = "payload"
        out.checked += 1
        if reason is not None:
            out.bad += 1
            out.reasons[reason] += 1
            if len(out.bad_slots) < BAD_SLOTS_LISTED:
                out.bad_slots.append(slot)
    return out
