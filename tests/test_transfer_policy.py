"""The transfer policy: which path ``auto`` gives each copy, from its direction, bytes and host block runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.tier.transfer_policy as policy
from kvtier.geometry import KVGeometry
from kvtier.kernels import StagedTransfer
from kvtier.kernels.checks import LayerSpan
from kvtier.tier.transfer_policy import CopyPlan, Path, TransferPolicy
from tests.kv_helpers import make_host, make_kv

QWEN3 = KVGeometry(36, 8, 128, torch.bfloat16, page_size=16)  # 64 KiB a page and layer, 2.25 MiB a block
ONE_RUN = np.arange(100, 612)  # 512 blocks: 8192 tokens
SINGLES = np.arange(0, 1024, 2)  # the same count, in runs of one
PAIRS = (np.arange(0, 1024, 4)[:, None] + np.arange(2)).reshape(-1)  # runs of two


def _path(layout: str, ids: np.ndarray, *, to_host: bool = False, layers: int = 36, mode: str = "auto") -> Path:
    return TransferPolicy(mode, layout, QWEN3).path(CopyPlan(to_host=to_host, block_ids=ids, layers=layers))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("ids", [ONE_RUN, SINGLES, ONE_RUN[:1]], ids=["one_run", "singles", "one_block"])
def test_stores_always_go_staged_and_fixed_modes_never_choose(layout, ids):
    assert _path(layout, ids, to_host=True) is Path.STAGED
    assert _path(layout, ids, to_host=True, layers=1) is Path.STAGED
    for mode in ("direct", "staged"):
        assert _path(layout, ids, mode=mode) is Path(mode)
        assert _path(layout, ids, to_host=True, layers=1, mode=mode) is Path(mode)


def test_whole_loads_go_direct_per_layer_when_the_copy_engine_rows_are_short():
    """layer_first rows are a run's pages of one layer, K and V, 64 KiB a 16-token page: runs under
    AUTO_STAGED_MIN_ROW_BYTES (256 KiB: 4 pages) go through the direct kernel, one launch per layer. page_first
    rows are whole runs of blocks (2.25 MiB a block). Loads under AUTO_STAGED_LOAD_BYTES take one direct launch."""
    runs_of = lambda r: (np.arange(0, 2048, 2 * r)[:, None] + np.arange(r)).reshape(-1)[:512]  # noqa: E731
    assert _path("layer_first", ONE_RUN) is Path.STAGED
    for r, want in ((1, Path.DIRECT_LAYERS), (2, Path.DIRECT_LAYERS), (3, Path.DIRECT_LAYERS), (4, Path.STAGED)):
        assert _path("layer_first", runs_of(r)) is want, r
        assert _path("page_first", runs_of(r)) is Path.STAGED
    assert _path("layer_first", ONE_RUN[:1]) is Path.DIRECT  # 2.25 MiB: under AUTO_STAGED_LOAD_BYTES
    assert _path("layer_first", SINGLES[:1]) is Path.DIRECT


def test_short_fragmented_whole_loads_go_direct_in_one_launch():
    """Up to AUTO_DIRECT_LOAD_MAX_BYTES (256 MiB) a fragmented whole load takes one direct launch (36 launches would
    add ~6% at 1024 tokens); above it a launch per layer; one run stays staged."""
    fits = policy.AUTO_DIRECT_LOAD_MAX_BYTES // QWEN3.block_bytes  # 113 blocks of 2.25 MiB
    assert _path("layer_first", SINGLES[:64]) is Path.DIRECT  # 1024 tokens, 144 MiB
    assert _path("layer_first", SINGLES[:fits]) is Path.DIRECT
    assert _path("layer_first", SINGLES[:fits + 1]) is Path.DIRECT_LAYERS
    assert _path("layer_first", PAIRS[:64]) is Path.DIRECT
    assert _path("layer_first", ONE_RUN[:64]) is Path.STAGED
    assert _path("page_first", SINGLES[:64]) is Path.STAGED  # rows of whole blocks


def test_layerwise_loads_go_direct_beyond_the_rows_a_layer_may_issue():
    """One layer of 512 pages is 32 MiB; staged while its rows stay within AUTO_STAGED_MAX_LAYER_ROWS (one run:
    one row in layer_first, K and V; one 2-D copy in page_first)."""
    per_layer_runs = policy.AUTO_STAGED_MAX_LAYER_ROWS  # runs a layer_first layer may have: a row each
    few = (np.arange(per_layer_runs)[:, None] * 128 + np.arange(64)).reshape(-1)  # that many runs of 64
    more = (np.arange(per_layer_runs + 1)[:, None] * 128 + np.arange(64)).reshape(-1)
    assert _path("layer_first", ONE_RUN, layers=1) is Path.STAGED
    assert _path("layer_first", few, layers=1) is Path.STAGED
    assert _path("layer_first", more, layers=1) is Path.DIRECT
    assert _path("page_first", ONE_RUN, layers=1) is Path.STAGED
    assert _path("page_first", more, layers=1) is Path.DIRECT  # a row per block: 128 rows
    assert _path("layer_first", ONE_RUN[:63], layers=1) is Path.DIRECT  # under AUTO_STAGED_LAYER_BYTES


def test_page_first_short_layer_slices_go_direct(monkeypatch):
    monkeypatch.setattr(policy, "AUTO_STAGED_MIN_SLICE_BYTES", QWEN3.page_bytes + 1)
    assert _path("page_first", ONE_RUN, layers=1) is Path.DIRECT
    assert _path("layer_first", ONE_RUN, layers=1) is Path.STAGED


GEO = KVGeometry(4, 2, 64, torch.float16, page_size=2)


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(["page_first", "layer_first"]),
       ids=st.lists(st.integers(0, 11), min_size=2, max_size=8, unique=True), layers=st.sampled_from([1, 4]))
def test_the_rows_the_policy_counts_are_the_rows_the_staged_path_issues(layout, ids, layers):
    """For several runs the policy's count is the number of rows of the batched copy the staged path builds."""
    host_ids = np.array(ids, dtype=np.int64)
    if len(set(np.diff(host_ids).tolist())) == 1 and np.diff(host_ids)[0] == 1:
        host_ids = host_ids[::-1].copy()  # several runs
    gen = torch.Generator().manual_seed(0)
    stager = StagedTransfer(make_kv(GEO, 16, "cpu", gen), make_host(GEO, 12, layout, "cpu", gen), layout=layout)
    rows = stager.run_rows(host_ids, LayerSpan(0, layers))
    counted = TransferPolicy("auto", layout, GEO).staged_rows(CopyPlan(False, host_ids, layers))
    assert counted == rows.width.size
