"""The state one daemon owns, handed to the servicers: identity, cache registry, link table, transfer manager."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbrokerd.links import LinkTable
from kvbrokerd.notifications import NotificationBox
from kvbrokerd.registry import Registry
from kvbrokerd.sessions import SessionTable
from kvbrokerd.transfers import TransferManager


@dataclass(eq=False)
class Node:
    cluster_id: int
    epoch: str
    peer_address: str
    data_address: str
    backends: tuple[str, ...]
    registry: Registry
    links: LinkTable
    transfers: TransferManager
    sessions: SessionTable
    metrics_address: str = ""
    notifications: NotificationBox = field(default_factory=NotificationBox)
