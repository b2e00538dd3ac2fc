"""Admission by cost: serve an SSD hit only when reading it is faster than recomputing it.

A request of ``n`` tokens past its CPU hit whose first ``k`` are on the SSD either waits for those blocks to be
promoted (read into CPU blocks, then loaded like any host hit) and prefills the other ``n - k``, or prefills all
``n``. Reading ``b`` bytes behind ``q`` bytes of reads already queued takes ``(q + b) / read_bandwidth``; the
policy admits the hit when ``read + rest(n - k) < prefill(n)`` (sglang#26305 measured file-backend hits at
2,450 ms against 1,725 ms of recompute: without this check a slow disk makes the cache a loss).

``prefill(x)``: ``prefill_tokens_per_s`` from the config (``x / rate``), else interpolated between the prefills
the engine reports with nothing cached (:meth:`CostAdmission.note_prefill`: tokens computed, seconds), so a
prefill's fixed cost and attention's growth with the context are in it; beyond the largest one it grows with the
last slope, below the smallest one with the first segment's (a fixed cost and a per-token cost; at least in
proportion to the smallest), so the tokens a hit saves always count. ``rest(x)``: the same, and at least what the
engine's prefills past a cached prefix (``cached_tokens`` > 0) of about ``x`` computed tokens took (held at their
smallest and largest, a floor): such a prefill also loads the prefix and attends over it, so a short one costs more
than a short prompt alone (on the H200's end-to-end harness, 16 tokens past a 2k prefix 45-60 ms, a 64-token
prompt 15-53 ms). Bandwidth: ``ssd_read_gbps`` from the config, else the SSD tier's measured reads. Unknown rates
admit (to measure), logged once.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Optional

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["CostAdmission", "PrefillModel", "lower_read_blocks"]


def lower_read_blocks(hit_blocks: int, pool_blocks: int) -> int:
    """Blocks of a lower tier's hit of ``hit_blocks`` to read into a CPU pool of ``pool_blocks``: at most half
    the pool, so that one long hit does not evict every other prefix the CPU holds (and admission weighs only
    what is read)."""
    return min(hit_blocks, max(1, pool_blocks // 2))


class PrefillModel:
    """Prefill seconds as a function of tokens, from the last ``keep`` reported prefills (or a fixed rate)."""

    def __init__(self, tokens_per_s: Optional[float] = None, keep: int = 64) -> None:
        self.tokens_per_s = tokens_per_s
        self._samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=keep)

    def note(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._samples.append((int(tokens), float(seconds)))

    @property
    def known(self) -> bool:
        return self.tokens_per_s is not None or bool(self._samples)

    def seconds(self, tokens: int, *, hold: bool = False) -> Optional[float]:
        """Estimated prefill seconds of ``tokens`` tokens; None before any measurement. With ``hold``, outside the
        measured prefills it costs as much as the nearest one."""
        if self.tokens_per_s is not None:
            return tokens / self.tokens_per_s
        if not self._samples:
            return None
        by: dict[int, list[float]] = {}
        for n, t in self._samples:
            by.setdefault(n, []).append(t)
        ns = np.array(sorted(by), dtype=np.float64)
        ts = np.array([float(np.median(by[int(n)])) for n in ns])
        ts = np.maximum.accumulate(ts)  # more tokens never cost less
        if hold or ns[0] <= tokens <= ns[-1]:
            return float(np.interp(tokens, ns, ts))  # np.interp holds the end values outside the samples
        if tokens < ns[0]:
            pro = ts[0] * tokens / ns[0]
            if ns.size == 1 or ts[1] <= ts[0]:
                return float(pro)
            slope = (ts[1] - ts[0]) / (ns[1] - ns[0])
            return float(max(ts[0] - slope * (ns[0] - tokens), pro))
        slope = (ts[-1] - ts[-2]) / (ns[-1] - ns[-2]) if ns.size > 1 else ts[-1] / ns[-1]
        return float(ts[-1] + slope * (tokens - ns[-1]))


class CostAdmission:
    """The admission decision for SSD hits (``mode``: ``"cost"`` or ``"always"``)."""

    def __init__(self, mode: str, *, read_gbps: Optional[float], prefill_tokens_per_s: Optional[float],
                 measured_read_gbps: Callable[[], Optional[float]]) -> None:
        if mode not in ("cost", "always"):
            raise ValueError(f"admission mode must be 'cost' or 'always', got {mode!r}")
        self.mode = mode
        self._read_gbps = read_gbps
        self._measured = measured_read_gbps
        self.prefill = PrefillModel(prefill_tokens_per_s)
        self.extend = PrefillModel()  # prefills past a cached prefix (unused with a configured rate)
        self._said_unknown = False
        self.admitted = 0
        self.refused = 0

    def note_prefill(self, tokens: int, seconds: float, cached_tokens: int = 0) -> None:
        """The engine prefilled ``tokens`` (computed, not cached) past ``cached_tokens`` cached ones in
        ``seconds``."""
        (self.extend if cached_tokens > 0 else self.prefill).note(tokens, seconds)

    def rest_seconds(self, tokens: int) -> Optional[float]:
        """Estimated seconds of the prefill of ``tokens`` tokens past a hit (see the module docstring)."""
        base = self.prefill.seconds(tokens)
        if base is None or self.prefill.tokens_per_s is not None or not self.extend.known:
            return base
        extend = self.extend.seconds(tokens, hold=True)  # known: a number
        return base if extend is None else max(base, extend)

    @property
    def read_gbps(self) -> Optional[float]:
        return self._read_gbps if self._read_gbps is not None else self._measured()

    def estimate(self, hit_tokens: int, tokens: int, nbytes: int, queued_bytes: int
                 ) -> tuple[Optional[float], Optional[float]]:
        """(seconds with the SSD hit: its read and the prefill of the rest, seconds without it: the prefill of all
        ``tokens``); None where unknown."""
        gbps = self.read_gbps
        rest, everything = self.rest_seconds(tokens - hit_tokens), self.prefill.seconds(tokens)
        if not gbps or rest is None:
            return None, everything
        return (queued_bytes + nbytes) / (gbps * 1e9) + rest, everything

    def admit(self, hit_tokens: int, tokens: int, nbytes: int, queued_bytes: int = 0) -> bool:
        """Whether to promote the first ``hit_tokens`` of ``tokens`` tokens past the CPU hit (``nbytes`` bytes on
        the SSD) behind ``queued_bytes`` of reads."""
        if self.mode == "always":
            self.admitted += 1
            return True
        with_hit, without = self.estimate(hit_tokens, tokens, nbytes, queued_bytes)
        if with_hit is None or without is None:
            if without is None and not self._said_unknown:
                self._said_unknown = True
                logger.info("kvtier: SSD admission by cost has no prefill measurement yet (set prefill_tokens_per_s, "
                            "or the engine reports it): admitting SSD hits until it has one")
            self.admitted += 1
            return True
        ok = with_hit < without
        self.admitted += ok
        self.refused += not ok
        return ok
