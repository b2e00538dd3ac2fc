"""The disk tier's block file on real files: round trips, restarts in a new process, damaged bytes, torn and half
written slots, other models' files, and a storing process killed at random points (SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.ssd_crash import apply_writer_log
from kvtier.storage import BlockFile, BlockFileError, BlockHeader, fingerprint
from kvtier.storage.block_format import ALIGN, pack_block_header, unpack_block_header

FP = fingerprint(model="test", layers=2, heads=1, dim=64, dtype="bf16", page=16, layout="page_first", tp=(0, 1))
SLOT = 3 * ALIGN + 100  # not a multiple of the alignment: payloads are padded
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def payload_for(chain_hash: int, n: int = SLOT) -> np.ndarray:
    """The bytes a block of ``chain_hash`` holds in these tests (so any read can be checked)."""
    return np.random.default_rng(chain_hash).integers(0, 256, n, dtype=np.uint8)


def header_for(chain_hash: int):
    """``write_run``'s ``header_of`` for a block of ``chain_hash`` (namespace 7, 16 tokens)."""
    return lambda i, nbytes, check: BlockHeader(FP, 7, chain_hash, np.arange(16) + chain_hash, nbytes, check)


def put(f: BlockFile, slot: int, chain_hash: int, n: int = SLOT) -> np.ndarray:
    """Store a block by the durability protocol (header and payload, sync, journal record, sync)."""
    p = payload_for(chain_hash, n)
    f.commit([(slot, f.write_run(slot, [p], header_for(chain_hash))[0])])
    return p


def open_file(path, **kw) -> BlockFile:
    return BlockFile(str(path), slot_payload_bytes=SLOT, num_slots=kw.pop("num_slots", 8), fingerprint=FP, **kw)


def read(f: BlockFile, slot: int):
    out = np.empty(SLOT, dtype=np.uint8)
    h = f.read(slot, out)
    return h, out


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_round_trip_and_restart_in_a_new_process(tmp_path, direct):
    path = tmp_path / "blocks"
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        from tests.test_storage_block_file import open_file, put
        f = open_file({str(path)!r}, direct={direct})
        for slot, chain in ((0, 11), (3, 12), (7, 13)):
            put(f, slot, chain, n={SLOT} - slot)  # payloads of several lengths
        os._exit(0)  # no close: what is durable must not depend on it
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    with open_file(path, direct=direct) as f:
        assert [(s, h.chain_hash) for s, h in f.scan()] == [(0, 11), (3, 12), (7, 13)]
        for slot, chain in ((0, 11), (3, 12), (7, 13)):
            h, out = read(f, slot)
            assert h.namespace == 7 and (h.tokens == np.arange(16) + chain).all()
            assert np.array_equal(out[:h.payload_len], payload_for(chain, SLOT - slot))
        assert read(f, 1)[0] is None  # never written: empty


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x40]))


def test_damaged_bytes_are_misses_never_data(tmp_path):
    path = tmp_path / "blocks"
    with open_file(path) as f:
        for slot in range(4):
            put(f, slot, 100 + slot)
        stride = f.stride
    _flip(path, ALIGN + 0 * stride + ALIGN + 5000)  # slot 0: a payload byte
    _flip(path, ALIGN + 1 * stride + 40)  # slot 1: a header byte (the chain hash)
    with open(path, "r+b") as fh:  # slot 2: a torn header (its second half never written)
        fh.seek(ALIGN + 2 * stride + 60)
        fh.write(b"\0" * (ALIGN - 60))
    with open_file(path) as f:
        assert [s for s, _ in f.scan()] == [0, 3]  # slot 0's header is intact; its payload is not
        assert read(f, 0)[0] is None and read(f, 1)[0] is None and read(f, 2)[0] is None
        h, out = read(f, 3)
        assert np.array_equal(out, payload_for(103))


