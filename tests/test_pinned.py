"""The registry of host ranges registered with CUDA outside torch's pinned allocator."""

import pytest
import torch

from kvtier.kernels.pinned import (is_pinned, register_pinned_range, split_at_registrations,
                                   unregister_pinned_range)


def test_registered_ranges_cover_tensors_without_gaps():
    t = torch.empty(4096, dtype=torch.uint8)
    base = t.data_ptr()
    assert not is_pinned(t)
    register_pinned_range(base, 1024)
    register_pinned_range(base + 1024, 2048)  # adjacent chunks, as a chunked pool registers them
    try:
        assert is_pinned(t[:3072])
        assert is_pinned(t[100:2000])  # spans the chunk boundary
        assert not is_pinned(t)  # the last 1024 bytes are not registered
        assert not is_pinned(t[3000:3100])
        with pytest.raises(ValueError, match="already"):
            register_pinned_range(base, 16)
    finally:
        unregister_pinned_range(base)
        unregister_pinned_range(base + 1024)
    assert not is_pinned(t[:10])


def test_copies_split_at_registration_boundaries():
    t = torch.empty(4096, dtype=torch.uint8)
    base = t.data_ptr()
    assert split_at_registrations(base, 4096) == [(0, 4096)]  # nothing registered: one piece
    register_pinned_range(base + 1024, 1024)
    register_pinned_range(base + 2048, 1024)
    try:
        assert split_at_registrations(base + 1500, 1000) == [(0, 548), (548, 452)]
        assert split_at_registrations(base, 4096) == [(0, 1024), (1024, 1024), (2048, 1024), (3072, 1024)]
        assert split_at_registrations(base + 1100, 100) == [(0, 100)]
    finally:
        unregister_pinned_range(base + 1024)
        unregister_pinned_range(base + 2048)
