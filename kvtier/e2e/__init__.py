"""The end-to-end harness: a real decoder over a paged KV pool (:mod:`kvtier.e2e.model`), a minimal paged pool of
kvtier's own (:mod:`kvtier.e2e.pool`), workloads (:mod:`kvtier.e2e.workloads`) and a serving loop over
:class:`~kvtier.tier.KVTier` without an engine (:mod:`kvtier.e2e.engine`, the demo's). The SGLang serving loop is
:mod:`kvtier.sglang.serving`. Needs ``transformers`` (``pip install 'kvtier[e2e]'``)."""