def test_a_new_payload_under_an_old_header_is_a_miss(tmp_path):
    """A crash in the middle of a slot's write can leave its old header over new payload bytes."""
    path = tmp_path / "blocks"
    with open_file(path) as f:
        put(f, 2, 21)
        with open(path, "r+b") as fh:  # the request's payload part landed, its header part did not
            fh.seek(ALIGN + 2 * f.stride + ALIGN)
            fh.write(payload_for(22).tobytes())
        assert read(f, 2)[0] is None
        assert read(f, 2)[0] is None  # and stays one; the slot is reusable
        put(f, 2, 22)
        assert np.array_equal(read(f, 2)[1], payload_for(22))


def test_a_truncated_file_keeps_what_remains(tmp_path, caplog):
    path = tmp_path / "blocks"
    with open_file(path) as f:
        for slot in range(8):
            put(f, slot, 200 + slot)
        cut = ALIGN + 5 * f.stride + ALIGN + 10  # inside slot 5's payload
    os.truncate(path, cut)
    with open_file(path) as f:
        assert "truncated" in caplog.text
        assert [s for s, _ in f.scan()] == [0, 1, 2, 3, 4, 5]  # slot 5's header survived, its payload did not
        assert read(f, 5)[0] is None and all(read(f, s)[0] is None for s in (6, 7))
        assert np.array_equal(read(f, 4)[1], payload_for(204))
        assert os.path.getsize(path) == f.size  # the file is whole again, ready for new blocks


def test_another_models_file_is_left_alone_unless_wiping_is_allowed(tmp_path):
    path = tmp_path / "blocks"
    with open_file(path) as f:
        put(f, 0, 1)
    before = path.read_bytes()
    other = fingerprint(model="other", layers=2)
    with pytest.raises(BlockFileError, match="another model"):
        BlockFile(str(path), slot_payload_bytes=SLOT, num_slots=8, fingerprint=other)
    with pytest.raises(BlockFileError, match="slot geometry"):
        open_file(path, num_slots=9)
    assert path.read_bytes() == before
    with BlockFile(str(path), slot_payload_bytes=SLOT, num_slots=8, fingerprint=other, wipe_mismatch=True) as f:
        assert list(f.scan()) == []


