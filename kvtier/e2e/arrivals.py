"""How requests reach a server in the serving harness: open-loop Poisson arrivals under a concurrency cap, and
closed-loop clients in rounds.

A feed hands a server its requests as time passes and requests finish (:class:`Feed`):

* :class:`OpenLoop`: SGLang's ``bench_serving.py`` (``--request-rate``, ``--max-concurrency``): request ``i`` is due
  at a Poisson arrival time; it is sent at that time, or, when ``concurrency`` requests are outstanding, when one of
  them finishes (its TTFT counts from its sending, as the client measures it);
* :class:`Rounds`: SGLang's ``benchmark/hicache/bench_multiturn.py``: each client's prompt in round ``r`` is its whole
  history (every earlier prompt's new turn and output) plus its turn ``r``; round ``r + 1`` starts when every client
  finished round ``r`` (the round barrier); requests are sent at Poisson times at ``request_rate``, at most
  ``max_parallel`` outstanding.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, Sequence

import numpy as np

__all__ = ["Arrival", "Feed", "OpenLoop", "Rounds"]


@dataclasses.dataclass
class Arrival:
    """A request to serve: its tokens and how many new tokens to generate; ``tag`` is the feed's (a prompt's index,
    or a (client, round) pair)."""

    tokens: list
    max_new_tokens: int
    tag: object = None


class Finished(Protocol):
    """A finished request, as a server reports it: its ``tag`` and ``output`` tokens."""

    tag: Any  # what the feed tagged its arrival with
    output: list


class Feed(Protocol):
    """What a server asks a feed, between its steps."""

    def take(self, now_s: float, finished: Sequence[Finished]) -> list[Arrival]:
        """The requests to send at ``now_s`` (seconds since the run began), given the requests ``finished`` since
        the last call."""

    def done(self) -> bool:
        """Whether every request has been sent and none will follow."""

    def next_s(self) -> Optional[float]:
        """When the next request is due (None: when a request finishes), for an idle server's sleep."""


def poisson_times(n: int, rate: float, seed: int) -> np.ndarray:
    """``n`` arrival times (seconds from 0) of a Poisson process of ``rate`` per second (all at 0 when ``rate`` is
    infinite)."""
    if rate == float("inf"):
        return np.zeros(n)
    return np.cumsum(np.random.default_rng([seed, 7]).exponential(1.0 / rate, n))


class OpenLoop:
    """Prompts sent at ``qps`` (Poisson), at most ``concurrency`` outstanding (see the module docstring)."""

    def __init__(self, prompts: list[list[int]], *, qps: float, concurrency: int, max_new_tokens: int,
                 seed: int = 0) -> None:
        self.prompts, self.concurrency, self.max_new_tokens = prompts, concurrency, max_new_tokens
        self.due = poisson_times(len(prompts), qps, seed)
        self.sent = self.outstanding = 0

    def take(self, now_s: float, finished: Sequence[Finished]) -> list[Arrival]:
        self.outstanding -= len(finished)
        out = []
        while (self.sent < len(self.prompts) and self.due[self.sent] <= now_s
               and self.outstanding < self.concurrency):
            out.append(Arrival(self.prompts[self.sent], self.max_new_tokens, tag=self.sent))
            self.sent += 1
            self.outstanding += 1
        return out

    def done(self) -> bool:
        return self.sent == len(self.prompts)

    def next_s(self) -> Optional[float]:
        if self.done() or self.outstanding >= self.concurrency:
            return None
        return float(self.due[self.sent])


class Rounds:
    """Closed-loop clients in rounds (see the module docstring): ``turns[c][r]`` is client ``c``'s turn in round
    ``r``."""

    def __init__(self, turns: list[list[list[int]]], *, max_new_tokens: int, max_parallel: int,
                 request_rate: float, seed: int = 0) -> None:
        self.turns, self.max_new_tokens, self.max_parallel = turns, max_new_tokens, max_parallel
        self.rate, self.seed = request_rate, seed
        self.history: list[list[int]] = [[] for _ in turns]
        self.rounds = min(len(t) for t in turns)
        self.round = 0
        self.outstanding = 0
        self._start_round(0.0)

    def _start_round(self, now_s: float) -> None:
        order = np.random.default_rng([self.seed, self.round]).permutation(len(self.turns))
        self.queue = list(order)
        self.due = now_s + poisson_times(len(order), self.rate, self.seed + self.round)
        self.left = len(order)  # requests of this round not finished

    def take(self, now_s: float, finished: Sequence[Finished]) -> list[Arrival]:
        for f in finished:
            client, _ = f.tag
            self.history[client] = self.history[client] + self.turns[client][self.round] + list(f.output)
            self.outstanding -= 1
            self.left -= 1
        if self.left == 0 and self.round + 1 < self.rounds:  # the barrier: the next round starts now
            self.round += 1
            self._start_round(now_s)
        out = []
        sent = len(self.turns) - len(self.queue)
        while self.queue and self.due[sent] <= now_s and self.outstanding < self.max_parallel:
            c = int(self.queue.pop(0))
            out.append(Arrival(self.history[c] + self.turns[c][self.round], self.max_new_tokens, tag=(c, self.round)))
            self.outstanding += 1
            sent += 1
        return out

    def done(self) -> bool:
        return self.round + 1 >= self.rounds and not self.queue

    def next_s(self) -> Optional[float]:
        if not self.queue or self.outstanding >= self.max_parallel:
            return None
        return float(self.due[len(self.turns) - len(self.queue)])
