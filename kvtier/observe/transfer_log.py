"""TransferLog: one INFO line per completed transfer, as FlexKV logs its transfer requests.

Lines go to the ``kvtier.transfers`` logger (``log_transfers: false`` in the config, or that logger's level, turns
them off), e.g. ``kvtier: cpu load: 512 pages, 64.0 MiB in 2.41 ms (27.9 GB/s)``.
"""

from __future__ import annotations

import logging

from kvtier.tier.observers import TierObserver, Transfer

__all__ = ["TransferLog", "LOGGER_NAME"]

LOGGER_NAME = "kvtier.transfers"
_WHAT = {("cpu", "store"): "cpu store (GPU->CPU)", ("cpu", "load"): "cpu load (CPU->GPU)",
         ("ssd", "store"): "ssd write (CPU->SSD)", ("ssd", "load"): "ssd read (SSD->CPU)",
         ("remote", "store"): "remote put (CPU->remote)", ("remote", "load"): "remote fetch (remote->CPU)"}


class TransferLog(TierObserver):
    """Logs each completed transfer at INFO on ``logger`` (default ``kvtier.transfers``)."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(LOGGER_NAME)

    def transfer_done(self, t: Transfer) -> None:
        if not self.logger.isEnabledFor(logging.INFO):
            return
        what = _WHAT.get((t.tier, t.op), f"{t.tier} {t.op}")
        gbps = t.gbps
        timing = (f" in {t.seconds * 1e3:.2f} ms ({gbps:.1f} GB/s)" if gbps is not None and t.seconds is not None
                  else "")
        self.logger.info("kvtier: %s: %d pages, %.2f MiB%s", what, t.pages, t.nbytes / (1 << 20), timing)
