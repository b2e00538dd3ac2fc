"""attach: give a KVTier the observers its config asks for (transfer log, metrics and their HTTP endpoint)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping, Optional

from kvtier.observe.transfer_log import TransferLog

if TYPE_CHECKING:  # the metrics module imports the Prometheus client: only when metrics are on
    from kvtier.observe.metrics import TierMetrics

__all__ = ["attach", "Observability"]

logger = logging.getLogger(__name__)


class Observability:
    """What :func:`attach` added to a tier: :attr:`metrics` (or None), :attr:`server` (kvtier's own HTTP
    endpoint, or None), :attr:`port` (the port it serves on). ``Observability()``: nothing attached yet."""

    def __init__(self, tier=None) -> None:
        self.tier = tier
        self.metrics: Optional[TierMetrics] = None
        self.server: Optional[Any] = None  # the Prometheus client's HTTP server
        self.port: Optional[int] = None
        self.observers: list = []  # what it added to the tier

    def add(self, observer) -> None:
        self.tier.add_observer(observer)
        self.observers.append(observer)

    def close(self) -> None:
        """Stop the endpoint and the metrics' sync thread, and take the observers off the tier (it keeps running
        unobserved by them); idempotent."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        if self.metrics is not None:
            self.metrics.close()
        while self.observers:
            self.tier.remove_observer(self.observers.pop())


def attach(tier, config=None, *, labels: Optional[Mapping[str, str]] = None, multiprocess: bool = False,
           port_offset: int = 0) -> Observability:
    """Add to ``tier`` a :class:`TransferLog` (``log_transfers``) and :class:`~kvtier.observe.metrics.TierMetrics`
    when ``multiprocess`` (SGLang's ``--enable-metrics``) or ``metrics_port`` asks for them; ``metrics_port`` plus
    ``port_offset`` (the rank) is served over HTTP (``metrics_port: 0``: a free port on every rank).
    ``config``: the keys to follow (default ``tier.config``)."""
    config = config if config is not None else tier.config
    port = config.metrics_port
    if port:  # 0: any free port, on every rank
        port += port_offset
        if port > 65535:
            raise ValueError(f"kvtier config: metrics_port {config.metrics_port} (+{port_offset} for this rank) is "
                             "past 65535: lower metrics_port")
    out = Observability(tier)
    if config.log_transfers:
        out.add(TransferLog())
    if not multiprocess and port is None:
        return out
    from kvtier.observe.metrics import TierMetrics, serve

    out.metrics = metrics = TierMetrics(tier.stats, labels=labels, multiprocess=multiprocess)
    out.add(metrics)
    if port is not None:
        try:
            out.server, _ = serve(metrics, port)
        except OSError as e:
            out.close()
            raise ValueError(f"kvtier config: metrics_port {config.metrics_port} (+{port_offset} for this rank): "
                             f"cannot serve on port {port}: {e}") from None
        out.port = out.server.server_port
        logger.info("kvtier: metrics on http://0.0.0.0:%d/metrics", out.port)
    return out
