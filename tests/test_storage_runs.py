"""The SSD store's data path on real files: runs of consecutive slots in one request, payloads moved to and from
CPU blocks where they are (both pool layouts, aligned or not), batches made durable while the next one is written
(and a failing batch that keeps the earlier ones), and reads that check every block and stop at the first bad
one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from kvtier.storage import Block, SsdStore, fingerprint, payload
from kvtier.storage.aligned_io import aligned
from kvtier.storage.block_format import ALIGN

FP = fingerprint(model="runs-test")
ROOT = __file__.rsplit("/tests/", 1)[0]
PLANES = 4  # rows of a block


def pool(n: int, row: int, layout: str) -> tuple[np.ndarray, callable]:
    """A page-aligned CPU pool of ``n`` blocks of ``PLANES`` rows of ``row`` bytes in ``layout``, random bytes, and
    its block view (a contiguous block in ``page_first``, rows one stride apart in ``layer_first``)."""
    flat = aligned(n * PLANES * row)
    flat[:] = np.random.default_rng(n + row).integers(0, 256, flat.size, np.uint8)
    if layout == "page_first":
        rows = flat.reshape(n, PLANES, row)
        return flat, lambda b: rows[b]
    rows = flat.reshape(PLANES, n, row)
    return flat, lambda b: rows[:, b]


def make(dirs, block_bytes: int, slots_per_dir: int, **kw) -> SsdStore:
    stride = ALIGN + -(-block_bytes // ALIGN) * ALIGN
    return SsdStore([str(d) for d in dirs], capacity_bytes=len(dirs) * slots_per_dir * stride,
                    block_bytes=block_bytes, fingerprint=FP, tokens_per_block=4, **kw)


def blocks_of(view, ids, chain0: int = 100) -> list[Block]:
    return [Block(0, chain0 + b, np.arange(4) + b, view(b)) for b in ids]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("row", [ALIGN, 1000], ids=["page_rows", "odd_rows"])
def test_blocks_round_trip_between_cpu_blocks_and_runs_of_slots_leaving_other_slots_alone(tmp_path, layout, row):
    """Blocks go from one half of a pool to slots in runs (two striped files, batches of 3, slots out of order and
    in runs), then come back into the other half; slots outside the put keep their blocks, read back exactly."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    n = 12
    flat, view = pool(2 * n, row, layout)
    bb = PLANES * row
    slots = [6, 8, 10, 12, 14, 3, 5, 7, 20, 1, 9, 11]  # runs of one file's consecutive slots, and lone slots
    with make(dirs, bb, slots_per_dir=12, io_threads=3) as s:
        others = [0, 2, 4, 13, 15]  # written before; a run's write must not touch them
        neighbours = [np.random.default_rng(i).integers(0, 256, bb, np.uint8) for i in range(len(others))]
        s.put(others, [Block(0, 900 + i, np.arange(4), p) for i, p in enumerate(neighbours)])
        durable = []
        s.put(slots, blocks_of(view, range(n)), batch=3, on_durable=durable.append)
        assert durable == [3, 6, 9, 12]
        got = s.read(slots, [view(n + i) for i in range(n)])
        assert got.error is None and [h.chain_hash for h in got.headers] == [100 + i for i in range(n)]
        for i in range(n):
            assert np.array_equal(view(n + i), view(i)), f"block {i} read back other bytes"
        outs = [np.empty(bb, np.uint8) for _ in others]
        assert [h.chain_hash for h in s.get(others, outs)] == [900, 901, 902, 903, 904]
        assert all(np.array_equal(o, p) for o, p in zip(outs, neighbours))


def test_only_contiguous_blocks_of_whole_aligned_pages_move_in_place():
    """A ``page_first`` block of whole pages is read and written where it is; a ``layer_first`` block's rows, a block
    off a page or of another size go through the aligned buffer; an array of neither layout is refused."""
    flat, view = pool(3, ALIGN, "page_first")
    assert payload.in_place(view(1), PLANES * ALIGN) and not payload.in_place(view(1), PLANES * ALIGN + ALIGN)
    assert payload.in_place(flat, PLANES * ALIGN, exact=False) and not payload.in_place(flat, PLANES * ALIGN)
    assert not payload.in_place(pool(3, ALIGN, "layer_first")[1](1), PLANES * ALIGN)
    assert not payload.in_place(flat[1:1 + ALIGN], ALIGN)  # not on a page
    assert payload.byte_rows(np.zeros((4, 4))[:, ::2]) is None  # neither contiguous nor in contiguous rows


