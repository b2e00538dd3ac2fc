"""The end-to-end harness: a real decoder over a paged KV pool (:mod:`kvtier.e2e.model`), workloads
(:mod:`kvtier.e2e.workloads`) and a serving loop over :class:`~kvtier.tier.KVTier` without an engine
(:mod:`kvtier.e2e.engine`, the demo's). The SGLang serving loop is :mod:`kvtier.sglang.serving`. Needs
``transformers`` (``pip install 'kvtier[e2e]'``).

The harness moves KV through kvtier's kernels: they are imported first, so that on a machine without CUDA they
choose the Triton interpreter before building a model imports triton.
"""

import kvtier.kernels  # noqa: F401
