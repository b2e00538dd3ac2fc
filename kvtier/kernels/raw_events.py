"""CUDA events recorded and waited on through raw handles (CuPy's runtime calls), for issue paths that run per layer.

A layerwise staged load hands each layer's staging buffer between two streams with a few event records and stream
waits; torch's ``Event.record`` and ``Stream.wait_event`` cost the host several times what the runtime's own calls
through CuPy do (bench/results/transfer_notes.md, "Host time per call").
Without CuPy, callers keep torch events.
"""

from __future__ import annotations

try:
    import cupy as _cupy
except Exception:  # pragma: no cover - cupy is an optional extra
    _cupy = None

__all__ = ["RawEvent", "available", "wait_event"]


def available() -> bool:
    """Whether raw events can be made (CuPy is installed)."""
    return _cupy is not None


class RawEvent:
    """A CUDA event without timing, made on the current device; streams are raw ``cudaStream_t`` handles."""

    __slots__ = ("_event", "ptr")

    def __init__(self) -> None:
        self._event = _cupy.cuda.Event(block=False, disable_timing=True)
        self.ptr = self._event.ptr

    def record(self, stream: int) -> None:
        """Record the event at the current end of ``stream``."""
        _cupy.cuda.runtime.eventRecord(self.ptr, stream)

    def wait(self, stream: int) -> None:
        """Make ``stream``'s later work wait for the event's last record."""
        _cupy.cuda.runtime.streamWaitEvent(stream, self.ptr, 0)


def wait_event(stream, event) -> None:
    """Make the torch ``stream`` wait for ``event``: a torch event or a :class:`RawEvent`."""
    if isinstance(event, RawEvent):
        event.wait(stream.cuda_stream)
    else:
        stream.wait_event(event)
