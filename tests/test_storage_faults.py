"""The SSD store off its happy path: a full disk, restarts, a crash while creating or wiping its file, the same file
opened twice, an open that fails halfway, and a write that fails beside others. Real files; a full disk is a small
tmpfs (mounting needs root: these tests skip elsewhere)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvtier.storage import Block, BlockFileError, SsdStore, block_file, fingerprint
from kvtier.storage.block_format import ALIGN
from kvtier.storage.journal import reserve_bytes

FP = fingerprint(model="faults-test")
TOKENS = 16
ROOT = __file__.rsplit("/tests/", 1)[0]


class Killed(BaseException):
    """The process dies here (as a signal would end it: no handler runs)."""


def block(chain: int) -> Block:
    return Block(0, chain, np.arange(TOKENS) + chain, np.full(ALIGN, chain % 251, np.uint8))


def store(d, slots: int, **kw) -> SsdStore:
    return SsdStore(str(d), capacity_bytes=slots * 2 * ALIGN, block_bytes=ALIGN, fingerprint=FP,
                    tokens_per_block=TOKENS, **kw)


def file_bytes(slots: int) -> int:
    return ALIGN + slots * 2 * ALIGN


def fill(path: str) -> None:
    """A file at ``path`` that takes every free page of its disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * ALIGN):
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


@pytest.fixture
def small_fs(tmp_path):
    """A function mounting a tmpfs of ``nbytes`` (rounded up to pages) under ``tmp_path``; unmounted after."""
    mounts = []

    def mount(nbytes: int) -> str:
        d = tmp_path / f"fs{len(mounts)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={-(-nbytes // ALIGN) * ALIGN}", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
        mounts.append(d)
        return str(d)

    yield mount
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], check=True)  # lazily: a failed test may hold a file open


def test_a_disk_without_room_for_the_journal_fails_at_open_and_closes_what_it_opened(small_fs):
    slots = 64
    d = small_fs(file_bytes(slots) + 32 * ALIGN)  # the block file and 32 pages: the journal needs more
    before = _open_fds()
    for _ in range(3):
        with pytest.raises(BlockFileError, match="journal"):
            store(d, slots)
    assert _open_fds() == before


def test_after_an_open_that_found_no_room_for_the_journal_a_smaller_store_opens(small_fs):
    """The error's advice taken: a store of a quarter the slots opens (the failed open left its preallocated block
    file, of the larger geometry, and the smaller store refused it)."""
    d = small_fs(file_bytes(16) + reserve_bytes(16, TOKENS) + 8 * ALIGN)  # room for 16 slots, not for 64
    with pytest.raises(BlockFileError, match="journal"):
        store(d, 64)
    assert not os.path.exists(os.path.join(d, "kvtier_blocks.bin"))
    with store(d, 16) as s:
        s.put([0], [block(1)])


@pytest.mark.parametrize("name", ["kvtier_blocks.bin", "kvtier_blocks.bin.journal",
                                  "kvtier_blocks.bin.journal.reserve"])
def test_a_directory_where_a_file_of_the_store_goes_is_a_clear_error(tmp_path, name):
    (tmp_path / name).mkdir()
    with pytest.raises(BlockFileError, match=f"{name} is a directory"):
        store(tmp_path, 8)


def test_a_disk_filled_after_open_costs_reserve_pages_and_puts_go_on(small_fs):
    """Another file takes every free page once the store is open: the journal grows into the pages its reserve
    gives back, and every put still succeeds; a restart recovers each slot's last block."""
    slots = 64
    d = small_fs(file_bytes(slots) + reserve_bytes(slots, TOKENS) + 64 * ALIGN)
    want = {}
    with store(d, slots) as s:
        fill(os.path.join(d, "filler"))
        for i in range(300):  # a journal page a put: the journal outgrows what was left after a few
            slot = i % slots
            s.put([slot], [block(1000 + i)])
            want[slot] = 1000 + i
    with store(d, slots) as s:
        assert {slot: h.chain_hash for slot, h in s.recover()} == want


def test_a_full_disk_without_reserve_compacts_the_journal_in_place(small_fs):
    """The disk full and the reserve gone too (the test takes its pages): an append that finds no room compacts the
    journal, in place since the new file's copy finds none either, and writes into what that freed."""
    slots = 64
    d = small_fs(file_bytes(slots) + reserve_bytes(slots, TOKENS) + 64 * ALIGN)
    want = {}
    with store(d, slots) as s:
        for i in range(40):  # 40 journal pages, 37 of them superseded
            s.put([i % slots], [block(2000 + i)])
            want[i % slots] = 2000 + i
        j = s.files[0].journal
        pages = j.pages
        for n in range(2):  # the free space, then the reserve's pages, go to other files
            if n:
                os.truncate(j.path + ".reserve", 0)
            fill(os.path.join(d, f"filler{n}"))
        for i in range(40, 140):
            s.put([i % slots], [block(2000 + i)])
            want[i % slots] = 2000 + i
        assert j.pages < pages  # compacted at least once, with no room for a copy
        assert not os.path.exists(j.path + ".tmp")
    for n in range(2):  # room again: a restart holds its reserve anew
        os.unlink(os.path.join(d, f"filler{n}"))
    with store(d, slots) as s:
        assert {slot: h.chain_hash for slot, h in s.recover()} == want


