"""Executors: where the tier's copies are issued and how their completion is observed.

Protocol (the manager only talks to its executor through these, so its bookkeeping is the same on every machine):

* ``stream(name)``: the stream named ``"store"`` or ``"load"`` (None where there are no streams).
* ``begin(name)``: order what is issued next on ``name`` after the engine's work so far on its current stream (the
  slots' KV was written there; a load must not overwrite slots still being read).
* ``run(name, fn, own_stream=False)``: issue ``fn()`` (kernel launches) on stream ``name``. With ``own_stream``
  ``fn`` passes ``stream(name)`` to what it launches itself, so no stream or device context is entered around it
  (on CUDA those cost tens of microseconds of host time, paid per layer by a layerwise load).
* ``fence(name) -> Completion``: a completion that finishes when everything issued on ``name`` so far has.
* ``wait_current(completion)``: make the engine's current stream wait for it (GPU-side on CUDA).

A ``Completion`` has ``done() -> bool`` (never blocks), ``wait()`` (blocks the host until done) and ``seconds()``
(device time of the fenced work once done, None if unknown). Implementations:

* :class:`CudaExecutor`: two CUDA streams, completions are CUDA events (timing events bracket each task).
* :class:`ImmediateExecutor`: CPU; ``fn`` runs at once (the kernels run synchronously in the Triton interpreter),
  every completion is already done.
* :class:`DeferredExecutor`: CPU, for tests: ``fn`` is queued per stream and runs only when the test releases it
  (or someone waits on a completion behind it), in issue order per stream, as a GPU would run it. This makes
  in-flight copies real: a block freed or reused too early shows up as wrong bytes.
* :class:`FailingExecutor`: wraps another and makes some ``run`` calls raise, before or after issuing (tests and
  fault drills: the tier must unwind every failed copy).
"""

from __future__ import annotations

import collections
import random
import time
from typing import Callable, Optional, Sequence

import torch

STREAM_NAMES = ("store", "load")


class Done:
    """A completion that is already done."""

    def __init__(self, seconds: Optional[float] = None) -> None:
        self._seconds = seconds

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def seconds(self) -> Optional[float]:
        return self._seconds


class ImmediateExecutor:
    """CPU: run every copy at once; completions are done."""

    def __init__(self) -> None:
        self._elapsed = {name: 0.0 for name in STREAM_NAMES}

    def stream(self, name: str):
        return None

    def begin(self, name: str) -> None:
        self._elapsed[name] = 0.0

    def run(self, name: str, fn: Callable[[], None], own_stream: bool = False) -> None:
        t = time.perf_counter()
        fn()
        self._elapsed[name] += time.perf_counter() - t

    def fence(self, name: str) -> Done:
        return Done(self._elapsed[name])

    def wait_current(self, completion) -> None:
        completion.wait()


class _EventCompletion:
    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.start, self.end = start, end

    def done(self) -> bool:
        return self.end.query()

    def wait(self) -> None:
        self.end.synchronize()

    def seconds(self) -> Optional[float]:
        return self.start.elapsed_time(self.end) * 1e-3


