"""PagedKV: an engine's per-layer device KV buffers, addressed by the transfer kernels through one offset table.

SGLang's ``MHATokenToKVPool`` keeps a K and a V tensor ``[num_slots, heads, head_dim]`` per layer, separately
allocated; ``MLATokenToKVPool`` keeps one latent tensor per layer. The kernels address all of them from a single
base pointer (the lowest-addressed buffer) plus a device table holding each buffer's offset from it, so one launch
can move any set of layers. Offsets are stored in units of the buffers' common alignment (up to 16 bytes), which
lets Triton prove alignment and emit 16-byte vector loads and stores even though the table is read at run time.

Build a ``PagedKV`` once per KV pool (building the table costs a host-to-device copy) and pass it to every call.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Sequence

import torch

from kvtier.geometry import KVGeometry

# Widest word the kernels move, and the alignment they can exploit (16 B = one vector load per lane).
MAX_WORD_BYTES = 8
VECTOR_BYTES = 16
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _largest_pow2_dividing(value: int, cap: int) -> int:
    """Largest power of two <= ``cap`` dividing ``value`` (``value`` 0 counts as divisible by anything)."""
    p = cap
    while p > 1 and value % p:
        p //= 2
    return p


def as_words(t: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """A view of a contiguous tensor's bytes as ``word_bytes``-byte integers (no copy; only its address and
    element type matter to the kernels)."""
    try:
        return t.view(torch.uint8).view(_WORD_DTYPES[word_bytes])
    except RuntimeError:  # the last dimension's bytes are not a multiple of the word: flatten first
        return t.reshape(-1).view(torch.uint8).view(_WORD_DTYPES[word_bytes])


class PagedKV:
    """The per-layer device buffers of one KV pool, ready for the transfer kernels.

    Args:
        buffers: per layer, the K then the V buffer (MHA) or the latent buffer (MLA), each ``[num_slots, heads,
            head_dim]``, contiguous, all of one dtype, shape and device. Layer-major: ``[K0, V0, K1, V1, ...]``.
        page_size: tokens per page (and per host block).
        is_mla: one buffer per layer instead of two.

    Use :meth:`mha` or :meth:`mla` rather than this constructor.
    """

    def __init__(self, buffers: Sequence[torch.Tensor], *, page_size: int, is_mla: bool) -> None:
        kv_count = 1 if is_mla else 2
        if len(buffers) == 0 or len(buffers) % kv_count:
            raise ValueError(f"expected a non-empty list of {'latent' if is_mla else 'K and V'} buffers, "
                             f"{kv_count} per layer; got {len(buffers)}")
        first = buffers[0]
        for i, b in enumerate(buffers):
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"KV buffer {i} is a {type(b).__name__}, not a torch.Tensor")
            if b.device != first.device:
                raise ValueError(f"KV buffer {i} is on {b.device}, buffer 0 on {first.device}: all must share a device")
            if b.dtype != first.dtype or b.shape != first.shape:
                raise ValueError(f"KV buffer {i} is {b.dtype} {tuple(b.shape)}, buffer 0 is {first.dtype} "
                                 f"{tuple(first.shape)}: all must match")
            if not b.is_contiguous():
                raise ValueError(f"KV buffer {i} is not contiguous")
        self.buffers: tuple[torch.Tensor, ...] = tuple(buffers)
        self.geometry = KVGeometry.for_buffers(first, len(buffers) // kv_count, page_size=page_size, is_mla=is_mla)
        self.num_slots: int = first.shape[0]
        self.device: torch.device = first.device
        self.is_cuda: bool = first.device.type == "cuda"
        ptrs = [b.data_ptr() for b in self.buffers]
        # One word size for every address and row: the widest that divides the row and all buffer addresses.
        self.word_bytes = _largest_pow2_dividing(math.gcd(self.geometry.row_bytes, *ptrs), MAX_WORD_BYTES)
        # Unit of the offset table, in words: the alignment every buffer address shares, up to one vector.
        self.align_words = _largest_pow2_dividing(math.gcd(*ptrs), VECTOR_BYTES) // self.word_bytes or 1
        base_index = min(range(len(ptrs)), key=ptrs.__getitem__)
        self.base: torch.Tensor = as_words(self.buffers[base_index], self.word_bytes)
        unit = self.word_bytes * self.align_words
        offsets = [(p - ptrs[base_index]) // unit for p in ptrs]
        self.offsets: torch.Tensor = torch.tensor(offsets, dtype=torch.int64).to(self.device)

    @classmethod
    def mha(cls, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], *,
            page_size: int = 1) -> PagedKV:
        """Wrap SGLang-style per-layer K and V buffers (``MHATokenToKVPool.k_buffer`` / ``v_buffer``)."""
        if len(k_buffers) != len(v_buffers):
            raise ValueError(f"{len(k_buffers)} K buffers but {len(v_buffers)} V buffers")
        interleaved = [b for pair in zip(k_buffers, v_buffers) for b in pair]
        return cls(interleaved, page_size=page_size, is_mla=False)

    @classmethod
    def mla(cls, kv_buffers: Sequence[torch.Tensor], *, page_size: int = 1) -> PagedKV:
        """Wrap per-layer MLA latent buffers (``MLATokenToKVPool.kv_buffer``)."""
        return cls(list(kv_buffers), page_size=page_size, is_mla=True)

    def with_page_size(self, page_size: int) -> PagedKV:
        """The same buffers moved in host blocks of ``page_size`` tokens (a multiple of the engine's page: the
        kernels take a device slot per token, so a block need not be one engine page)."""
        other = copy.copy(self)
        other.geometry = dataclasses.replace(self.geometry, page_size=page_size)
        return other

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The buffers of one layer: ``(K, V)`` or ``(latent,)``."""
        kv = self.geometry.kv_count
        return self.buffers[layer * kv:(layer + 1) * kv]
