"""LayerDoneCounter: tell the forward pass, GPU-side, that a layer of a layerwise load has landed.

Protocol (the object an engine registers on its KV pool; SGLang's ``register_layer_transfer_counter`` reads
``wait_until``, ``consumer_index`` and ``num_layers``):

* Producer (the tier, on its load stream): ``slot = update_producer(stream)`` picks the next of ``num_slots``
  rotating slots (>= 3, so the next load can be issued before the current one is consumed); then, after issuing
  layer ``i``'s copy, ``complete(i, slot=slot, stream=stream)`` records that slot's event ``i`` on the load stream.
  Before a slot is reused, the load stream waits (on the GPU, never the host) on the slot's previous last-layer
  event: SGLang asserts on the host that the event has finished instead, which fails when loads run 3 batches ahead.
* Consumer (the forward pass): ``set_consumer(slot)`` (-1: nothing to wait for), then ``wait_until(i)`` before
  reading layer ``i`` makes the *current* stream wait on event ``i``: the host returns at once (a few us). The
  wait for the last layer consumes the slot: the consumer goes back to -1, so the next batch's forward (which may
  have loaded nothing) waits on nothing. Several loads of one batch on one load stream need only the last one's
  slot as consumer: its layer ``i`` event is recorded after every earlier load's copies, in stream order.
  ``wait_until`` raises if layer ``i`` of the consumer slot was never recorded (waiting on an unrecorded CUDA event
  is a silent no-op, which would read stale KV).
* Contract: the consumer issues its waits for a slot before the producer comes back around to it (``num_slots - 1``
  loads later); waits issued earlier keep the event state they captured, so later re-recording is harmless.

Backends (``backend=``): ``"cupy"`` (CuPy events recorded and waited through CuPy streams on the raw handles of
torch streams; the DESIGN choice, the cheapest wait for the host), ``"torch"``
(``torch.cuda.Event``, same semantics, no CuPy needed) and ``"host"`` (no CUDA: events are flags set by
``complete``; the CPU tests use it, where every copy is synchronous). ``"auto"`` picks cupy, else torch, else host.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvtier._checks import check_count

# Load slots: one in flight, one being consumed, one being issued (docs/DESIGN.md, "Tuned constants").
DEFAULT_SLOTS = 3


class _HostEvents:
    """Events as flags: complete() runs after the copy on CPU, so a recorded event is a finished one."""

    name = "host"

    def new_event(self):
        return [False]

    def record(self, ev, stream) -> None:
        ev[0] = True

    def wait_current(self, ev) -> None:
        if not ev[0]:  # pragma: no cover - guarded by the recorded-layer check
            raise RuntimeError("host layer event waited before it completed")

    def stream_wait(self, stream, ev) -> None:
        pass

    def query(self, ev) -> bool:
        return ev[0]

    def clear(self, ev) -> None:
        ev[0] = False


class _TorchEvents:
    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_event(self):
        return torch.cuda.Event()

    def record(self, ev, stream) -> None:
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))

    def wait_current(self, ev) -> None:
        torch.cuda.current_stream(self.device).wait_event(ev)

    def stream_wait(self, stream, ev) -> None:
        (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(ev)

    def query(self, ev) -> bool:
        return ev.query()

    def clear(self, ev) -> None:
        pass


class _StreamHandle:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol, which ``cupy.cuda.Stream.from_external`` takes."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def cupy_stream(cupy, ptr: int):
    """A CuPy stream on the raw handle ``ptr``: ``Stream.from_external`` (CuPy >= 14, where ``ExternalStream`` is
    deprecated), else ``ExternalStream``."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(ptr)
    return from_external(_StreamHandle(ptr))


class _CupyEvents:
    """CuPy events on torch streams: a CuPy stream wraps a raw ``cudaStream_t`` (cached per handle)."""

    name = "cupy"

    def __init__(self, device: torch.device, cupy) -> None:
        self.device, self.cupy = device, cupy
        self._streams: dict[int, object] = {}

    def _ext(self, stream):
        ptr = int(stream.cuda_stream if stream is not None else torch.cuda.current_stream(self.device).cuda_stream)
        ext = self._streams.get(ptr)
        if ext is None:
            ext = self._streams[ptr] = cupy_stream(self.cupy, ptr)
        return ext

    def new_event(self):
        return self.cupy.cuda.Event(block=False, disable_timing=True)

    def record(self, ev, stream) -> None:
        ev.record(self._ext(stream))

    def wait_current(self, ev) -> None:
        self._ext(None).wait_event(ev)

    def stream_wait(self, stream, ev) -> None:
        self._ext(stream).wait_event(ev)

    def query(self, ev) -> bool:
        return ev.done

    def clear(self, ev) -> None:
        pass


def _import_cupy():
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:
        return None


