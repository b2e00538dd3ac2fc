"""Bad input raises a clear error before any launch, and nothing is written."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvtier.geometry import KVGeometry
from kvtier.kernels import DirectCopy, PagedKV, StagedTransfer, Tuning, load_pages, store_pages
from tests.kv_helpers import as_bytes, make_host, make_kv, snapshot

# CPU tensors run through the Triton interpreter, which is on only where CUDA is absent (tests/conftest.py).
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter off")),
           pytest.param("cuda", marks=pytest.mark.gpu)]
GEO = KVGeometry(2, 2, 64, torch.bfloat16, page_size=4)
NUM_SLOTS, NUM_BLOCKS = 40, 6


@pytest.fixture(params=DEVICES)
def setup(request):
    device = request.param
    gen = torch.Generator().manual_seed(1)
    kv = make_kv(GEO, NUM_SLOTS, device, gen)
    host = make_host(GEO, NUM_BLOCKS, "page_first", device, gen)
    return kv, host, device


def _direct_copy(kv, host, *, to_host: bool):
    def op(s, b, **kw):
        layers = kw.pop("layers", None)
        DirectCopy(kv, kw.pop("host", host), s, b, to_host=to_host, **kw).launch(layers, stream=kw.get("stream"))
    return op


def _ops(kv, host):
    stager = StagedTransfer(kv, host)
    return [
        ("store_pages", lambda s, b, **kw: store_pages(kv, kw.pop("host", host), s, b, **kw)),
        ("load_pages", lambda s, b, **kw: load_pages(kv, kw.pop("host", host), s, b, **kw)),
        ("DirectCopy store", _direct_copy(kv, host, to_host=True)),
        ("DirectCopy load", _direct_copy(kv, host, to_host=False)),
        ("staged.store", lambda s, b, **kw: stager.store(s, b, **kw)),
        ("staged.load", lambda s, b, **kw: stager.load(s, b, **kw)),
    ]


SLOTS = torch.arange(8)  # two pages
BLOCKS = torch.tensor([1, 4])

BAD_INDICES = [
    ("slot out of range", torch.tensor([0, 1, 2, NUM_SLOTS, 4, 5, 6, 7]), BLOCKS, IndexError, "out of range"),
    ("negative slot", torch.tensor([0, 1, 2, -1, 4, 5, 6, 7]), BLOCKS, IndexError, "out of range"),
    ("block out of range", SLOTS, torch.tensor([1, NUM_BLOCKS]), IndexError, "out of range"),
    ("lengths differ", SLOTS[:7], BLOCKS, ValueError, "page_size"),
    ("int32 slots", SLOTS.to(torch.int32), BLOCKS, TypeError, "int64"),
    ("float blocks", SLOTS, BLOCKS.to(torch.float32), TypeError, "int64"),
    ("2-D slots", SLOTS.view(2, 4), BLOCKS, ValueError, "1-D"),
]


@pytest.mark.parametrize("what,slots,blocks,exc,match", BAD_INDICES, ids=[b[0] for b in BAD_INDICES])
def test_bad_indices_raise_and_write_nothing(setup, what, slots, blocks, exc, match):
    kv, host, _ = setup
    for name, op in _ops(kv, host):
        dev_before, host_before = snapshot(kv), as_bytes(host).clone()
        with pytest.raises(exc, match=match):
            op(slots, blocks)
        assert torch.equal(as_bytes(host), host_before), f"{name} wrote host blocks before failing"
        assert all(torch.equal(a, as_bytes(b)) for a, b in zip(dev_before, kv.buffers)), f"{name} wrote KV"


def test_repeated_destinations_are_rejected(setup):
    kv, host, _ = setup
    with pytest.raises(ValueError, match="repeated"):
        store_pages(kv, host, SLOTS, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="repeated"):
        load_pages(kv, host, torch.tensor([0, 1, 2, 3, 0, 5, 6, 7]), BLOCKS)
    # repeated sources are fine: one block loaded into two places, one slot stored into two blocks
    load_pages(kv, host, SLOTS, torch.tensor([2, 2]))
    store_pages(kv, host, torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), BLOCKS)


def test_a_staged_store_that_would_skip_tokens_is_refused_before_any_write(setup):
    """A staged store copies whole blocks from its staging buffer: asked to skip the first block's first tokens,
    it overwrote them with whatever the staging buffer held (the direct path keeps them)."""
    from kvtier.kernels.staged_copy import StagedCopy
    kv, host, _ = setup
    stager = StagedTransfer(kv, host)
    slots = SLOTS[:-1]  # two blocks, the first token of the first skipped
    host_before = as_bytes(host).clone()
    with pytest.raises(ValueError, match="whole blocks"):
        stager.store(slots, BLOCKS, skip_tokens=1)
    with pytest.raises(ValueError, match="whole blocks"):
        StagedCopy(stager, slots, BLOCKS, to_host=True, skip_tokens=1)
    assert torch.equal(as_bytes(host), host_before)
    store_pages(kv, host, slots, BLOCKS, skip_tokens=1)  # the direct path stores part of a block


def test_a_numpy_int_skip_reaches_the_launch_as_an_int(setup):
    """``skip_tokens`` passes its check as any integer; a numpy one reached the kernel launch as it was."""
    from kvtier.kernels.staged_copy import StagedCopy
    kv, host, _ = setup
    stager = StagedTransfer(kv, host)
    slots = SLOTS[:-1]
    want = None
    for load in (lambda k: load_pages(kv, host, slots, BLOCKS, skip_tokens=k),
                 lambda k: stager.load(slots, BLOCKS, skip_tokens=k),
                 lambda k: StagedCopy(stager, slots, BLOCKS, to_host=False, skip_tokens=k).launch()):
        for k in (1, np.int64(1)):
            for b in kv.buffers:
                b[slots] = 0
            load(k)
            got = snapshot(kv)
            want = got if want is None else want
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_host_shape_dtype_and_layout_mismatch(setup):
    kv, host, device = setup
    wrong_dtype = host.view(torch.float16)
    with pytest.raises(TypeError, match="dtype"):
        store_pages(kv, wrong_dtype, SLOTS, BLOCKS)
    with pytest.raises(ValueError, match="shape"):
        store_pages(kv, host[:, :1], SLOTS, BLOCKS)  # one layer missing
    with pytest.raises(ValueError, match="does not match layer_first"):
        store_pages(kv, host, SLOTS, BLOCKS, layout="layer_first")
    with pytest.raises(ValueError, match="layout"):
        store_pages(kv, host, SLOTS, BLOCKS, layout="head_first")
    with pytest.raises(ValueError, match="6-D"):
        store_pages(kv, host.view(NUM_BLOCKS, -1), SLOTS, BLOCKS)
    with pytest.raises(ValueError, match="contiguous"):
        store_pages(kv, host.transpose(0, 1).contiguous().transpose(0, 1), SLOTS, BLOCKS)


def test_host_tensor_must_be_host_memory(setup):
    kv, host, _ = setup
    on_meta = torch.empty(host.shape, dtype=host.dtype, device="meta")
    with pytest.raises(ValueError, match="host memory"):
        store_pages(kv, on_meta, SLOTS, BLOCKS)


def test_layers_and_programs_are_checked(setup):
    kv, host, _ = setup
    with pytest.raises(ValueError, match="out of range"):
        store_pages(kv, host, SLOTS, BLOCKS, layers=2)
    with pytest.raises(ValueError, match="out of range"):
        store_pages(kv, host, SLOTS, BLOCKS, layers=range(1, 3))
    with pytest.raises(TypeError, match="step 1"):
        store_pages(kv, host, SLOTS, BLOCKS, layers=range(0, 2, 2))
    with pytest.raises(ValueError, match="num_programs"):
        store_pages(kv, host, SLOTS, BLOCKS, num_programs=0)
    copy = DirectCopy(kv, host, SLOTS, BLOCKS, to_host=True)  # a built copy checks each launch's layers
    host_before = as_bytes(host).clone()
    with pytest.raises(ValueError, match="out of range"):
        copy.launch(2)
    with pytest.raises(TypeError, match="step 1"):
        copy.launch(range(0, 2, 2))
    assert torch.equal(as_bytes(host), host_before), "a refused launch wrote host blocks"


def test_paged_kv_rejects_inconsistent_buffers():
    k = [torch.zeros(8, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    v = [torch.zeros(8, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match="K buffers"):
        PagedKV.mha(k, v[:1])
    with pytest.raises(ValueError, match="must match"):
        PagedKV.mha(k, [v[0], torch.zeros(8, 2, 64, dtype=torch.float16)])
    with pytest.raises(ValueError, match="must match"):
        PagedKV.mha(k, [v[0], torch.zeros(9, 2, 64, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="contiguous"):
        PagedKV.mha(k, [v[0], torch.zeros(2, 8, 64, dtype=torch.bfloat16).transpose(0, 1)])
    with pytest.raises(ValueError, match="3-D"):
        PagedKV.mla([torch.zeros(8, 576)])
    with pytest.raises(ValueError, match="non-empty"):
        PagedKV.mla([])


def test_geometry_rejects_bad_config():
    with pytest.raises(ValueError, match="page_size"):
        KVGeometry(2, 2, 64, torch.bfloat16, page_size=0)
    with pytest.raises(ValueError, match="num_layers"):
        KVGeometry(0, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="latent head"):
        KVGeometry(2, 2, 576, torch.bfloat16, is_mla=True)
    with pytest.raises(TypeError, match="torch.dtype"):
        KVGeometry(2, 2, 64, "bf16")


@pytest.mark.gpu
def test_unpinned_host_and_wrong_device_are_rejected():
    gen = torch.Generator().manual_seed(2)
    kv = make_kv(GEO, NUM_SLOTS, "cuda", gen)
    pageable = torch.zeros(GEO.host_shape(NUM_BLOCKS, "page_first"), dtype=GEO.dtype)
    with pytest.raises(ValueError, match="pinned"):
        store_pages(kv, pageable, SLOTS, BLOCKS)
    with pytest.raises(ValueError, match="pinned"):
        StagedTransfer(kv, pageable)
    on_gpu = pageable.cuda()
    with pytest.raises(ValueError, match="host memory"):
        load_pages(kv, on_gpu, SLOTS, BLOCKS)
    with pytest.raises(ValueError, match="must all share a device|all must share a device"):
        PagedKV.mha([kv.buffers[0]], [kv.buffers[1].cpu()])


@pytest.mark.parametrize("kw,match", [({"num_buffers": 0}, "num_buffers"), ({"gather_programs": 0}, "gather_programs"),
                                      ({"scatter_programs": 0}, "scatter_programs"), ({"tile_bytes": 0}, "tile_bytes"),
                                      ({"edge_chunk_divisor": 0}, "edge_chunk_divisor")])
def test_tuning_rejects_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        Tuning(**kw)


def test_launchers_take_only_a_tuning(setup):
    """``tuning=`` is a Tuning (or None): anything else is refused before any index is checked or any launch."""
    kv, host, _ = setup
    host_before = as_bytes(host).clone()
    for call in (lambda: store_pages(kv, host, SLOTS, BLOCKS, tuning={"tile_bytes": 256}),
                 lambda: DirectCopy(kv, host, SLOTS, BLOCKS, to_host=True, tuning=4),
                 lambda: StagedTransfer(kv, host, tuning="fast")):
        with pytest.raises(TypeError, match="tuning must be a kvtier.kernels.Tuning"):
            call()
    assert torch.equal(as_bytes(host), host_before), "a refused call wrote host blocks"


_ROUND_TRIP = """
import os, torch
import kvtier.kernels as K
from kvtier.geometry import KVGeometry
print("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"))
geo = KVGeometry(2, 2, 8, torch.float16, page_size=4)
bufs = [torch.randn(32, 2, 8).half() for _ in range(4)]
kv = K.PagedKV.mha(bufs[0::2], bufs[1::2], page_size=4)
host = torch.zeros(geo.host_shape(4, "page_first"), dtype=torch.float16)
src = [b[:8].clone() for b in bufs]
K.store_pages(kv, host, torch.arange(8), torch.tensor([2, 0]), layout="page_first")
K.load_pages(kv, host, torch.arange(8, 16), torch.tensor([2, 0]), layout="page_first")
print("exact", all(torch.equal(b[8:16], s) for b, s in zip(bufs, src)))
"""


def _python(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=e)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen where CUDA is absent")
def test_importing_the_kernels_leaves_triton_interpret_unset():
    """Importing kvtier.kernels used to set TRITON_INTERPRET=1 for the whole process (and its children)."""
    out = _python(_ROUND_TRIP)
    assert out.returncode == 0, out.stderr
    assert "TRITON_INTERPRET None" in out.stdout and "exact True" in out.stdout, out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs CPU tensors through the interpreter")
@pytest.mark.parametrize("path", ["load_pages", "DirectCopy", "staged"])
def test_kvtier_check_range_checks_launches_that_skip_their_checks(path):
    """check=False with an out-of-range slot is an illegal access (or silent corruption); KVTIER_CHECK=1 turns
    every such launch into an IndexError before it runs."""
    launch = {
        "load_pages": "K.load_pages(kv, host, bad, ids, layout='page_first', check=False)",
        "DirectCopy": "K.DirectCopy(kv, host, bad, ids, to_host=False, layout='page_first', check=False).launch(0)",
        "staged": "K.StagedTransfer(kv, host, layout='page_first').load(bad, ids, check=False)",
    }[path]
    code = _ROUND_TRIP + f"""
