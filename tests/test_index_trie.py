"""PageTrie and chained page hashes: semantics, namespaces, bad input, forced collisions, growth."""
from __future__ import annotations

import random
from array import array

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.index import DEFAULT_NAMESPACE_SEED, Namespace, PageTrie, namespace_seed, page_hashes
from tests.index_extras import ExtrasTrie, narrow_trie


def ref_chain(tokens, page_size, seed):
    out, h = [], seed
    for i in range(len(tokens) // page_size):
        ids = tokens[i * page_size:(i + 1) * page_size]
        page = np.asarray(ids, dtype="<u4" if max(ids) < 2**32 else "<u8").tobytes()
        h = xxhash.xxh64_intdigest(page, h)
        out.append(h)
    return out


# ---- page hashes and namespaces -------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300), page_size=st.integers(1, 40),
       extra=st.none() | st.text(max_size=5), lora=st.none() | st.integers(-5, 5) | st.text(max_size=3))
def test_page_hashes_are_the_chain(tokens, page_size, extra, lora):
    ns = Namespace(extra_key=extra, lora_id=lora)
    got = page_hashes(tokens, page_size, ns).tolist()
    assert got == ref_chain(tokens, page_size, ns.seed)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 40) | st.sampled_from([2**32 - 1, 2**32, 2**62 + 12345, 2**63 - 1]),
                       max_size=60), page_size=st.integers(1, 8))
def test_pages_of_wide_ids_hash_as_uint64_ids(tokens, page_size):
    """SGLang's image pad values reach 2**62: a page holding an id of 2**32 or more hashes as its ids in uint64,
    every other page as before."""
    assert page_hashes(tokens, page_size).tolist() == ref_chain(tokens, page_size, DEFAULT_NAMESPACE_SEED)


def test_negative_ids_are_refused_among_wide_ones():
    with pytest.raises(ValueError, match="2\\*\\*63"):
        page_hashes([2**40, -1], 2)


