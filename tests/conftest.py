"""Test configuration: the ``gpu`` marker, and the Triton interpreter on machines without CUDA."""

import os

import pytest
import torch

# The ``mooncake_master`` fixture, for any test that names it (a test module that imported it would shadow it).
pytest_plugins = ["tests.mooncake_master"]

CUDA = torch.cuda.is_available()
if not CUDA:  # kernels run on CPU tensors through the interpreter (kvtier.kernels sets this too)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
