"""KV geometry: the shape of one model's paged KV cache, on the device and in host blocks.

Units (see docs/DESIGN.md):

* **row**: one token's K (or V, or MLA latent) vector in one layer, ``num_kv_heads * head_dim`` elements,
  contiguous on the device (SGLang's ``[num_slots, heads, head_dim]`` buffers).
* **page**: ``page_size`` consecutive tokens.
* **block**: one page of every layer, K and V, in host memory.

Host layouts:

* ``page_first``  ``[num_blocks, layers, kv, page_size, heads, head_dim]``: a block is contiguous (SSD spill, one
  copy per block).
* ``layer_first`` ``[layers, num_blocks, kv, page_size, heads, head_dim]``: a layer is contiguous (layerwise loads),
  and so is a block's page of one layer, K then V (one copy-engine row per layer and run of blocks, as wide as the
  run's pages of K and V: a fragmented pool's rows are twice as wide as with K and V in planes of their own).

``kv`` is 2 (K then V) for MHA and 1 for MLA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import torch

from kvtier._checks import check_count

HostLayout = Literal["page_first", "layer_first"]  # the methods take a str: check_layout checks it at run time
HOST_LAYOUTS: tuple[str, ...] = ("page_first", "layer_first")


@dataclasses.dataclass(frozen=True)
class KVGeometry:
    """Shape of a model's KV cache as kvtier moves it.

    Attributes:
        num_layers: layers whose KV is cached (a pipeline stage's share under PP).
        num_kv_heads: KV heads held by this rank (after TP sharding); 1 for MLA.
        head_dim: elements per head; for MLA ``kv_lora_rank + qk_rope_head_dim`` (e.g. 576).
        dtype: element type of the device buffers (fp8 caches use a 1-byte type such as ``torch.uint8``).
        page_size: tokens per page / per host block, >= 1.
        is_mla: one latent buffer per layer instead of a K and a V buffer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int = 1
    is_mla: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):  # as Python ints: no numpy wrapping
            object.__setattr__(self, name, check_count(f"KVGeometry.{name}", getattr(self, name)))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"KVGeometry.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.is_mla and self.num_kv_heads != 1:
            raise ValueError(f"an MLA cache has one latent head, got num_kv_heads={self.num_kv_heads}")

    @functools.cached_property
    def kv_count(self) -> int:
        """Buffers per layer: 2 (K, V) for MHA, 1 for MLA."""
        return 1 if self.is_mla else 2

    @functools.cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @functools.cached_property
    def row_elems(self) -> int:
        return self.num_kv_heads * self.head_dim

    @functools.cached_property
    def row_bytes(self) -> int:
        """Bytes of one token in one layer, K or V alone."""
        return self.row_elems * self.itemsize

    @functools.cached_property
    def page_bytes(self) -> int:
        """Bytes of one page in one layer, K and V together."""
        return self.kv_count * self.plane_page_bytes

    @functools.cached_property
    def plane_page_bytes(self) -> int:
        """Bytes of one page in one layer, K or V alone (one token row per token of the page)."""
        return self.page_size * self.row_bytes

    @functools.cached_property
    def block_bytes(self) -> int:
        """Bytes of one host block: one page of every layer, K and V."""
        return self.num_layers * self.page_bytes

    @functools.cached_property
    def token_bytes(self) -> int:
        """Bytes of one token over all layers, K and V."""
        return self.num_layers * self.kv_count * self.row_bytes

    def host_shape(self, num_blocks: int, layout: str = "page_first") -> tuple[int, ...]:
        """Shape of a host tensor holding ``num_blocks`` blocks in ``layout``."""
        check_layout(layout)
        num_blocks = check_count("num_blocks", num_blocks, 0)
        tail = (self.page_size, self.num_kv_heads, self.head_dim)
        if layout == "page_first":
            return (num_blocks, self.num_layers, self.kv_count, *tail)
        return (self.num_layers, num_blocks, self.kv_count, *tail)

    def host_row_strides(self, num_blocks: int, layout: str = "page_first") -> tuple[int, int, int]:
        """(block, layer, kv) strides of a host tensor in rows; a token within a page has stride 1."""
        check_layout(layout)
        p, kv, layers = self.page_size, self.kv_count, self.num_layers
        if layout == "page_first":
            return (layers * kv * p, kv * p, p)
        return (kv * p, kv * num_blocks * p, p)

    def device_shape(self, num_slots: int) -> tuple[int, int, int]:
        """Shape of one per-layer device buffer (SGLang's ``[slots, heads, head_dim]``)."""
        return (num_slots, self.num_kv_heads, self.head_dim)

    def num_blocks_in(self, host: torch.Tensor, layout: str) -> int:
        """Number of blocks a host tensor holds; raises if its shape or dtype does not fit this geometry."""
        check_layout(layout)
        if host.dtype != self.dtype:
            raise TypeError(f"host blocks have dtype {host.dtype}, the KV geometry has {self.dtype}")
        if host.dim() != 6:
            raise ValueError(
                f"host blocks must be 6-D {layout} {_layout_names(layout)}, got shape {tuple(host.shape)}"
            )
        num_blocks = host.shape[0] if layout == "page_first" else host.shape[1]
        expected = self.host_shape(num_blocks, layout)
        if tuple(host.shape) != expected:
            raise ValueError(f"host blocks shape {tuple(host.shape)} does not match {layout} {expected} "
                             f"{_layout_names(layout)}")
        return num_blocks

    @classmethod
    def for_buffers(cls, buffers: torch.Tensor, num_layers: int, *, page_size: int, is_mla: bool) -> KVGeometry:
        """Geometry of per-layer device buffers shaped ``[num_slots, heads, head_dim]``."""
        if buffers.dim() != 3:
            raise ValueError(f"device KV buffers must be 3-D [slots, heads, head_dim], got {tuple(buffers.shape)}")
        return cls(num_layers=num_layers, num_kv_heads=buffers.shape[1], head_dim=buffers.shape[2],
                   dtype=buffers.dtype, page_size=page_size, is_mla=is_mla)


def check_layout(layout: str) -> None:
    if layout not in HOST_LAYOUTS:
        raise ValueError(f"host layout must be one of {HOST_LAYOUTS}, got {layout!r}")


def _layout_names(layout: str) -> str:
    if layout == "page_first":
        return "[num_blocks, layers, kv, page_size, heads, head_dim]"
    return "[layers, num_blocks, kv, page_size, heads, head_dim]"