def test_read_only_block_ids_insert_in_a_fresh_process():
    """Read-only int64 block ids took the insert's fast path, and numba, compiling it first for them, raised a
    TypingError."""
    import subprocess
    import sys
    code = ("import numpy as np; from kvtier.index import PageTrie; t = PageTrie(16); "
            "ro = np.frombuffer(np.arange(2, dtype=np.int64).tobytes(), dtype=np.int64); "
            "print(t.insert(np.arange(32), ro).new_mask.tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "[True, True]", out.stderr[-2000:]


def test_default_namespace_seed_is_fixed():
    assert DEFAULT_NAMESPACE_SEED == 0xF4F062749E8B0862
    assert namespace_seed() == DEFAULT_NAMESPACE_SEED == Namespace().seed
    assert page_hashes([1, 2], 2).tolist() == ref_chain([1, 2], 2, DEFAULT_NAMESPACE_SEED)


def test_namespace_encoding_is_injective():
    seeds = [namespace_seed("a", None, "bc"), namespace_seed("ab", None, "c"), namespace_seed(None, "a", "bc"),
             namespace_seed(lora_id=1), namespace_seed(lora_id="1"), namespace_seed(extra_key=""),
             namespace_seed(cache_salt=""), namespace_seed(), namespace_seed("a"), namespace_seed(cache_salt="a")]
    assert len(set(seeds)) == len(seeds)


@pytest.mark.parametrize("kw", [dict(extra_key=1), dict(cache_salt=2.0), dict(lora_id=1.5), dict(lora_id=True)])
def test_namespace_field_types(kw):
    with pytest.raises(TypeError):
        Namespace(**kw)


def test_namespaces_never_share_pages():
    t = PageTrie(4)
    toks = list(range(16))
    a, b = Namespace(extra_key="a"), Namespace(lora_id=7)
    assert t.insert(toks, [0, 1, 2, 3], a).num_new == 4
    assert t.match(toks).num_pages == 0
    assert t.match(toks, b).num_pages == 0
    assert t.insert(toks, [4, 5, 6, 7], b).num_new == 4  # same tokens, new pages
    assert t.match(toks, a).block_ids.tolist() == [0, 1, 2, 3]
    assert t.match(toks, b).block_ids.tolist() == [4, 5, 6, 7]
    assert t.match(toks, Namespace(extra_key="a")).num_pages == 4  # equal value, same namespace


# ---- semantics ------------------------------------------------------------------------------------
def _matcher(t: ExtrasTrie, method: str):
    """The trie's own match (the walk) or the gallop kept in the tests."""
    return t.match if method == "walk" else t.match_gallop


@pytest.mark.parametrize("method", ["walk", "gallop"])
def test_insert_match_partial_pages(method):
    t = ExtrasTrie(3)
    match = _matcher(t, method)
    r = t.insert(list(range(10)), [7, 8, 9])  # 3 full pages, 1 token ignored
    assert r.new_mask.tolist() == [True, True, True] and r.num_held == 0
    assert match(list(range(11))).block_ids.tolist() == [7, 8, 9]
    assert match([0, 1, 2, 3, 4, 9]).block_ids.tolist() == [7]
    assert match([0, 1]).num_pages == 0
    r = t.insert([0, 1, 2, 3, 4, 5, 6, 6, 6], [1, 2, 3])
    assert r.new_mask.tolist() == [False, False, True] and r.num_held == 2  # caller frees blocks 1 and 2
    assert match([0, 1, 2, 3, 4, 5, 6, 6, 6]).block_ids.tolist() == [7, 8, 3]
    assert t.total_pages == 4


@pytest.mark.parametrize("page_size", [1, 2, 16, 33])
def test_token_containers(page_size):
    toks = list(range(100, 100 + 4 * page_size))
    t = PageTrie(page_size)
    t.insert(array("q", toks), np.arange(4))
    for q in (toks, array("q", toks), np.array(toks, np.int32), np.array(toks, np.uint32), np.array(toks, np.uint16),
              tuple(toks)):
        assert t.match(q).num_pages == 4


def test_lru_eviction_order_and_locks():
    t = PageTrie(1)
    t.insert([1, 2, 3], [10, 11, 12])  # tick 1
    t.insert([1, 5], [10, 15])         # tick 2: page [1] touched again
    t.match([1, 2])                    # tick 3: [1], [1,2]
    assert t.evictable_leaves == 2     # [1,2,3] (tick 1) and [1,5] (tick 2)
    m = t.match([1, 5])                # tick 4
    t.lock(m)
    assert (t.protected_pages, t.evictable_pages) == (2, 2)
    assert t.evict(10).tolist() == [12, 11]  # [1,5] and [1] locked
    t.unlock(m)
    assert t.evict(1).tolist() == [15]
    assert t.evict(5).tolist() == [10] and t.total_pages == 0
    with pytest.raises(ValueError, match="stale"):
        t.unlock(m)


def test_remove_stops_at_shared_or_locked_pages():
    t = ExtrasTrie(2)
    t.insert([0, 0, 1, 1, 2, 2], [0, 1, 2])
    t.insert([0, 0, 1, 1, 3, 3], [0, 1, 3])
    assert t.remove([0, 0, 1, 1, 2, 2]).tolist() == [2]  # [0 0 1 1] is still shared
    m = t.match([0, 0, 1, 1, 3, 3])
    t.lock(m)
    assert t.remove([0, 0, 1, 1, 3, 3]).tolist() == []
    t.unlock(m)
    assert t.remove([0, 0, 1, 1, 3, 3, 9]).tolist() == [3, 1, 0]
    assert t.total_pages == 0


def test_match_without_touch_keeps_lru_order():
    t = PageTrie(1)
    t.insert([1], [1])
    t.insert([2], [2])
    t.match([1], touch=False)
    assert t.evict(1).tolist() == [1]


def test_reset():
    t = PageTrie(2, initial_nodes=2)
    for i in range(50):
        t.insert([i, i, i, i], [2 * i, 2 * i + 1])
    m = t.match([1, 1])
    t.lock(m)
    t.reset()
    assert (t.total_pages, t.protected_pages, t.match([1, 1]).num_pages) == (0, 0, 0)
    with pytest.raises(ValueError, match="stale"):
        t.unlock(m)


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["match", "insert", "remove"])
@pytest.mark.parametrize("toks, err", [([0, -1], ValueError), ([2**63, 0], ValueError),
                                       (np.zeros(2, np.float64), TypeError), (np.zeros((1, 2), np.int64), ValueError),
                                       ([0, 2**64], ValueError)])
