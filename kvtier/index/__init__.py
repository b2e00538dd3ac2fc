"""kvtier host index: which prefix pages the host tier holds and where (numpy + numba only, no torch).

- ``xxh64`` / ``hash_tokens``: numba xxh64, bit-identical to the ``xxhash`` package; tokens hash as
  little-endian uint32.
- ``Namespace`` / ``namespace_seed`` / ``page_hashes``: chained page hashes
  ``h_i = xxh64(page i, seed=h_{i-1})``, ``h_{-1}`` from the namespace.
- ``PageTrie`` (``page_trie.py``, the Python face over the jitted core ``trie_jit.py``): match / insert / lock /
  unlock / evict over a struct-of-arrays trie.
- ``EvictionPolicy`` (``eviction.py``): which pages leave first; ``lru`` (the trie's heap order) by default.
"""
from ._config import NUMBA_CACHE
from .eviction import EvictionPolicy, LruEviction, eviction_policy, eviction_policy_names, register_eviction_policy
from .page_hash import DEFAULT_NAMESPACE_SEED, Namespace, namespace_seed, page_hashes
from .page_trie import InsertResult, MatchResult, PageTrie
from .xxh64 import hash_tokens, xxh64

__all__ = ["NUMBA_CACHE", "DEFAULT_NAMESPACE_SEED", "Namespace", "namespace_seed", "page_hashes", "PageTrie",
           "MatchResult", "InsertResult", "hash_tokens", "xxh64", "EvictionPolicy", "LruEviction",
           "eviction_policy", "eviction_policy_names", "register_eviction_policy"]
