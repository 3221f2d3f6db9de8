"""The state one daemon owns, handed to the servicers: identity, cache registry, link table, transfer manager."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvbroker.v1 import broker_pb2
from kvbrokerd.errors import LlmError
from kvbrokerd.limits import DEFAULT_SESSION_MESSAGE_PAIRS
from kvbrokerd.links.notifications import NotificationBox
from kvbrokerd.links.table import LinkTable
from kvbrokerd.registry.caches import Registry
from kvbrokerd.registry.grants import Grant, GrantTable
from kvbrokerd.registry.sessions import SessionTable
from kvbrokerd.transfers.manager import TransferManager

log = logging.getLogger(__name__)


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
    max_session_message_pairs: int = DEFAULT_SESSION_MESSAGE_PAIRS
    """Block pairs the pulls of one PullKvBlocksSession message may name in all (`--max-session-message-pairs`)."""
    notifications: NotificationBox = field(default_factory=NotificationBox)
    grants: GrantTable = field(init=False)

    def __post_init__(self) -> None:
        self.grants = GrantTable(self._grant_ended)

    def _grant_ended(self, grant: Grant, outcome: str) -> None:
        """Posts the grant's end on its topics, as from our own cluster id: no linked peer can claim that id (the
        handshake refuses it), so a client that fetches these topics can tell our events from a peer's notes. Posted
        outside every peer's budget: no flood refuses it (the prefill engine frees the blocks on it)."""
        payload = broker_pb2.GrantEvent(grant_id=grant.grant_id, label=grant.label,
                                        outcome=outcome).SerializeToString()
        for topic in grant.event_topics:
            try:
                self.notifications.post_own(self.cluster_id, topic, payload)
            except LlmError as e:  # only a malformed topic, which CreateGrant refused already
                log.error("grant %s (%s) ended (%s) but its event could not be posted on %r: %s",
                          grant.grant_id.hex()[:8], grant.label, outcome, topic, e.message)
