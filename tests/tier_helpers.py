"""Builders shared by the host-tier tests: a tiny KV pool, a KVTier over it, and byte views of device pages."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from kvtier.config import TierConfig
from kvtier.geometry import KVGeometry
from kvtier.tier import HostBlockPool, KVTier
from tests.kv_helpers import as_bytes, make_kv

# Tiny on CPU: the kernels run in the Triton interpreter. 2 layers, 1 head of 8 fp16 = 16-byte rows.
TINY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float16, page_size=2)


def make_tier(geo: KVGeometry = TINY, *, num_slots: int = 128, num_blocks: int = 16, device: str = "cpu",
              layout: str = "layer_first", mode: str = "auto", executor=None, seed: int = 0,
              finalize: str = "auto", tokens_per_block: Optional[int] = None, eviction_policy: str = "lru",
              counter_backend: str = "auto") -> KVTier:
    """A tier over a tiny random KV pool; host blocks of ``tokens_per_block`` tokens (default: one page)."""
    gen = torch.Generator().manual_seed(seed)
    kv = make_kv(geo, num_slots, device, gen)
    block = tokens_per_block or geo.page_size
    cfg = TierConfig(page_size=geo.page_size, tokens_per_block=block, host_layout=layout, transfer_mode=mode,
                     cpu_cache_gb=1.0, eviction_policy=eviction_policy)
    pool = HostBlockPool(dataclasses.replace(geo, page_size=block), num_blocks, layout=layout)
    return KVTier(kv, cfg, pool=pool, executor=executor, counter_backend=counter_backend, finalize=finalize)


def slot_bytes(tier: KVTier, slots) -> list[torch.Tensor]:
    """Bytes of ``slots`` in every device buffer (layer-major, K then V), cloned."""
    idx = torch.as_tensor(np.asarray(slots), dtype=torch.int64).to(tier.kv.device)
    return [as_bytes(b[idx]).clone() for b in tier.kv.buffers]


def page_slots(first_page: int, num_pages: int, page_size: int) -> torch.Tensor:
    """Token slots of device pages ``first_page .. first_page + num_pages - 1`` (consecutive, as in SGLang)."""
    return torch.arange(first_page * page_size, (first_page + num_pages) * page_size, dtype=torch.int64)


def fill_random_(tier: KVTier, slots, seed: int) -> None:
    """Overwrite ``slots`` in every device buffer with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.as_tensor(np.asarray(slots), dtype=torch.int64).to(tier.kv.device)
    for b in tier.kv.buffers:
        rows = b.view(torch.uint8).view(b.shape[0], -1)
        rows[idx] = torch.randint(0, 256, (idx.numel(), rows.shape[1]), dtype=torch.uint8,
                                  generator=gen).to(rows.device)


def accounted_blocks(tier: KVTier) -> tuple[int, int, int]:
    """(free, held by the index, owned by in-flight stores): must add up to the pool's blocks."""
    s = tier.stats()
    return tier.pool.num_free, s["pages_held"], s["inflight_store_blocks"]



def prompt(i: int, pages: int, page_size: int = TINY.page_size) -> np.ndarray:
    """Tokens of ``pages`` pages, distinct for each ``i``."""
    return np.arange(pages * page_size) + 1000 * i


def lower_hit_and_load(tier: KVTier, toks: np.ndarray, first_page: int = 40) -> tuple[int, list[torch.Tensor]]:
    """Wait for what :meth:`KVTier.lookup_tiers` starts bringing from a lower tier (an SSD promotion or a remote
    fetch), then load the host hit into device pages ``first_page..``; (pages, their bytes)."""
    P = tier.page_size
    hit = tier.lookup_tiers(toks, None)
    if hit.read is not None:
        tier.wait(hit.read)
    dst = page_slots(first_page, toks.size // P, P)
    task = tier.load(toks, None, dst)
    tier.wait(task)
    return task.num_pages, slot_bytes(tier, dst[:task.num_pages * P])


def same(a: list[torch.Tensor], b: list[torch.Tensor], pages: int, page_size: int = TINY.page_size) -> bool:
    """Whether the first ``pages`` pages of two :func:`slot_bytes` results are equal."""
    n = pages * page_size
    return all(torch.equal(x[:n], y[:n]) for x, y in zip(a, b))
