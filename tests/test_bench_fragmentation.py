"""The fragmentation bench's smoke run: every path over fragmented host blocks loads and stores exact bytes (the bench
checks each against the reference and raises otherwise), and the churn part sees the run lengths of a full pool."""
from __future__ import annotations

import json

from bench.bench_fragmentation import RUNS, fragmented_ids, main
from kvtier.kernels.staged import block_runs

import numpy as np


def test_fragmented_ids_are_distinct_runs_of_the_asked_length():
    rng = np.random.default_rng(0)
    for run in RUNS:
        ids = fragmented_ids(48, run, 128, rng)
        assert ids.size == 48 and np.unique(ids).size == 48 and ids.min() >= 0 and ids.max() < 128
        lengths = [n for _, n in block_runs(ids)]
        if run == 0:
            assert lengths == [48]
        else:  # runs of `run` ids, two of which may happen to be adjacent
            assert all(n % run == 0 for n in lengths[:-1]) and sum(lengths) == 48


def test_smoke_run_checks_every_fragmented_load_and_reports_the_churn(tmp_path):
    out = tmp_path / "frag.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    ops = {(r["layout"], r["tokens"], r["run"], r["op"], r["path"]) for r in res["rows"]}
    assert len(ops) == 2 * 2 * len(RUNS) * 2 * 4  # layouts x sizes x R x load/store x paths
    s = res["summary"]
    assert s["frag_worst_over_one_run"] > 0 and s["frag_layerwise_issue_ms_max"] > 0
    churn = res["churn"]
    assert churn["pool_full_at_step"] is not None and churn["loads"]["copies"] > 0
    assert 0 < churn["hit_rate"] < 1 and 0 <= churn["hit_rate_full"] <= 1  # later turns hit; first turns miss
    assert (tmp_path / "frag.png").stat().st_size > 10_000  # the PNG beside the JSON
    # --resummarize replays the same block ids: by the same policy it reproduces the run's picks and summary
    again = tmp_path / "again.json"
    assert main(["--smoke", "--resummarize", str(out), "--out", str(again)]) == 0
    res2 = json.loads(again.read_text())
    assert res2["auto"] == res["auto"] and res2["summary"] == s
