"""`kvtier demo` moves real bytes and verifies them; a mismatch makes it fail."""

import pytest
import torch

from kvtier import cli

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_demo_round_trip_is_exact():
    assert cli.main(["demo", "--device", DEVICE] if DEVICE == "cuda" else ["demo"]) == 0


def test_demo_reports_a_mismatch(monkeypatch):
    import kvtier.kernels as kernels

    real_load = kernels.load_pages

    def lossy_load(kv, host, slots, block_ids, **kw):  # drops the last page: the demo must notice
        real_load(kv, host, slots[:-kv.geometry.page_size], block_ids[:-1], **kw)

    monkeypatch.setattr(kernels, "load_pages", lossy_load)
    assert cli.run_demo(DEVICE) is False


def test_cli_rejects_unknown_command():
    with pytest.raises(SystemExit):
        cli.main(["bogus"])
