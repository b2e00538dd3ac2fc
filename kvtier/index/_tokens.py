"""Token arrays at the index boundary.

Accepted: a 1-D numpy integer array, a ``list``/``tuple`` of ints, or an ``array.array`` of integer
typecode (SGLang's ``RadixKey`` holds ``array('q')``). They become a C-contiguous 1-D numpy array of
dtype int64, int32 or uint32 without copying where the input already is one (``array('q')`` is viewed
with ``np.frombuffer``). The trie and ``page_hashes`` take ids in ``[0, 2**63)`` (the trie holds ids from 2**31 on
as codes: page_trie.py); the standalone token hash of xxh64.py takes ``[0, 2**32)`` (``check_token_range``).
"""
from __future__ import annotations

from array import array

import numba
import numpy as np
from numba import types
from numba.extending import overload

from ._config import NUMBA_CACHE

__all__ = ["as_token_array", "check_token_range", "in_range_from", "tokens_in_range", "TOKEN_MAX", "RAW_MAX"]

TOKEN_MAX = (1 << 32) - 1
_NATIVE = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint32))
_ARRAY_CODES = {"b": np.int8, "B": np.uint8, "h": np.int16, "H": np.uint16, "i": np.intc,
                "I": np.uintc, "l": np.int_, "L": np.uint, "q": np.int64, "Q": np.uint64}


def as_token_array(tokens) -> np.ndarray:
    """Return ``tokens`` as a C-contiguous, writable 1-D int64/int32/uint32 array (range not checked)."""
    if type(tokens) is array and tokens.typecode == "q" and len(tokens):  # SGLang's RadixKey: no copy
        return np.frombuffer(tokens, dtype=np.int64)
    if isinstance(tokens, np.ndarray):
        a = tokens
    elif isinstance(tokens, array):
        dt = _ARRAY_CODES.get(tokens.typecode)
        if dt is None:
            raise TypeError(f"token array('{tokens.typecode}') is not an integer array")
        a = np.frombuffer(tokens, dtype=dt) if len(tokens) else np.empty(0, dtype=dt)
    else:
        try:
            a = np.asarray(tokens)
        except (OverflowError, ValueError) as e:
            raise ValueError(f"tokens must be ints in [0, 2**63): {e}") from None
        if a.size == 0:
            a = np.empty(0, dtype=np.int64)
        elif a.dtype.kind == "f" and all(isinstance(v, int) for v in tokens):  # ints past int64: numpy made floats
            raise ValueError("tokens must be ints in [0, 2**63) (got values that do not fit int64)")
        elif a.dtype == object:
            raise ValueError("tokens must be ints in [0, 2**63) (got values that do not fit int64)")
    if a.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integers, got dtype {a.dtype}")
    if a.dtype not in _NATIVE:
        if a.dtype == np.uint64 and a.size and int(a.max()) >= 1 << 63:
            raise ValueError(f"token ids must be < 2**63, got {int(a.max())}")
        a = a.astype(np.int64)
    if not (a.flags.c_contiguous and a.flags.writeable):
        a = a.copy()
    return a


RAW_MAX = (1 << 31) - 1  # ids above it reach the trie as codes (page_trie.py: wide ids)


def in_range_from(q, start):
    """True when every id of ``q[start:]`` may go to the trie as it is: in [0, 2**31) for signed token arrays
    (the callers' ids), always for uint32 arrays (the trie's codes, where wide ids were replaced)."""


@overload(in_range_from, inline="always")
def _in_range_from(q, start):
    if q.dtype == types.uint32:
        return lambda q, start: True

    def impl(q, start):
        bad = np.int64(0)
        n = len(q)
        i = max(start, 0)  # a provably non-negative index: no wraparound select, so the loop vectorizes
        while i < n:  # no early exit: vectorizes
            bad |= np.int64(q[i])
            i += 1
        return (bad >> 31) == 0  # a negative id sets the sign bit, an id >= 2**31 a bit above 30

    return impl



@numba.njit(cache=NUMBA_CACHE)
def tokens_in_range(t):
    """True when every token id is in [0, 2**32)."""
    bad = np.int64(0)
    for i in range(len(t)):
        bad |= np.int64(t[i])
    return (bad >> 32) == 0


def check_token_range(t: np.ndarray) -> None:
    """Raise ``ValueError`` if a token id of ``t`` (from ``as_token_array``) is outside [0, 2**32)."""
    if t.dtype != np.uint32 and t.size and not tokens_in_range(t):
        bad = t[(t < 0) | (t > TOKEN_MAX)][0]
        raise ValueError(f"token ids must be in [0, 2**32), got {int(bad)}")
