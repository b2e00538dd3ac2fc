"""The on-disk format of a host block: a 4 KiB header that makes each block verifiable on its own.

A block file is a head page (4 KiB) followed by slots; a slot is a block header (4 KiB) and the payload (the
block's KV bytes) padded to 4 KiB, so that O_DIRECT reads and writes stay aligned. The head page holds the file header
(its first 512-byte sector: fingerprint, slot geometry, and the store id, 16 random bytes drawn when the file is made)
and two seals (a sector each, written in turn, so a torn write leaves the other whole): the last journal page known
durable, which a journal cut short or rolled back falls below (:mod:`kvtier.storage.journal`). A block header holds
the format version, the fingerprint of what the KV belongs to, the namespace and chain hash of the block, its tokens,
the payload's length and checksum (xxh3-64), and a checksum of the header itself. A header that fails its own checksum
is an empty slot; a payload that fails its checksum, or tokens that differ from the caller's, is a miss.

Fingerprints: a 16-byte xxh3-128 digest of a canonical description (model identity, geometry, dtype, page size,
layout, TP rank and size); a file written for another fingerprint is never read as this one's.
"""

from __future__ import annotations

import json
import struct
from typing import NamedTuple, Optional

import numpy as np
import xxhash

__all__ = ["ALIGN", "FORMAT_VERSION", "FILE_VERSION", "BlockHeader", "FileHeader", "Seal", "fingerprint",
           "pack_block_header", "unpack_block_header", "pack_file_header", "unpack_file_header", "pack_seal",
           "unpack_seals", "payload_checksum", "padded"]

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers (the page size of the usual file systems)
FORMAT_VERSION = 1  # of block headers
FILE_VERSION = 2  # of the file header: 2 adds the store id and the seals (a file of version 1 is upgraded at open)
SECTOR = 512  # the head page's unit of atomic writes: the file header and each seal have one of their own
_BLOCK_MAGIC = b"KVTBLK01"
_FILE_MAGIC = b"KVTFILE1"
_SEAL_MAGIC = b"KVTSEAL1"
# magic, version, fingerprint, namespace, chain hash, payload length, payload checksum, token count
_BLOCK_FIXED = struct.Struct("<8sI16sqQQQI")
_FILE_FIXED = struct.Struct("<8sI16sQQ")  # magic, version, fingerprint, slot payload bytes, slots
_STORE_ID = struct.Struct("<16s")  # version 2: after the fixed fields
_SEAL = struct.Struct("<8sQQ16s")  # magic, write count, journal page sequence number, journal generation
_CHECK = struct.Struct("<Q")
MAX_TOKENS = (ALIGN - _BLOCK_FIXED.size - _CHECK.size) // 8


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def fingerprint(**identity) -> bytes:
    """16 bytes naming what a block's KV belongs to, from keyword fields (model, geometry, dtype, page size,
    layout, TP rank and size, ...): equal fields give equal fingerprints, in any order."""
    text = json.dumps(identity, sort_keys=True, default=str, separators=(",", ":"))
    return xxhash.xxh3_128_digest(text.encode())


def payload_checksum(payload) -> int:
    """The xxh3-64 checksum of a payload (any buffer)."""
    return xxhash.xxh3_64_intdigest(payload)


class BlockHeader(NamedTuple):
    """What a slot holds: the block's identity and its payload's length and checksum."""

    fingerprint: bytes
    namespace: int
    chain_hash: int
    tokens: np.ndarray  # int64
    payload_len: int
    payload_checksum: int


class FileHeader(NamedTuple):
    fingerprint: bytes
    slot_payload_bytes: int
    num_slots: int
    store_id: Optional[bytes] = None  # None: a version 1 file, made before store ids

    def same_geometry(self, other: "FileHeader") -> bool:
        """Whether both name the same fingerprint and slot geometry (the store id aside)."""
        return self[:3] == other[:3]


class Seal(NamedTuple):
    """A seal of the head page: the ``count``-th written, naming journal page ``journal_seq`` of the journal of
    ``generation`` as durable."""

    count: int  # type: ignore[assignment]  # a field named as on disk: it shadows tuple.count
    journal_seq: int
    generation: bytes


