"""Eviction policies (kvtier.index.eviction): ``eviction_policy`` names a registered policy, an unknown name is a
config error, and the tier evicts through the policy its config names."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.config import TierConfig
from kvtier.index import EvictionPolicy, PageTrie, eviction, eviction_policy, register_eviction_policy
from tests.tier_helpers import make_tier, page_slots, prompt


class OnePerCall(EvictionPolicy):
    """LRU order, but at most one page a call: a tier short of room gets one block back per allocation."""

    def evict(self, n: int) -> np.ndarray:
        return self.index.evict(min(n, 1))


@pytest.fixture
def registry(monkeypatch):
    """Registrations made by a test vanish after it."""
    monkeypatch.setattr(eviction, "_POLICIES", dict(eviction._POLICIES))


def test_lru_evicts_the_least_recently_used_leaf_first():
    trie = PageTrie(1)
    for i in range(3):
        trie.insert([i], [10 + i])
    trie.match([0])  # page [0] is now the most recent
    assert eviction_policy("lru", trie).evict(2).tolist() == [11, 12]


def test_an_unknown_policy_is_a_config_error_naming_the_registered_ones():
    with pytest.raises(ValueError, match=r"kvtier config: eviction_policy must be one of \['lru'\], got 'lfu'"):
        TierConfig(eviction_policy="lfu")
    with pytest.raises(ValueError, match=r"one of \['lru'\], got 'lfu'"):
        eviction_policy("lfu", PageTrie(1))


def test_registration_refuses_blank_and_repeated_names(registry):
    for name in ("", "  ", None):
        with pytest.raises(ValueError, match="non-empty name"):
            register_eviction_policy(name, OnePerCall)
    with pytest.raises(ValueError, match="already registered"):
        register_eviction_policy("lru", OnePerCall)
    with pytest.raises(TypeError, match="callable"):
        register_eviction_policy("broken", "OnePerCall")
    register_eviction_policy("not_a_policy", lambda index: object())
    with pytest.raises(TypeError, match="not an EvictionPolicy"):
        eviction_policy("not_a_policy", PageTrie(1))


def test_the_tier_evicts_through_the_policy_its_config_names(registry):
    """A full pool, then a store of 4 new pages: LRU frees 4 blocks and stores them all; the registered one-per-call
    policy frees one block, so the store keeps one page and drops three."""
    register_eviction_policy("one_per_call", OnePerCall)
    assert TierConfig(eviction_policy="one_per_call").eviction_policy == "one_per_call"
    got = {}
    for name in ("lru", "one_per_call"):
        tier = make_tier(num_blocks=8, eviction_policy=name)
        tier.wait(tier.store(prompt(0, 8), None, page_slots(0, 8, 2)))  # the pool is full
        task = tier.wait(tier.store(prompt(1, 4), None, page_slots(8, 4, 2)))
        s = tier.stats()
        got[name] = (task.num_pages, s["pages_evicted"], s["pages_store_dropped"], tier.lookup(prompt(1, 4)))
        tier.destroy()
    assert got["lru"] == (4, 4, 0, 4)
    assert got["one_per_call"] == (1, 1, 3, 1)
