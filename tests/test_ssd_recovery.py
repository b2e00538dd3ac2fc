"""A restarted SSD tier finds every intact block: a hash recorded in two slots, a record naming a block its slot no
longer holds, a journal cut short, rolled back, copied from another store or torn while compacting in place, and a
relative directory with a later ``chdir``. Real files; each state is what a crash or an operator leaves on disk."""

from __future__ import annotations

import os
import shutil

import pytest

from kvtier.storage import BlockHeader, SsdStore
from kvtier.storage import journal as journal_mod
from kvtier.storage.block_format import ALIGN
from kvtier.storage.ssd_store import FILE_NAME
from tests.ssd_medium import FP, Medium, open_store, payload, tokens


class Killed(BaseException):
    """The process dies here (as a signal would end it: no handler runs)."""


def rewrite_unrecorded(store: SsdStore, slot: int, h: int) -> None:
    """Write block ``h`` into ``slot`` whole, header and payload, and record nothing: what a process killed between a
    write and its journal records leaves (the slot's old record, if any, still names its old block)."""
    f, local = store._where(slot)
    f.write_run(local, [payload(h)], lambda i, n, c: BlockHeader(FP, 0, h, tokens(h), n, c))
    os.fsync(f._fd)


def journal_path(d) -> str:
    return os.path.join(str(d), FILE_NAME + ".journal")


def test_a_hash_recorded_in_two_slots_is_served_from_the_one_that_holds_it(tmp_path):
    """Slot 0's record names block 7, but slot 0 was rewritten (a kill before its new record); block 7 was stored
    again, into slot 5, and acknowledged. The restart serves 7 from slot 5 (it kept the first slot: 7 was lost)."""
    with open_store(tmp_path, 8) as s:
        s.put([0], [_block(7)])
        rewrite_unrecorded(s, 0, 8)
        s.put([5], [_block(7)])
    m = Medium(tmp_path, 8)
    assert m.read(7) is True and m.tier.index.slot_of(7) == 5
    m.close()
    m = Medium(tmp_path, 8)  # the stale record was freed for good
    assert m.tier.index.slot_of(7) == 5 and m.tier.stats.blocks_recovered == 1
    m.close()


def test_a_slot_holding_another_block_than_its_record_names_is_given_to_that_block(tmp_path):
    """Slot 2's record names block 40, but the slot holds block 41 whole (a journal that lost 41's record): reading
    40 is a miss, and 41 is served from then on, also after a restart (it was never found)."""
    with open_store(tmp_path, 4) as s:
        s.put([2], [_block(40)])
        rewrite_unrecorded(s, 2, 41)
    m = Medium(tmp_path, 4)
    assert m.read(40) is False
    assert m.read(41) is True and m.tier.stats.blocks_stale == 1 and m.tier.stats.blocks_adopted == 1
    m.close()
    m = Medium(tmp_path, 4)
    assert m.held() == {41} and m.read(41) is True
    m.close()


def test_a_damaged_block_read_as_a_miss_is_recorded_free(tmp_path):
    """A block whose payload fails its checksum is a miss, and its slot is recorded free: a restart does not hold it
    again (which would cost the same miss after every restart)."""
    with open_store(tmp_path, 4) as s:
        s.put([1], [_block(60)])
    _flip(os.path.join(str(tmp_path), FILE_NAME), ALIGN + 1 * (ALIGN + 2 * ALIGN) + ALIGN + 100)
    m = Medium(tmp_path, 4)
    assert m.read(60) is False and m.tier.stats.blocks_corrupt == 1
    m.close()
    m = Medium(tmp_path, 4)
    assert m.held() == set()
    m.close()


@pytest.mark.parametrize("same_name_there", [False, True])
def test_a_relative_directory_stays_where_it_was_opened_after_a_chdir(tmp_path, monkeypatch, same_name_there):
    """The store opened over ``rel`` from one directory, then the process changes directory (where a ``rel`` exists
    or not) and writes past journal compactions: every write succeeds, and a restart finds every block."""
    (tmp_path / "a" / "rel").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    if same_name_there:
        (tmp_path / "b" / "rel").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    want = {}
    with open_store("rel", 4) as s:
        monkeypatch.chdir(tmp_path / "b")
        bound = s.files[0].journal.bound_pages
        for i in range(bound + 40):  # a journal page a put: compacts at least once
            s.put([i % 4], [_block(100 + i)])
            want[i % 4] = 100 + i
    assert not os.listdir(tmp_path / "b" / "rel") if same_name_there else not (tmp_path / "b" / "rel").exists()
    with open_store(tmp_path / "a" / "rel", 4) as s:
        assert {slot: h.chain_hash for slot, h in s.recover()} == want


