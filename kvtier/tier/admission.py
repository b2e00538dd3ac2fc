"""Admission by cost: serve an SSD hit only when reading it is faster than recomputing it.

A request whose prefix continues on the SSD past the CPU hit either waits for those blocks to be promoted (read
into CPU blocks, then loaded like any host hit) or recomputes them. Reading ``b`` bytes behind ``q`` bytes of reads
already queued takes ``(q + b) / read_bandwidth``; recomputing ``t`` tokens takes ``t / prefill_rate``. The policy
admits the hit when the first is smaller (sglang#26305 measured file-backend hits at 2,450 ms against 1,725 ms of
recompute: without this check a slow disk makes the cache a loss).

Bandwidth: ``ssd_read_gbps`` from the config, else the SSD tier's measured reads (none yet: admit, to measure).
Prefill rate: ``prefill_tokens_per_s`` from the config, else what the engine reports through
:meth:`CostAdmission.note_prefill` (none: admit, logged once).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

logger = logging.getLogger(__name__)

__all__ = ["CostAdmission"]

_EWMA = 0.2  # weight of a new prefill measurement


class CostAdmission:
    """The admission decision for SSD hits (``mode``: ``"cost"`` or ``"always"``)."""

    def __init__(self, mode: str, *, read_gbps: Optional[float], prefill_tokens_per_s: Optional[float],
                 measured_read_gbps: Callable[[], Optional[float]]) -> None:
        if mode not in ("cost", "always"):
            raise ValueError(f"admission mode must be 'cost' or 'always', got {mode!r}")
        self.mode = mode
        self._read_gbps = read_gbps
        self._measured = measured_read_gbps
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self._configured_rate = prefill_tokens_per_s is not None
        self._said_unknown = False
        self.admitted = 0
        self.refused = 0

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """The engine prefilled ``tokens`` in ``seconds`` (its measured rate, unless the config fixes one)."""
        if self._configured_rate or tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - _EWMA) * old + _EWMA * rate

    @property
    def read_gbps(self) -> Optional[float]:
        return self._read_gbps if self._read_gbps is not None else self._measured()

    def estimate(self, tokens: int, nbytes: int, queued_bytes: int) -> tuple[Optional[float], Optional[float]]:
        """(seconds to read, seconds to recompute); None where unknown."""
        gbps, rate = self.read_gbps, self.prefill_tokens_per_s
        read_s = (queued_bytes + nbytes) / (gbps * 1e9) if gbps else None
        return read_s, (tokens / rate if rate else None)

    def admit(self, tokens: int, nbytes: int, queued_bytes: int = 0) -> bool:
        """Whether to promote an SSD hit of ``tokens`` tokens (``nbytes`` bytes) behind ``queued_bytes`` of reads."""
        if self.mode == "always":
            self.admitted += 1
            return True
        read_s, recompute_s = self.estimate(tokens, nbytes, queued_bytes)
        if read_s is None or recompute_s is None:
            if recompute_s is None and not self._said_unknown:
                self._said_unknown = True
                logger.info("kvtier: SSD admission by cost has no prefill rate yet (set prefill_tokens_per_s, or the "
                            "engine reports it): admitting SSD hits until it has one")
            self.admitted += 1
            return True
        ok = read_s < recompute_s
        self.admitted += ok
        self.refused += not ok
        return ok
