"""HostTier: the contract between an engine adapter and a host tier of its prefix KV cache.

Primitives (all non-blocking unless said so; "pages" are whole ``page_size``-token pages of a token sequence,
"slots" the engine's per-token device KV slots, ``ns`` a :class:`~kvtier.index.Namespace`):

* ``lookup(tokens, ns) -> int``: leading pages held on the host. Never returns a page whose store has not
  completed, and never a page of another namespace.
* ``store(tokens, ns, slots) -> task``: start copying the pages not yet held to the host. They become visible to
  ``lookup`` and ``load`` only after the copy completes. The engine keeps the slots' KV unchanged until the task
  is reported finished (``poll``/``wait``).
* ``load(tokens, ns, slots) -> task``: start copying the longest held prefix into ``slots``; ``task.num_pages``
  pages. Those pages cannot be evicted until the copy completes.
* ``load_layerwise(tokens, ns, slots) -> task``: the same, layer by layer; the forward pass waits per layer through
  the tier's ``counter`` (a :class:`~kvtier.tier.signal.LayerDoneCounter`) with ``task.producer_index``.
* ``poll() -> list[int]``: ids of tasks finalized since the last poll (each id once). ``wait(task)`` blocks the
  host until that task is finalized.
* ``cancel(task) -> bool``: discard an in-flight task once its copy has completed (a store then inserts nothing).
* ``reset()``: wait for in-flight copies, then drop everything.

Optional hooks with safe defaults: ``evict(n) -> int`` (0: nothing evicted), ``stats() -> dict`` (empty).
"""

from __future__ import annotations

import abc
from typing import Optional, Union

from kvtier.index import Namespace


class HostTier(abc.ABC):
    """Abstract host tier; :class:`kvtier.tier.KVTier` implements it (see the module docstring)."""

    @abc.abstractmethod
    def lookup(self, tokens, ns: Optional[Namespace] = None) -> int:
        """Leading full pages of ``tokens`` held. Returns: a page count."""

    @abc.abstractmethod
    def store(self, tokens, ns: Optional[Namespace], slot_indices):
        """Start the D2H of the pages not held. Returns: a task (``.id``, ``.num_pages``)."""

    @abc.abstractmethod
    def load(self, tokens, ns: Optional[Namespace], slot_indices):
        """Start the H2D of the held prefix. Returns: a task (``.id``, ``.num_pages``)."""

    @abc.abstractmethod
    def load_layerwise(self, tokens, ns: Optional[Namespace], slot_indices):
        """As ``load``, signalled per layer. Returns: a task with ``.producer_index``."""

    @abc.abstractmethod
    def poll(self) -> list[int]:
        """Returns: ids of the tasks finalized since the last call."""

    @abc.abstractmethod
    def wait(self, task: Union[object, int]):
        """Block until ``task`` is finalized. Returns: the task."""

    @abc.abstractmethod
    def cancel(self, task: Union[object, int]) -> bool:
        """Returns: True if the task was in flight (and is now discarded)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Wait for in-flight copies, then drop every page."""

    def evict(self, num_pages: int) -> int:
        """Evict up to ``num_pages`` unlocked pages. Returns: pages evicted (default: none)."""
        return 0

    def stats(self) -> dict:
        """Returns: counters (default: none)."""
        return {}
