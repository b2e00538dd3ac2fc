"""Input validation for the transfer kernels: every check runs before any launch and raises a clear error.

Kernels do no bounds checking: an index out of range writes someone else's KV or faults the GPU. So the launchers
check shapes, dtypes, devices, pinning, lengths and (unless ``check=False``) index ranges and distinct destinations.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Union

import torch
from triton import knobs

from kvtier._checks import check_int_in
from kvtier.geometry import check_layout
from kvtier.kernels.paged_kv import PagedKV
from kvtier.kernels.pinned import is_pinned


# Whether kvtier's kernels run through the Triton interpreter (decided when they are decorated: see _interpret.py).
INTERPRETED = bool(knobs.runtime.interpret)

CHECK_ENV = "KVTIER_CHECK"


def forced_checks() -> bool:
    """``KVTIER_CHECK=1``: every launch range-checks its indices, device-side ones too (a device sync per launch:
    for debugging; ``check=False`` with a bad index is otherwise an illegal memory access or silent corruption)."""
    return os.environ.get(CHECK_ENV, "") == "1"


@dataclasses.dataclass(frozen=True)
class LayerSpan:
    """Consecutive layers ``[start, start + count)``."""

    start: int
    count: int


def layer_span(layers: Union[None, int, range], num_layers: int) -> LayerSpan:
    """Normalise ``layers`` (None = all, an int, or a step-1 range) and check it lies within the model."""
    if layers is None:
        return LayerSpan(0, num_layers)
    if isinstance(layers, bool):
        raise TypeError("layers must be None, an int or a range, not a bool")
    if isinstance(layers, int):
        layers = range(layers, layers + 1)
    if not isinstance(layers, range) or layers.step != 1:
        raise TypeError(f"layers must be None, an int or a range with step 1, got {layers!r}")
    if len(layers) == 0 or layers.start < 0 or layers.stop > num_layers:
        raise ValueError(f"layers {layers} out of range for a model of {num_layers} layers")
    return LayerSpan(layers.start, len(layers))


def check_kv(kv) -> None:
    if not isinstance(kv, PagedKV):
        raise TypeError(f"kv must be a kvtier PagedKV (build one with PagedKV.mha / PagedKV.mla), "
                        f"got {type(kv).__name__}")


def _as_index_tensor(name: str, idx, device: torch.device) -> torch.Tensor:
    if not isinstance(idx, torch.Tensor):
        try:
            idx = torch.as_tensor(idx)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"{name} must be a 1-D int64 tensor (or a sequence of ints): {e}") from None
        if idx.numel() == 0:
            idx = idx.to(torch.int64)
        elif idx.dtype == torch.bool or idx.dtype.is_floating_point or idx.dtype.is_complex:
            raise TypeError(f"{name} must hold integers, got {idx.dtype} values (floats and bools are not indices)")
        else:
            idx = idx.to(torch.int64)
    if idx.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {idx.dtype}")
    if idx.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(idx.shape)}")
    if idx.device.type not in ("cpu", device.type) or (idx.device.type == device.type == "cuda"
                                                         and idx.device != device):
        raise ValueError(f"{name} is on {idx.device}; it must be on the CPU or on the KV device {device}")
    if not idx.is_contiguous():
        idx = idx.contiguous()
    return idx


def _check_range(name: str, idx: torch.Tensor, bound: int, what: str, distinct: bool) -> None:
    if idx.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack([idx.min(), idx.max()]).tolist())
    if lo < 0 or hi >= bound:
        bad = lo if lo < 0 else hi
        raise IndexError(f"{name} holds {bad}, out of range for {bound} {what}")
    if distinct and torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{name} holds repeated entries: each destination {what[:-1]} may be written once")


def check_blocks_tensor(kv: PagedKV, blocks: torch.Tensor, layout: str, *, host_side: bool) -> int:
    """Check a host-blocks (or staging) tensor against the KV geometry; return its block count."""
    check_layout(layout)
    if not isinstance(blocks, torch.Tensor):
        raise TypeError(f"host blocks must be a torch.Tensor, got {type(blocks).__name__}")
    num_blocks = kv.geometry.num_blocks_in(blocks, layout)
    if not blocks.is_contiguous():
        raise ValueError("host blocks must be contiguous")
    if host_side:
        if blocks.device.type != "cpu":
            raise ValueError(f"host blocks must be in host memory, got a tensor on {blocks.device}")
        if kv.is_cuda and not is_pinned(blocks):
            raise ValueError("host blocks must be pinned (page-locked) memory for GPU transfers: allocate with "
                             "pin_memory=True or use kvtier's host pool")
    elif blocks.device != kv.device:
        raise ValueError(f"staging buffer is on {blocks.device}, the KV buffers on {kv.device}")
    if (blocks.untyped_storage().data_ptr() + blocks.storage_offset() * blocks.element_size()) % kv.word_bytes:
        raise ValueError(f"host blocks address is not {kv.word_bytes}-byte aligned")
    return num_blocks


def check_transfer(kv: PagedKV, blocks: torch.Tensor, slots, block_ids, *, layout: str, host_side: bool,
                   writes_blocks: bool, check_indices: bool, block_ids_to_device: bool = True,
                   skip_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Validate one transfer; return the slot and block indices as contiguous int64 tensors (on the KV device;
    block ids stay where they are when ``block_ids_to_device`` is False), and the number of blocks the blocks
    tensor holds. ``skip_tokens``: leading tokens of the first block not moved."""
    check_kv(kv)
    if kv.is_cuda and INTERPRETED:
        raise ValueError("KV buffers on the GPU cannot be moved through the Triton interpreter (TRITON_INTERPRET=1 "
                         "copies each tensor argument to the host, so other buffers' addresses point elsewhere): "
                         "unset TRITON_INTERPRET, or keep the KV on the CPU")
    if not kv.is_cuda and not INTERPRETED:
        raise ValueError(f"KV buffers on {kv.device} can only be moved through the Triton interpreter, chosen when "
                         "triton is imported: import kvtier.kernels before anything imports triton, or set "
                         "TRITON_INTERPRET=1")
    num_blocks = check_blocks_tensor(kv, blocks, layout, host_side=host_side)
    slots = _as_index_tensor("slots", slots, kv.device)
    block_ids = _as_index_tensor("block_ids", block_ids, kv.device)
    page = kv.geometry.page_size
    skip_tokens = check_int_in("skip_tokens", skip_tokens, 0, page, bounds=f"[0, page_size={page})")
    if skip_tokens and block_ids.numel() == 0:
        raise ValueError(f"skip_tokens={skip_tokens} with no block to skip into")
    if slots.numel() != block_ids.numel() * page - skip_tokens:
        raise ValueError(f"{slots.numel()} slots for {block_ids.numel()} blocks: need page_size ({page}) slots "
                         f"per block" + (f", less skip_tokens ({skip_tokens})" if skip_tokens else ""))
    if check_indices or forced_checks():
        _check_range("slots", slots, kv.num_slots, "device slots", distinct=not writes_blocks)
        _check_range("block_ids", block_ids, num_blocks, "host blocks", distinct=writes_blocks)
    if slots.device != kv.device:
        slots = _upload(slots, kv.device)
    if block_ids_to_device and block_ids.device != kv.device:
        block_ids = _upload(block_ids, kv.device)
    return slots, block_ids, num_blocks


def _upload(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Checked host indices on ``device``. An asynchronous copy from pinned memory reads it when the stream runs,
    so a caller's pinned tensor is copied to pageable memory first (a copy from there reads it before returning):
    the values checked are the values moved."""
    if idx.is_pinned():
        idx = idx.clone(memory_format=torch.contiguous_format)
    return idx.to(device, non_blocking=True)


def kept_indices(*indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Checked index tensors a copy object keeps for later launches: those in host memory cloned, so a caller
    that changes its own (or the numpy array they share memory with) after the checks changes nothing launched."""
    return tuple(t.clone() if t.device.type == "cpu" else t for t in indices)


def check_staged_skip(skip_tokens, *, to_host: bool) -> int:
    """``skip_tokens`` of a staged transfer as an int (checked in range by :func:`check_transfer`): a staged store
    copies whole blocks from its staging buffer, so only a load may skip tokens (the direct path stores part of a
    block)."""
    if to_host and skip_tokens:
        raise ValueError(f"a staged store copies whole blocks: skip_tokens must be 0, got {skip_tokens!r} (store "
                         f"part of a block through the direct path)")
    return int(skip_tokens)