bad, ids = torch.arange(30, 38), torch.tensor([1, 3])
before = [b.clone() for b in bufs]
try:
    {launch}
    print("launched")
except IndexError as e:
    print("refused:", e)
print("untouched", all(torch.equal(b, o) for b, o in zip(bufs, before)))
"""
    out = _python(code, KVTIER_CHECK="1")
    assert "refused: slots holds 37, out of range for 32 device slots" in out.stdout, out.stdout + out.stderr
    assert "untouched True" in out.stdout


# --- inputs that used to slip through (a new user's first hour) ---

@pytest.mark.parametrize("slots, ids", [([0.9, 1.9, 2.9, 3.9], [0]), ([True, False, True, True], [0]),
                                        ([0, 1, 2, 3], [0.7]), (np.array([0.0, 1, 2, 3]), [0])],
                         ids=["float_slots", "bool_slots", "float_blocks", "numpy_float_slots"])
def test_float_and_bool_indices_are_refused_before_any_write(slots, ids):
    """They used to be truncated and used: [0.9, 1.9, 2.9, 3.9] stored slots 0-3 into block 0."""
    geo = KVGeometry(2, 2, 8, torch.float16, page_size=4)
    kv = make_kv(geo, 32, "cpu", torch.Generator().manual_seed(0))
    host = make_host(geo, 4, "page_first", "cpu", torch.Generator().manual_seed(1))
    before = host.clone()
    with pytest.raises(TypeError, match="must hold integers"):
        store_pages(kv, host, slots, ids, layout="page_first")
    assert torch.equal(as_bytes(host), as_bytes(before))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_an_empty_staged_transfer_is_a_no_op(layout):
    """It used to fail with ZeroDivisionError in layer_first while every other path treats it as a no-op."""
    geo = KVGeometry(2, 2, 8, torch.float16, page_size=4)
    kv = make_kv(geo, 32, "cpu", torch.Generator().manual_seed(0))
    host = make_host(geo, 4, layout, "cpu", torch.Generator().manual_seed(1))
    st = StagedTransfer(kv, host, layout=layout)
    empty = torch.empty(0, dtype=torch.int64)
    assert st.store(empty, empty) is None and st.load(empty, empty) is None
    store_pages(kv, host, [], [], layout=layout)


def test_a_plain_list_as_kv_is_a_type_error():
    geo = KVGeometry(2, 2, 8, torch.float16, page_size=4)
    host = torch.zeros(geo.host_shape(4, "page_first"), dtype=torch.float16)
    for call in (lambda: store_pages([1, 2], host, [0, 1, 2, 3], [0]), lambda: StagedTransfer([1, 2], host),
                 lambda: DirectCopy([1, 2], host, [0, 1, 2, 3], [0], to_host=True)):
        with pytest.raises(TypeError, match="kv must be a kvtier PagedKV"):
            call()


@pytest.mark.parametrize("kw", [{"staging_bytes": -1}, {"num_buffers": True}, {"scatter_programs": 2.5},
                                {"gather_programs": True}])
def test_staged_counts_must_be_ints(kw):
    with pytest.raises(ValueError, match=f"{next(iter(kw))} must be an int >= 1"):
        Tuning(**kw)


def test_counts_refuse_bools_and_negative_shapes():
    geo = KVGeometry(2, 2, 8, torch.float16, page_size=4)
    kv = make_kv(geo, 32, "cpu", torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="num_programs must be an int >= 1, got True"):
        DirectCopy(kv, make_host(geo, 4, "page_first", "cpu", torch.Generator().manual_seed(1)), [0, 1, 2, 3], [0],
                   to_host=True, num_programs=True)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 0, got -1"):
        geo.host_shape(-1)


@pytest.mark.parametrize("kind", ["direct", "staged"])
@pytest.mark.parametrize("array", [torch.tensor, np.array], ids=["torch", "numpy"])
def test_a_copy_object_does_not_launch_through_the_callers_indices(kind, array):
    """DirectCopy kept the caller's numpy indices (a tensor sharing their memory), StagedCopy its CPU tensors and
    block ids: changing them after the checks launched unchecked indices (a repeated destination too)."""
    from kvtier.kernels import StagedCopy

    geo = KVGeometry(2, 2, 8, torch.float16, page_size=4)
    kv = make_kv(geo, 32, "cpu", torch.Generator().manual_seed(0))
    host = make_host(geo, 4, "page_first", "cpu", torch.Generator().manual_seed(1))
    slots, ids = array(list(range(8))), array([1, 2])
    copy = (DirectCopy(kv, host, slots, ids, to_host=True, layout="page_first") if kind == "direct" else
            StagedCopy(StagedTransfer(kv, host, layout="page_first"), slots, ids, to_host=True))
    before = host.clone()
    slots += 8  # after the checks: must not change what the copy moves
    ids[1] = 1
    copy.launch()
    for block, first in ((1, 0), (2, 4)):  # slots 0-3 into block 1, 4-7 into block 2
        assert torch.equal(as_bytes(host[block, 0, 0]), as_bytes(kv.buffers[0][first:first + 4]))
    assert torch.equal(as_bytes(host[[0, 3]]), as_bytes(before[[0, 3]]))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_an_empty_staged_copy_is_a_no_op(layout):
    """StagedCopy of no block raised ZeroDivisionError in layer_first (StagedTransfer's calls were fixed)."""
    from kvtier.kernels import StagedCopy

    geo = KVGeometry(2, 2, 8, torch.float16, page_size=4)
    kv = make_kv(geo, 32, "cpu", torch.Generator().manual_seed(0))
    host = make_host(geo, 4, layout, "cpu", torch.Generator().manual_seed(1))
    before = host.clone()
    st = StagedTransfer(kv, host, layout=layout)
    for to_host in (True, False):
        StagedCopy(st, [], [], to_host=to_host).launch()
    assert torch.equal(as_bytes(host), as_bytes(before))


def test_geometry_counts_given_as_numpy_ints_are_python_ints():
    """np.int32 counts were kept as given, so the byte sizes derived from them wrapped (a 16 GiB block came out
    as 0 bytes)."""
    geo = KVGeometry(np.int32(36), np.int32(8), np.int32(128), torch.bfloat16, page_size=np.int32(16))
    assert all(type(getattr(geo, f)) is int for f in ("num_layers", "num_kv_heads", "head_dim", "page_size"))
    big = KVGeometry(np.int32(1024), np.int32(64), np.int32(1024), torch.bfloat16, page_size=np.int32(64))
    assert big.block_bytes == 1024 * 2 * 64 * 1024 * 2 * 64 == 2 ** 34


def test_staging_bytes_that_are_not_whole_words_are_rounded_down():
    """A staging size that is not a multiple of the KV's word was accepted, and every staged transfer then failed
    viewing the buffer as words."""
    geo = KVGeometry(2, 2, 8, torch.float16, page_size=4)
    kv = make_kv(geo, 32, "cpu", torch.Generator().manual_seed(0))
    host = make_host(geo, 4, "layer_first", "cpu", torch.Generator().manual_seed(1))
    st = StagedTransfer(kv, host, layout="layer_first", tuning=Tuning(staging_bytes=geo.block_bytes * 2 + 2))
    assert st.staging_bytes % kv.word_bytes == 0
    slots, ids = torch.arange(8), torch.tensor([2, 0])
    st.store(slots, ids)
    want = make_host(geo, 4, "layer_first", "cpu", torch.Generator().manual_seed(1))
    store_pages(kv, want, slots, ids, layout="layer_first")
    assert torch.equal(as_bytes(host), as_bytes(want))
