"""Pure-torch reference for the page transfers: the ground truth tests and benchmarks compare against."""

from __future__ import annotations

import torch

from kvtier.kernels.paged_kv import PagedKV


def _host_rows(kv: PagedKV, host: torch.Tensor, layout: str, layer: int, kv_index: int) -> torch.Tensor:
    """View of one (layer, kv) of the host blocks as ``[num_blocks, page_size, heads, head_dim]``."""
    if layout == "page_first":
        return host[:, layer, kv_index]
    return host[layer, kv_index]


def copy_pages_ref(kv: PagedKV, host: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor, *,
                   to_host: bool, layout: str = "page_first", layers=None) -> None:
    """What :func:`store_pages` (``to_host=True``) and :func:`load_pages` compute, with torch indexing."""
    geo = kv.geometry
    layer_range = range(geo.num_layers) if layers is None else (
        range(layers, layers + 1) if isinstance(layers, int) else layers)
    slots = slots.to(kv.device).view(-1, geo.page_size)
    for layer in layer_range:
        for kv_index, buf in enumerate(kv.layer_buffers(layer)):
            # byte views: the copy must be bit-exact whatever the dtype (NaN payloads included)
            rows = _host_rows(kv, host, layout, layer, kv_index).view(torch.uint8)
            dev = buf.view(torch.uint8)
            blocks_on_host = block_ids.to(rows.device)
            if to_host:
                rows[blocks_on_host] = dev[slots].view(-1, geo.page_size, *dev.shape[1:]).to(rows.device)
            else:
                dev[slots.view(-1)] = rows[blocks_on_host].reshape(-1, *dev.shape[1:]).to(dev.device)
