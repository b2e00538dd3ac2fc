"""Observability: what leaves the process about a KVTier (metrics, transfer logs). Engine-neutral; the SGLang
backend's KV events live in :mod:`kvtier.sglang.kv_events`."""

from kvtier.observe.transfer_log import TransferLog

__all__ = ["TransferLog", "TierMetrics", "serve"]


def __getattr__(name):  # prometheus_client is imported only when metrics are used
    if name in ("TierMetrics", "serve"):
        from kvtier.observe import metrics

        return getattr(metrics, name)
    raise AttributeError(name)
