"""Prometheus metrics of a KVTier, through ``prometheus-client``.

:class:`TierMetrics` is a :class:`~kvtier.tier.observers.TierObserver`: it observes each completed transfer into a
duration histogram as it happens, and turns the tier's cumulative ``stats()`` into counters and gauges when it
syncs (on every scrape of its own registry, or every ``interval_s`` on a thread under SGLang's multiprocess
collection). Nothing else runs on the engine's path. Every quantity is in tokens or bytes, labelled by ``tier``
(``cpu``, ``ssd``, ``remote``) and, for transfers, ``op`` (``store``: into the tier; ``load``: out of it towards
the GPU).

Two ways out:

* :func:`serve`: kvtier's own HTTP endpoint (``metrics_port`` in the config), on the metrics' own registry.
* ``multiprocess=True``: SGLang runs with ``--enable-metrics``; its scheduler processes write their metrics to
  ``$PROMETHEUS_MULTIPROC_DIR`` and the HTTP server's ``/metrics`` collects them all. kvtier's metrics join them
  there (gauges in ``mostrecent`` mode, as SGLang's own); its own endpoint, if any, serves them too.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping, NamedTuple, Optional

from kvtier.tier.observers import TierObserver, Transfer

__all__ = ["TierMetrics", "METRICS", "serve", "DURATION_BUCKETS"]

logger = logging.getLogger(__name__)

PREFIX = "kvtier_"
DURATION_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metric(NamedTuple):
    """One metric: its name (without the ``kvtier_`` prefix), kind (``counter`` or ``gauge``), help text, label
    names, and its series: (label values, stats key, unit). A unit scales the stats value: ``"page"`` (times the
    page size: tokens), ``"block"`` (times the tokens per block), ``"block_bytes"``, or 1."""

    name: str
    kind: str
    doc: str
    labels: tuple
    series: tuple


METRICS: tuple[Metric, ...] = (
    Metric("lookups_total", "counter", "Prefix lookups in the host tier.", (), (((), "lookups", 1),)),
    Metric("lookup_hit_tokens_total", "counter",
           "Tokens of looked-up prefixes the CPU tier held, per lookup (an engine may look a request up more than "
           "once, and the whole prefix, its GPU-held part too): a lookup-level figure; the CPU hits requests used "
           "are transfer_tokens_total{tier=\"cpu\",op=\"load\"}.", ("tier",),
           ((("cpu",), "hit_pages", "page"),)),
    Metric("lookup_miss_tokens_total", "counter", "Tokens of looked-up full pages the CPU tier did not hold.",
           ("tier",), ((("cpu",), "miss_pages", "page"),)),
    Metric("transfer_tokens_total", "counter",
           "Tokens moved: op=store into the tier (GPU->CPU, CPU->SSD, CPU->remote), op=load out of it.",
           ("tier", "op"),
           ((("cpu", "store"), "pages_stored", "page"), (("cpu", "load"), "pages_loaded", "page"),
            (("ssd", "store"), "ssd_blocks_written", "block"), (("ssd", "load"), "pages_promoted", "page"),
            (("remote", "store"), "remote_blocks_put", "block"), (("remote", "load"), "pages_fetched", "page"))),
    Metric("transfer_bytes_total", "counter", "Bytes moved (op as for transfer_tokens_total).", ("tier", "op"),
           ((("cpu", "store"), "bytes_d2h", 1), (("cpu", "load"), "bytes_h2d", 1),
            (("ssd", "store"), "ssd_bytes_written", 1), (("ssd", "load"), "ssd_bytes_read", 1),
            (("remote", "store"), "remote_bytes_put", 1), (("remote", "load"), "remote_bytes_fetched", 1))),
    Metric("transfer_seconds_total", "counter",
           "Seconds spent moving transfer_bytes_total (device time on the GPU, IO time for SSD and remote): "
           "rate(bytes) / rate(seconds) is the bandwidth.", ("tier", "op"),
           ((("cpu", "store"), "seconds_d2h", 1), (("cpu", "load"), "seconds_h2d", 1),
            (("ssd", "store"), "ssd_seconds_write", 1), (("ssd", "load"), "ssd_seconds_read", 1),
            (("remote", "store"), "remote_seconds_put", 1), (("remote", "load"), "remote_seconds_fetch", 1))),
    Metric("evicted_tokens_total", "counter", "Tokens evicted from the tier (LRU).", ("tier",),
           ((("cpu",), "pages_evicted", "page"), (("ssd",), "ssd_blocks_evicted", "block"))),
    Metric("dropped_tokens_total", "counter", "Tokens not stored into the tier, by why.", ("tier", "reason"),
           ((("cpu", "no_room"), "pages_store_dropped", "page"),
            (("ssd", "queue_full"), "ssd_blocks_write_dropped", "block"),
            (("ssd", "io_error"), "ssd_blocks_write_failed", "block"),
            (("remote", "queue_full_or_down"), "remote_blocks_put_dropped", "block"),
            (("remote", "store_error"), "remote_blocks_put_failed", "block"))),
    Metric("integrity_failures_total", "counter",
           "Blocks that failed a check on read (size, header, identity, chain hash, tokens, checksum): "
           "counted as misses, never served.", ("tier",),
           ((("ssd",), "ssd_blocks_corrupt", 1), (("remote",), "remote_blocks_corrupt", 1))),
    Metric("failures_total", "counter",
           "Transfers that failed (cpu: the copy's issue raised, unwound; ssd: read errors; remote: failed "
           "calls; fetches abandoned past remote_timeout_s count under reason=timeout, values their holder did "
           "not serve under reason=peer_error).", ("tier", "reason"),
           ((("cpu", "store_error"), "failed_stores", 1), (("cpu", "load_error"), "failed_loads", 1),
            (("ssd", "read_error"), "ssd_read_errors", 1), (("remote", "call_error"), "remote_errors", 1),
            (("remote", "timeout"), "remote_fetches_abandoned", 1),
            (("remote", "peer_error"), "remote_blocks_fetch_failed", 1))),
    Metric("admission_refused_total", "counter", "Reads the cost admission refused (recomputing was cheaper).",
           ("tier",), ((("ssd",), "ssd_refused", 1), (("remote",), "remote_refused", 1))),
    Metric("remote_down_total", "counter", "Times the remote tier went down.", (),
           (((), "remote_times_down", 1),)),
    Metric("remote_fetches_skipped_total", "counter",
           "Remote fetches not started because the fetch thread still runs a call given up on (a hung peer).", (),
           (((), "remote_fetches_skipped", 1),)),
    Metric("pool_used_bytes", "gauge", "Bytes of the tier's pool in use.", ("tier",),
           ((("cpu",), "blocks_used", "block_bytes"), (("ssd",), "ssd_blocks_held", "block_bytes"))),
    Metric("pool_capacity_bytes", "gauge", "Bytes of the tier's pool.", ("tier",),
           ((("cpu",), "blocks_total", "block_bytes"), (("ssd",), "ssd_blocks_total", "block_bytes"))),
    Metric("held_tokens", "gauge", "Tokens the CPU index holds, and of them those locked by transfers.",
           ("tier", "state"), ((("cpu", "held"), "pages_held", "page"), (("cpu", "locked"), "pages_locked", "page"))),
    Metric("inflight_tasks", "gauge", "Stores, loads, promotions and fetches in flight.", (),
           (((), "inflight_tasks", 1),)),
    Metric("queued_blocks", "gauge", "Blocks queued for the tier's writer.", ("tier",),
           ((("ssd",), "ssd_blocks_pending", 1), (("remote",), "remote_blocks_pending_put", 1))),
    Metric("remote_up", "gauge", "1 while the remote tier is up.", (), (((), "remote_up", 1),)),
)


def _scale(unit, stats: Mapping) -> float:
    if unit == "page":
        return stats["page_size"]
    if unit == "block":
        return stats["tokens_per_block"]
    if unit == "block_bytes":
        return stats["block_bytes"]
    return unit


class TierMetrics(TierObserver):
    """The metrics of one tier (see the module docstring).

    Args:
        stats: the tier's ``stats`` method (called on each sync).
        labels: constant labels on every series (e.g. ``{"model_name": ..., "tp_rank": "0"}``).
        registry: a ``CollectorRegistry`` to register in (synced on each collection); None: a new one of its own
            (:attr:`registry`).
        multiprocess: SGLang's multiprocess collection: the values are in ``$PROMETHEUS_MULTIPROC_DIR`` (set
            before ``prometheus_client`` is first imported, as SGLang does), where nothing collects through this
            object, so a thread of its own syncs every ``interval_s`` until :meth:`close`.
    """

    def __init__(self, stats: Callable[[], dict], *, labels: Optional[Mapping[str, str]] = None, registry=None,
                 multiprocess: bool = False, interval_s: float = 1.0) -> None:
        import prometheus_client as prom

        self._stats = stats
        self.labels = dict(labels or {})
        names = tuple(self.labels)
        self._lock = threading.Lock()
        self._last: dict[tuple, float] = {}
        self.registry = registry if registry is not None else prom.CollectorRegistry(auto_describe=True)
        self.registry.register(_SyncOnCollect(self))  # first: the values are synced before they are read
        self._metrics: list[tuple[Metric, Any]] = []  # each with its client metric: a Counter or a Gauge (m.kind)
        for m in METRICS:
            kw: dict[str, Any] = dict(registry=self.registry)
            if m.kind == "gauge":
                kw["multiprocess_mode"] = "mostrecent"
            cls = prom.Counter if m.kind == "counter" else prom.Gauge
            name = PREFIX + (m.name[:-len("_total")] if m.kind == "counter" else m.name)  # the client adds _total
            self._metrics.append((m, cls(name, m.doc, labelnames=names + m.labels, **kw)))
        self._duration = prom.Histogram(
            PREFIX + "transfer_duration_seconds", "Duration of each completed transfer (op as for "
            "transfer_tokens_total).", labelnames=names + ("tier", "op"), buckets=DURATION_BUCKETS,
            registry=self.registry)
        self._stop = threading.Event()
        self._thread = None
        if multiprocess:
            self._thread = threading.Thread(target=self._loop, args=(interval_s,), name="kvtier-metrics",
                                            daemon=True)
            self._thread.start()

    # --- observer ---

    def transfer_done(self, transfer: Transfer) -> None:
        if transfer.seconds is not None:
            self._duration.labels(*self.labels.values(), transfer.tier, transfer.op).observe(transfer.seconds)

    # --- sync ---

    def sync(self) -> None:
        """Bring every counter and gauge to the tier's current stats (series whose keys the tier lacks, such as a
        tier not configured, are left out)."""
        stats = self._stats()
        const = tuple(self.labels.values())
        absent = {t for t, key in (("ssd", "ssd_blocks_total"), ("remote", "remote_up")) if key not in stats}
        with self._lock:
            for m, metric in self._metrics:
                for values, key, unit in m.series:
                    v = stats.get(key)
                    if v is None or (m.labels[:1] == ("tier",) and values[0] in absent):
                        continue
                    v = float(v) * _scale(unit, stats)
                    child = metric.labels(*const, *values) if const or values else metric
                    if m.kind == "gauge":
                        child.set(v)
                        continue
                    last = self._last.get((m.name, values), 0.0)
                    if v > last:
                        child.inc(v - last)
                        self._last[(m.name, values)] = v
                    elif (m.name, values) not in self._last:
                        child.inc(0)  # the series exists from the first sync on
                        self._last[(m.name, values)] = v

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._sync_logged()

    def _sync_logged(self) -> None:
        try:
            self.sync()
        except Exception:  # a tier torn down under the thread: the metrics stop, serving does not
            logger.exception("kvtier: syncing the metrics failed; they stop here")
            self._stop.set()

    def close(self) -> None:
        """Sync a last time and stop the sync thread (multiprocess)."""
        if self._thread is not None and not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._sync_logged()


class _SyncOnCollect:
    """A collector that yields nothing and syncs its metrics: registered first, it runs before they are read."""

    def __init__(self, metrics: TierMetrics) -> None:
        self._metrics = metrics

    def collect(self):
        self._metrics.sync()
        return iter(())

    def describe(self):
        return []


def serve(metrics: TierMetrics, port: int, addr: str = "0.0.0.0"):
    """Serve ``metrics``' registry over HTTP at ``http://addr:port/metrics``; returns (server, thread) (``port``
    0: a free one, ``server.server_port``)."""
    import prometheus_client as prom

    return prom.start_http_server(port, addr=addr, registry=metrics.registry)