def test_batches_become_durable_in_order_and_a_failing_batch_keeps_the_earlier_ones(tmp_path):
    """A put of 12 blocks in batches of 4 where the disk refuses every write past slot 8 (the file size limit,
    EFBIG): the first two batches are reported durable and a restart recovers exactly them; the third is not."""
    bb = 2 * ALIGN
    script = textwrap.dedent(f"""
        import os, resource, signal, sys
        sys.path.insert(0, {ROOT!r})
        from kvtier.storage.block_format import ALIGN
        from tests.test_storage_runs import blocks_of, make, pool
        flat, view = pool(12, ALIGN // 2, "page_first")
        s = make([{str(tmp_path)!r}], {bb}, slots_per_dir=12, io_threads=2)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        stride = ALIGN + {bb}
        resource.setrlimit(resource.RLIMIT_FSIZE, (ALIGN + 8 * stride + ALIGN, resource.RLIM_INFINITY))
        durable = []
        try:
            s.put(range(12), blocks_of(view, range(12)), batch=4, on_durable=durable.append)
        except OSError as e:
            print("error", e.errno, durable, flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], check=True, timeout=120, capture_output=True, text=True)
    assert out.stdout.split(None, 2) == ["error", "27", "[4, 8]\n"], out.stdout + out.stderr
    flat, view = pool(12, ALIGN // 2, "page_first")
    with make([tmp_path], bb, slots_per_dir=12) as s:
        assert [slot for slot, _ in s.recover()] == list(range(8))
        outs = [np.empty(bb, np.uint8) for _ in range(12)]
        got = s.get(range(12), outs)
        assert [h.chain_hash if h else None for h in got] == [100 + i for i in range(8)] + [None] * 4
        assert all(np.array_equal(outs[i], view(i).reshape(-1)) for i in range(8))


def test_a_read_stops_at_the_first_block_that_fails_a_check(tmp_path):
    """Slot 5's payload damaged on disk: a read that stops at the first bad block serves exactly blocks 0-4;
    one that does not serves every other block; a block the caller's own check refuses is a miss too."""
    bb = 2 * ALIGN
    flat, view = pool(24, ALIGN // 2, "page_first")
    with make([tmp_path], bb, slots_per_dir=12, io_threads=4) as s:
        s.put(range(12), blocks_of(view, range(12)))
        stride = s.files[0].stride
    with open(tmp_path / "kvtier_blocks.bin", "r+b") as fh:
        fh.seek(ALIGN + 5 * stride + ALIGN + 100)
        b = fh.read(1)
        fh.seek(ALIGN + 5 * stride + ALIGN + 100)
        fh.write(bytes([b[0] ^ 0x10]))
    with make([tmp_path], bb, slots_per_dir=12, io_threads=4) as s:
        got = s.read(range(12), [view(12 + i) for i in range(12)], stop_at_bad=True)
        leading = next(i for i, h in enumerate(got.headers) if h is None)
        assert leading == 5 and got.error is None
        assert all(np.array_equal(view(12 + i), view(i)) for i in range(5))
        got = s.read(range(12), [view(12 + i) for i in range(12)], accept=lambda i, h: i != 9)
        assert [h is not None for h in got.headers] == [i not in (5, 9) for i in range(12)]
        assert all(np.array_equal(view(12 + i), view(i)) for i in range(12) if i not in (5, 9))
    with make([tmp_path], bb, slots_per_dir=12, io_threads=1) as s:  # one thread: the runs go in order
        outs = [np.zeros(bb, np.uint8) for _ in range(9)]
        got = s.read([0, 1, 2, 3, 4, 5, 7, 9, 11], outs, stop_at_bad=True)  # runs 0-5, 7, 9, 11
        assert [h is not None for h in got.headers] == [True] * 5 + [False] * 4
        assert not any(o.any() for o in outs[6:])  # the runs after the bad block were never read