def test_bad_tokens(op, toks, err):
    t = ExtrasTrie(2)
    with pytest.raises(err):
        if op == "insert":
            t.insert(toks, [0])
        else:
            getattr(t, op)(toks)
    assert t.total_pages == 0


@pytest.mark.parametrize("blocks, err, msg", [([0], ValueError, "got 1 block ids for 2 full pages"),
                                              ([0, 1, 2], ValueError, "got 3 block ids for 2"),
                                              ([-1, 0], ValueError, ">= 0"), ([0.0, 1.0], TypeError, "integers"),
                                              ([[0, 1]], ValueError, "1-D")])
def test_bad_blocks(blocks, err, msg):
    t = PageTrie(2)
    with pytest.raises(err, match=msg):
        t.insert([1, 2, 3, 4, 5], blocks)
    assert t.total_pages == 0


def test_an_unlock_needs_a_lock_of_its_own_handle():
    """Every page of a deeper lock's path has a count above zero, so the unlock of a shorter handle that holds no
    lock was taken, and the path's counts went wrong: after the deeper unlock the first page stayed at -1 and could
    never be evicted."""
    t = PageTrie(4)
    toks = np.arange(8)
    t.insert(toks, np.arange(2))
    short, deep = t.match(toks[:4]), t.match(toks)
    t.lock(deep)
    with pytest.raises(ValueError, match="not locked"):
        t.unlock(short)  # never locked
    t.lock(short)
    t.unlock(short)
    with pytest.raises(ValueError, match="not locked"):
        t.unlock(short)  # unlocked twice
    assert t.protected_pages == 2
    t.unlock(deep)
    assert t.protected_pages == 0 and sorted(t.evict(10).tolist()) == [0, 1]


def test_a_handle_from_before_a_reset_is_stale():
    t = PageTrie(4, initial_nodes=2)
    old = [t.insert(np.arange(k * 4, k * 4 + 4), np.array([k])) for k in range(4)]  # grows past the initial size
    t.reset()
    for k in range(4):  # other pages in the same slots (the trie grows back into the slots it had)
        t.insert(np.arange(100 + k * 4, 104 + k * 4), np.array([10 + k]))
    for h in old:
        with pytest.raises(ValueError, match="stale"):
            t.lock(h)
    assert t.protected_pages == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        PageTrie(0)
    with pytest.raises(ValueError, match="initial_nodes must be an int >= 0"):
        PageTrie(2, initial_nodes=-1)
    t = PageTrie(2)
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        t.evict(-1)
    with pytest.raises(TypeError):
        t.match([1, 2], ns="a")
    r = t.insert([1, 2], [0])
    with pytest.raises(ValueError, match="not locked"):
        t.unlock(r)


