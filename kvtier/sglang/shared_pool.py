"""One host pool for the ranks of a stage whose KV is the same (MLA under TP or attention CP: the latent is
replicated on every rank), instead of a copy per rank.

The stage's leader creates a :class:`~kvtier.tier.shared_memory.SharedSegment` of every rank's ``cpu_cache_gb``
together (the host memory of the stage's private pools, so the shared pool holds as many times more blocks); the
other ranks map it by name; once every rank has it, the leader unlinks the name. Each rank's stores copy a share of
the layers (rank p of T: layers ``p*L//T .. (p+1)*L//T - 1``), so a page crosses each GPU's PCIe link once in
total, and every rank loads all layers. A page enters the host index only once every rank has completed its share
(the ranks' agreement), and block ids are the same on every rank because every rank allocates alike (checked each
round: :meth:`~kvtier.tier.host_pool.HostBlockPool.block_digest`). Ranks on other machines, or a ``/dev/shm`` too
small for the segment, fall back to a pool per rank, said in the log.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import Optional

import torch.distributed as dist

from kvtier.geometry import KVGeometry
from kvtier.sglang.agreement import RankAgreement
from kvtier.tier.host_pool import HostBlockPool
from kvtier.tier.shared_memory import SharedSegment

logger = logging.getLogger(__name__)

__all__ = ["SharedPool", "share_pool"]


@dataclasses.dataclass
class SharedPool:
    """A pool in shared memory and this rank's part in it."""

    pool: HostBlockPool
    segment: SharedSegment
    store_layers: range  # the layers this rank's stores copy
    ranks: int  # ranks sharing the pool


def _name(token: int, pp_rank: int) -> str:
    return f"kvtier-pool-{token:016x}-stage{pp_rank}"


def share_pool(agreement: RankAgreement, geometry: KVGeometry, layout: str, blocks_per_rank: int,
               budget_bytes: Optional[int]) -> Optional[SharedPool]:
    """Build the stage's shared pool (collective over the stage's ranks: every rank calls it at start-up).

    Args:
        geometry: the host blocks' geometry (the tier's, in blocks of ``tokens_per_block`` tokens).
        blocks_per_rank: the blocks each rank's own pool would hold (agreed across the ranks).
        budget_bytes: this rank's share of host memory, or None.

    Returns:
        The shared pool, or None when the ranks cannot share (then each builds its own).
    """
    ranks = agreement.stage_size
    if ranks < 2:
        return None
    num_blocks = blocks_per_rank * ranks
    nbytes = num_blocks * geometry.block_bytes
    leader = agreement.stage_position == 0
    segment: Optional[SharedSegment] = None
    token = 0
    if leader:
        token = secrets.randbits(62) + 1
        try:
            segment = SharedSegment(_name(token, agreement.pp_rank), nbytes, create=True)
        except OSError as e:
            logger.warning("kvtier: cannot create a %.2f GiB shared host pool in /dev/shm (%s); each rank keeps a "
                           "pool of its own (raise the container's --shm-size to share it)", nbytes / (1 << 30), e)
            token = 0
    token = agreement.stage_reduce([token], dist.ReduceOp.MAX)[0]
    if token and not leader:
        try:
            segment = SharedSegment.open(_name(token, agreement.pp_rank), nbytes)
        except (OSError, ValueError) as e:
            logger.warning("kvtier: cannot map the stage's shared host pool (%s): its ranks are not all on one "
                           "machine; each rank keeps a pool of its own", e)
    shared = agreement.stage_reduce([int(segment is not None)], dist.ReduceOp.MIN)[0] if token else 0
    # every stage shares, or none does: the ranks of every stage must hold pools of as many blocks
    shared = agreement.startup_reduce([shared], dist.ReduceOp.MIN)[0]
    if leader and segment is not None:
        segment.unlink()  # every rank has mapped it (or given up): the memory lives as long as its mappings
    if not shared:
        if token and segment is not None:
            logger.warning("kvtier: another pipeline stage cannot share its host pool, so this one keeps a pool "
                           "per rank too")
        return None
    assert segment is not None  # shared: every rank mapped the segment
    pool = HostBlockPool(geometry, num_blocks, layout=layout, memory=segment.tensor[:nbytes],
                         budget_bytes=None if budget_bytes is None else budget_bytes * ranks)
    p, layers = agreement.stage_position, geometry.num_layers
    store_layers = range(p * layers // ranks, (p + 1) * layers // ranks)
    logger.info("kvtier: one host pool of %.2f GiB shared by the %d ranks of this stage (their KV is the same); "
                "this rank's stores copy layers %d..%d", nbytes / (1 << 30), ranks, store_layers.start,
                store_layers.stop - 1)
    return SharedPool(pool, segment, store_layers, ranks)
