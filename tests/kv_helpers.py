"""Builders shared by the transfer tests: random KV pools, host blocks, distinct slot and block picks."""

from __future__ import annotations

import math

import torch

from kvtier.geometry import KVGeometry
from kvtier.kernels import PagedKV, StagedTransfer, copy_pages_ref


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


def staged_store(stager: StagedTransfer, src: torch.Tensor, blocks: torch.Tensor, *, layerwise: bool) -> torch.Tensor:
    """Store the slots ``src`` into the host ``blocks`` through ``stager``, all layers at once or a layer at a time
    (``StagedCopy``), and wait for it; returns the host tensor the reference store would have left (computed first)."""
    from kvtier.kernels.staged_copy import StagedCopy
    expect = stager.host.clone()
    copy_pages_ref(stager.kv, expect, src, blocks, to_host=True, layout=stager.layout)
    if layerwise:
        copy = StagedCopy(stager, src, blocks, to_host=True)
        for layer in range(stager.kv.geometry.num_layers):
            copy.launch(layer)
    else:
        stager.store(src, blocks)
    if stager.kv.is_cuda:
        torch.cuda.synchronize()
    return expect