def _fill(d, n: int, first: int = 0, per_put: int = 2) -> dict:
    """Blocks ``first .. first + n - 1`` into slots ``0 .. n - 1``, ``per_put`` a put (a journal page each)."""
    want = {}
    with open_store(d, n) as s:
        for a in range(0, n, per_put):
            slots = list(range(a, min(a + per_put, n)))
            s.put(slots, [_block(first + i) for i in slots])
            want.update((first + i, i) for i in slots)
    return want


def _served(d, slots: int, want: dict) -> int:
    """How many blocks of ``want`` (hash -> slot) a restarted tier serves whole."""
    m = Medium(d, slots)
    try:
        return sum(bool(m.read(h)) for h in want)
    finally:
        m.close()


def test_a_journal_cut_short_at_a_page_boundary_is_rebuilt_from_the_headers(tmp_path, caplog):
    want = _fill(tmp_path, 32)  # 16 record pages
    path = journal_path(tmp_path)
    os.truncate(path, ALIGN + 12 * ALIGN)  # the last quarter of its pages gone
    assert _served(tmp_path, 32, want) == 32
    assert "ends at page" in caplog.text


def test_a_journal_rolled_back_to_an_older_copy_is_rebuilt_from_the_headers(tmp_path, caplog):
    _fill(tmp_path, 96, first=1000)
    old = journal_path(tmp_path) + ".old"
    shutil.copy(journal_path(tmp_path), old)
    want = _fill(tmp_path, 96, first=5000)  # every slot rewritten since
    shutil.copy(old, journal_path(tmp_path))
    assert _served(tmp_path, 96, want) == 96
    assert "before page" in caplog.text


def test_a_journal_copied_from_another_store_of_the_same_model_is_rebuilt_from_the_headers(tmp_path, caplog):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    want = _fill(tmp_path / "x", 32, first=300)
    _fill(tmp_path / "y", 32, first=700)
    shutil.copy(journal_path(tmp_path / "y"), journal_path(tmp_path / "x"))
    assert _served(tmp_path / "x", 32, want) == 32
    assert "another store" in caplog.text


def test_a_compaction_in_place_torn_by_a_crash_is_rebuilt_from_the_headers(tmp_path, monkeypatch):
    """The disk full, the journal compacts in place; the process dies after the first page of the compacted records
    is written (records of slots 0-21, in slot order) over the first old page (slot 63's only record). The pages
    behind it are the old ones: a replay of them loses slot 63."""
    want = {63: 63}
    with open_store(tmp_path, 64) as s:
        s.put([63], [_block(63)])  # the journal's first page: slot 63's only record
        for rnd in range(1, 4):  # a page a put; the other slots' records superseded twice
            for slot in range(63):
                s.put([slot], [_block(10_000 * rnd + slot)])
                want[slot] = 10_000 * rnd + slot
        j = s.files[0].journal
        live = list(j.replay().records())
        real = journal_mod._write_all

        def first_page_then_die(fd, buf, offset):
            real(fd, buf[:ALIGN], offset)
            raise Killed()
        monkeypatch.setattr(journal_mod, "_write_all", first_page_then_die)
        with pytest.raises(Killed):
            j._rewrite_in_place(live)
        monkeypatch.undo()
    served = _served(tmp_path, 64, {h: slot for slot, h in want.items()})
    assert served == 64


def _block(h: int):
    from kvtier.storage import Block
    return Block(0, h, tokens(h), payload(h))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))



def test_a_block_file_of_the_first_format_is_given_a_store_id_and_keeps_its_blocks(tmp_path, caplog):
    """A file made before store ids (file header version 1, its journal of the previous version): it opens, is given
    a store id, and every block is recovered from the headers."""
    import logging
    import struct

    import xxhash
    caplog.set_level(logging.INFO)
    want = _fill(tmp_path, 8)
    path = os.path.join(str(tmp_path), FILE_NAME)
    body = struct.pack("<8sI16sQQ", b"KVTFILE1", 1, FP, ALIGN + 200, 8)
    with open(path, "r+b") as f:
        f.write((body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))).ljust(ALIGN, b"\0"))
    assert _served(tmp_path, 8, want) == 8
    assert "previous format" in caplog.text
    with open(path, "rb") as f:
        assert struct.unpack_from("<I", f.read(12), 8)[0] == 2