def test_the_journal_stays_bounded_across_restarts(tmp_path):
    slots = 64
    for restart in range(6):  # each process appends fewer pages than the bound
        with store(tmp_path, slots) as s:
            for i in range(100):
                s.put([i % slots], [block(restart * 1000 + i)])
            j = s.files[0].journal
            assert j.pages <= j.bound_pages
    assert os.path.getsize(j.path) <= ALIGN * (1 + j.bound_pages)


def test_a_crash_after_a_wipe_leaves_no_journal_of_the_old_file(tmp_path, monkeypatch):
    """The file wiped for a smaller geometry, then a crash before the new journal is written: the next start
    recovers an empty store instead of the old file's records (which name slots past the new file's end)."""
    with store(tmp_path, 64) as s:
        s.put(list(range(64)), [block(100 + i) for i in range(64)])

    def crash(self, live, first_seq=None, new_generation=False):
        raise Killed()
    monkeypatch.setattr(block_file.Journal, "rewrite", crash)
    with pytest.raises(Killed):
        store(tmp_path, 16, wipe_mismatch=True)
    monkeypatch.undo()
    with store(tmp_path, 16, wipe_mismatch=True) as s:
        assert s.recover() == [] and s.recover_hashes()[0].size == 0


def test_records_of_slots_past_the_files_end_are_void(tmp_path):
    with store(tmp_path, 16) as s:
        s.put([3, 5], [block(3), block(5)])
        s.files[0].journal.append(block_file._record(s.num_slots + i, s.files[0].read(3, np.empty(ALIGN, np.uint8)))
                                  for i in range(3))
        s.sync()
    with store(tmp_path, 16) as s:
        assert [slot for slot, _ in s.recover()] == [3, 5]
        assert s.recover_hashes()[0].tolist() == [3, 5]


def test_a_crash_while_creating_the_file_does_not_block_the_next_start(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        from kvtier.storage import SsdStore, fingerprint
        allocate = os.posix_fallocate
        os.posix_fallocate = lambda fd, off, n: (allocate(fd, off, n), os._exit(9))  # killed before the header
        SsdStore({str(tmp_path)!r}, capacity_bytes=64 * 2 * {ALIGN}, block_bytes={ALIGN},
                 fingerprint=fingerprint(model="faults-test"), tokens_per_block={TOKENS})
    """)
    assert subprocess.run([sys.executable, "-c", script], timeout=120).returncode == 9
    with store(tmp_path, 64) as s:
        s.put([0], [block(7)])
        assert s.get([0], [np.empty(ALIGN, np.uint8)])[0].chain_hash == 7


def test_one_directory_named_twice_or_opened_by_two_stores_fails_at_open(tmp_path):
    with pytest.raises(ValueError, match="one directory"):
        SsdStore(f"{tmp_path};{tmp_path}/", capacity_bytes=8 * 2 * ALIGN, block_bytes=ALIGN, fingerprint=FP)
    with store(tmp_path, 8):
        with pytest.raises(BlockFileError, match="in use"):
            store(tmp_path, 8)
    store(tmp_path, 8).close()  # closed: free again


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_an_open_that_fails_halfway_closes_what_it_opened(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    SsdStore(str(b), capacity_bytes=8 * 2 * ALIGN, block_bytes=ALIGN, fingerprint=fingerprint(model="other"),
             tokens_per_block=TOKENS).close()  # b holds another model's cache
    before = _open_fds()
    for _ in range(3):
        with pytest.raises(BlockFileError, match="another model"):
            store(f"{a};{b}", 16)
    assert _open_fds() == before
    with store(a, 8):  # and a's file is not left locked
        pass


def test_a_write_skipped_after_another_fails_is_never_acknowledged(tmp_path, monkeypatch):
    """Batches of one block, the second's write failing (EIO): the first block is acknowledged durable only if it was
    written. Pieces of the first batch that start after the second's failed are skipped; the switch interval is
    cut so that this happens in some of the puts."""
    real = block_file.BlockFile.write_run

    def write_run(self, slot, payloads, header_of):
        if slot == 1:
            raise OSError(5, "Input/output error")
        return real(self, slot, payloads, header_of)
    monkeypatch.setattr(block_file.BlockFile, "write_run", write_run)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        s = SsdStore(str(tmp_path), capacity_bytes=8 * 2 * ALIGN, block_bytes=ALIGN, fingerprint=FP, io_threads=4)
        with s:
            wrong = 0
            for _ in range(3000):
                s.free([0])
                acked = [0]
                with pytest.raises(OSError, match="Input/output"):
                    s.put([0, 1], [block(7), block(8)], batch=1,
                          on_durable=lambda n, acked=acked: acked.__setitem__(0, n))
                wrong += acked[0] >= 1 and s.get([0], [np.empty(ALIGN, np.uint8)])[0] is None
    finally:
        sys.setswitchinterval(interval)
    assert wrong == 0
