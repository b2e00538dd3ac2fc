"""xxh64 in numba is bit-identical to the xxhash package; token byte encoding is little-endian uint32."""
from __future__ import annotations

from array import array

import numpy as np
import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvtier.index import hash_tokens, xxh64
from kvtier.index import _config

SEEDS = st.integers(0, 2**64 - 1)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=10_000), seed=SEEDS)
@example(data=b"", seed=0)
@example(data=b"", seed=2**64 - 1)
@example(data=bytes(range(256)) * 40, seed=2**64 - 1)
def test_bytes_match_xxhash(data, seed):
    assert xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 10_000), seed=SEEDS, rs=st.integers(0, 2**32 - 1))
@example(n=0, seed=0, rs=0)
@example(n=10_000, seed=2**64 - 1, rs=1)
def test_tokens_match_xxhash_of_le_uint32(n, seed, rs):
    toks = np.random.default_rng(rs).integers(0, 2**32, n, dtype=np.uint64)
    want = xxhash.xxh64_intdigest(toks.astype("<u4").tobytes(), seed)
    assert hash_tokens(toks, seed) == want  # uint64 input, converted
    assert hash_tokens(toks.astype(np.uint32), seed) == want
    assert hash_tokens(toks.astype(np.int64), seed) == want


def test_input_kinds_agree():
    toks = [0, 1, 150_000, 2**31, 2**32 - 1]
    want = xxhash.xxh64_intdigest(np.array(toks, dtype="<u4").tobytes(), 7)
    assert hash_tokens(toks, 7) == want
    assert hash_tokens(array("q", toks), 7) == want
    assert hash_tokens(array("L", toks), 7) == want
    assert hash_tokens(np.array(toks, dtype=np.int64)[::1], 7) == want
    assert hash_tokens(np.repeat(np.array(toks, dtype=np.int64), 2)[::2], 7) == want  # non-contiguous view


@pytest.mark.parametrize("bad", [[-1], [2**32], [0, 1, 2**40], np.array([-5], dtype=np.int32)])
def test_out_of_range_tokens_raise(bad):
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        hash_tokens(bad)


@pytest.mark.parametrize("bad, err", [(np.zeros(3, dtype=np.float32), TypeError),
                                      (np.zeros((2, 2), dtype=np.int64), ValueError),
                                      (np.array([True]), TypeError), (array("d", [1.0]), TypeError),
                                      ([2**70], ValueError)])
def test_bad_token_containers_raise(bad, err):
    with pytest.raises(err):
        hash_tokens(bad)


@pytest.mark.parametrize("seed, err", [(-1, ValueError), (2**64, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_seed_raises(seed, err):
    with pytest.raises(err):
        xxh64(b"x", seed)


def test_numba_cache_switch(monkeypatch):
    assert _config.NUMBA_CACHE is True or "KVTIER_NUMBA_CACHE" in __import__("os").environ
    for raw, want in [("0", False), ("off", False), ("no", False), ("1", True), ("", True)]:
        monkeypatch.setenv("KVTIER_NUMBA_CACHE", raw)
        assert _config._env_flag("KVTIER_NUMBA_CACHE", True) is want
    monkeypatch.delenv("KVTIER_NUMBA_CACHE")
    assert _config._env_flag("KVTIER_NUMBA_CACHE", True) is True
