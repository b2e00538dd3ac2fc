"""The SSD tier behind KVTier, over real files in temporary directories: device -> CPU -> SSD -> CPU -> device round
trips in both layouts, restarts in a new process, damaged and foreign files, IO errors, capacity, write policies and
admission by cost."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from kvtier.config import TierConfig
from kvtier.index import page_hashes
from kvtier.storage import BlockFileError
from kvtier.storage.ssd_store import FILE_NAME
from kvtier.tier import HostBlockPool, KVTier
from tests.kv_helpers import make_kv
from tests.tier_helpers import TINY, lower_hit_and_load as promote_and_load, page_slots, prompt, same, slot_bytes

ROOT = __file__.rsplit("/tests/", 1)[0]
ID = {"model": "tiny-test", "tp_rank": 0, "tp_size": 1}
P = TINY.page_size  # tokens per page = per block here


def make_ssd_tier(ssd_dir, *, layout: str = "layer_first", num_blocks: int = 12, seed: int = 0, identity=ID,
                  ssd_slots: int = 64, geo=TINY, **cfg) -> KVTier:
    """A tier over a small random KV pool (64 pages), CPU blocks of one page, an SSD tier of ``ssd_slots`` slots."""
    kv = make_kv(geo, 64 * geo.page_size, "cpu", torch.Generator().manual_seed(seed))
    pool = HostBlockPool(geo, num_blocks, layout=layout)
    slot_bytes_on_disk = 4096 + -(-pool.block_bytes // 4096) * 4096  # a header and a padded payload
    cfg.setdefault("ssd_admission", "always")
    config = TierConfig(page_size=geo.page_size, tokens_per_block=geo.page_size, host_layout=layout,
                        cpu_cache_gb=1.0, ssd_cache_gb=ssd_slots * slot_bytes_on_disk / 2**30,
                        ssd_cache_dir=str(ssd_dir), **cfg)
    return KVTier(kv, config, pool=pool, model_identity=identity)


def store_all(tier: KVTier, toks: np.ndarray, first_page: int = 0) -> list[torch.Tensor]:
    """Store ``toks`` from device pages ``first_page..``, wait until the SSD has it; the bytes stored."""
    slots = page_slots(first_page, toks.size // P, P)
    tier.wait(tier.store(toks, None, slots))
    tier.flush_lower()
    return slot_bytes(tier, slots)


@pytest.mark.parametrize("src,dst", [("layer_first", "page_first"), ("page_first", "layer_first"),
                                     ("layer_first", "layer_first")])
def test_pages_round_trip_device_cpu_ssd_cpu_device_across_layouts(tmp_path, src, dst):
    a = make_ssd_tier(tmp_path, layout=src)
    toks = prompt(1, 6)
    want = store_all(a, toks)
    assert a.stats()["ssd_blocks_written"] == 6
    a.destroy()
    # other device bytes: only what the SSD held can match; a pool twice the prefix (a read takes half at most)
    b = make_ssd_tier(tmp_path, layout=dst, seed=1, num_blocks=12)
    assert b.stats()["ssd_blocks_recovered"] == 6
    assert b.lookup(toks) == 0  # the CPU tier is empty: the pages are on the SSD, being promoted
    pages, got = promote_and_load(b, toks)
    assert pages == 6 and same(got, want, 6)
    s = b.stats()
    assert s["pages_promoted"] == 6 and s["ssd_blocks_read"] == 6 and s["ssd_blocks_corrupt"] == 0
    b.destroy()


def test_image_pad_ids_round_trip_through_the_ssd_and_leave_no_lock(tmp_path):
    """SGLang's image pad values (up to 2**62 + 10**6) are token ids too. The CPU index took them, but the SSD
    tier's page hashes refused ids of 2**32 or more: a store extending a held prefix raised when its blocks
    entered the index, leaving that prefix locked for good, and a lookup past the CPU hit raised."""
    a = make_ssd_tier(tmp_path)
    toks = prompt(1, 6)
    toks[2 * P:4 * P] = (1 << 62) + 12345 + np.arange(2 * P)  # two pages of an image
    store_all(a, toks[:2 * P])  # a text prefix, held while the next store extends it
    want = store_all(a, toks)
    assert a.index.protected_pages == 0 and a.stats()["ssd_blocks_written"] == 6
    a.destroy()
    b = make_ssd_tier(tmp_path, seed=1)
    other = toks.copy()
    other[3 * P] += 1  # another image from its second page on
    hit = b.lookup_tiers(other, None)
    assert hit.lower_pages == 3
    b.wait(hit.read)
    pages, got = promote_and_load(b, toks)
    assert pages == 6 and same(got, want, 6)
    b.destroy()


PAGE_ROWS = dataclasses.replace(TINY, num_kv_heads=2, head_dim=128, page_size=8)  # a row per layer: 8 KiB (K, V)


@pytest.mark.parametrize("src,dst", [("layer_first", "page_first"), ("page_first", "layer_first")])
def test_blocks_of_whole_page_rows_go_between_the_pinned_pool_and_the_disk_where_they_are(tmp_path, src, dst):
    """Blocks of whole 4 KiB pages: the SSD tier reads and writes a ``page_first`` CPU block where it is, and a
    ``layer_first`` one's rows through its aligned buffer; the bytes come back exactly after a restart in the other
    layout."""
    a = make_ssd_tier(tmp_path, layout=src, geo=PAGE_ROWS)
    assert a.pool.block_rows(0).shape[1] * a.pool.block_rows(0).itemsize == 2 * 4096
    toks = prompt(1, 6, PAGE_ROWS.page_size)
    slots = page_slots(0, 6, PAGE_ROWS.page_size)
    a.wait(a.store(toks, None, slots))
    a.flush_lower()
    want = slot_bytes(a, slots)
    assert a.stats()["ssd_blocks_written"] == 6
    a.destroy()
    b = make_ssd_tier(tmp_path, layout=dst, geo=PAGE_ROWS, seed=1, num_blocks=12)
    pages, got = promote_and_load(b, toks)
    assert pages == 6 and same(got, want, 6, PAGE_ROWS.page_size)
    assert b.stats()["ssd_blocks_read"] == 6 and b.stats()["ssd_blocks_corrupt"] == 0
    b.destroy()


def test_lookup_returns_the_cpu_hit_and_promotes_only_the_pages_past_it(tmp_path):
    t = make_ssd_tier(tmp_path, num_blocks=8)
    first, second = prompt(1, 4), prompt(2, 6)
    want = store_all(t, first)
    store_all(t, second, first_page=10)  # 4 + 6 blocks > 8: the LRU pages of `first` leave the CPU tier
    cpu = t.lookup(first)
    assert cpu < 4
    hit = t.lookup_tiers(first, None)
    assert hit.cpu_pages == cpu and hit.lower_pages == 4 - cpu and hit.read.num_held == cpu
    again = t.lookup_tiers(first, None)  # the same promotion, not a second one
    assert again.read.id == hit.read.id and t.stats()["promotions"] == 1
    t.wait(hit.read)
    assert t.lookup(first) == 4
    pages, got = promote_and_load(t, first, first_page=40)
    assert pages == 4 and same(got, want, 4)
    t.destroy()


def test_restart_in_a_new_process_finds_every_durable_page(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        import numpy as np
        from tests.test_tier_ssd import make_ssd_tier, prompt, store_all
        t = make_ssd_tier({str(tmp_path)!r}, num_blocks=16)
        for i in range(3):
            store_all(t, prompt(i, 5), first_page=5 * i)
        print(t.stats()["ssd_blocks_written"], flush=True)
        import os
        os._exit(0)  # no clean shutdown: what the SSD holds was durable when its write finished
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "15"
    ref = make_ssd_tier(tmp_path / "ref", num_blocks=16)  # the same device bytes (seed 0), no SSD history
    t = make_ssd_tier(tmp_path, num_blocks=16, seed=3)
    assert t.stats()["ssd_blocks_recovered"] == 15
    for i in range(3):
        want = slot_bytes(ref, page_slots(5 * i, 5, P))
        pages, got = promote_and_load(t, prompt(i, 5))
        assert pages == 5 and same(got, want, 5)
    t.destroy()
    ref.destroy()


def _payload_offset(slot: int) -> int:
    return 4096 + slot * (4096 + 4096) + 4096  # file header, then slots of a header and a payload


def ssd_slots_of(tmp_path, toks: np.ndarray) -> list:
    """The SSD slots a restarted tier finds ``toks``'s blocks in."""
    t = make_ssd_tier(tmp_path, seed=1)
    slots = [t.lower_tier("ssd").medium.index.slot_of(int(h)) for h in page_hashes(toks, P)]
    t.destroy()
    return slots


