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


# --- from a review of the above (each failed on the code before its fix) ---

def _kill_after_rewrite(monkeypatch, switch):
    """The process dies right after the journal is rewritten (a compaction or a rebuild), before the next seal."""
    from kvtier.storage import journal as jmod
    real = jmod.Journal.rewrite

    def rewrite(self, *a, **kw):
        real(self, *a, **kw)
        switch.arm(0)
    monkeypatch.setattr(jmod.Journal, "rewrite", rewrite)


def test_a_journal_compacted_then_cut_before_the_next_seal_is_rebuilt(tmp_path, monkeypatch):
    """A compaction renumbers every live record, acknowledged ones included, past the seal; killed before the put's
    seal, then the journal cut short: it was trusted, and 7 acknowledged blocks were lost."""
    import numpy as np

    from tests.crash_switch import Killed, KillSwitch
    switch = KillSwitch().install()
    try:
        m = Medium(tmp_path, 8)
        acked = set(m.write([1, 2, 3, 4, 5, 6, 7]))
        _kill_after_rewrite(monkeypatch, switch)
        for i in range(10_000):  # one slot churned, the others kept most recently used, until a compaction
            m.tier.touch(m.tier.match(np.array(sorted(acked), dtype=np.uint64)))
            try:
                m.write([1000 + i])
            except Killed:
                pass
            if switch.dead:
                break
        assert switch.dead
        try:
            m.close()
        except Killed:
            pass
        monkeypatch.undo()
        switch.disarm()
        os.truncate(journal_path(tmp_path), ALIGN)  # cut to its head
        m = Medium(tmp_path, 8)
        assert acked <= m.held() and all(m.read(h) for h in acked)
        m.close()
    finally:
        switch.uninstall()


def test_a_journal_rebuilt_at_start_then_cut_before_its_seal_is_rebuilt_again(tmp_path, monkeypatch):
    from tests.crash_switch import Killed, KillSwitch
    m = Medium(tmp_path, 8)
    acked = set(m.write([1, 2, 3, 4, 5, 6]))
    m.close()
    os.unlink(journal_path(tmp_path))  # the next start rebuilds it from the headers
    switch = KillSwitch().install()
    try:
        _kill_after_rewrite(monkeypatch, switch)
        with pytest.raises(Killed):
            Medium(tmp_path, 8)
        monkeypatch.undo()
        switch.disarm()
    finally:
        switch.uninstall()
    os.truncate(journal_path(tmp_path), ALIGN)
    m = Medium(tmp_path, 8)
    assert m.held() == acked
    m.close()


def test_a_read_error_while_resolving_a_hash_recorded_twice_frees_neither_copy(tmp_path, monkeypatch):
    import errno

    from kvtier.storage import block_file
    with open_store(tmp_path, 4) as s:
        s.put([0], [_block(5)])
        s.put([1], [_block(5)])  # the same block stored again elsewhere: recorded twice

    def failing(self, *a, **kw):
        raise OSError(errno.EIO, "a transient read error")
    monkeypatch.setattr(block_file.BlockFile, "read_run", failing)
    with open_store(tmp_path, 4) as s:
        s.recover_hashes()
    monkeypatch.undo()
    m = Medium(tmp_path, 4)
    assert m.held() == {5} and m.read(5) is True
    m.close()


def test_a_write_whose_seal_fails_is_not_acknowledged(tmp_path, monkeypatch):
    import errno

    from kvtier.storage import block_file
    m = Medium(tmp_path, 4)

    def failing(self):
        raise OSError(errno.EIO, "the head page cannot be written")
    monkeypatch.setattr(block_file.BlockFile, "seal", failing)
    assert m.write([7]) == [] and m.held() == set()
    monkeypatch.undo()
    assert m.write([7]) == [7]
    m.close()


def test_an_append_that_fails_part_way_leaves_no_page_past_the_journals_end(tmp_path, monkeypatch):
    """The first page of an append landed and the second failed: a later, shorter append would overwrite only the
    first, and a replay would take the stale records of the second."""
    import errno

    from kvtier.storage import journal as jmod
    with open_store(tmp_path, 64) as s:
        j = s.files[0].journal
        real = jmod._write_all

        def first_page_only(fd, buf, offset):
            if buf.size > ALIGN and offset > 0:
                real(fd, buf[:ALIGN], offset)
                raise OSError(errno.EIO, "the second page failed")
            real(fd, buf, offset)
        monkeypatch.setattr(jmod, "_write_all", first_page_only)
        with pytest.raises(OSError):
            s.put(list(range(40)), [_block(100 + i) for i in range(40)])  # records of 40 slots: two pages
        monkeypatch.undo()
        assert os.path.getsize(j.path) == j.end


def test_a_slot_two_reads_held_is_given_to_the_block_it_holds_with_its_header_intact(tmp_path):
    """Two reads hold a slot whose record names a block it no longer holds. The first to finish recorded it free,
    zeroing its header under the second read; the second then gave it to the block it held: a header of zeros."""
    import numpy as np
    with open_store(tmp_path, 4) as s:
        s.put([2], [_block(40)])
        rewrite_unrecorded(s, 2, 41)
    m = Medium(tmp_path, 4, cpu_blocks=4)
    h = np.array([40], dtype=np.uint64)
    slots = m.tier.match(h)
    jobs = [m.tier.read(slots, h, 0, tokens(40)[None], np.array([i])) for i in range(2)]
    for job in jobs:
        job.wait()
        m.tier.finish(job)
    m.tier.wait_idle()
    assert m.read(41) is True
    m.close()
    m = Medium(tmp_path, 4)
    assert m.held() == {41} and m.read(41) is True
    m.close()


def test_an_unreadable_header_while_rebuilding_is_an_empty_slot_not_a_failed_start(tmp_path, monkeypatch):
    """A bad sector under one slot's header: the start reads the others (it stopped at the error: nothing served)."""
    import errno

    from kvtier.storage import block_file
    want = _fill(tmp_path, 8)
    os.unlink(journal_path(tmp_path))
    real = block_file.read_all
    bad = ALIGN + 3 * (ALIGN + 2 * ALIGN)  # slot 3's header

    def failing(fd, buf, offset):
        if offset == bad:
            raise OSError(errno.EIO, "a bad sector")
        real(fd, buf, offset)
    monkeypatch.setattr(block_file, "read_all", failing)
    with open_store(tmp_path, 8) as s:
        slots, _ = s.recover_hashes()
    assert sorted(slots.tolist()) == [i for i in range(8) if i != 3]  # the start went on; that block is a miss
    monkeypatch.undo()
    assert _served(tmp_path, 8, {h: s for h, s in want.items() if s != 3}) == 7