def pack_block_header(h: BlockHeader) -> bytes:
    """The 4 KiB header of ``h``, its own checksum last."""
    toks = np.ascontiguousarray(h.tokens, dtype="<i8")
    if toks.size > MAX_TOKENS:
        raise ValueError(f"a block header holds at most {MAX_TOKENS} tokens, got {toks.size}")
    if len(h.fingerprint) != 16:
        raise ValueError(f"a fingerprint is 16 bytes, got {len(h.fingerprint)}")
    body = _BLOCK_FIXED.pack(_BLOCK_MAGIC, FORMAT_VERSION, h.fingerprint, h.namespace, h.chain_hash,
                             h.payload_len, h.payload_checksum, toks.size) + toks.tobytes()
    return (body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))).ljust(ALIGN, b"\0")


def unpack_block_header(buf) -> Optional[BlockHeader]:
    """The header in ``buf`` (4 KiB), or None when it is not a whole, valid one (an empty or torn slot)."""
    mv = memoryview(buf)[:ALIGN]
    if len(mv) < ALIGN or bytes(mv[:8]) != _BLOCK_MAGIC:
        return None
    magic, version, fp, ns, chain, plen, pcheck, ntok = _BLOCK_FIXED.unpack_from(mv)
    if version != FORMAT_VERSION or ntok > MAX_TOKENS:
        return None
    end = _BLOCK_FIXED.size + 8 * ntok
    (check,) = _CHECK.unpack_from(mv, end)
    if xxhash.xxh3_64_intdigest(mv[:end]) != check:
        return None
    toks = np.frombuffer(mv[_BLOCK_FIXED.size:end], dtype="<i8").astype(np.int64)
    return BlockHeader(fp, ns, chain, toks, plen, pcheck)


def pack_file_header(h: FileHeader) -> bytes:
    """The head page of a new file: ``h`` (with its store id) and no seal."""
    if h.store_id is None or len(h.store_id) != 16:
        raise ValueError("a file header of this version needs a 16-byte store id")
    body = _FILE_FIXED.pack(_FILE_MAGIC, FILE_VERSION, h.fingerprint, h.slot_payload_bytes, h.num_slots)
    body += _STORE_ID.pack(h.store_id)
    return (body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))).ljust(ALIGN, b"\0")


def unpack_file_header(buf) -> Optional[FileHeader]:
    """The file header in ``buf`` (the head page), or None when the bytes are not a kvtier block file of a known
    version (a version 1 header has no store id)."""
    mv = memoryview(buf)[:ALIGN]
    if len(mv) < ALIGN or bytes(mv[:8]) != _FILE_MAGIC:
        return None
    magic, version, fp, slot_bytes, slots = _FILE_FIXED.unpack_from(mv)
    end = _FILE_FIXED.size + (_STORE_ID.size if version == FILE_VERSION else 0)
    if version not in (1, FILE_VERSION):
        return None
    (check,) = _CHECK.unpack_from(mv, end)
    if xxhash.xxh3_64_intdigest(mv[:end]) != check:
        return None
    store_id = _STORE_ID.unpack_from(mv, _FILE_FIXED.size)[0] if version == FILE_VERSION else None
    return FileHeader(fp, slot_bytes, slots, store_id)


def pack_seal(page, seal: Seal) -> None:
    """Write ``seal`` into its sector of the head page ``page`` (a uint8 array of 4 KiB): sectors 1 and 2 take the
    seals in turn, so the one written before stays whole whatever a torn write of the page leaves."""
    body = _SEAL.pack(_SEAL_MAGIC, seal.count, seal.journal_seq, seal.generation)
    at = SECTOR * (1 + seal.count % 2)
    raw = (body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))).ljust(SECTOR, b"\0")
    page[at:at + SECTOR] = np.frombuffer(raw, dtype=np.uint8)


def unpack_seals(buf) -> Optional[Seal]:
    """The latest whole seal of the head page ``buf`` (None: none was written)."""
    mv = memoryview(buf)[:ALIGN]
    best: Optional[Seal] = None
    for at in (SECTOR, 2 * SECTOR):
        sector = mv[at:at + SECTOR]
        if len(sector) < _SEAL.size + _CHECK.size or bytes(sector[:8]) != _SEAL_MAGIC:
            continue
        _, count, seq, generation = _SEAL.unpack_from(sector)
        (check,) = _CHECK.unpack_from(sector, _SEAL.size)
        if xxhash.xxh3_64_intdigest(sector[:_SEAL.size]) == check and (best is None or count > best.count):
            best = Seal(count, seq, generation)
    return best
