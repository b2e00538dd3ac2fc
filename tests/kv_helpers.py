"""Builders shared by the transfer tests: random KV pools, host blocks, distinct slot and block picks."""

from __future__ import annotations

import math

import torch

from kvtier.geometry import KVGeometry
from kvtier.kernels import PagedKV


def random_bytes_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill a tensor with random bytes (CPU generator, then copied), in place."""
    flat = t.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    return t


def make_kv(geo: KVGeometry, num_slots: int, device: str, gen: torch.Generator) -> PagedKV:
    bufs = [random_bytes_(torch.empty(geo.device_shape(num_slots), dtype=geo.dtype, device=device), gen)
            for _ in range(geo.num_layers * geo.kv_count)]
    return PagedKV(bufs, page_size=geo.page_size, is_mla=geo.is_mla)


def make_host(geo: KVGeometry, num_blocks: int, layout: str, device: str, gen: torch.Generator) -> torch.Tensor:
    """Random host blocks: a view 64 bytes into a larger allocation, so code that ignores a view's offset fails."""
    shape = geo.host_shape(num_blocks, layout)
    pad = 64 // geo.itemsize
    whole = torch.empty(math.prod(shape) + 2 * pad, dtype=geo.dtype, pin_memory=(device == "cuda"))
    random_bytes_(whole, gen)
    return whole[pad:pad + math.prod(shape)].view(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor: compare these, never floats (random bytes make NaNs, and NaN != NaN)."""
    return t.contiguous().view(-1).view(torch.uint8).cpu()


def snapshot(kv: PagedKV) -> list[torch.Tensor]:
    return [as_bytes(b).clone() for b in kv.buffers]
