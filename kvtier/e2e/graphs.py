"""GraphedForward: CUDA graphs of :meth:`PagedDecoder.forward`, one per shape, captured on request.

The decoder runs its layers op by op (about 2,000 kernel launches for 36 layers), so a forward of a few new tokens
costs tens of milliseconds of host time whatever its GPU time (docs/DESIGN.md, "End-to-end harness"), where an engine
with fused kernels and CUDA graphs spends a fraction of that. A graph replays the same launches in one call.

Graphs belong to one KV pool. A shape is ``(start, new tokens)``: the prefix length already in the pool and the
tokens computed. :meth:`capture` records one after a warm-up run that writes random KV into slots the caller lends
(they must hold nothing anyone reads); :meth:`__call__` replays the graph of its inputs' shape after copying the
tokens and slots into the graph's own input tensors, so a replay writes and reads the caller's slots only, and it
runs the decoder eagerly for a shape not captured (or another pool). Every graph draws from one memory pool:
replays run one at a time on one stream, and each returns a copy of its logits.

The pool's getters must not call a layer counter: its host-side ``wait_until`` runs at capture, not at replay. An
engine that graphs its forward loads host hits whole and waits for them before the replay.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from kvtier.e2e.model import PagedDecoder

__all__ = ["GraphedForward"]


@dataclasses.dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    tokens: torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor
    logits: torch.Tensor


class GraphedForward:
    """``model.forward`` over ``pool`` through CUDA graphs for the captured shapes (at most ``max_graphs``), eager
    otherwise."""

    def __init__(self, model: PagedDecoder, pool, *, max_graphs: int = 64) -> None:
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {model.device}")
        self.model, self.pool, self.max_graphs = model, pool, max_graphs
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._mempool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.eager = 0

    def __contains__(self, shape: tuple[int, int]) -> bool:
        return shape in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def capture(self, start: int, write_slots: torch.Tensor, read_slots: torch.Tensor) -> bool:
        """Capture the shape ``(start, write_slots.numel())`` (a no-op when held); False when ``max_graphs`` are
        held. The warm-up run writes random KV into the lent ``write_slots`` and reads ``read_slots`` (``start``
        slots, then ``write_slots``); the capture itself runs nothing."""
        n = write_slots.numel()
        if (start, n) in self._graphs:
            return True
        if len(self._graphs) >= self.max_graphs:
            return False
        dev, pool = self.model.device, self.pool
        tokens = torch.randint(0, self.model.config.vocab_size, (n,), device=dev)
        write, read = write_slots.to(dev).clone(), read_slots.to(dev).clone()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # lazy initialisation (cuBLAS handles, SDPA kernels) before the capture
            self.model.forward(pool, tokens, start, write, read)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            logits = self.model.forward(pool, tokens, start, write, read)
        self._graphs[(start, n)] = _Graph(graph, tokens, write, read, logits)
        return True

    def __call__(self, pool, tokens: torch.Tensor, start: int, write_slots: torch.Tensor,
                 read_slots: torch.Tensor) -> torch.Tensor:
        """The last position's logits, as :meth:`PagedDecoder.forward` returns them."""
        n = tokens.numel()
        g: Optional[_Graph] = self._graphs.get((start, n)) if pool is self.pool else None
        if g is None or write_slots.numel() != n or read_slots.numel() != start + n:  # eager (or its error)
            self.eager += 1
            return self.model.forward(pool, tokens, start, write_slots, read_slots)
        g.tokens.copy_(tokens, non_blocking=True)
        g.write_slots.copy_(write_slots, non_blocking=True)
        g.read_slots.copy_(read_slots, non_blocking=True)
        g.graph.replay()
        self.replays += 1
        return g.logits.clone()
