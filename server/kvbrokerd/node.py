"""The state one daemon owns, handed to the servicers: identity, cache registry, link table, transfer manager."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbrokerd.links.notifications import NotificationBox
from kvbrokerd.links.table import LinkTable
from kvbrokerd.registry.caches import Registry
from kvbrokerd.registry.sessions import SessionTable
from kvbrokerd.transfers.manager import TransferManager


@dataclass(eq=False)
class Node:
    cluster_id: int
    epoch: str
    peer_address: str
    backends: tuple[str, ...]
    registry: Registry
    links: LinkTable
    transfers: TransferManager
    sessions: SessionTable
    metrics_address: str = ""
    notifications: NotificationBox = field(default_factory=NotificationBox)
