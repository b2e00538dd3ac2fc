"""Transfer kernels: byte-exact round trips over geometries, dtypes, page sizes, layouts and modes.

Runs on CPU tensors through the Triton interpreter, and on CUDA tensors (``gpu`` marker) on a GPU machine. Every
test poisons both sides with random bytes first, then checks the whole of both sides: the chosen pages moved
exactly, and nothing else changed (source untouched, other slots and blocks untouched).
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtier.geometry import KVGeometry
from kvtier.kernels import DirectCopy, StagedTransfer, Tuning, copy_pages_ref, load_pages, store_pages
from kvtier.kernels.staged_copy import StagedCopy
from kvtier.kernels.checks import LayerSpan
from kvtier.kernels.staged import chunk_pages
from kvtier.tier.signal import cupy_stream
from tests.kv_helpers import as_bytes, make_host, make_kv, snapshot, staged_store

# CPU tensors run through the Triton interpreter, which is on only where CUDA is absent (tests/conftest.py).
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter off")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]  # uint8 stands for fp8
BUDGET_BYTES = 1 << 20  # bytes moved per example on CPU: the interpreter is slow
# direct: one store_pages/load_pages call; direct_copy: a DirectCopy checked once and launched layer by layer;
# staged: one StagedTransfer call; staged_copy: a StagedCopy planned once and launched layer by layer
MODES = ["direct", "direct_copy", "staged", "staged_copy"]
# host block ids of a case: a random pick; one run of consecutive ids (a pool's prefix: staged copies then span many
# blocks); descending ids (runs of one, in reverse); every other id (runs of one between another request's blocks)
BLOCK_PICKS = ["random", "run", "descending", "interleaved"]


@dataclasses.dataclass
class Case:
    geo: KVGeometry
    layout: str
    mode: str
    num_pages: int
    spare_blocks: int
    layers: object
    num_programs: int
    tile_bytes: int
    staging_pages: int
    num_buffers: int
    seed: int
    blocks: str = "random"  # see BLOCK_PICKS
    skip: int = 0  # the load leaves out the first `skip` tokens of the first block (a prefix held mid-block)


@st.composite
def cases(draw, budget: int = BUDGET_BYTES) -> Case:
    mla = draw(st.booleans())
    geo = KVGeometry(
        num_layers=draw(st.integers(1, 8)),
        num_kv_heads=1 if mla else draw(st.integers(1, 8)),
        head_dim=576 if mla else draw(st.sampled_from([64, 128])),
        dtype=draw(st.sampled_from(DTYPES)),
        page_size=draw(st.sampled_from([1, 2, 16, 64])),
        is_mla=mla,
    )
    max_pages = max(1, min(6, budget // geo.block_bytes))
    layer_pick = draw(st.sampled_from(["all", "one", "range"]))
    if layer_pick == "all":
        layers = None
    elif layer_pick == "one":
        layers = draw(st.integers(0, geo.num_layers - 1))
    else:
        start = draw(st.integers(0, geo.num_layers - 1))
        layers = range(start, draw(st.integers(start + 1, geo.num_layers)))
    return Case(geo=geo, layout=draw(st.sampled_from(["page_first", "layer_first"])),
                mode=draw(st.sampled_from(MODES)), num_pages=draw(st.integers(1, max_pages)),
                spare_blocks=draw(st.integers(0, 3)), layers=layers, num_programs=draw(st.integers(1, 5)),
                tile_bytes=draw(st.sampled_from([256, 4096, 65536])), staging_pages=draw(st.integers(1, 3)),
                num_buffers=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**31 - 1)),
                blocks=draw(st.sampled_from(BLOCK_PICKS)), skip=draw(st.integers(0, geo.page_size - 1)))


def _layer_range(layers, num_layers: int) -> range:
    if layers is None:
        return range(num_layers)
    return range(layers, layers + 1) if isinstance(layers, int) else layers


def run_round_trip(case: Case, device: str) -> None:
    geo, page = case.geo, case.geo.page_size
    gen = torch.Generator().manual_seed(case.seed)
    n = case.num_pages
    num_slots = 2 * n * page + page * 3 + 1  # odd count: slots need not be page aligned
    num_blocks = (2 * n if case.blocks == "interleaved" else n) + case.spare_blocks
    kv = make_kv(geo, num_slots, device, gen)
    host = make_host(geo, num_blocks, case.layout, device, gen)
    perm = torch.randperm(num_slots, generator=gen)
    src, dst = perm[:n * page], perm[n * page:2 * n * page]  # distinct, disjoint, arbitrary token slots
    first = int(torch.randint(0, case.spare_blocks + 1, (1,), generator=gen))
    if case.blocks == "run":
        blocks = torch.arange(first, first + n)
    elif case.blocks == "descending":
        blocks = torch.arange(first + n - 1, first - 1, -1)
    elif case.blocks == "interleaved":
        blocks = torch.arange(first, first + 2 * n, 2)
    else:
        blocks = torch.randperm(num_blocks, generator=gen)[:n]
    if device == "cuda":
        src, dst, blocks = src.cuda(), dst.cuda(), blocks.cuda()
    span = _layer_range(case.layers, geo.num_layers)

    if case.mode == "direct":
        kw = dict(layout=case.layout, layers=case.layers, num_programs=case.num_programs,
                  tuning=Tuning(tile_bytes=case.tile_bytes))
        store = lambda s, b: store_pages(kv, host, s, b, **kw)  # noqa: E731
        load = lambda s, b: load_pages(kv, host, s, b, skip_tokens=case.skip, **kw)  # noqa: E731
    elif case.mode == "direct_copy":  # checked and packed once, launched per layer of the span in shuffled order
        order = list(span)
        random.Random(case.seed).shuffle(order)

        def per_layer(to_host: bool):
            def run(s, b):
                copy = DirectCopy(kv, host, s, b, to_host=to_host, layout=case.layout,
                                  num_programs=case.num_programs, tuning=Tuning(tile_bytes=case.tile_bytes),
                                  skip_tokens=0 if to_host else case.skip)
                for layer in order:
                    copy.launch(layer)
            return run
        store, load = per_layer(True), per_layer(False)
    else:
        tuning = Tuning(num_buffers=case.num_buffers, staging_bytes=case.staging_pages * geo.page_bytes * len(span),
                        gather_programs=case.num_programs, scatter_programs=case.num_programs)
        stager = StagedTransfer(kv, host, layout=case.layout, tuning=tuning)
        if case.mode == "staged":
            store = lambda s, b: stager.store(s, b, layers=case.layers)  # noqa: E731
            load = lambda s, b: stager.load(s, b, layers=case.layers, skip_tokens=case.skip)  # noqa: E731
        else:  # planned once, launched per layer of the span in shuffled order, the plan reused for each layer
            order = list(span)
            random.Random(case.seed).shuffle(order)

            def staged_per_layer(to_host: bool):
                def run(s, b):
                    copy = StagedCopy(stager, s, b, to_host=to_host, skip_tokens=0 if to_host else case.skip)
                    for layer in order:
                        copy.launch(layer)
                return run
            store, load = staged_per_layer(True), staged_per_layer(False)

    # store: the chosen pages of the chosen layers land in the chosen blocks; nothing else changes
    dev_before = snapshot(kv)
    expect = host.clone()
    copy_pages_ref(kv, expect, src, blocks, to_host=True, layout=case.layout, layers=case.layers)
    store(src, blocks)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(as_bytes(host), as_bytes(expect)), "host blocks differ from the reference after store"
    assert all(torch.equal(a, as_bytes(b)) for a, b in zip(dev_before, kv.buffers)), "store changed device KV"

    # load into other slots: those rows of the chosen layers equal the source rows; nothing else changes
    host_before = as_bytes(host).clone()
    dst, src = dst[case.skip:], src[case.skip:]  # the first block's first `skip` tokens stay where they are
    load(dst, blocks)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(as_bytes(host), host_before), "load changed the host blocks"
    for layer in range(geo.num_layers):
        for k, buf in enumerate(kv.layer_buffers(layer)):
            before = dev_before[layer * geo.kv_count + k].view(num_slots, -1)
            want = before.clone()
            if layer in span:
                want[dst.cpu()] = before[src.cpu()]
            assert torch.equal(as_bytes(buf).view(num_slots, -1), want), f"layer {layer} buffer {k} wrong"


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
# found by CI: staged page_first whole blocks, a chunk whose second run (blocks 0, 1) follows block 2; the copy's
# staging offset was the run start times the run's width, not a block's
@example(case=Case(geo=KVGeometry(1, 1, 64, torch.uint8, page_size=16), layout="page_first", mode="staged",
                   num_pages=3, spare_blocks=0, layers=None, num_programs=1, tile_bytes=256, staging_pages=3,
                   num_buffers=1, seed=35))
def test_round_trip_is_byte_exact(device: str, case: Case) -> None:
    run_round_trip(case, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("geo", [
    KVGeometry(3, 8, 128, torch.bfloat16, page_size=16),  # Qwen3-8B-like, 2 KiB rows
    KVGeometry(2, 1, 576, torch.uint8, page_size=2, is_mla=True),  # MLA fp8: 576 B rows, 9 chunks of 64 B
    KVGeometry(2, 3, 64, torch.float16, page_size=1),  # 384 B rows: chunks of 128 B
    KVGeometry(2, 1, 36, torch.uint8, page_size=3),  # 36 B rows: 4-byte words, non power-of-two page
], ids=["qwen3", "mla_fp8", "odd_heads", "narrow_rows"])
@pytest.mark.parametrize("blocks", BLOCK_PICKS)
def test_round_trip_fixed_shapes(device: str, layout: str, mode: str, geo: KVGeometry, blocks: str) -> None:
    """Shapes that straddle chunk boundaries or force narrow words, every layout and mode, every pick of host
    blocks (one run: staged ``layer_first`` then stages groups of layers; the fragmented picks: a batched copy
    per chunk where the driver has it)."""
    case = Case(geo=geo, layout=layout, mode=mode, num_pages=3, spare_blocks=2, layers=None, num_programs=3,
                tile_bytes=4096, staging_pages=2, num_buffers=2, seed=7, blocks=blocks)
    run_round_trip(case, device)


@pytest.mark.gpu
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("stream_kind", ["torch", "cupy"])
def test_transfers_run_on_the_given_stream(stream_kind: str, check: bool) -> None:
    """A launch on a side stream is ordered on that stream: its event completes after the bytes are in place.
    Unchecked calls with device indices take the context-free path (raw stream handle), checked ones the other."""
    geo = KVGeometry(4, 8, 128, torch.bfloat16, page_size=16)
    gen = torch.Generator().manual_seed(3)
    kv = make_kv(geo, 4096, "cuda", gen)
    host = make_host(geo, 64, "layer_first", "cuda", gen)
    side = torch.cuda.Stream()
    stream = side
    if stream_kind == "cupy":
        cupy = pytest.importorskip("cupy")
        stream = cupy_stream(cupy, side.cuda_stream)
    src = torch.randperm(4096, device="cuda")[:32 * 16]
    blocks = torch.randperm(64)[:32]
    if not check:
        blocks = blocks.cuda()  # with the slots on the device too: nothing to copy, the context-free path
    expect = host.clone()
    copy_pages_ref(kv, expect, src, blocks, to_host=True, layout="layer_first")
    torch.cuda.synchronize()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(2e7))  # ~10 ms: the copy cannot have run when the call returns
    store_pages(kv, host, src, blocks, layout="layer_first", stream=stream, check=check)
    done = torch.cuda.Event()
    done.record(side)
    assert not done.query(), "the store did not queue behind the side stream's work"
    done.synchronize()
    assert torch.equal(as_bytes(host), as_bytes(expect))


@given(num_pages=st.integers(0, 200), per_chunk=st.integers(1, 40), to_host=st.booleans(),
       short_edge=st.booleans())
def test_chunk_plan_covers_every_page_once(num_pages: int, per_chunk: int, to_host: bool, short_edge: bool) -> None:
    """Staging chunks cover the pages in order with no gap or overlap, none larger than a staging buffer; the
    short chunk sits where the pipeline is exposed (first for stores, last for multi-chunk loads), and without
    ``short_edge`` every chunk but the last is full."""
    plan = chunk_pages(num_pages, per_chunk, to_host, short_edge=short_edge)
    assert sum(plan) == num_pages
    assert all(1 <= n <= per_chunk for n in plan)
    if not short_edge:
        assert all(n == per_chunk for n in plan[:-1])
        return
    edge = max(1, per_chunk // Tuning().edge_chunk_divisor)
    if len(plan) > 1:
        assert plan[0 if to_host else -1] == edge
    if not to_host and num_pages <= per_chunk:
        assert len(plan) <= 1, "a load that fits one staging buffer is not split"


@given(num_layers=st.integers(1, 12), start=st.integers(0, 11), count=st.integers(1, 12),
       run_lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8), staging_pages=st.integers(1, 30))
def test_layer_first_groups_cover_the_span_with_the_widest_rows(num_layers: int, start: int, count: int,
                                                                 run_lengths: list, staging_pages: int) -> None:
    """``layer_first`` spans are staged in consecutive groups of layers that cover the span once, each the most
    layers whose pages all fit one staging buffer (one layer when even that does not fit), and only when the runs
    of blocks are longer on average than a chunk of the whole span holds (else the whole span at once)."""
    start = min(start, num_layers - 1)
    span = LayerSpan(start, min(count, num_layers - start))
    geo = KVGeometry(num_layers, 1, 8, torch.float16, page_size=2)
    kv = make_kv(geo, 4, "cpu", torch.Generator().manual_seed(0))
    st_ = StagedTransfer(kv, torch.zeros(geo.host_shape(1, "layer_first"), dtype=geo.dtype), layout="layer_first",
                         tuning=Tuning(staging_bytes=staging_pages * geo.page_bytes))
    # runs of consecutive ids separated by gaps of one id
    host_ids = np.concatenate([np.arange(n) + 100 * i for i, n in enumerate(run_lengths)])
    groups = st_.layer_groups(span, host_ids, to_host=False)
    assert [g.start for g in groups] == list(itertools.accumulate([span.start] + [g.count for g in groups[:-1]]))
    assert sum(g.count for g in groups) == span.count
    num_pages = host_ids.size
    fit = st_.staging_bytes // (num_pages * geo.page_bytes)  # layers whose pages fit one buffer
    whole_span_chunk = st_.staging_bytes // (span.count * geo.page_bytes)  # pages of a whole-span chunk
    if fit >= span.count or num_pages <= len(run_lengths) * whole_span_chunk:
        assert groups == [span]
    else:
        assert all(g.count == max(1, fit) for g in groups[:-1]) and groups[-1].count <= max(1, fit)


@pytest.mark.parametrize("device", DEVICES)
def test_staged_copy_spans_in_layer_groups_land_on_their_layers(device: str) -> None:
    """A StagedCopy launched for spans that stage in groups of layers (``layer_first``, one long run, a staging
    buffer of two layers' pages), one span after another of the same width from different first layers (the
    groups are planned once per width, then moved), stores and loads every layer byte-exact: layers 0-2 then 1-3
    to the host, 1-3 then 0-2 back to other slots."""
    geo = KVGeometry(4, 1, 16, torch.float16, page_size=2)
    gen = torch.Generator().manual_seed(3)
    kv = make_kv(geo, 64, device, gen)
    host = make_host(geo, 16, "layer_first", device, gen)
    stager = StagedTransfer(kv, host, layout="layer_first", tuning=Tuning(staging_bytes=2 * 8 * geo.page_bytes))
    blocks = torch.arange(3, 11)  # one run of 8 blocks
    perm = torch.randperm(64, generator=gen).to(device)
    src, dst = perm[:16], perm[16:32]
    assert len(stager.layer_groups(LayerSpan(1, 3), blocks.numpy(), to_host=True)) == 2
    expect = host.clone()
    copy_pages_ref(kv, expect, src, blocks, to_host=True, layout="layer_first")
    store = StagedCopy(stager, src, blocks, to_host=True)
    store.launch(range(0, 3))
    store.launch(range(1, 4))
    load = StagedCopy(stager, dst, blocks, to_host=False)
    load.launch(range(1, 4))
    load.launch(range(0, 3))
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(as_bytes(host), as_bytes(expect))
    for layer in range(geo.num_layers):
        for buf in kv.layer_buffers(layer):
            rows = as_bytes(buf).view(64, -1)
            assert torch.equal(rows[dst.cpu()], rows[src.cpu()]), f"layer {layer} differs"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layerwise", [False, True], ids=["all_layers", "per_layer"])
def test_fragmented_staged_copies_go_in_one_driver_batch_per_chunk(monkeypatch, layout: str, layerwise: bool):
    """On CUDA 12.8+ drivers a staged chunk of several runs is batched driver calls (the real ones, counted): a
    ``cuMemcpy3DBatchAsync`` of a pitched copy per run of several rows, a ``cuMemcpyBatchAsync`` of the one-row
    runs; the chunks of a one-run transfer neither; both round trips byte-exact."""
    from kvtier.kernels import batch_copy
    assert batch_copy.available(), "the GPU machine's driver has no cuMemcpyBatchAsync"
    assert batch_copy.rects_available(), "the GPU machine's driver has no cuMemcpy3DBatchAsync"
    calls = []
    real_rows, real_rects = batch_copy.memcpy_batch, batch_copy.memcpy_rects
    monkeypatch.setattr(batch_copy, "memcpy_batch", lambda *a: (calls.append(("rows", a[2].size)), real_rows(*a))[1])
    monkeypatch.setattr(batch_copy, "memcpy_rects",
                        lambda *a: (calls.append(("rects", a[4].size)), real_rects(*a))[1])
    geo = KVGeometry(4, 8, 128, torch.bfloat16, page_size=16)
    gen = torch.Generator().manual_seed(5)
    kv = make_kv(geo, 4096, "cuda", gen)
    host = make_host(geo, 160, layout, "cuda", gen)
    stager = StagedTransfer(kv, host, layout=layout, tuning=Tuning(pitched_min_rows=2))  # 4 layers
    n = 40
    for blocks, batched in ((torch.arange(2 * n, 0, -2), True), (torch.arange(7, 7 + n), False)):
        calls.clear()
        perm = torch.randperm(4096, device="cuda")
        src, dst = perm[:n * 16], perm[n * 16:2 * n * 16]
        expect = host.clone()
        copy_pages_ref(kv, expect, src, blocks, to_host=True, layout=layout)
        if layerwise:
            for to_host, slots in ((True, src), (False, dst)):
                copy = StagedCopy(stager, slots, blocks, to_host=to_host)
                for layer in reversed(range(geo.num_layers)):
                    copy.launch(layer)
                torch.cuda.synchronize()
                if to_host:
                    assert torch.equal(as_bytes(host), as_bytes(expect))
        else:
            stager.store(src, blocks)
            torch.cuda.synchronize()
            assert torch.equal(as_bytes(host), as_bytes(expect))
            stager.load(dst, blocks)
            torch.cuda.synchronize()
        for layer in range(geo.num_layers):
            for buf in kv.layer_buffers(layer):
                rows = as_bytes(buf).view(4096, -1)
                assert torch.equal(rows[dst.cpu()], rows[src.cpu()]), f"layer {layer} differs"
        assert bool(calls) == batched, calls
        # layer_first runs of all layers are rectangles when loaded, rows when stored (a 64 KiB page of a layer is
        # as wide as Tuning.store_rows_min_bytes), runs of one layer rows; page_first runs of one block are rows
        if batched:
            rects = layout == "layer_first" and not layerwise
            assert {kind for kind, _ in calls} == ({"rects", "rows"} if rects else {"rows"}), calls


@pytest.mark.gpu
@pytest.mark.parametrize("layerwise", [False, True], ids=["all_layers", "per_layer"])
def test_fragmented_stores_cut_short_runs_into_shuffled_pages(monkeypatch, layerwise: bool):
    """A ``layer_first`` store of runs of 1 to 6 pages and one long run (64 KiB pages of a layer; one chunk), of all
    layers at once or a layer at a time, issues its runs of 2 pages as one row per page
    (``Tuning.store_split_max_bytes``: 128 KiB) and seldom a page right after its neighbour, the other runs whole;
    the blocks it writes are byte-exact."""
    from kvtier.kernels import batch_copy
    assert batch_copy.available(), "the GPU machine's driver has no cuMemcpyBatchAsync"
    issued = []
    real = batch_copy.memcpy_batch
    monkeypatch.setattr(batch_copy, "memcpy_batch", lambda *a: (issued.append((a[0].copy(), a[2].copy())), real(*a))[1])
    geo = KVGeometry(4, 8, 128, torch.bfloat16, page_size=16)
    page = geo.page_bytes
    assert page == 64 << 10
    gen = torch.Generator().manual_seed(9)
    kv = make_kv(geo, 4096, "cuda", gen)
    host = make_host(geo, 200, "layer_first", "cuda", gen)
    stager = StagedTransfer(kv, host, layout="layer_first", tuning=Tuning(edge_chunk_divisor=1))  # one chunk
    lengths = [1, 2, 3, 4, 5, 6, 40, 2, 1]
    starts = np.cumsum([0] + [n + 1 for n in lengths[:-1]])  # a free block between runs
    blocks = torch.from_numpy(np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lengths)]))
    src = torch.randperm(4096, device="cuda")[:blocks.numel() * 16]
    expect = staged_store(stager, src, blocks, layerwise=layerwise)
    assert torch.equal(as_bytes(host), as_bytes(expect))
    widths = np.concatenate([w for _, w in issued]) // page
    pairs = lengths.count(2) * geo.num_layers  # runs cut in two
    whole = [n for n in lengths if n != 2] * geo.num_layers
    assert sorted(widths.tolist()) == sorted([1] * 2 * pairs + whole)
    neighbours = 0  # a page row right after the page row below it (each cut run's, issued in host order)
    for dsts, sizes in issued:
        d, w = dsts.astype(np.int64), sizes.astype(np.int64)
        neighbours += int(((d[1:] == d[:-1] + page) & (w[1:] == page) & (w[:-1] == page)).sum())
    assert neighbours < pairs // 2, neighbours


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_one_chunk_layerwise_loads_beside_whole_loads_are_exact(layout: str):
    """A layerwise load of one run whose layer fits a staging buffer issues through raw handles (StagedCopy's
    one-chunk path, a few event calls a layer); launched layer by layer out of order, skipping the first tokens,
    each launch followed by a whole staged load of scattered blocks through the same staging buffers (torch events),
    every layer of both lands byte-exact."""
    pytest.importorskip("cupy")  # the path's runtime calls
    geo = KVGeometry(4, 8, 128, torch.bfloat16, page_size=16)
    gen = torch.Generator().manual_seed(9)
    kv = make_kv(geo, 4096, "cuda", gen)
    host = make_host(geo, 160, layout, "cuda", gen)
    stager = StagedTransfer(kv, host, layout=layout, tuning=Tuning(staging_bytes=40 * geo.page_bytes))
    run, scattered = torch.arange(20, 60), torch.arange(150, 70, -2)  # one run of 40 blocks; 40 runs of one
    perm = torch.randperm(4096, device="cuda")
    skip = 5
    src, dst = perm[:40 * 16], perm[40 * 16:80 * 16 - skip]
    src2, dst2 = perm[2560:3200], perm[3200:3840]
    stager.store(src, run)
    stager.store(src2, scattered)
    torch.cuda.synchronize()
    load = StagedCopy(stager, dst, run, to_host=False, skip_tokens=skip)
    assert load._plan_one_chunk(1) is not None and load._plan_one_chunk(geo.num_layers) is None
    for layer in (2, 0, 3, 1):
        load.launch(layer)
        stager.load(dst2, scattered)
    torch.cuda.synchronize()
    for layer in range(geo.num_layers):
        for buf in kv.layer_buffers(layer):
            rows = as_bytes(buf).view(4096, -1)
            assert torch.equal(rows[dst.cpu()], rows[src[skip:].cpu()]), f"layer {layer} differs"
            assert torch.equal(rows[dst2.cpu()], rows[src2.cpu()]), f"layer {layer} differs (whole loads)"
