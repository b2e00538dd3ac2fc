"""A minimal engine over :class:`~kvtier.tier.KVTier`, without SGLang: what ``kvtier demo`` serves with.

:class:`PagedPool` holds per-layer KV buffers with SGLang's pool method names (so :class:`PagedDecoder` runs on it)
and calls a registered layer counter's ``wait_until`` in its getters, as SGLang's pools do. :class:`TierEngine`
serves one request at a time from one of three sources for its prefix:

* ``"none"``: recompute everything;
* ``"device"``: reuse the previous request's slots (a warm device cache of one entry);
* ``"kvtier"``: the device holds nothing; the prefix is loaded from the host tier (layer by layer when the config
  says so). With an SSD tier the request first waits for the promotion of what the SSD holds past the CPU hit,
  when admission lets it in (as HiCache's ``wait_complete`` prefetch policy does).

Every request reports its prefill to the tier (``KVTier.note_prefill``), for SSD admission: the tokens it computed
and the seconds from its arrival to its first token, less any wait for a promotion. A short prefill past a long
cached prefix reports what it costs (its load and its attention over the prefix), not only what a short prompt
alone costs: admission weighs an SSD hit's read against the prefill it leaves, and a short prompt's prefill is
cheaper than that.

Every request is stored to the host tier when it finishes (its slots are freed once that copy has completed).

With ``cuda_graphs``, the forward replays CUDA graphs (:class:`~kvtier.e2e.graphs.GraphedForward`) for the shapes
:meth:`TierEngine.capture_graphs` prepared, and host hits load whole (a graph replays no host-side layer wait).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from kvtier.config import TierConfig
from kvtier.e2e.graphs import GraphedForward
from kvtier.e2e.model import PagedDecoder, greedy

__all__ = ["PagedPool", "TierEngine", "Result"]


class PagedPool:
    """Per-layer K/V (or MLA latent) buffers ``[num_slots, heads, dim]`` and a free list of pages."""

    def __init__(self, model: PagedDecoder, num_slots: int, page_size: int) -> None:
        shape, dev, dtype = model.kv_shape, model.device, model.dtype
        self.page_size = page_size
        self.buffers = [torch.zeros(num_slots, shape.kv_heads, shape.head_dim, dtype=dtype, device=dev)
                        for _ in range(shape.num_layers * (1 if shape.is_mla else 2))]
        self.is_mla = shape.is_mla
        self.counter = None
        self._free_pages = list(range(num_slots // page_size))

    def paged_kv(self):
        from kvtier.kernels import PagedKV

        if self.is_mla:
            return PagedKV.mla(self.buffers, page_size=self.page_size)
        return PagedKV.mha(self.buffers[0::2], self.buffers[1::2], page_size=self.page_size)

    # --- SGLang's pool interface (what PagedDecoder calls) ---

    def register_layer_transfer_counter(self, counter) -> None:
        self.counter = counter

    def set_kv_buffer(self, layer, loc, k, v, layer_id_override: int) -> None:
        per = 1 if self.is_mla else 2
        self.buffers[layer_id_override * per][loc] = k
        if v is not None:
            self.buffers[layer_id_override * per + 1][loc] = v

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        if self.counter is not None:
            self.counter.wait_until(layer)
        return self.buffers[layer * (1 if self.is_mla else 2)]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        if self.counter is not None:
            self.counter.wait_until(layer)
        return self.buffers[layer * 2 + 1]

    # --- slots ---

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """Slots for ``num_tokens`` consecutive positions, in whole pages."""
        pages = -(-num_tokens // self.page_size)
        if pages > len(self._free_pages):
            raise RuntimeError(f"the KV pool has {len(self._free_pages)} free pages, {pages} needed")
        ids, self._free_pages = self._free_pages[:pages], self._free_pages[pages:]
        page = torch.tensor(ids, dtype=torch.int64)
        slots = (page[:, None] * self.page_size + torch.arange(self.page_size)[None]).reshape(-1)
        return slots[:num_tokens].to(self.buffers[0].device)

    def free(self, slots: torch.Tensor) -> None:
        pages = sorted(set((slots.cpu() // self.page_size).tolist()))
        self._free_pages = sorted(self._free_pages + pages)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)


@dataclasses.dataclass
class Result:
    output: list[int]
    ttft_s: float
    prompt_len: int
    cached: int  # prompt tokens not computed (from the device or kvtier)
    computed: int


class TierEngine:
    """One model, one :class:`PagedPool`, one :class:`~kvtier.tier.KVTier` (see the module docstring)."""

    def __init__(self, model: PagedDecoder, config: TierConfig, *, num_slots: int,
                 model_identity: Optional[dict] = None, cuda_graphs: bool = False) -> None:
        from kvtier.tier import KVTier

        if cuda_graphs and config.layerwise:
            raise ValueError("cuda_graphs needs layerwise=False: a graph replays no host-side layer wait")
        self.model, self.config, self.page_size = model, config, config.page_size
        self.pool = PagedPool(model, num_slots, config.page_size)
        self.graphs = GraphedForward(model, self.pool) if cuda_graphs else None
        self.forward: Callable[..., torch.Tensor] = self.graphs if self.graphs is not None else model.forward
        self.tier = KVTier(self.pool.paged_kv(), config, model_identity=model_identity)
        if config.layerwise:
            self.pool.register_layer_transfer_counter(self.tier.counter)
        self._last: Optional[tuple[list[int], torch.Tensor]] = None  # the device cache: tokens, slots

    def serve(self, tokens: list[int], max_new_tokens: int, *, source: str) -> Result:
        """Serve ``tokens`` with its prefix from ``source`` (``"none"``, ``"device"``, ``"kvtier"``)."""
        if source not in ("none", "device", "kvtier"):
            raise ValueError(f"source must be 'none', 'device' or 'kvtier', got {source!r}")
        P, n, dev = self.page_size, len(tokens), self.model.device
        self._sync()
        t0 = time.perf_counter()
        reuse, prev = 0, self._last
        if source == "device" and prev is not None:
            while reuse < min(len(prev[0]), n - 1) and prev[0][reuse] == tokens[reuse]:
                reuse += 1
            reuse = reuse // P * P
        if prev is not None:  # the device cache keeps the reused pages only
            self.pool.free(prev[1][reuse:] if reuse else prev[1])
            self._last = None
        new = self.pool.alloc(n + max_new_tokens - reuse)
        slots = torch.cat((prev[1][:reuse], new)) if reuse and prev is not None else new
        cached, waited = reuse, 0.0
        if source == "kvtier":
            want = (n - 1) // P * P
            promotion = self.tier.lookup_tiers(tokens[:want], None).read
            if promotion is not None:
                t_wait = time.perf_counter()
                self.tier.wait(promotion)
                waited = time.perf_counter() - t_wait
            load = self.tier.load_layerwise if self.config.layerwise else self.tier.load
            task = load(tokens[:want], None, slots[:want])
            cached = task.num_pages * P
            if self.config.layerwise:
                self.tier.counter.set_consumer(task.producer_index)
            else:
                self.tier.wait_on_current_stream(task)
        toks = torch.tensor(tokens[cached:], dtype=torch.int64, device=dev)
        out = [greedy(self.forward(self.pool, toks, cached, slots[cached:n], slots[:n]))]
        ttft = time.perf_counter() - t0
        self.tier.note_prefill(n - cached, ttft - waited, cached)
        for pos in range(n, n + max_new_tokens - 1):
            last = torch.tensor([out[-1]], dtype=torch.int64, device=dev)
            out.append(greedy(self.forward(self.pool, last, pos, slots[pos:pos + 1], slots[:pos + 1])))
        done = n + max_new_tokens - 1  # positions whose KV exists
        seq = list(tokens) + out[:-1]
        self.tier.wait(self.tier.store(seq[:done // P * P], None, slots[:done // P * P]))
        self._last = (seq[:done], slots)
        return Result(out, ttft, n, cached, n - cached)

    def hit_tokens(self, prompt_len: int) -> int:
        """The prompt tokens a full host hit serves: whole pages short of the last token, in whole host blocks."""
        want, block = (prompt_len - 1) // self.page_size * self.page_size, self.tier.block_tokens
        return want // block * block

    def capture_graphs(self, prompt_len: int, max_new_tokens: int, cached: Optional[tuple[int, ...]] = None) -> None:
        """Capture the forward shapes of a ``prompt_len``-token prompt served with each of ``cached`` prefix
        tokens reused (page multiples; by default none and a full host hit, :meth:`hit_tokens`), and of its
        ``max_new_tokens - 1`` decode steps, in free slots (their pages hold nothing anyone reads; freed again).
        Raises when the graph cache is full."""
        if self.graphs is None:
            raise RuntimeError("this engine was built without cuda_graphs")
        if cached is None:
            cached = (0, self.hit_tokens(prompt_len))
        for c in cached:
            if c % self.page_size or not 0 <= c < prompt_len:
                raise ValueError(f"cached tokens must be page multiples below {prompt_len}, got {c}")
        slots = self.pool.alloc(prompt_len + max_new_tokens)
        try:
            shapes = [(c, slots[c:prompt_len], slots[:prompt_len]) for c in cached]
            shapes += [(pos, slots[pos:pos + 1], slots[:pos + 1])
                       for pos in range(prompt_len, prompt_len + max_new_tokens - 1)]
            for start, write, read in shapes:
                if not self.graphs.capture(start, write, read):
                    raise RuntimeError(f"the engine holds {self.graphs.max_graphs} graphs; shape ({start}, "
                                       f"{write.numel()}) not captured")
        finally:
            self._sync()
            self.pool.free(slots)

    def drop_device_cache(self) -> None:
        """Free the device cache's slots (kvtier's copies stay)."""
        if self._last is not None:
            self.pool.free(self._last[1])
            self._last = None

    def _sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