def pick_backend(device: Optional[torch.device | str] = None, backend: str = "auto"):
    """The event backend for ``device``: see the module docstring."""
    if backend not in ("auto", "cupy", "torch", "host"):
        raise ValueError(f"backend must be one of 'auto', 'cupy', 'torch', 'host', got {backend!r}")
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if backend == "host" or (backend == "auto" and dev.type != "cuda"):
        return _HostEvents()
    if dev.type != "cuda":
        raise ValueError(f"the {backend!r} layer-event backend needs a CUDA device, got {dev}")
    if backend in ("auto", "cupy"):
        cupy = _import_cupy()
        if cupy is not None:
            return _CupyEvents(dev, cupy)
        if backend == "cupy":
            raise ImportError("the 'cupy' layer-event backend needs CuPy: pip install 'kvtier[cuda13]' "
                              "(or kvtier[cuda12])")
    return _TorchEvents(dev)


class LayerDoneCounter:
    """Per-layer load events in ``num_slots`` rotating slots; see the module docstring for the protocol.

    Args:
        num_layers: layers per load (the KV pool's layers on this rank / PP stage).
        num_slots: rotating slots, >= 3.
        device: CUDA device of the streams (default: current; CPU selects the host backend).
        backend: ``"auto"``, ``"cupy"``, ``"torch"`` or ``"host"``.
    """

    def __init__(self, num_layers: int, num_slots: int = DEFAULT_SLOTS, device=None, backend: str = "auto") -> None:
        self.num_layers = check_count("num_layers", num_layers)
        self.num_slots = check_count("num_slots", num_slots, 3,
                                     why="a load in flight, one being consumed, one being issued")
        self._ev = pick_backend(device, backend)
        self.events = [[self._ev.new_event() for _ in range(num_layers)] for _ in range(num_slots)]
        self._recorded = [0] * num_slots  # slot -> layers recorded by its current producer (host-side count)
        self.producer_index = -1
        self.consumer_index = -1

    @property
    def backend(self) -> str:
        return self._ev.name

    @property
    def num_counters(self) -> int:  # SGLang's name
        return self.num_slots

    # --- producer ---

    def update_producer(self, stream=None) -> int:
        """Advance to the next slot and return it; ``stream`` (the load stream) waits GPU-side for the slot's
        previous use to finish."""
        slot = (self.producer_index + 1) % self.num_slots
        if self._recorded[slot]:  # its previous load recorded events: wait for the last one
            self._ev.stream_wait(stream, self.events[slot][self._recorded[slot] - 1])
        for ev in self.events[slot]:
            self._ev.clear(ev)
        self._recorded[slot] = 0
        self.producer_index = slot
        return slot

    start = update_producer

    def rewind(self, index: int) -> None:
        """Make ``index`` (the producer before the last :meth:`update_producer`) the producer again: the load that
        took the next slot failed to issue, so the next load takes that slot again rather than moving on to one the
        forward pass may still wait on."""
        if not -1 <= index < self.num_slots:
            raise ValueError(f"producer index {index} out of range [-1, {self.num_slots})")
        self.producer_index = index

    def complete(self, layer: int, *, slot: Optional[int] = None, stream=None) -> None:
        """Record layer ``layer``'s event of ``slot`` (default: the producer slot) on ``stream`` (default: current).

        Layers must be completed in order 0, 1, ... (a layer's event then also implies all earlier layers).
        """
        slot = self.producer_index if slot is None else slot
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots}) (call update_producer first)")
        if layer != self._recorded[slot]:
            raise ValueError(f"layer {layer} completed out of order: slot {slot} expects layer "
                             f"{self._recorded[slot]} next")
        self._ev.record(self.events[slot][layer], stream)
        self._recorded[slot] = layer + 1

    # --- consumer ---

    def set_consumer(self, index: int) -> None:
        """Set the slot the forward pass waits on; -1: nothing to wait for."""
        if not -1 <= index < self.num_slots:
            raise ValueError(f"consumer index {index} out of range [-1, {self.num_slots})")
        self.consumer_index = index

    def wait_until(self, layer: int) -> None:
        """Make the current stream wait until layer ``layer`` of the consumer slot has landed (no host block)."""
        slot = self.consumer_index
        if slot < 0:
            return
        if not 0 <= layer < self._recorded[slot]:
            raise RuntimeError(f"layer {layer} of load slot {slot} was never issued ({self._recorded[slot]} of "
                               f"{self.num_layers} layers recorded): waiting would read stale KV")
        self._ev.wait_current(self.events[slot][layer])
        if layer == self.num_layers - 1:  # this forward has queued all its waits: the slot is consumed
            self.consumer_index = -1

    def is_done(self, slot: Optional[int] = None) -> bool:
        """True when every layer of ``slot`` (default: the producer slot) has landed."""
        slot = self.producer_index if slot is None else slot
        if slot < 0:
            return True
        return self._recorded[slot] == self.num_layers and self._ev.query(self.events[slot][self.num_layers - 1])

    def reset(self) -> None:
        """Forget all slots (the caller guarantees no load is in flight)."""
        for slot in range(self.num_slots):
            for ev in self.events[slot]:
                self._ev.clear(ev)
        self._recorded = [0] * self.num_slots
        self.producer_index = self.consumer_index = -1
