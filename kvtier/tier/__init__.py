"""kvtier host tier: pinned block pool, asynchronous store/load manager, layer-done signalling.

- ``HostBlockPool``: a (pinned) host tensor of blocks and its allocator (``host_pool.py``).
- ``LayerDoneCounter``: per-layer load events waited on GPU-side, CuPy / torch / host backends (``signal.py``).
- ``KVTier``: lookup / store / load / load_layerwise / poll / wait / cancel / reset (``manager.py``), against the
  ``HostTier`` contract (``abstract.py``); copies issued through an executor (``executor.py``).
"""

from kvtier.tier.abstract import HostTier
from kvtier.tier.executor import CudaExecutor, DeferredExecutor, FailingExecutor, ImmediateExecutor, InjectedFailure
from kvtier.tier.host_pool import HostBlockPool
from kvtier.tier.manager import KVTier, TierStats, TierTask
from kvtier.tier.signal import LayerDoneCounter

__all__ = ["HostTier", "HostBlockPool", "LayerDoneCounter", "KVTier", "TierTask", "TierStats", "CudaExecutor",
           "ImmediateExecutor", "DeferredExecutor", "FailingExecutor", "InjectedFailure"]
