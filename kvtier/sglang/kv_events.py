"""HostKvEvents: kvtier's CPU tier in SGLang's KV event stream (``--kv-events-config``).

Blocks entering kvtier's CPU index become ``BlockStored`` events, blocks it evicts ``BlockRemoved`` events, both
with ``medium="CPU_PINNED"``, queued on the cache's own ``KVCacheEventRecorder``: the scheduler publishes them with
the device tree's events (its ``take_events``), so subscribers (cache-aware routers, Dynamo) see them unchanged.
The block hashes are SGLang's own for the same tokens and namespace (its recorder computes them, over a detached
chain of ``TreeNode`` s standing for the prefix), so a router matches a host page to the device page it was.
"""

from __future__ import annotations

from array import array

import numpy as np
from sglang.srt.disaggregation.kv_events import BlockRemoved, StorageMedium
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from kvtier.tier.observers import TierObserver

__all__ = ["HostKvEvents"]


def _runs(positions: np.ndarray) -> list[tuple[int, int, int]]:
    """(first index, first position, count) of each run of consecutive ``positions``."""
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [positions.size]))
    return [(int(a), int(positions[a]), int(b - a)) for a, b in zip(starts, ends)]


class HostKvEvents(TierObserver):
    """Queues CPU-tier placement events on ``recorder`` (the cache's ``kv_events``).

    Args:
        recorder: SGLang's ``KVCacheEventRecorder`` (enabled).
        page_size: the engine's page (one event hash each).
        block_tokens: tokens per kvtier host block.
    """

    def __init__(self, recorder, page_size: int, block_tokens: int) -> None:
        self.recorder, self.page_size, self.block_tokens = recorder, page_size, block_tokens
        self._hashes: dict[int, list[int]] = {}  # CPU block id -> the published hashes of its pages

    def blocks_entered(self, block_ids: np.ndarray, tokens: np.ndarray, ns, positions: np.ndarray) -> None:
        B, G = self.block_tokens, self.block_tokens // self.page_size
        extra_key = ns.extra_key if ns is not None else None
        cache_salt = ns.cache_salt if ns is not None else None
        for first, pos, n in _runs(positions):
            parent = self._node(None, [], extra_key, cache_salt)  # the root
            if pos:
                parent = self._node(parent, tokens[:pos * B], extra_key, cache_salt)
                self.recorder._node_event_hash_values(parent)  # the chain the run's first page links to
            node = self._node(parent, tokens[pos * B:(pos + n) * B], extra_key, cache_salt)
            self.recorder.record_store(node, medium=StorageMedium.CPU)
            published = self._published(node)
            for i, block in enumerate(block_ids[first:first + n].tolist()):
                self._hashes[block] = published[i * G:(i + 1) * G]

    def blocks_evicted(self, block_ids: np.ndarray) -> None:
        gone = [h for b in block_ids.tolist() for h in self._hashes.pop(b, ())]
        if gone:
            self.recorder.enqueue(BlockRemoved(block_hashes=gone, medium=StorageMedium.CPU))

    def cleared(self) -> None:
        gone = [h for hashes in self._hashes.values() for h in hashes]
        self._hashes.clear()
        if gone:
            self.recorder.enqueue(BlockRemoved(block_hashes=gone, medium=StorageMedium.CPU))

    # --- SGLang's hashes ---

    @staticmethod
    def _node(parent, tokens, extra_key, cache_salt) -> TreeNode:
        node = TreeNode()
        ids = array("q")
        ids.frombytes(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
        node.key = RadixKey(ids, extra_key, cache_salt=cache_salt)
        node.parent = parent
        return node

    def _published(self, node: TreeNode) -> list[int]:
        """The block hashes ``record_store(node)`` published, page by page."""
        from sglang.srt.disaggregation.kv_events import namespaced_block_hash
        from sglang.srt.mem_cache.utils import hash_str_to_int64

        seed = self.recorder._namespace_seed(node)
        return [namespaced_block_hash(hash_str_to_int64(h), namespace_seed=seed)
                for h in self.recorder._node_event_hash_values(node)]
