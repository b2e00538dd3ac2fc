"""LayerDoneCounter: slot rotation, the consumer side SGLang calls, guards, and (GPU) no stale reads, no host block."""

from __future__ import annotations

import statistics
import time
import types

import pytest
import torch

from kvtier.tier.signal import LayerDoneCounter, cupy_stream, pick_backend

CUDA = torch.cuda.is_available()


def test_cpu_picks_the_host_backend():
    c = LayerDoneCounter(4, device="cpu")
    assert c.backend == "host" and (c.num_layers, c.num_slots, c.num_counters) == (4, 3, 3)
    assert (c.producer_index, c.consumer_index) == (-1, -1)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        pick_backend("cpu", "cupy")
    with pytest.raises(ValueError, match="backend must be one of"):
        pick_backend("cpu", "opencl")


def test_argument_checks():
    with pytest.raises(ValueError, match="num_slots must be an int >= 3"):
        LayerDoneCounter(4, num_slots=2, device="cpu")
    with pytest.raises(ValueError, match="num_layers must be an int >= 1"):
        LayerDoneCounter(0, device="cpu")
    c = LayerDoneCounter(2, device="cpu")
    with pytest.raises(ValueError, match="call update_producer first"):
        c.complete(0)
    with pytest.raises(ValueError, match="consumer index 3 out of range"):
        c.set_consumer(3)


def test_cupy_stream_uses_the_stream_protocol_where_cupy_has_it():
    """CuPy >= 14 gets the raw handle through ``__cuda_stream__`` (``ExternalStream`` is deprecated there); older
    CuPy gets ``ExternalStream``. Stand-ins for the two CuPy versions record what they were handed."""
    seen = []
    new_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Stream=types.SimpleNamespace(from_external=lambda obj: seen.append(("from_external", obj.__cuda_stream__()))),
        ExternalStream=lambda ptr: seen.append(("ExternalStream", ptr))))
    old_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Stream=types.SimpleNamespace(), ExternalStream=lambda ptr: seen.append(("ExternalStream", ptr))))
    cupy_stream(new_cupy, 0x1234)
    cupy_stream(old_cupy, 0x5678)
    assert seen == [("from_external", (0, 0x1234)), ("ExternalStream", 0x5678)]


def test_slots_rotate():
    c = LayerDoneCounter(2, num_slots=4, device="cpu")
    assert [c.update_producer() for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    assert c.start() == 2  # alias


def test_consumer_minus_one_never_waits():
    c = LayerDoneCounter(3, device="cpu")
    c.set_consumer(-1)
    for layer in range(3):
        c.wait_until(layer)  # nothing loaded, nothing to wait for


def test_wait_until_refuses_layers_never_issued():
    c = LayerDoneCounter(3, device="cpu")
    slot = c.update_producer()
    c.set_consumer(slot)
    with pytest.raises(RuntimeError, match="layer 0 of load slot 0 was never issued"):
        c.wait_until(0)
    c.complete(0)
    c.wait_until(0)
    with pytest.raises(RuntimeError, match="layer 1 of load slot 0 was never issued \\(1 of 3"):
        c.wait_until(1)
    assert not c.is_done(slot)
    c.complete(1)
    c.complete(2)
    assert c.is_done(slot) and c.is_done()
    for layer in range(3):
        c.wait_until(layer)


def test_the_last_layers_wait_consumes_the_slot():
    """A forward that waited on every layer has consumed its load: the next batch's forward waits on nothing."""
    c = LayerDoneCounter(3, device="cpu")
    slot = c.update_producer()
    for layer in range(3):
        c.complete(layer)
    c.set_consumer(slot)
    for layer in range(3):
        assert c.consumer_index == slot
        c.wait_until(layer)
        c.wait_until(layer)  # K then V of one layer: both wait
    assert c.consumer_index == -1


def test_layers_complete_in_order_and_a_reused_slot_starts_over():
    c = LayerDoneCounter(2, device="cpu")
    s0 = c.update_producer()
    with pytest.raises(ValueError, match="layer 1 completed out of order: slot 0 expects layer 0"):
        c.complete(1)
    c.complete(0)
    c.complete(1)
    c.update_producer()
    c.update_producer()
    assert c.update_producer() == s0  # back around: the slot's old layers no longer count
    c.set_consumer(s0)
    with pytest.raises(RuntimeError, match="never issued"):
        c.wait_until(0)
    c.reset()
    assert (c.producer_index, c.consumer_index) == (-1, -1) and c.is_done()


# --- GPU: the same protocol on CUDA streams ---

BACKENDS = [pytest.param("torch", marks=pytest.mark.gpu), pytest.param("cupy", marks=pytest.mark.gpu)]


def _spin_cycles(ms: float) -> int:
    props = torch.cuda.get_device_properties(0)
    return int(ms * 1e-3 * getattr(props, "clock_rate", 1_980_000) * 1e3)


def _produce(counter, stream, bufs, spin):
    """On ``stream``: per layer, spin (a slow copy) then write the layer's value, then record its event."""
    slot = counter.update_producer(stream)
    with torch.cuda.stream(stream):
        for layer, b in enumerate(bufs):
            torch.cuda._sleep(spin)
            b.fill_(layer + 1)
            counter.complete(layer, slot=slot, stream=stream)
    return slot


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wait", [True, False])
def test_gpu_wait_until_orders_reads_and_never_blocks_the_host(backend, wait):
    if backend == "cupy":
        pytest.importorskip("cupy")
    layers = 12
    counter = LayerDoneCounter(layers, device="cuda", backend=backend)
    assert counter.backend == backend
    load = torch.cuda.Stream()
    bufs = [torch.zeros(1 << 16, device="cuda") for _ in range(layers)]
    seen = torch.zeros(layers, device="cuda")
    spin = _spin_cycles(2.0)  # each layer lands >= 2 ms after the previous one
    for _ in range(2):  # warm-up, then the measured run
        for b in bufs:
            b.zero_()
        torch.cuda.synchronize()
        slot = _produce(counter, load, bufs, spin)
        counter.set_consumer(slot if wait else -1)
        host = []
        t0 = time.perf_counter()
        for layer, b in enumerate(bufs):
            t = time.perf_counter()
            counter.wait_until(layer)
            host.append(time.perf_counter() - t)
            seen[layer] = b[-1]  # the forward reads the layer right after wait_until
        issue_s = time.perf_counter() - t0
        still_loading = not load.query()
        torch.cuda.synchronize()
    values = seen.cpu().tolist()
    assert still_loading and issue_s < 0.5 * layers * 2e-3  # the host never waited for the load
    if wait:
        assert values == [float(i + 1) for i in range(layers)]
        assert statistics.median(host) < 50e-6 and max(host) < 2e-3  # microseconds, not the 2 ms per layer
    else:  # negative control: without the wait the forward reads stale (zero) KV
        assert values.count(0.0) >= layers - 1