def test_a_prefix_stored_over_evicted_blocks_takes_ascending_slots(tmp_path):
    """Once the SSD is full, a new prefix's blocks take the slots LRU eviction frees: in ascending order (runs of
    consecutive slots, one request each for the store), not in the reverse order the free list gives them back."""
    t = make_ssd_tier(tmp_path, ssd_slots=8, num_blocks=16)
    store_all(t, prompt(1, 8))  # fills slots 0..7
    b = prompt(2, 4)
    store_all(t, b, first_page=8)  # evicts four of the first prefix's blocks
    slots = [t.lower_tier("ssd").medium.index.slot_of(int(h)) for h in page_hashes(b, P)]
    assert t.stats()["ssd_blocks_evicted"] == 4
    assert None not in slots and slots == list(range(slots[0], slots[0] + 4)), slots
    t.destroy()


def test_a_flipped_byte_on_disk_is_a_counted_miss_never_served(tmp_path):
    a = make_ssd_tier(tmp_path)
    toks = prompt(1, 4)
    want = store_all(a, toks)
    a.destroy()
    slot = ssd_slots_of(tmp_path, toks)[2]
    with open(os.path.join(tmp_path, FILE_NAME), "r+b") as f:  # damage the third block's payload
        f.seek(_payload_offset(slot) + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    c = make_ssd_tier(tmp_path, seed=1)
    pages, got = promote_and_load(c, toks)
    assert pages == 2 and same(got, want, 2)  # the blocks before the damaged one serve, nothing after it
    s = c.stats()
    assert s["ssd_blocks_corrupt"] == 1 and s["pages_promote_failed"] == 2 and s["ssd_blocks_held"] == 3
    assert c.lookup_tiers(toks, None).lower_pages == 0  # the damaged block is no longer on the SSD tier
    c.destroy()


def test_a_truncated_file_serves_the_blocks_before_the_cut(tmp_path):
    a = make_ssd_tier(tmp_path)
    toks = prompt(1, 6)
    want = store_all(a, toks)
    a.destroy()
    slots = ssd_slots_of(tmp_path, toks)
    assert slots == sorted(slots)
    os.truncate(tmp_path / FILE_NAME, _payload_offset(slots[3]) + 100)  # the 4th block's payload is cut
    c = make_ssd_tier(tmp_path, seed=1)
    pages, got = promote_and_load(c, toks)
    assert pages == 3 and same(got, want, 3)
    assert c.stats()["ssd_blocks_corrupt"] == 1
    c.destroy()


def test_another_models_directory_is_left_alone_or_wiped_when_configured(tmp_path):
    a = make_ssd_tier(tmp_path)
    store_all(a, prompt(1, 3))
    a.destroy()
    size = os.path.getsize(tmp_path / FILE_NAME)
    with pytest.raises(BlockFileError, match="another model.*left alone"):
        make_ssd_tier(tmp_path, identity={**ID, "tp_size": 2})
    assert os.path.getsize(tmp_path / FILE_NAME) == size
    b = make_ssd_tier(tmp_path, identity={**ID, "model": "other"}, ssd_wipe_mismatch=True)
    assert b.stats()["ssd_blocks_recovered"] == 0 and b.lookup_tiers(prompt(1, 3), None).lower_pages == 0
    b.destroy()
    with pytest.raises(BlockFileError, match="ssd_wipe_mismatch"):  # the file is the other model's now
        make_ssd_tier(tmp_path)


def test_unusable_directories_are_clear_errors_at_start(tmp_path):
    with pytest.raises(BlockFileError, match="cannot create the SSD cache directory /proc/kvtier"):
        make_ssd_tier("/proc/kvtier")  # not creatable, even by root
    with pytest.raises(BlockFileError, match="cannot create /proc/" + FILE_NAME):
        make_ssd_tier("/proc")  # exists, not writable, even by root
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(BlockFileError, match="not enough space"):
        make_ssd_tier(tmp_path, ssd_slots=2 * free // 8192 + 1)
    assert not os.path.exists(tmp_path / FILE_NAME)  # nothing left behind
    with pytest.raises(ValueError, match="needs model_identity"):
        make_ssd_tier(tmp_path, identity=None)


def test_write_errors_mid_serving_are_counted_and_the_cpu_tier_carries_on(tmp_path):
    t = make_ssd_tier(tmp_path)
    store_all(t, prompt(1, 2))
    f = t.lower_tier("ssd").medium.store.files[0]
    os.close(f._fd)  # the disk goes away under the tier: every write and read now fails in the kernel
    f._fd = os.open(tmp_path, os.O_RDONLY)  # a directory: reads fail with EISDIR, writes with EBADF
    toks = prompt(2, 3)
    want = store_all(t, toks, first_page=10)
    s = t.stats()
    assert s["ssd_blocks_write_failed"] == 3 and s["ssd_blocks_held"] == 2 and s["ssd_blocks_pending"] == 0
    assert t.lookup(toks) == 3  # the CPU tier has them
    pages, got = promote_and_load(t, toks)
    assert pages == 3 and same(got, want, 3)
    t.evict(100)
    assert t.lookup_tiers(toks, None).lower_pages == 0  # never findable on the SSD
    hit = t.lookup_tiers(prompt(1, 2), None)  # a read of the broken file: a counted miss
    t.wait(hit.read)
    assert t.lookup(prompt(1, 2)) == 0 and t.stats()["ssd_read_errors"] == 1
    assert t.pool.num_free == t.pool.num_blocks  # nothing leaked
    t.destroy()


def test_the_ssd_tier_keeps_its_size_evicting_lru_blocks(tmp_path):
    t = make_ssd_tier(tmp_path, num_blocks=8, ssd_slots=6)
    assert t.stats()["ssd_blocks_total"] == 6
    for i in range(4):
        store_all(t, prompt(i, 3), first_page=3 * i)
        # prompt 0, loaded from the CPU tier every time, stays the most recently used on the SSD too
        assert promote_and_load(t, prompt(0, 3))[0] == 3
    assert t.stats()["promotions"] == 0
    s = t.stats()
    assert s["ssd_blocks_held"] == 6 and s["ssd_blocks_evicted"] == 6
    t.evict(100)
    assert t.lookup_tiers(prompt(0, 3), None).lower_pages == 3
    assert t.lookup_tiers(prompt(3, 3), None).lower_pages == 3
    assert t.lookup_tiers(prompt(1, 3), None).lower_pages == 0
    t.destroy()
    assert os.path.getsize(tmp_path / FILE_NAME) == 4096 + 6 * 8192


def test_write_back_writes_a_block_when_the_cpu_tier_evicts_it(tmp_path):
    t = make_ssd_tier(tmp_path, num_blocks=6, ssd_write_policy="write_back")
    first = prompt(1, 3)
    want = store_all(t, first)
    assert t.stats()["ssd_blocks_written"] == 0  # on the CPU only
    store_all(t, prompt(2, 3), first_page=10)  # 3 + 3 = 6, and a block is kept free: one of `first`'s is written
    t.flush_lower()
    s = t.stats()
    assert s["ssd_blocks_written"] == s["pages_evicted"] > 0 and s["held_cpu_blocks"] == 0
    t.evict(100)
    t.flush_lower()
    pages, got = promote_and_load(t, first)
    assert pages == 3 and same(got, want, 3)
    last = prompt(3, 2)
    want = store_all(t, last, first_page=20)  # on the CPU only, until the tier shuts down
    t.destroy()
    b = make_ssd_tier(tmp_path, num_blocks=4, ssd_write_policy="write_back", seed=1)
    pages, got = promote_and_load(b, last)
    assert pages == 2 and same(got, want, 2)
    b.destroy()


def test_write_back_keeps_room_free_ahead_so_stores_into_a_full_pool_are_kept(tmp_path):
    """Blocks evicted for room are held by their write-back until durable, so a store into a full pool evicted and
    got nothing: every other store was dropped. The tier now evicts ahead of the next allocation (at most one
    store is short, while the room it keeps grows to the stores' size)."""
    t = make_ssd_tier(tmp_path, num_blocks=8, ssd_slots=64, ssd_write_policy="write_back")
    stored = []
    for i in range(12):
        task = t.store(prompt(i, 3), None, page_slots(3 * (i % 6), 3, P))
        t.wait(task)
        t.flush_lower()  # the disk keeps up with the stores
        stored.append(task.num_pages)
    assert sum(n < 3 for n in stored) <= 1 and stored[-6:] == [3] * 6, stored
    s = t.stats()
    assert s["ssd_blocks_written"] == s["pages_evicted"] and s["ssd_blocks_write_dropped"] == 0
    t.destroy()


def test_write_back_keeps_no_extra_room_after_a_prefix_longer_than_the_pool(tmp_path):
    """A store longer than the pool came short with no block held by a write, and the room kept free grew to half
    the pool for good: every later allocation evicted ahead, and the CPU tier kept half of what it could."""
    t = make_ssd_tier(tmp_path, num_blocks=8, ssd_write_policy="write_back")
    before = t.stats()["ssd_free_target_blocks"]
    t.wait(t.store(prompt(1, 12), None, page_slots(0, 12, P)))  # 8 of 12 fit
    assert t.stats()["ssd_free_target_blocks"] == before == 1
    t.wait(t.store(prompt(2, 1), None, page_slots(20, 1, P)))  # evicts one block, held by its write
    t.flush_lower()
    assert t.lookup(prompt(1, 12)) == 7  # evicting ahead for a target of 4 left 4
    t.destroy()


def test_an_allocation_takes_the_blocks_writes_gave_back_since_the_calls_drain(tmp_path):
    """Writes that finished between a call's drain and its allocation gave back more blocks than were missing: the
    allocation asked the index to evict a negative count and raised (a store or a promotion crashed, and a
    promotion left its prefix locked)."""
    t = make_ssd_tier(tmp_path, num_blocks=12, ssd_write_policy="write_back")
    t.wait(t.store(prompt(1, 10), None, page_slots(0, 10, P)))
    t.evict(6)  # write_back: six are written now (the queue holds half the pool) and held until durable
    for job in t.lower_tier("ssd")._writes:
        job.wait()  # durable, not yet drained
    assert t.pool.num_free == 2
    assert t.room.alloc(4).size == 4
    t.destroy()


def test_destroy_writes_back_every_cpu_block_beyond_the_write_queue(tmp_path):
    """The write queue holds half the pool: destroy evicted the whole pool in one write, and the blocks past the
    queue's bound (the most recently used) were dropped instead of written."""
    n = 160  # the queue: half the pool, at least 64 blocks
    t = make_ssd_tier(tmp_path, num_blocks=n, ssd_slots=256, ssd_write_policy="write_back")
    assert t.lower_tier("ssd").medium.max_pending_blocks < n
    for i in range(n // 8):
        t.wait(t.store(prompt(i, 8), None, page_slots(0, 8, P)))
    assert t.stats()["pages_held"] > t.lower_tier("ssd").medium.max_pending_blocks  # more than one write takes
    t.destroy()
    b = make_ssd_tier(tmp_path, num_blocks=n, ssd_slots=256, ssd_write_policy="write_back", seed=1)
    assert b.stats()["ssd_blocks_recovered"] == n
    b.destroy()


def test_one_long_ssd_hit_takes_at_most_half_the_cpu_pool(tmp_path):
    """A promotion had no bound: an SSD hit longer than the CPU pool evicted every unlocked CPU block, hot
    prefixes too. It reads at most half the pool (as a remote fetch does); the rest of the prefix is recomputed."""
    w = make_ssd_tier(tmp_path, num_blocks=16, ssd_slots=64)
    long = prompt(1, 12)
    store_all(w, long)
    w.destroy()
    t = make_ssd_tier(tmp_path, num_blocks=8, ssd_slots=64)
    hot = prompt(2, 4)
    store_all(t, hot, first_page=20)
    hit = t.lookup_tiers(long, None)
    assert hit.lower_pages == 4
    t.wait(hit.read)
    assert t.lookup(hot) == 4 and t.lookup(long) == 4
    t.destroy()


def test_admission_by_cost_refuses_a_read_slower_than_recompute(tmp_path):
    a = make_ssd_tier(tmp_path)
    toks = prompt(1, 4)
    store_all(a, toks)
    a.destroy()
    slow = make_ssd_tier(tmp_path, ssd_admission="cost", ssd_read_gbps=1e-9, prefill_tokens_per_s=1e6)
    hit = slow.lookup_tiers(toks, None)
    assert hit.read is None and slow.stats()["ssd_refused"] == 1
    slow.destroy()
    fast = make_ssd_tier(tmp_path, ssd_admission="cost", ssd_read_gbps=1.0)
    fast.note_prefill(1, 1.0)  # the engine's measured rate: one token a second
    hit = fast.lookup_tiers(toks, None)
    assert hit.read is not None and fast.stats()["ssd_admitted"] == 1
    fast.wait(hit.read)
    fast.destroy()


def test_a_block_whose_tokens_differ_from_the_querys_is_a_miss(tmp_path):
    """A chain-hash collision (the SSD index keeps hashes, not tokens) is caught by the header's tokens."""
    t = make_ssd_tier(tmp_path)
    toks = prompt(1, 3)
    store_all(t, toks)
    t.evict(100)
    link = t.lower_tier("ssd")
    plan = link.plan_read(toks, None, 0, page_hashes(toks[:3 * P], P, None))
    forged = plan._replace(tokens=plan.tokens.copy())
    forged.tokens[1, 0] += 1  # as if another prefix's block had the same chain hash
    ids = t.pool.alloc(3)
    job = link.start_read(forged, task_id=-1)
    link.fill(job, ids)
    job.wait()
    link.end_read(job, cancelled=False)
    t.pool.free(ids)
    assert (job.io.ok, job.io.bad) == (1, 1)
    assert t.stats()["ssd_blocks_corrupt"] == 1 and t.lookup_tiers(toks, None).lower_pages == 1
    t.destroy()


def tiny_qwen3_engine(tmp_path):
    """(TierEngine, a 2-layer random Qwen3 on the CPU, an SSD tier config over ``tmp_path`` that admits every hit,
    an 80-token prompt); skips without transformers."""
    pytest.importorskip("transformers")
    from kvtier.e2e.engine import TierEngine
    from kvtier.e2e.model import PagedDecoder, qwen3_config

    cfg = qwen3_config(num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)
    model = PagedDecoder.from_config(cfg, seed=0, device="cpu")
    config = TierConfig(cpu_cache_gb=1 / 256, page_size=16, ssd_cache_gb=1 / 64, ssd_cache_dir=str(tmp_path),
                        ssd_admission="always")
    prompt = torch.randint(1, 256, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    return TierEngine, model, config, prompt


def test_a_model_reads_kv_the_ssd_tier_brought_back_after_a_restart(tmp_path):
    """A random-weight Qwen3 serves a prompt, the engine is rebuilt over the same SSD directory (an empty CPU tier),
    and the prompt's prefix comes back from the SSD: the outputs equal the warm device cache's."""
    TierEngine, model, config, prompt = tiny_qwen3_engine(tmp_path)
    ident = {"model": "tiny-qwen3", "seed": 0}
    first = TierEngine(model, config, num_slots=512, model_identity=ident)
    first.serve(prompt, 4, source="none")
    warm = first.serve(prompt, 4, source="device")
    first.tier.destroy()
    again = TierEngine(model, config, num_slots=512, model_identity=ident)
    assert again.tier.lookup(prompt) == 0
    served = again.serve(prompt, 4, source="kvtier")
    assert served.cached == 64 and served.output == warm.output
    assert again.tier.stats()["pages_promoted"] >= 4
    again.tier.destroy()


def test_destroy_makes_the_queued_ssd_writes_durable_and_releases_the_pool(tmp_path):
    a = make_ssd_tier(tmp_path)
    toks = prompt(1, 5)
    a.wait(a.store(toks, None, page_slots(0, 5, P)))  # its SSD write is queued, maybe not done
    a.destroy()
    assert a.pool.destroyed is True and a.pool.host is None
    a.destroy()  # idempotent
    b = make_ssd_tier(tmp_path, seed=1)
    assert b.stats()["ssd_blocks_recovered"] == 5
    b.destroy()


def test_admission_compares_the_read_and_the_rest_with_the_measured_prefill_at_that_size():
    """The H200's figures: prefills of 64 / 2080 / 8224 / 28704 tokens in 15 / 75 / 310 / 1550 ms, reads of 3.3 GB/s
    (a RAM disk) and 147 KB of KV per token: a 2k-token hit loses (91 ms of read + the 32-token rest against 75 ms),
    a 28k-token one wins; a single rate from the short prompts would have admitted both."""
    from kvtier.tier.admission import CostAdmission

    adm = CostAdmission("cost", read_gbps=3.3, prefill_tokens_per_s=None, measured_read_gbps=lambda: None)
    assert adm.admit(2048, 2080, 2048 * 147456)  # no prefill measured yet: admitted, to measure
    for n, ms in ((64, 15), (2080, 75), (8224, 310), (28704, 1550)):
        adm.note_prefill(n, ms / 1e3)
    assert not adm.admit(2048, 2080, 2048 * 147456)
    assert not adm.admit(8192, 8224, 8192 * 147456)  # 366 ms of read + the rest against 310 ms
    assert adm.admit(28672, 28704, 28672 * 147456)
    assert not adm.admit(28672, 28704, 28672 * 147456, queued_bytes=2 << 30)  # behind 2 GiB of reads: loses
    assert adm.prefill.seconds(57408) > 3.1  # beyond the largest prefill: the last slope
    assert (adm.admitted, adm.refused) == (2, 3)


def test_admission_weighs_the_rest_of_a_hit_with_what_prefills_past_a_cached_prefix_took():
    """The H200's end-to-end harness: a 64-token prompt prefills in 15 ms, but 16 tokens past a 2k-token cached
    prefix take 50 ms (the prefix's load and attention over it). With reads of 7.7 GB/s a 2k-token hit then loses
    (39 ms of read + 50 against 75 ms), which the short prompt's 15 ms alone would have admitted; an 8k one still
    wins, and a long rest past a hit costs what the prefill curve says (the extends' figure is a floor, not a
    slope)."""
    from kvtier.tier.admission import CostAdmission

    kv = 147456  # bytes of KV per token
    adm = CostAdmission("cost", read_gbps=7.7, prefill_tokens_per_s=None, measured_read_gbps=lambda: None)
    for n, ms in ((64, 15), (2080, 75), (8224, 310), (28704, 1550)):
        adm.note_prefill(n, ms / 1e3)
    assert adm.admit(2048, 2064, 2048 * kv)  # the short prompt's cost as the rest: admitted
    adm.note_prefill(16, 0.050, cached_tokens=2048)
    assert adm.rest_seconds(16) == pytest.approx(0.050)
    assert adm.rest_seconds(6000) == pytest.approx(adm.prefill.seconds(6000))
    # a prefill with nothing cached is unchanged: below the smallest prefill, its first segment's slope
    assert adm.prefill.seconds(16) == pytest.approx(0.015 - 0.060 / 2016 * 48)
    assert not adm.admit(2048, 2064, 2048 * kv)
    assert adm.admit(8192, 8208, 8192 * kv)  # 157 ms of read + 50 against 310 ms
    assert adm.admit(2048, 8048, 2048 * kv)  # 39 ms of read + the 6000-token rest's 227 against 310 ms
    fixed = CostAdmission("cost", read_gbps=7.7, prefill_tokens_per_s=1e5, measured_read_gbps=lambda: None)
    fixed.note_prefill(16, 0.050, cached_tokens=2048)
    assert fixed.rest_seconds(16) == pytest.approx(16 / 1e5)  # a configured rate is the operator's word


def test_a_hit_of_a_request_shorter_than_every_measured_prefill_counts_the_tokens_it_saves():
    """Below the smallest measured prefill both sides cost as much as that one, so a practically free hit was
    refused; the request was then recomputed, reported, and became the smallest prefill: refused for good."""
    from kvtier.tier.admission import CostAdmission

    kv = 147456
    adm = CostAdmission("cost", read_gbps=1e3, prefill_tokens_per_s=None, measured_read_gbps=lambda: None)
    adm.note_prefill(2048, 0.2)
    assert adm.admit(1024, 1040, 1024 * kv)  # a 0.15 ms read + 16 tokens' prefill against 1040 tokens'
    adm.note_prefill(1040, 0.1)
    assert adm.admit(1024, 1040, 1024 * kv)
    assert adm.prefill.seconds(16) < adm.prefill.seconds(1000) < adm.prefill.seconds(1040)
    slow = CostAdmission("cost", read_gbps=1.0, prefill_tokens_per_s=None, measured_read_gbps=lambda: None)
    slow.note_prefill(2048, 0.2)
    assert not slow.admit(1024, 1040, 1024 * kv)  # 151 ms of read + the rest against ~102 ms: still refused


def test_the_engine_reports_the_prefill_past_a_hit_with_its_cached_tokens(tmp_path):
    """A request served from the SSD tier reports the tokens it computed past the cached prefix, and the seconds
    after its promotion, as a prefill past a cached prefix; a recompute reports a prefill with nothing cached."""
    TierEngine, model, config, prompt = tiny_qwen3_engine(tmp_path)
    engine = TierEngine(model, config, num_slots=512, model_identity={"model": "tiny-qwen3"})
    engine.serve(prompt, 2, source="none")
    adm = engine.tier.lower_tier("ssd").admission
    assert [n for n, _ in adm.prefill._samples] == [80] and not adm.extend.known
    engine.tier.flush_lower()
    engine.tier.reset()  # the prefix is on the SSD only
    engine.drop_device_cache()
    served = engine.serve(prompt, 2, source="kvtier")
    assert served.cached == 64 and engine.tier.stats()["pages_promoted"] == 4
    assert [n for n, _ in adm.extend._samples] == [16] and len(adm.prefill._samples) == 1
    engine.tier.destroy()


def test_destroy_after_a_failing_close_still_releases_everything(tmp_path):
    """A close that failed (the file's descriptor gone, as on a dying disk) stopped destroy at that step: the pool,
    the journal, the lock file and the remote tier were left, a second destroy reported success, and the directory
    could not be opened again in the process ("in use by another SSD store")."""
    import threading

    before = set(threading.enumerate())
    t = make_ssd_tier(tmp_path)
    store_all(t, prompt(1, 2))
    f = t.lower_tier("ssd").medium.store.files[0]
    os.close(f._fd)  # the disk goes away: EBADF from now on
    with pytest.raises(OSError):
        t.destroy()
    assert t.pool.destroyed and f._lock_fd == -1 and f.journal._fd == -1
    assert not [th for th in set(threading.enumerate()) - before if th.name.startswith("kvtier-ssd")]
    t.destroy()  # idempotent
    b = make_ssd_tier(tmp_path, seed=1)  # the directory opens again
    b.destroy()


def test_a_disk_that_does_not_finish_writes_holds_at_most_half_a_small_pool(tmp_path, monkeypatch):
    """A pool of 8 blocks over a disk whose writes do not finish: the write queue takes at most 4 of them, so
    stores go on into the rest (a queue of at least 64 blocks held all 8, and every later store was dropped)."""
    import threading

    from kvtier.storage import SsdStore
    t = make_ssd_tier(tmp_path, num_blocks=8)
    gate = threading.Event()
    real = SsdStore.put

    def stuck(self, *a, **kw):
        gate.wait(60)
        return real(self, *a, **kw)
    monkeypatch.setattr(SsdStore, "put", stuck)
    try:
        for i in range(8):  # 2 pages each: the first 4 fill the pool, the others must evict for room
            t.wait(t.store(prompt(i, 2), None, page_slots(2 * i, 2, P)))
            assert t.lower_tier("ssd").medium._pending_blocks <= 4
        assert sum(t.lookup(prompt(i, 2)) == 2 for i in range(4, 8)) >= 2
    finally:
        gate.set()
    t.destroy()


def test_a_destroyed_tier_gives_its_io_memory_back_without_a_garbage_collection(tmp_path):
    """The SSD store's IO buffers (a region shared by its IO threads) go when the tier is destroyed, not when the
    cyclic garbage collector next runs (16 MiB a build and destroy stayed until then)."""
    import gc

    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    make_ssd_tier(tmp_path).destroy()
    gc.collect()
    gc.disable()
    try:
        before = rss_mib()
        for _ in range(5):
            make_ssd_tier(tmp_path).destroy()
        growth = (rss_mib() - before) / 5
    finally:
        gc.enable()
    assert growth < 4, f"{growth:.1f} MiB kept per build and destroy"


@pytest.mark.parametrize("identity,message", [
    ({}, "model_identity is empty"),
    ({"model": object()}, r"model_identity\['model'\] must be JSON data"),
    ({"model": "m", "revisions": [1, {"x": object()}]}, r"model_identity\['revisions'\]\[1\]\['x'\] must be JSON"),
    (42, "model_identity must be a mapping"),
    ("", "must name the model"),
])
def test_a_model_identity_that_cannot_name_the_model_for_good_is_a_clear_error(tmp_path, identity, message):
    """An empty identity let two models of one KV geometry read each other's blocks; an object's str() differs
    between processes (every restart refused the directory); a str was refused with a dict-update error."""
    with pytest.raises(ValueError, match=message):
        make_ssd_tier(tmp_path, identity=identity)
    assert not os.path.exists(tmp_path / FILE_NAME)


def test_a_model_identity_given_as_a_string_names_the_model(tmp_path):
    a = make_ssd_tier(tmp_path, identity="Qwen/Qwen3-8B@main")
    toks = prompt(1, 2)
    store_all(a, toks)
    a.destroy()
    b = make_ssd_tier(tmp_path, identity="Qwen/Qwen3-8B@main")
    assert b.lookup_tiers(toks, None).lower_pages == 2
    b.destroy()
    with pytest.raises(BlockFileError, match="another model"):
        make_ssd_tier(tmp_path, identity="Qwen/Qwen3-8B@other")


def test_a_read_in_flight_that_got_fewer_blocks_than_planned_is_shared_for_what_it_reads(tmp_path, monkeypatch):
    """A promotion that could get CPU blocks for one of the four blocks it planned, still reading when the same
    prefix is looked up again: that lookup shares it for the one block it brings (it reported all four, pages no
    read was bringing; the SSD state machine found it)."""
    import threading

    from kvtier.storage import SsdStore
    from kvtier.tier.executor import DeferredExecutor
    t = make_ssd_tier(tmp_path, num_blocks=8)
    toks = prompt(1, 4)
    store_all(t, toks)
    assert t.evict(4) == 4
    t.executor = DeferredExecutor()  # the next store's copy stays in flight: 7 of the 8 blocks owned by it
    other = t.store(prompt(2, 7), None, page_slots(8, 7, P))
    assert t.pool.num_free == 1
    gate, real = threading.Event(), SsdStore.read

    def held(self, *a, **kw):
        gate.wait(60)
        return real(self, *a, **kw)
    monkeypatch.setattr(SsdStore, "read", held)
    try:
        first = t.lookup_tiers(toks, None)
        assert first.read is not None and first.read.num_pages == 1 and first.lower_pages == 1
        again = t.lookup_tiers(toks, None)
        assert again.read is first.read and again.lower_pages == 1
    finally:
        gate.set()
    t.wait(first.read)
    t.wait(other)
    assert t.lookup(toks) == 1
    t.destroy()
