"""Notifications linked peers send to this daemon's local clients, and the daemon's own grant events, queued by topic
until fetched.

The use: a decode engine tells the prefill engine, through both sidecars, that it holds a request's blocks; and the
daemon tells the prefill engine that a grant ended (a GrantEvent), so that it frees the blocks. Bounded everywhere:
topic and payload sizes, queued notifications, topics, and age. What peers send is bounded per sending source: the
network its link was made from (/24, /64, as inbound link shares count it; a token holder can claim any cluster id on
as many links as it likes, but it cannot choose its source address freely) as well as for all peers together
(bytes, count, topics), so one network that floods us is refused once it holds its share and every other peer's
notifications still get in. A full
box is always a refusal to the sender, never a note dropped to make room.

The daemon's own events are not peers' notes: they never count against the peers' budgets, so no flood can refuse
or drop one (the vLLM prefill engine frees a request's blocks on that event). Their number is bounded by the grants
the local clients create and end, not by anything a peer sends; like every note they are gone after MAX_AGE_S.

Every notification is charged a fixed overhead on top of its payload and topic: an empty one costs us memory too. A
fetch answers at most MAX_FETCH_REPLY_BYTES and leaves the rest queued: a reply gRPC cannot send would lose what it
had dequeued.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvbrokerd.errors import LlmStatus, fail, param_invalid

log = logging.getLogger(__name__)

MAX_TOPIC_BYTES = 128
MAX_PAYLOAD_BYTES = 64 << 10
NOTE_OVERHEAD_BYTES = 512
"""Charged for each waiting notification besides its payload and topic: the record, its queue slot, its strings'
headers (about 400 bytes in CPython)."""
MAX_QUEUED_BYTES = 64 << 20
"""Charged bytes (payload + topic + NOTE_OVERHEAD_BYTES each) waiting from all peers together."""
MAX_QUEUED = 65536
"""Peers' notifications waiting, all peers together."""
MAX_TOPICS = 1024
"""Topics holding peers' notifications."""
MAX_QUEUED_BYTES_PER_PEER = 16 << 20
"""Charged bytes waiting from one sending host: a flood from one host stops there, however many links it made and
whatever cluster ids they claim."""
MAX_QUEUED_PER_PEER = 16384
"""Notifications waiting from one sending host."""
MAX_TOPICS_PER_PEER = 128
"""Topics holding notifications of one sending host (vLLM uses one per prefill engine rank)."""
OWN_EVENTS_WARN = 65536
"""The daemon's own events waiting past which it says so (local clients that create grants but never fetch their
events); they are still kept."""
MAX_AGE_S = 600.0
MAX_FETCH = 65536
DEFAULT_FETCH = 1024
MAX_FETCH_REPLY_BYTES = 16 << 20
"""One FetchNotifications reply at most (well under the 64 MiB message limit of the daemon and the Python client);
notifications past it stay queued for the next fetch."""
_WIRE_OVERHEAD_BYTES = 64
"""A Notification's encoding besides its payload and topic (tags, lengths, cluster id, time): at most ~30 bytes."""
MAX_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class Notification:
    cluster_id: int
    topic: str
    payload: bytes
    received_unix: float
    received: float  # time.monotonic(), for expiry
    source: str | None = None
    """The sending host whose share it is charged to; None: the daemon's own event."""

    @property
    def charge(self) -> int:
        """What holding it counts against the byte budgets."""
        return NOTE_OVERHEAD_BYTES + len(self.payload) + len(self.topic.encode())

    @property
    def wire_bytes(self) -> int:
        """An upper bound of its size in a FetchNotifications reply."""
        return _WIRE_OVERHEAD_BYTES + len(self.payload) + len(self.topic.encode())


@dataclass(slots=True)
class _Share:
    """What one sending host (or all peers, or the daemon itself) has waiting here."""

    bytes: int = 0
    count: int = 0
    topics: dict[str, int] = field(default_factory=dict)  # topic -> its notifications there

    def add(self, note: Notification) -> None:
        self.bytes += note.charge
        self.count += 1
        self.topics[note.topic] = self.topics.get(note.topic, 0) + 1

    def remove(self, note: Notification) -> None:
        self.bytes -= note.charge
        self.count -= 1
        self.topics[note.topic] -= 1
        if not self.topics[note.topic]:
            del self.topics[note.topic]


def check(topic: str, payload: bytes = b"") -> None:
    if not 1 <= len(topic.encode()) <= MAX_TOPIC_BYTES:
        param_invalid(f"topic must be 1..{MAX_TOPIC_BYTES} bytes")
    if len(payload) > MAX_PAYLOAD_BYTES:
        param_invalid(f"payload is {len(payload)} bytes; at most {MAX_PAYLOAD_BYTES}")


