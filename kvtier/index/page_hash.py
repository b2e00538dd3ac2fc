"""Namespaces and chained page hashes.

A sequence of token ids is cut into pages of ``page_size`` tokens (a trailing partial page is ignored).
Page ``i`` has the chained hash::

    h_{-1} = namespace_seed(ns)
    h_i    = xxh64(tokens of page i, seed = h_{i-1})      (tokens as little-endian uint32, see xxh64.py)

so ``h_i`` identifies the whole prefix ``tokens[: (i + 1) * page_size]`` within one namespace, and
the same tokens under two namespaces hash differently from the first page on. A page holding an id of 2**32 or more
(SGLang's image pad values reach 2**62) is hashed as its ids in little-endian uint64 instead: twice the bytes, so
never the encoding of another page of the same size.

Namespace seed: the triple ``(extra_key, lora_id, cache_salt)`` is encoded as::

    b"kvtier.ns.v1" + field(extra_key) + field(lora_id) + field(cache_salt)
    field(None) = b"\\x00"
    field(str)  = b"\\x01" + len(utf8) as u64 LE + utf8
    field(int)  = b"\\x02" + len(ascii decimal) as u64 LE + ascii decimal

and hashed with xxh64, seed 0. The length prefixes make the encoding injective, so
``("a", "bc")`` and ``("ab", "c")`` differ and ``lora_id=1`` differs from ``lora_id="1"``. The default
namespace (all ``None``) has the fixed seed ``DEFAULT_NAMESPACE_SEED``.
The trie does not rely on seeds being distinct: it also keys each namespace's root by the encoding
itself, so two namespaces never share a page even if their seeds collided.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

import numba
import numpy as np

from kvtier._checks import check_count

from ._config import NUMBA_CACHE
from ._tokens import TOKEN_MAX, as_token_array, tokens_in_range
from .xxh64 import xxh64, xxh64_token_range, xxh64_u8

__all__ = ["Namespace", "namespace_seed", "page_hashes", "chain_page_hashes", "chain_wide_page_hashes",
           "DEFAULT_NAMESPACE_SEED", "FULL_HASH_MASK"]

FULL_HASH_MASK = (1 << 64) - 1
_MAGIC = b"kvtier.ns.v1"


def _field(v) -> bytes:
    if v is None:
        return b"\x00"
    if isinstance(v, str):
        raw, tag = v.encode("utf-8"), b"\x01"
    elif isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        raw, tag = str(int(v)).encode("ascii"), b"\x02"
    else:
        raise TypeError(f"namespace fields must be str, int or None, got {type(v).__name__}")
    return tag + struct.pack("<Q", len(raw)) + raw


@dataclass(frozen=True)
class Namespace:
    """Who may share cached pages: requests share pages only within one namespace."""

    extra_key: str | None = None
    lora_id: int | str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.extra_key is not None and not isinstance(self.extra_key, str):
            raise TypeError(f"extra_key must be str or None, got {type(self.extra_key).__name__}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(f"cache_salt must be str or None, got {type(self.cache_salt).__name__}")
        _field(self.lora_id)  # type check

    @cached_property
    def encoding(self) -> bytes:
        """The injective byte encoding hashed into the seed (module docstring)."""
        return _MAGIC + _field(self.extra_key) + _field(self.lora_id) + _field(self.cache_salt)

    @cached_property
    def seed(self) -> int:
        """``h_{-1}`` of every chain in this namespace."""
        return xxh64(self.encoding, 0)


DEFAULT_NAMESPACE = Namespace()


def namespace_seed(extra_key: str | None = None, lora_id: int | str | None = None,
                   cache_salt: str | None = None) -> int:
    """Seed ``h_{-1}`` for the namespace ``(extra_key, lora_id, cache_salt)``."""
    return Namespace(extra_key, lora_id, cache_salt).seed


DEFAULT_NAMESPACE_SEED: int = DEFAULT_NAMESPACE.seed


@numba.njit(cache=NUMBA_CACHE)
def chain_page_hashes(t, page_size, seed, mask, out):
    """Fill ``out[i] = h_i & mask`` for every full page of ``t``; return the page count.

    ``mask`` is all ones except in tests (a narrow mask forces collisions); the masked value is the
    seed of the next page.
    """
    n = t.shape[0] // page_size
    h = seed
    for i in range(n):
        h = xxh64_token_range(t, i * page_size, (i + 1) * page_size, h) & mask
        out[i] = h
    return n


def page_hashes(tokens, page_size: int, ns: Namespace | None = None) -> np.ndarray:
    """Chained hashes (uint64) of the full pages of ``tokens`` (ids in [0, 2**63)) in namespace ``ns``."""
    check_count("page_size", page_size)
    ns = DEFAULT_NAMESPACE if ns is None else ns
    t = as_token_array(tokens)
    out = np.empty(t.shape[0] // page_size, dtype=np.uint64)
    if t.dtype == np.uint32 or not t.size or tokens_in_range(t):
        chain_page_hashes(t, int(page_size), np.uint64(ns.seed), np.uint64(FULL_HASH_MASK), out)
    else:
        if int(t.min()) < 0:
            raise ValueError(f"token ids must be in [0, 2**63), got {int(t.min())}")
        chain_wide_page_hashes(t.astype(np.int64, copy=False), int(page_size), np.uint64(ns.seed),
                               np.uint64(FULL_HASH_MASK), out)
    return out


@numba.njit(cache=NUMBA_CACHE)
def chain_wide_page_hashes(t, page_size, seed, mask, out):
    """:func:`chain_page_hashes` of int64 ids some of which are 2**32 or more: their pages hashed as the ids'
    little-endian uint64 bytes."""
    n = t.shape[0] // page_size
    h = seed
    for i in range(n):
        a, b = i * page_size, (i + 1) * page_size
        wide = False
        for j in range(a, b):
            wide |= t[j] > TOKEN_MAX
        if wide:
            h = xxh64_u8(t[a:b].view(np.uint8), h) & mask
        else:
            h = xxh64_token_range(t, a, b, h) & mask
        out[i] = h
    return n
