"""Eviction policies: which unlocked pages of a :class:`~kvtier.index.PageTrie` leave first when a tier needs room.

The policy is the tier's choice; the mechanism (locks, the leaf heap, freeing a page and its table entry) stays in
the index. ``TierConfig.eviction_policy`` names a policy registered here, and :func:`eviction_policy` builds it
over a tier's index. ``lru``, the default, is the order of the trie's own jitted heap (the unlocked leaf matched or
inserted longest ago first, O(log n) a page), so it costs nothing beyond :meth:`PageTrie.evict`.

A policy subclasses :class:`EvictionPolicy` and registers a name with :func:`register_eviction_policy` before a
config naming it is built. It frees pages only through the index's primitives; the index offers LRU order today,
so a policy with another order (LFU: the heap keyed by hits) adds its key to the jitted core beside the tick.
"""

from __future__ import annotations

import abc
from typing import Callable

import numpy as np

from .page_trie import PageTrie

__all__ = ["EvictionPolicy", "LruEviction", "eviction_policy", "eviction_policy_names", "register_eviction_policy"]


class EvictionPolicy(abc.ABC):
    """Chooses and frees the pages an index gives up.

    Args:
        index: the index it evicts from.
    """

    def __init__(self, index: PageTrie) -> None:
        self.index = index

    @abc.abstractmethod
    def evict(self, n: int) -> np.ndarray:
        """Free up to ``n`` pages of the index, never a locked page nor one with children.

        Returns:
            The freed pages' block ids (int64), in eviction order; the caller frees the blocks. Atomic: the pages
            returned have left the index, every other page is as it was.
        """


class LruEviction(EvictionPolicy):
    """The least recently used unlocked leaf first (a parent becomes a candidate when its last child goes)."""

    def evict(self, n: int) -> np.ndarray:
        return self.index.evict(n)


_POLICIES: dict[str, Callable[[PageTrie], EvictionPolicy]] = {"lru": LruEviction}


def register_eviction_policy(name: str, factory: Callable[[PageTrie], EvictionPolicy]) -> None:
    """Make ``name`` a valid ``eviction_policy``: ``factory(index)`` builds the policy. A blank name or one
    already registered is a ValueError."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"an eviction policy needs a non-empty name, got {name!r}")
    if name in _POLICIES:
        raise ValueError(f"eviction policy {name!r} is already registered")
    if not callable(factory):
        raise TypeError(f"the factory of eviction policy {name!r} must be callable, got {type(factory).__name__}")
    _POLICIES[name] = factory


def eviction_policy_names() -> list[str]:
    """The registered policy names, in registration order (``lru`` first)."""
    return list(_POLICIES)


def eviction_policy(name: str, index: PageTrie) -> EvictionPolicy:
    """The policy registered as ``name``, over ``index``; ValueError naming the registered ones otherwise."""
    factory = _POLICIES.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ValueError(f"eviction_policy must be one of {eviction_policy_names()}, got {name!r}")
    policy = factory(index)
    if not isinstance(policy, EvictionPolicy):
        raise TypeError(f"eviction policy {name!r} built a {type(policy).__name__}, not an EvictionPolicy")
    return policy
