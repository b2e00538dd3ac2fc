"""Pure-torch reference for the page transfers: the ground truth tests and benchmarks compare against."""

from __future__ import annotations

import torch

from kvtier.kernels.paged_kv import PagedKV


def _host_rows(kv: PagedKV, host: torch.Tensor, layout: str, layer: int, kv_index: int) -> torch.Tensor:
    """View of one (layer, kv) of the host blocks as ``[num_blocks, page_size, heads, head_dim]``."""
    if layout == "page_first":
        return host[:, layer, kv_index]
    return host[layer, :, kv_index]


def copy_pages_ref(kv: PagedKV, host: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor, *,
                   to_host: bool, layout: str = "page_first", layers=None, skip_tokens: int = 0) -> None:
    """What :func:`store_pages` (``to_host=True``) and :func:`load_pages` compute, with torch indexing."""
    geo = kv.geometry
    layer_range = range(geo.num_layers) if layers is None else (
        range(layers, layers + 1) if isinstance(layers, int) else layers)
    slots = slots.to(kv.device).view(-1)
    # the (block, offset in the block) of every token moved
    tok = torch.arange(skip_tokens, skip_tokens + slots.numel())
    blocks, offsets = block_ids.cpu().to(torch.int64)[tok // geo.page_size], tok % geo.page_size
    for layer in layer_range:
        for kv_index, buf in enumerate(kv.layer_buffers(layer)):
            # byte views: the copy must be bit-exact whatever the dtype (NaN payloads included)
            rows = _host_rows(kv, host, layout, layer, kv_index).view(torch.uint8)
            dev = buf.view(torch.uint8)
            b, o = blocks.to(rows.device), offsets.to(rows.device)
            if to_host:
                rows[b, o] = dev[slots].to(rows.device)
            else:
                dev[slots] = rows[b, o].to(dev.device)
