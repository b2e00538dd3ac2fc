"""xxh64 in numba, bit-identical to the ``xxhash`` package (XXH64, the reference C implementation).

Token byte encoding (fixed, part of the on-disk/page-hash contract): a token id is hashed as a
**little-endian unsigned 32-bit integer**, so a token array hashes exactly like
``xxhash.xxh64_intdigest(np.asarray(tokens).astype("<u4").tobytes(), seed)``. Ids must lie in
``[0, 2**32)``; callers validate (see :mod:`kvtier.index._tokens`). The jitted readers accept any
integer token array (int64, int32, uint32) and take the low 32 bits of each element, so no byte copy
is ever made.

Public:
    xxh64(data, seed=0) -> int                 bytes-like input, for any byte string
    hash_tokens(tokens, seed=0) -> int         token ids, encoded as above
Jitted building blocks (used by page_hash and the trie):
    xxh64_token_range(t, start, end, seed)     hash of tokens t[start:end] (uint64 seed and result)
    xxh64_u8(buf, seed)                        hash of a uint8 array
"""
from __future__ import annotations

import numba
import numpy as np

from ._config import NUMBA_CACHE
from ._tokens import as_token_array, check_token_range

__all__ = ["xxh64", "hash_tokens", "xxh64_token_range", "xxh64_u8"]

_U = np.uint64
P1 = _U(11400714785074694791)
P2 = _U(14029467366897019727)
P3 = _U(1609587929392839161)
P4 = _U(9650029242287828579)
P5 = _U(2870177450012600261)
_M32 = _U(0xFFFFFFFF)
_U64_MAX = (1 << 64) - 1


@numba.njit(inline="always")
def _rotl(x, r):
    return (x << _U(r)) | (x >> _U(64 - r))


@numba.njit(inline="always")
def _round(acc, lane):
    acc = acc + lane * P2
    acc = _rotl(acc, 31)
    return acc * P1


@numba.njit(inline="always")
def _merge(acc, v):
    acc = acc ^ _round(_U(0), v)
    return acc * P1 + P4


@numba.njit(inline="always")
def _converge(v1, v2, v3, v4):
    """Fold the four stripe accumulators into one hash (inputs of 32 bytes or more)."""
    h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
    h = _merge(h, v1)
    h = _merge(h, v2)
    h = _merge(h, v3)
    return _merge(h, v4)


@numba.njit(inline="always")
def _avalanche(h):
    h = h ^ (h >> _U(33))
    h = h * P2
    h = h ^ (h >> _U(29))
    h = h * P3
    return h ^ (h >> _U(32))


@numba.njit(inline="always")
def _tok(t, i):
    return _U(t[_U(i)]) & _M32  # an unsigned index: no negative-index wraparound select per load


@numba.njit(inline="always")
def _lane2(t, i):
    # two consecutive tokens = one little-endian 8-byte lane
    return _tok(t, i) | (_tok(t, i + 1) << _U(32))


@numba.njit(inline="always", cache=NUMBA_CACHE)
def xxh64_token_range(t, start, end, seed):
    """xxh64 of tokens ``t[start:end]`` encoded as little-endian uint32 (``seed``: uint64)."""
    p = start
    if end - start >= 8:  # 32-byte stripes = 8 tokens
        v1 = seed + P1 + P2
        v2 = seed + P2
        v3 = seed
        v4 = seed - P1
        while p + 8 <= end:
            v1 = _round(v1, _lane2(t, p))
            v2 = _round(v2, _lane2(t, p + 2))
            v3 = _round(v3, _lane2(t, p + 4))
            v4 = _round(v4, _lane2(t, p + 6))
            p += 8
        h = _converge(v1, v2, v3, v4)
    else:
        h = seed + P5
    h = h + _U(4 * (end - start))
    while p + 2 <= end:
        h = h ^ _round(_U(0), _lane2(t, p))
        h = _rotl(h, 27) * P1 + P4
        p += 2
    if p < end:
        h = h ^ (_tok(t, p) * P1)
        h = _rotl(h, 23) * P2 + P3
    return _avalanche(h)


@numba.njit(inline="always")
def _read64(b, i):
    v = _U(0)
    for k in range(8):
        v |= _U(b[i + k]) << _U(8 * k)
    return v


@numba.njit(inline="always")
def _read32(b, i):
    v = _U(0)
    for k in range(4):
        v |= _U(b[i + k]) << _U(8 * k)
    return v


@numba.njit(cache=NUMBA_CACHE)
def xxh64_u8(b, seed):
    """xxh64 of a uint8 array (any byte string)."""
    n = b.shape[0]
    p = 0
    if n >= 32:
        v1 = seed + P1 + P2
        v2 = seed + P2
        v3 = seed
        v4 = seed - P1
        while p + 32 <= n:
            v1 = _round(v1, _read64(b, p))
            v2 = _round(v2, _read64(b, p + 8))
            v3 = _round(v3, _read64(b, p + 16))
            v4 = _round(v4, _read64(b, p + 24))
            p += 32
        h = _converge(v1, v2, v3, v4)
    else:
        h = seed + P5
    h = h + _U(n)
    while p + 8 <= n:
        h = h ^ _round(_U(0), _read64(b, p))
        h = _rotl(h, 27) * P1 + P4
        p += 8
    if p + 4 <= n:
        h = h ^ (_read32(b, p) * P1)
        h = _rotl(h, 23) * P2 + P3
        p += 4
    while p < n:
        h = h ^ (_U(b[p]) * P5)
        h = _rotl(h, 11) * P1
        p += 1
    return _avalanche(h)


@numba.njit(cache=NUMBA_CACHE)
def _xxh64_tokens(t, seed):
    return xxh64_token_range(t, 0, t.shape[0], seed)


def _check_seed(seed: int) -> np.uint64:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int in [0, 2**64), got {type(seed).__name__}")
    if not 0 <= int(seed) <= _U64_MAX:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return np.uint64(int(seed))


def xxh64(data: bytes | bytearray | memoryview, seed: int = 0) -> int:
    """xxh64 of a byte string; equals ``xxhash.xxh64_intdigest(data, seed)``."""
    buf = np.frombuffer(bytes(data), dtype=np.uint8)
    return int(xxh64_u8(buf, _check_seed(seed)))


def hash_tokens(tokens, seed: int = 0) -> int:
    """xxh64 of token ids encoded as little-endian uint32 (see module docstring)."""
    t = as_token_array(tokens)
    check_token_range(t)
    return int(_xxh64_tokens(t, _check_seed(seed)))