class NotificationBox:
    """Runs on the event loop only."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[Notification]] = {}
        self._arrived: dict[str, asyncio.Event] = {}
        self._waiters: dict[str, int] = {}
        self._shares: dict[str, _Share] = {}  # by sending host
        self._peers = _Share()
        """Every peer's notes together."""
        self._own = _Share()
        """The daemon's own events: a budget no peer's note is charged to."""
        self.dropped = 0
        """Notes gone unfetched past MAX_AGE_S."""

    @property
    def queued(self) -> int:
        return self._peers.count + self._own.count

    @property
    def queued_bytes(self) -> int:
        """Charged bytes waiting (see Notification.charge), peers' and our own."""
        return self._peers.bytes + self._own.bytes

    def share_of(self, source: str) -> tuple[int, int]:
        """(charged bytes, notifications) waiting from the sending host `source`."""
        share = self._shares.get(source)
        return (share.bytes, share.count) if share else (0, 0)

    def own_waiting(self) -> tuple[int, int]:
        """(charged bytes, notifications) of the daemon's own events waiting."""
        return self._own.bytes, self._own.count

    def put(self, cluster_id: int, topic: str, payload: bytes, *, source: str) -> None:
        """A linked peer's note: `cluster_id` is what its link claims (shown to the fetcher), `source` the host the
        link was made from, whose share it is charged to. LLM_OUT_OF_MEMORY where a share or the peers' whole is
        full (nothing changed)."""
        check(topic, payload)
        self._expire()
        note = Notification(cluster_id, topic, payload, time.time(), time.monotonic(), source)
        share = self._shares.get(source) or _Share()
        self._admit(share, note)
        self._shares[source] = share
        share.add(note)
        self._peers.add(note)
        self._enqueue(note)

    def post_own(self, cluster_id: int, topic: str, payload: bytes) -> None:
        """The daemon's own event (`cluster_id`: ours): never refused for room, whatever peers hold."""
        check(topic, payload)
        self._expire()
        note = Notification(cluster_id, topic, payload, time.time(), time.monotonic())
        self._own.add(note)
        if self._own.count == OWN_EVENTS_WARN:
            log.warning("%d grant events wait to be fetched: do the local clients that create grants fetch their "
                        "event topics?", OWN_EVENTS_WARN)
        self._enqueue(note)

    def _enqueue(self, note: Notification) -> None:
        self._queues.setdefault(note.topic, deque()).append(note)
        event = self._arrived.get(note.topic)
        if event is not None:
            event.set()

    def _admit(self, share: _Share, note: Notification) -> None:
        """Refuses `note` (LLM_OUT_OF_MEMORY, nothing changed) where it would take its sending host past its share
        or all peers past theirs; the host's own share is checked first, so a flooding peer learns it is the one."""
        later = "try again once the receiving clients have fetched them"
        host = note.source or "an unknown host"
        if share.bytes + note.charge > MAX_QUEUED_BYTES_PER_PEER or share.count >= MAX_QUEUED_PER_PEER:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"links from {host} have {share.count} notifications ({share.bytes} "
                 f"bytes as charged) waiting here, that host's share (at most {MAX_QUEUED_PER_PEER} and "
                 f"{MAX_QUEUED_BYTES_PER_PEER} bytes); {later}")
        if note.topic not in share.topics and len(share.topics) >= MAX_TOPICS_PER_PEER:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"links from {host} have notifications waiting in "
                 f"{MAX_TOPICS_PER_PEER} topics here, that host's share; {later}")
        peers = self._peers
        if peers.bytes + note.charge > MAX_QUEUED_BYTES or peers.count >= MAX_QUEUED:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"{peers.count} notifications ({peers.bytes} bytes as charged) from "
                 f"peers wait to be fetched here, the most this daemon holds; {later}")
        if note.topic not in peers.topics and len(peers.topics) >= MAX_TOPICS:
            param_invalid(f"more than {MAX_TOPICS} topics hold undelivered notifications")

    async def fetch(self, topic: str, max_count: int, wait_s: float) -> list[Notification]:
        check(topic)
        if not 0 <= max_count <= MAX_FETCH:
            param_invalid(f"max_count must be in [0, {MAX_FETCH}]")
        max_count = max_count or DEFAULT_FETCH
        wait_s = min(max(wait_s, 0.0), MAX_WAIT_S)
        self._expire()
        if not self._queues.get(topic) and wait_s > 0:
            event = self._arrived.setdefault(topic, asyncio.Event())
            self._waiters[topic] = self._waiters.get(topic, 0) + 1
            try:
                await asyncio.wait_for(event.wait(), wait_s)
            except TimeoutError:
                pass
            finally:
                self._waiters[topic] -= 1
                if not self._waiters[topic]:  # the last waiter takes the event away: topics fetched leave no trace
                    del self._waiters[topic], self._arrived[topic]
        queue = self._queues.get(topic)
        if not queue:
            return []
        # Taken off the queue only what one reply can carry, and with no await before the reply is built: what is
        # dequeued is what the caller gets.
        out: list[Notification] = []
        size = 0
        while queue and len(out) < max_count:
            wire = queue[0].wire_bytes
            if out and size + wire > MAX_FETCH_REPLY_BYTES:
                break
            size += wire
            out.append(queue.popleft())
        for n in out:
            self._forget(n)
        if not queue:
            del self._queues[topic]
        return out

    def _expire(self) -> None:
        cutoff = time.monotonic() - MAX_AGE_S
        for topic in list(self._queues):
            queue = self._queues[topic]
            while queue and queue[0].received < cutoff:
                self._forget(queue.popleft())
                self.dropped += 1
            if not queue:
                del self._queues[topic]

    def _forget(self, n: Notification) -> None:
        if n.source is None:
            self._own.remove(n)
            return
        self._peers.remove(n)
        share = self._shares[n.source]
        share.remove(n)
        if not share.count:
            del self._shares[n.source]
