"""The SSD store over real directories: striping, durable batches, reads that verify, recovery in a new process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvtier.storage import Block, SsdStore, fingerprint
from kvtier.storage.block_format import ALIGN

FP = fingerprint(model="store-test", layers=2)
BLOCK = 2 * ALIGN + 300
ROOT = __file__.rsplit("/tests/", 1)[0]


def block(chain: int, ns: int = 0) -> Block:
    return Block(ns, chain, np.arange(16) * chain, np.random.default_rng(chain).integers(0, 256, BLOCK, np.uint8))


def make(dirs, slots_per_dir: int = 5, **kw) -> SsdStore:
    k = len(dirs.split(";")) if isinstance(dirs, str) else len(dirs)
    return SsdStore(dirs, capacity_bytes=k * slots_per_dir * (ALIGN + 3 * ALIGN), block_bytes=BLOCK,
                    fingerprint=FP, **kw)


def test_slots_stripe_round_robin_over_the_directories(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for d in dirs:
        d.mkdir()
    with make(";".join(map(str, dirs))) as s:
        assert s.num_slots == 15 and len(s.files) == 3
        s.put(range(6), [block(10 + i) for i in range(6)])
        for i in range(6):  # slot i lives in directory i % 3, as local slot i // 3
            f = s.files[i % 3]
            out = np.empty(BLOCK, np.uint8)
            assert f.read(i // 3, out).chain_hash == 10 + i
        outs = [np.empty(BLOCK, np.uint8) for _ in range(7)]
        got = s.get(list(range(7)), outs)
        assert [h.chain_hash if h else None for h in got] == [10, 11, 12, 13, 14, 15, None]
        assert all(np.array_equal(o, block(10 + i).payload) for i, o in enumerate(outs[:6]))


@pytest.mark.parametrize("journal", [None, 16], ids=["headers", "journal"])
def test_recovery_in_a_new_process_lists_every_durable_block(tmp_path, journal):
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        from tests.test_storage_ssd_store import block, make
        s = make([{str(tmp_path)!r}], slots_per_dir=8, tokens_per_block={journal})
        s.put([1, 4, 6], [block(5, ns=2), block(6), block(7)])
        s.free([4])
        s.put([2], [block(8)])
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    with make([str(tmp_path)], slots_per_dir=8, tokens_per_block=journal) as s:
        rec = s.recover()
        assert [(slot, h.chain_hash, h.namespace) for slot, h in rec] == [(1, 5, 2), (2, 8, 0), (6, 7, 0)]
        assert np.array_equal(rec[0][1].tokens, block(5).tokens)


def test_bad_arguments_fail_before_any_write(tmp_path):
    with pytest.raises(ValueError, match="at least one directory"):
        SsdStore(";", capacity_bytes=1 << 20, block_bytes=BLOCK, fingerprint=FP)
    with pytest.raises(ValueError, match="holds no"):
        SsdStore(str(tmp_path), capacity_bytes=ALIGN, block_bytes=BLOCK, fingerprint=FP)
    with make([str(tmp_path)]) as s:
        with pytest.raises(ValueError, match="exceeds"):
            s.put([0], [Block(0, 1, np.arange(16), np.zeros(BLOCK + 1, np.uint8))])
        with pytest.raises(IndexError):
            s.put([s.num_slots], [block(1)])
        with pytest.raises(ValueError, match="slots for"):
            s.put([0, 1], [block(1)])
        assert s.recover() == []


def _journal(tmp_path) -> str:
    return str(tmp_path / "kvtier_blocks.bin.journal")


def test_a_damaged_or_missing_journal_is_rebuilt_from_the_headers(tmp_path, caplog):
    with make([str(tmp_path)], slots_per_dir=8, tokens_per_block=16) as s:
        s.put(range(4), [block(30 + i) for i in range(4)])  # a page of records a put
        s.put([4, 5], [block(34), block(35)])
        assert [h.chain_hash for _, h in s.recover()] == [30, 31, 32, 33, 34, 35]
        rec_bytes = s.files[0].journal.record_bytes
    with open(_journal(tmp_path), "r+b") as fh:  # the first page's second record (slot 1): one byte
        fh.seek(ALIGN + rec_bytes + 30)
        b = fh.read(1)
        fh.seek(ALIGN + rec_bytes + 30)
        fh.write(bytes([b[0] ^ 1]))
    with make([str(tmp_path)], slots_per_dir=8, tokens_per_block=16) as s:  # a damaged page: the headers decide
        assert "is damaged" in caplog.text and "rebuilding" in caplog.text
        assert [h.chain_hash for _, h in s.recover()] == [30, 31, 32, 33, 34, 35]
    caplog.clear()
    import os
    os.unlink(_journal(tmp_path))
    with make([str(tmp_path)], slots_per_dir=8, tokens_per_block=16) as s:  # rebuilt from the headers
        assert "rebuilding" in caplog.text
        assert [h.chain_hash for _, h in s.recover()] == [30, 31, 32, 33, 34, 35]


def _write_v1_journal(path: str, records) -> None:
    """A journal in the previous format (a checksum per record, 21 records a page) holding ``records``."""
    import struct
    import xxhash
    head = struct.pack("<8sI16sI", b"KVTJRNL1", 1, FP, 16)
    page = b""
    for slot, chain in records:
        body = struct.pack("<IHHqqQQQI4x", 0x524A564B, 1, 1, slot, 0, chain, BLOCK, 0, 16) + bytes(8 * 16)
        page += body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    head = (head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))).ljust(ALIGN, b"\0")
    with open(path, "wb") as f:
        f.write(head + page.ljust(ALIGN, b"\0"))


def test_a_journal_of_the_previous_format_is_rebuilt_from_the_headers_never_parsed(tmp_path, caplog):
    with make([str(tmp_path)], slots_per_dir=8, tokens_per_block=16) as s:
        s.put([1, 3], [block(50), block(51)])
    _write_v1_journal(_journal(tmp_path), [(1, 990), (2, 991), (3, 992)])  # records the headers do not hold
    with make([str(tmp_path)], slots_per_dir=8, tokens_per_block=16) as s:
        assert "rebuilding" in caplog.text
        assert [(slot, h.chain_hash) for slot, h in s.recover()] == [(1, 50), (3, 51)]
        slots, hashes = s.recover_hashes()
        assert slots.tolist() == [1, 3] and hashes.tolist() == [50, 51]


def test_the_journal_stays_bounded_under_churn_and_replays_the_last_state(tmp_path):
    import os
    rng = np.random.default_rng(3)
    want = {}
    with make([str(tmp_path)], slots_per_dir=4, tokens_per_block=16) as s:
        for i in range(1200):  # a page a put or free: compaction runs several times
            slot = int(rng.integers(0, 4))
            if rng.random() < 0.2:
                s.free([slot])
                s.sync()
                want.pop(slot, None)
            else:
                s.put([slot], [block(1000 + i)])
                want[slot] = 1000 + i
        j = s.files[0].journal
        assert os.path.getsize(_journal(tmp_path)) <= ALIGN * (1 + 2 * -(-4 // j.per_page) + 256 + 1)
    with make([str(tmp_path)], slots_per_dir=4, tokens_per_block=16) as s:
        assert {slot: h.chain_hash for slot, h in s.recover()} == want


def test_a_put_killed_before_its_journal_records_lists_only_the_durable_blocks(tmp_path):
    """A process killed inside a put, its blocks written whole and synced but not yet recorded: recovery lists
    only the blocks of the put before, each read back whole; the unrecorded ones are not findable (their slots are
    free to the restarted tier) and take new blocks."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        from kvtier.storage import BlockFile
        from tests.test_storage_ssd_store import block, make
        s = make([{str(tmp_path)!r}], slots_per_dir=8, tokens_per_block=16, io_threads=1)
        s.put([0, 1], [block(40), block(41)])
        def die(self, entries):
            os._exit(0)
        BlockFile.record = die
        s.put([2, 3], [block(42), block(43)])
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    with make([str(tmp_path)], slots_per_dir=8, tokens_per_block=16) as s:
        listed = {slot: h.chain_hash for slot, h in s.recover()}
        assert listed == {0: 40, 1: 41}
        outs = [np.empty(BLOCK, np.uint8) for _ in range(4)]
        got = s.get([0, 1, 2, 3], outs)
        assert [h.chain_hash for h in got] == [40, 41, 42, 43]  # on disk whole, but only 0 and 1 findable
        assert all(np.array_equal(o, block(c).payload) for o, c in zip(outs, (40, 41)))
        s.put([2, 3], [block(52), block(53)])
    with make([str(tmp_path)], slots_per_dir=8, tokens_per_block=16) as s:
        assert {slot: h.chain_hash for slot, h in s.recover()} == {0: 40, 1: 41, 2: 52, 3: 53}


def test_directories_are_stripped_expanded_and_absolute(tmp_path, monkeypatch):
    """``ssd_cache_dir`` entries as the config reads them: blanks around each dropped, ``~`` expanded (it named a
    directory called ``~`` under the working directory), made absolute once."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    with make(" ~/a ; ../b ", slots_per_dir=2) as s:
        assert s.dirs == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert (tmp_path / "a" / "kvtier_blocks.bin").exists() and not (tmp_path / "b" / "~").exists()
