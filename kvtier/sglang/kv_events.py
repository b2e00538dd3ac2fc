"""HostKvEvents: kvtier's tiers in SGLang's KV event stream (``--kv-events-config``).

Blocks entering kvtier's CPU index become ``BlockStored`` events, blocks it evicts ``BlockRemoved`` events, both
with ``medium="CPU_PINNED"``, queued on the cache's own ``KVCacheEventRecorder``: the scheduler publishes them with
the device tree's events (its ``take_events``), so subscribers (cache-aware routers, Dynamo) see them unchanged.
The block hashes are SGLang's own for the same tokens and namespace (its recorder computes them, over a detached
chain of ``TreeNode`` s standing for the prefix), so a router matches a host page to the device page it was.

The lower tiers publish with the same hashes, tokens and parents as the CPU block each was written from:

* SSD (``medium="DISK"``): ``BlockStored`` once a write is durable (findable), ``BlockRemoved`` when the SSD
  evicts a block or drops one that failed a check.
* Remote (``medium="EXTERNAL"``): ``BlockStored`` once a put is stored. No ``BlockRemoved``: a value leaves the
  Mooncake store when its master evicts it or the instance holding its segment stops, and kvtier is told of
  neither; a router learns of it as a miss.
* Not published: SSD blocks recovered at start-up (the disk keeps each block's own tokens, not the prefix that
  SGLang's hashes chain over), their later evictions, and remote values another instance put.

Memory: the last event of each CPU block (its page hashes, parent, tokens), and the page hashes of each SSD block
published since start (for its ``BlockRemoved``).
"""

from __future__ import annotations

from array import array
from typing import NamedTuple, Optional

import numpy as np
from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, StorageMedium
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from kvtier.tier.observers import TierObserver

__all__ = ["HostKvEvents"]

_MEDIUM = {"ssd": StorageMedium.DISK, "remote": StorageMedium.EXTERNAL}


def _runs(positions: np.ndarray) -> list[tuple[int, int, int]]:
    """(first index, first position, count) of each run of consecutive ``positions``."""
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [positions.size]))
    return [(int(a), int(positions[a]), int(b - a)) for a, b in zip(starts, ends)]


class _Placed(NamedTuple):
    """What a CPU block's ``BlockStored`` said: its pages' hashes, the hash its first page links to, its tokens,
    and the namespace fields of the event."""

    hashes: list
    parent: Optional[int]
    tokens: np.ndarray
    cache_salt: Optional[str]
    lora_name: Optional[str]


class HostKvEvents(TierObserver):
    """Queues kvtier's placement events on ``recorder`` (the cache's ``kv_events``).

    Args:
        recorder: SGLang's ``KVCacheEventRecorder`` (enabled).
        page_size: the engine's page (one event hash each).
        block_tokens: tokens per kvtier host block.
    """

    def __init__(self, recorder, page_size: int, block_tokens: int) -> None:
        self.recorder, self.page_size, self.block_tokens = recorder, page_size, block_tokens
        self._placed: dict[int, _Placed] = {}  # CPU block id -> its last BlockStored (kept after its eviction:
        # a write-back SSD write of it completes later)
        self._on_cpu: set[int] = set()  # CPU blocks whose BlockStored stands
        self._on_ssd: dict[int, list[int]] = {}  # chain hash -> the published page hashes of an SSD block

    # --- the CPU tier ---

    def blocks_entered(self, block_ids: np.ndarray, tokens: np.ndarray, ns, positions: np.ndarray) -> None:
        B, G = self.block_tokens, self.block_tokens // self.page_size
        extra_key = ns.extra_key if ns is not None else None
        cache_salt = ns.cache_salt if ns is not None else None
        lora_name = self._lora_name(extra_key)
        for first, pos, n in _runs(positions):
            parent = self._node(None, [], extra_key, cache_salt)  # the root
            parent_hash = None
            if pos:
                parent = self._node(parent, tokens[:pos * B], extra_key, cache_salt)
                parent_hash = self._published(parent)[-1]  # the chain the run's first page links to
            node = self._node(parent, tokens[pos * B:(pos + n) * B], extra_key, cache_salt)
            self.recorder.record_store(node, medium=StorageMedium.CPU)
            published = self._published(node)
            for i, block in enumerate(block_ids[first:first + n].tolist()):
                hashes = published[i * G:(i + 1) * G]
                self._placed[block] = _Placed(hashes, parent_hash, tokens[(pos + i) * B:(pos + i + 1) * B].copy(),
                                              cache_salt, lora_name)
                self._on_cpu.add(block)
                parent_hash = hashes[-1]

    def blocks_evicted(self, block_ids: np.ndarray) -> None:
        gone = [h for b in block_ids.tolist() if b in self._on_cpu for h in self._placed[b].hashes]
        self._on_cpu.difference_update(block_ids.tolist())
        if gone:
            self.recorder.enqueue(BlockRemoved(block_hashes=gone, medium=StorageMedium.CPU))

    def cleared(self) -> None:
        gone = [h for b in self._on_cpu for h in self._placed[b].hashes]
        self._on_cpu.clear()
        self._placed.clear()  # a reset waits for every lower-tier write first: none will ask for them
        if gone:
            self.recorder.enqueue(BlockRemoved(block_hashes=gone, medium=StorageMedium.CPU))

    # --- the lower tiers ---

    def lower_stored(self, tier: str, hashes: np.ndarray, block_ids: np.ndarray) -> None:
        medium = _MEDIUM[tier]
        for chain, block in zip(hashes.tolist(), block_ids.tolist()):
            placed = self._placed.get(block)
            if placed is None:  # entered before this observer was added
                continue
            parent = placed.parent
            for k, h in enumerate(placed.hashes):  # one event per page, as SGLang's recorder publishes
                page = placed.tokens[k * self.page_size:(k + 1) * self.page_size].tolist()
                self.recorder.enqueue(BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=page,
                                                  block_size=len(page), lora_id=None, medium=medium,
                                                  cache_salt=placed.cache_salt, lora_name=placed.lora_name))
                parent = h
            if tier == "ssd":
                self._on_ssd[chain] = placed.hashes

    def lower_removed(self, tier: str, hashes: np.ndarray) -> None:
        gone = [h for chain in hashes.tolist() for h in self._on_ssd.pop(chain, ())]
        if gone:
            self.recorder.enqueue(BlockRemoved(block_hashes=gone, medium=_MEDIUM[tier]))

    # --- SGLang's hashes (tied to sglang 0.5.23's recorder: two private helpers and its lora_names) ---

    @staticmethod
    def _node(parent, tokens, extra_key, cache_salt) -> TreeNode:
        node = TreeNode()
        ids = array("q")
        ids.frombytes(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
        node.key = RadixKey(ids, extra_key, cache_salt=cache_salt)
        node.parent = parent
        return node

    def _published(self, node: TreeNode) -> list[int]:
        """The block hashes ``record_store(node)`` publishes, page by page."""
        from sglang.srt.disaggregation.kv_events import namespaced_block_hash
        from sglang.srt.mem_cache.utils import hash_str_to_int64

        seed = self.recorder._namespace_seed(node)
        return [namespaced_block_hash(hash_str_to_int64(h), namespace_seed=seed)
                for h in self.recorder._node_event_hash_values(node)]

    def _lora_name(self, extra_key) -> Optional[str]:
        """The ``lora_name`` ``record_store`` gives an event in namespace ``extra_key``."""
        r = self.recorder
        return r.lora_names.resolve(extra_key) if r.dynamo_format else r.lora_names.get(extra_key)