class CudaExecutor:
    """Copies on two CUDA streams (store, load) of ``device``; completions are CUDA events.

    Args:
        device: the KV pool's device.
        order_after: engine streams every copy is also ordered after, besides the caller's current stream: the
            engine's forward stream, where the KV is written and read.
    """

    def __init__(self, device: torch.device, order_after: Sequence = ()) -> None:
        self.device = device
        self._streams = {name: torch.cuda.Stream(device=device) for name in STREAM_NAMES}
        self._start: dict[str, Optional[torch.cuda.Event]] = {name: None for name in STREAM_NAMES}
        self._after = [st for st in order_after if st is not None]

    def stream(self, name: str) -> torch.cuda.Stream:
        return self._streams[name]

    def begin(self, name: str) -> None:
        s = self._streams[name]
        # A store must not read slots before the work that wrote them, a load must not overwrite slots still read.
        s.wait_stream(torch.cuda.current_stream(self.device))
        for forward in self._after:
            # The forward stream can run ahead of the scheduler's current stream (overlap scheduling; prefills
            # that skip SGLang's shared-read barrier): its writes and reads of the KV are fenced too.
            s.wait_stream(forward)
        start = torch.cuda.Event(enable_timing=True)
        start.record(s)
        self._start[name] = start

    def run(self, name: str, fn: Callable[[], None], own_stream: bool = False) -> None:
        if own_stream:
            fn()
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._streams[name]):
            fn()

    def fence(self, name: str) -> _EventCompletion:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self._streams[name])
        start = self._start[name]
        if start is None:  # fence without begin: time from here (zero)
            start = end
        self._start[name] = None
        return _EventCompletion(start, end)

    def wait_current(self, completion) -> None:
        if isinstance(completion, _EventCompletion):
            torch.cuda.current_stream(self.device).wait_event(completion.end)
        else:
            completion.wait()


class _Deferred:
    def __init__(self, executor: DeferredExecutor, name: str, position: int) -> None:
        self._ex, self._name, self._pos = executor, name, position

    def done(self) -> bool:
        return self._ex.executed[self._name] >= self._pos

    def wait(self) -> None:
        self._ex.release(self._name, self._pos - self._ex.executed[self._name])

    def seconds(self) -> Optional[float]:
        return None


class DeferredExecutor:
    """CPU, for tests: copies are queued per stream and run when released, in order (see module docstring)."""

    def __init__(self) -> None:
        self.queues: dict[str, collections.deque] = {name: collections.deque() for name in STREAM_NAMES}
        self.issued = {name: 0 for name in STREAM_NAMES}  # fns issued per stream
        self.executed = {name: 0 for name in STREAM_NAMES}  # fns run per stream

    def stream(self, name: str):
        return None

    def begin(self, name: str) -> None:
        pass

    def run(self, name: str, fn: Callable[[], None], own_stream: bool = False) -> None:
        self.queues[name].append(fn)
        self.issued[name] += 1

    def fence(self, name: str) -> _Deferred:
        return _Deferred(self, name, self.issued[name])

    def wait_current(self, completion) -> None:
        completion.wait()

    def pending(self, name: str) -> int:
        return len(self.queues[name])

    def release(self, name: str, n: int = 1) -> int:
        """Run the next ``n`` queued copies of stream ``name``; returns how many ran."""
        ran = 0
        while ran < n and self.queues[name]:
            self.queues[name].popleft()()
            self.executed[name] += 1
            ran += 1
        return ran

    def release_all(self) -> None:
        for name in STREAM_NAMES:
            self.release(name, len(self.queues[name]))


class InjectedFailure(RuntimeError):
    """A copy failure injected by :class:`FailingExecutor`."""


class FailingExecutor:
    """Wraps an executor; each ``run`` raises :class:`InjectedFailure` with probability ``rate`` (from ``seed``):
    half of them before issuing ``fn`` (a launch that never happened), half after (part of a copy is on the stream
    and still runs). Everything else is the wrapped executor's."""

    def __init__(self, inner, rate: float = 0.1, seed: int = 0) -> None:
        if not 0 <= rate <= 1:
            raise ValueError(f"rate must be in [0, 1], got {rate!r}")
        self.inner, self.rate = inner, rate
        self._rng = random.Random(seed)
        self.failures = 0

    def run(self, name: str, fn: Callable[[], None], own_stream: bool = False) -> None:
        r = self._rng.random()
        if r < self.rate / 2:
            self.failures += 1
            raise InjectedFailure(f"injected failure before issuing on the {name} stream")
        self.inner.run(name, fn, own_stream)
        if r < self.rate:
            self.failures += 1
            raise InjectedFailure(f"injected failure after issuing on the {name} stream")

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
