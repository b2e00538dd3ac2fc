"""kvtier host tier: pinned block pool, asynchronous store/load manager, layer-done signalling.

- ``HostBlockPool``: a (pinned) host tensor of blocks and its allocator (``host_pool.py``).
- ``LayerDoneCounter``: per-layer load events waited on GPU-side, CuPy / torch / host backends (``signal.py``).
- ``KVTier``: lookup / store / load / load_layerwise / poll / wait / cancel / reset (``manager.py``), against the
  ``HostTier`` contract (``abstract.py``); copies issued through an executor (``executor.py``); its tasks and
  their records in ``tasks.py``; the transfer path of each copy chosen by ``transfer_policy.py``. Executors that
  defer or fail copies for tests (``DeferredExecutor``, ``FailingExecutor``) are in ``kvtier.tier.executor``.
- Lower tiers (SSD, shared store) behind one protocol: ``lower.py``.
"""

from kvtier.tier.abstract import HostTier
from kvtier.tier.executor import CudaExecutor, ImmediateExecutor
from kvtier.tier.host_pool import HostBlockPool
from kvtier.tier.manager import KVTier, TierStats
from kvtier.tier.signal import LayerDoneCounter
from kvtier.tier.tasks import TaskKind, TaskStatus, TierTask

__all__ = ["HostTier", "HostBlockPool", "LayerDoneCounter", "KVTier", "TierTask", "TaskKind", "TaskStatus",
           "TierStats", "CudaExecutor", "ImmediateExecutor"]
