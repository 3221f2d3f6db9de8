"""What a transfer is asked to do, and what it becomes once checked and planned: the values the pipeline
(pipeline.py), the manager (manager.py) and the steps of a pull session (steps.py) pass along."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvbrokerd.dataplane.pairs import BlockPairs
from kvbrokerd.dataplane.plan import Plan
from kvbrokerd.dataplane.seam import PeerChannel, RemoteCache
from kvbrokerd.links.table import Link
from kvbrokerd.transfers.planner import LayerSelection


class Direction(enum.Enum):
    PULL = "pull"
    PUSH = "push"


@dataclass(frozen=True, slots=True)
class GrantClaim:
    """PullKvBlocksRequest.grant: a peer's grant, which of its caches, and where in its block list to start."""

    grant_id: bytes
    secret: bytes
    cache_slot: int
    first_block: int


@dataclass(frozen=True, slots=True)
class BlocksRequest:
    """PullKvBlocks (remote -> local) or PushKvBlocks (local -> remote)."""

    remote_cluster_id: int
    remote_cache_id: int
    remote_batch_index: int
    local_cache_id: int
    pairs: BlockPairs
    """Unsourced (destination blocks only) for a pull of a grant's blocks in order, until the grant is redeemed."""
    layers: LayerSelection
    grant: GrantClaim | None = None
    """Pull granted blocks (pipeline.py, `redeem`)."""


@dataclass(frozen=True, slots=True)
class CacheRequest:
    """PullKvCache / PushKvCache: one batch row of each selected tensor."""

    remote_cluster_id: int
    remote_cache_id: int
    local_cache_id: int
    src_batch_index: int
    dst_batch_index: int
    size: int
    layers: LayerSelection


@dataclass(eq=False)
class Job:
    """A validated, planned transfer; nothing has moved yet."""

    direction: Direction
    plan: Plan
    local_cache_id: int
    channel: PeerChannel
    remote: RemoteCache
    link: Link | None = None
    """None for a local copy (its channel is this daemon's own)."""
    sources: tuple[RemoteCache, ...] = ()
    """A pull from several of the peer's caches as one job (`PeerChannel.pull_several`): the caches whose tensors
    the plan's source tensors index, one cache after the other (`remote` is the first). Empty: `remote` alone."""

    @property
    def backend(self) -> str:
        return self.channel.name