def test_bad_places_fail_at_open_with_what_to_do(tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a block file" * 1000)
    with pytest.raises(BlockFileError, match="not a kvtier block file"):
        open_file(junk)
    assert junk.read_bytes() == b"not a block file" * 1000
    with pytest.raises(BlockFileError, match="not a directory"):
        open_file(tmp_path / "missing_dir" / "blocks")
    with pytest.raises(BlockFileError, match="not a directory"):
        open_file(junk / "blocks")  # a file where the directory should be
    with pytest.raises(ValueError, match="exceeds"):
        open_file(tmp_path / "b").write_run(0, [np.zeros(SLOT + 1, np.uint8)], header_for(1))


@settings(max_examples=200, deadline=None)
@given(ntok=st.integers(0, 32), ns=st.integers(-2**63, 2**63 - 1), chain=st.integers(0, 2**64 - 1),
       plen=st.integers(0, 2**40), check=st.integers(0, 2**64 - 1), flip=st.integers(0, 10_000))
def test_a_header_round_trips_and_any_flipped_byte_voids_it(ntok, ns, chain, plen, check, flip):
    toks = np.arange(ntok, dtype=np.int64) * 7919 - 3
    h = BlockHeader(FP, ns, chain, toks, plen, check)
    raw = bytearray(pack_block_header(h))
    got = unpack_block_header(raw)
    assert got is not None and got[:3] == h[:3] and got[4:] == h[4:] and np.array_equal(got.tokens, toks)
    used = 8 + 4 + 16 + 8 * 4 + 4 + 8 * ntok + 8  # the header's bytes in use, its checksum included
    raw[flip % used] ^= 1 << (flip % 8)
    assert unpack_block_header(raw) is None


CRASH_WRITER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    from tests.test_storage_block_file import open_file, put
    f = open_file(sys.argv[2], num_slots=6, journal_tokens=None if sys.argv[4] == "none" else int(sys.argv[4]))
    rng = np.random.default_rng(int(sys.argv[3]))
    chain = int(sys.argv[3]) * 1000
    while True:  # reuse random slots: say so first (the slot's old block is evicted), then say when it is durable
        slot, chain = int(rng.integers(0, 6)), chain + 1
        os.write(1, f"begin {slot} {chain}\\n".encode())
        put(f, slot, chain)
        os.write(1, f"done {slot} {chain}\\n".encode())
""")


@pytest.mark.parametrize("journal", [None, 16], ids=["headers", "journal"])
def test_a_storing_process_killed_at_random_points_loses_nothing_acknowledged_and_serves_nothing_corrupt(tmp_path,
                                                                                                        journal):
    """20 kills here (the bench runs hundreds). A writer reuses slots in place: once it begins a slot, that slot's
    previous block is evicted. After each kill, every slot whose last acknowledged block was not being replaced
    reads it back exactly; a slot being replaced reads as empty, its old block or its new one, each exactly;
    nothing else is ever served. Recovery (the journal, or every header) lists every acknowledged block; a block
    written whole but not yet recorded is one recovery does not list (never served)."""
    path = str(tmp_path / "blocks")
    rng = np.random.default_rng(9)
    acked: dict[int, int] = {}  # slot -> its durable block, not being replaced
    durable = 0
    begun: dict[int, set] = {}  # slot -> every block a writer began there
    for kill in range(20):
        p = subprocess.Popen([sys.executable, "-c", CRASH_WRITER, ROOT, path, str(kill + 1), str(journal).lower()],
                             stdout=subprocess.PIPE)
        seen = [p.stdout.readline() for _ in range(int(rng.integers(1, 16)))]  # let it write a few blocks
        time.sleep(float(rng.uniform(0, 0.02)))  # then kill it anywhere in the next ones
        p.send_signal(signal.SIGKILL)
        out = b"".join(seen) + p.stdout.read()  # through the same buffered reader as readline (it reads ahead)
        p.wait(timeout=30)
        replacing, done = apply_writer_log(out, acked, begun)
        durable += done
        with open_file(path, num_slots=6, journal_tokens=journal) as f:
            recovered = dict((slot, h.chain_hash) for slot, h in f.recover())
            for slot, chain in acked.items():
                assert recovered.get(slot) == chain, f"kill {kill}: recovery lost slot {slot}'s block {chain}"
            # a listed block was written there once (the journal may still list a block a later payload voided:
            # reading it is then a miss, and a header that names another block is a miss to the tier too)
            assert all(chain in begun.get(slot, ()) for slot, chain in recovered.items()), f"kill {kill}: {recovered}"
            for slot in range(6):
                h, data = read(f, slot)
                if h is None:
                    assert slot not in acked, f"kill {kill}: slot {slot}'s acknowledged block {acked.get(slot)} lost"
                    continue
                assert np.array_equal(data, payload_for(h.chain_hash)), f"kill {kill}: slot {slot} served corrupt"
                assert h.chain_hash in begun.get(slot, ()), f"kill {kill}: slot {slot} holds {h.chain_hash}"
                if recovered.get(slot) != h.chain_hash:
                    # written whole before its journal record: the index lists the slot's old block (a header
                    # naming another block: a miss) or nothing, so a restarted tier never serves it
                    assert slot not in acked, f"kill {kill}: slot {slot}'s acknowledged block {acked[slot]} lost"
                    continue
                allowed = {acked[slot]} if slot in acked else set(replacing.get(slot, ()))
                assert h.chain_hash in allowed, f"kill {kill}: slot {slot} serves {h.chain_hash}, not {allowed}"
                acked[slot] = h.chain_hash  # the recovered index holds it: the next writer evicts it
    assert durable >= 20, f"the writers acknowledged only {durable} blocks in 20 runs"