# ---- forced collisions ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_narrow_hash_never_returns_a_wrong_page(bits):
    """With 1-4 bit hashes almost every lookup collides; answers must equal a plain dict's."""
    rng = random.Random(bits)
    t = narrow_trie(bits)(2, initial_nodes=8)
    held, nxt = {}, 0
    seqs = [[rng.randrange(3) for _ in range(rng.randrange(0, 16))] for _ in range(300)]
    for s in seqs:
        n = len(s) // 2
        blocks = list(range(nxt, nxt + n))
        nxt += n
        r = t.insert(s, blocks)
        for k in range(n):
            held.setdefault(tuple(s[: 2 * k + 2]), blocks[k])
        assert r.new_mask.sum() == r.num_new
    assert t.total_pages == len(held)
    for s in seqs + [[rng.randrange(3) for _ in range(14)] for _ in range(300)]:
        want = []
        for k in range(len(s) // 2):
            b = held.get(tuple(s[: 2 * k + 2]))
            if b is None:
                break
            want.append(b)
        for method in ("walk", "gallop"):
            assert _matcher(t, method)(s, touch=False).block_ids.tolist() == want
    assert t.collision_fallbacks > 0  # the gallop predicate was fooled and the verification caught it


# ---- growth and memory ----------------------------------------------------------------------------
def test_growth_keeps_everything():
    rng = np.random.default_rng(0)
    t = PageTrie(16, initial_nodes=1)
    seqs = [rng.integers(0, 150_000, rng.integers(16, 600)) for _ in range(300)]
    for i, s in enumerate(seqs):
        t.insert(s, np.arange(len(s) // 16) + 1000 * i)
    for i, s in enumerate(seqs):
        r = t.match(s)
        assert r.num_pages == len(s) // 16 and r.block_ids[0] == 1000 * i


def test_bytes_per_page_budget():
    """10M pages at page 16 must fit 1.5 GiB: the per-page footprint of an index sized for its pool."""
    cap = 100_000
    t = PageTrie(16, initial_nodes=cap)
    assert t.nbytes / cap <= 1.5 * 2**30 / 10_000_000


def test_lazy_ticks_parent_inherits_newest_child_tick():
    # Only the deepest page of a touched path gets the tick written; a parent that becomes a leaf
    # must still be ordered by the newest touch through it (max over its freed children).
    t = PageTrie(1)
    t.insert([1, 2, 3], [10, 11, 12])  # tick 1
    t.insert([7], [70])                # tick 2
    t.match([1, 2, 3])                 # tick 3 on the whole path [1], [1,2], [1,2,3]
    t.insert([8], [80])                # tick 4
    # LRU leaves: [7] (2), then [1,2,3] (3) -> its parent [1,2] inherits tick 3 and [1] as well,
    # so they go before [8] (4).
    assert t.evict(5).tolist() == [70, 12, 11, 10, 80]


def test_lazy_heap_keys_bound_ticks_and_evict_in_lru_order():
    """Heap keys are lazy (a touch writes only the tick): each key is a lower bound of its node's
    tick and the heap is ordered by the keys; every eviction still takes the unlocked leaf with the
    least (tick, node)."""
    from kvtier.index._state import BLOCK, DEPTH, M_HEAP, NCHILD, TICK
    rng = random.Random(5)
    t = PageTrie(2)
    seqs = [[rng.randrange(3) for _ in range(rng.randrange(2, 12))] for _ in range(200)]
    for i, s in enumerate(seqs):
        t.insert(s, np.arange(len(s) // 2) + 1000 * i)
        if i % 3 == 0:
            t.match(seqs[rng.randrange(i + 1)])
        if i % 7 == 0:
            t.evict(2)
        st_ = t._st
        size = int(st_.meta[M_HEAP])
        heap, key = st_.heap[:size], st_.hkey[:size]
        assert (key <= st_.i64[TICK, heap]).all()
        for c in range(1, size):
            p = (c - 1) // 2
            assert (key[p], heap[p]) < (key[c], heap[c])
    for s in seqs[::5]:
        t.match(s)  # more stale keys
    while t.total_pages:
        st_ = t._st
        live = np.flatnonzero(st_.i32[DEPTH] >= 0)
        oldest = min((int(x) for x in live if st_.i32[NCHILD, x] == 0), key=lambda x: (st_.i64[TICK, x], x))
        assert t.evict(1).tolist() == [st_.i64[BLOCK, oldest]]


def test_lookup_of_an_unknown_namespace_registers_nothing():
    trie = ExtrasTrie(4)
    toks = np.arange(8)
    for k in range(200):
        assert trie.match(toks, Namespace(cache_salt=f"salt-{k}")).num_pages == 0
    assert len(trie._ns_ids) == 1  # only the default namespace
    assert trie.remove(toks, Namespace(cache_salt="never")).size == 0 and len(trie._ns_ids) == 1


def test_namespaces_that_hold_no_pages_are_reclaimed():
    """Every distinct cache_salt / LoRA id used to stay registered for ever (across reset too), each one
    growing the namespace table; ids of namespaces whose pages are all gone are now reused."""
    trie = PageTrie(4)
    keep = Namespace(extra_key="kept")
    trie.insert(np.arange(8), np.array([0, 1]), keep)
    for k in range(2000):
        ns = Namespace(cache_salt=f"tenant-{k}")
        trie.insert(np.arange(100, 108), np.array([2, 3]), ns)
        assert trie.match(np.arange(100, 108), ns).num_pages == 2
        trie.match(np.arange(8), keep)  # the kept namespace is the most recently used: evict takes the tenant's
        assert sorted(trie.evict(2).tolist()) == [2, 3]
    assert trie._st.ns_slots <= 16 and len(trie._ns_ids) <= 16
    m = trie.match(np.arange(8), keep)
    assert m.num_pages == 2 and m.block_ids.tolist() == [0, 1]
    trie.reset()
    assert len(trie._ns_ids) == 1 and trie._st.ns_slots == 4


def test_the_codes_of_wide_ids_no_page_holds_are_handed_out_again():
    """Every image's pad value took a code for good: a server seeing ever new images grew the table of codes
    without end (and refused inserts after 2**31 - 1 of them)."""

    class SmallReclaim(PageTrie):
        RECLAIM_CODES_AT = 8

    trie = SmallReclaim(4, initial_nodes=8)
    text = list(range(100, 104))
    kept = text + [(1 << 62) + 7] * 4  # an image whose pages stay in the index throughout
    trie.insert(kept, np.array([0, 1]))
    trie.lock(trie.match(kept))
    for i in range(200):  # ever new images, their pages evicted soon after
        prompt = text + [(1 << 62) + 1000 + i] * 2 + [(1 << 62) + 5000 + i] * 2
        trie.insert(prompt, np.array([0, 2 + i % 4]))
        assert trie.match(prompt).num_pages == 2
        if trie.total_pages > 4:
            trie.evict(trie.total_pages - 4)
        assert trie.num_wide_ids <= 2 * 8 + 2
    assert trie.match(kept).num_pages == 2  # its code kept through every reclaim
    assert trie.match(text + [(1 << 62) + 1000] * 2 + [(1 << 62) + 5000] * 2).num_pages == 1  # long gone


def test_wide_token_ids_are_matched_and_verified_exactly():
    """SGLang's multimodal pad values (MM_PAD_SHIFT_VALUE + a 62-bit hash) used to fail match_prefix with
    ValueError (ids had to be < 2**32), killing the scheduler on the first image request."""
    pad = [1_000_000 + (v & ((1 << 62) - 1)) for v in (0x1234_5678_9ABC_DEF0, 0x0FED_CBA9_8765_4321)]
    text = list(range(100, 108))
    prompt = text + [pad[0]] * 8 + [pad[1]] * 4 + text[:4]  # 24 tokens, 6 pages of 4
    trie = ExtrasTrie(4)
    assert trie.match(array("q", prompt)).num_pages == 0 and trie.num_wide_ids == 0  # a lookup assigns nothing
    trie.insert(array("q", prompt), np.arange(6))
    assert trie.num_wide_ids == 2
    for form in (array("q", prompt), np.array(prompt, dtype=np.int64), np.array(prompt, dtype=np.uint64), prompt):
        m = trie.match(form)
        assert m.num_pages == 6 and m.block_ids.tolist() == list(range(6))
    other = prompt[:8] + [pad[0] + 1] + prompt[9:]  # another image: diverges at its first pad token
    assert trie.match(array("q", other)).num_pages == 2
    low = prompt[:8] + [pad[0] & 0xFFFFFFFF] + prompt[9:]  # the same low 32 bits, as a text id
    assert trie.match(array("q", low)).num_pages == 2
    code = trie._codes[pad[0]]  # a caller's id equal to the code that stands for pad[0] in the trie, with no
    code_like = prompt[:8] + [code] * 8 + text  # wide id after it: only the whole-query check can refuse it
    assert trie.match(array("q", code_like)).num_pages == 2
    assert trie.match(array("q", text)).num_pages == 2  # text pages hash and match as before
    assert trie.remove(array("q", prompt)).tolist() == [5, 4, 3, 2, 1, 0]
    trie.reset()
    assert trie.num_wide_ids == 0
