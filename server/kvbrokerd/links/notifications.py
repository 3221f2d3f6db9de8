"""Notifications linked peers send to this daemon's local clients, queued by topic until fetched.

The use: a decode engine tells the prefill engine, through both sidecars, that it holds a request's blocks, so the
prefill engine can free them. Bounded everywhere: topic and payload sizes, queued notifications per topic (the
oldest are dropped and counted), topics, and age. What waits is bounded per sending peer as well as in all (bytes,
count, topics), so one peer that floods us is refused once it holds its own share and every other peer's
notifications (vLLM's block releases among them) still get in. Every notification is charged a fixed overhead on top
of its payload and topic: an empty one costs us memory too. A fetch answers at most MAX_FETCH_REPLY_BYTES and leaves
the rest queued: a reply gRPC cannot send would lose what it had dequeued.
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
MAX_QUEUED_PER_TOPIC = 65536
MAX_TOPICS = 1024
NOTE_OVERHEAD_BYTES = 512
"""Charged for each waiting notification besides its payload and topic: the record, its queue slot, its strings'
headers (about 400 bytes in CPython)."""
MAX_QUEUED_BYTES = 64 << 20
"""Charged bytes (payload + topic + NOTE_OVERHEAD_BYTES each) waiting over all topics and peers."""
MAX_QUEUED = 65536
"""Notifications waiting over all topics and peers."""
MAX_QUEUED_BYTES_PER_PEER = 16 << 20
"""Charged bytes waiting from one sending cluster: a flood from one peer stops there."""
MAX_QUEUED_PER_PEER = 16384
"""Notifications waiting from one sending cluster (below MAX_QUEUED_PER_TOPIC: one peer alone cannot make a topic
drop another peer's oldest notifications)."""
MAX_TOPICS_PER_PEER = 128
"""Topics holding notifications of one sending cluster (vLLM uses one per prefill engine rank)."""
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
    """What one sending cluster has waiting here."""

    bytes: int = 0
    count: int = 0
    topics: dict[str, int] = field(default_factory=dict)  # topic -> its notifications there


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
        self._shares: dict[int, _Share] = {}  # by sending cluster id
        self.dropped = 0
        self.queued_bytes = 0
        """Charged bytes waiting (see Notification.charge)."""
        self.queued = 0

    def share_of(self, cluster_id: int) -> tuple[int, int]:
        """(charged bytes, notifications) waiting from `cluster_id`."""
        share = self._shares.get(cluster_id)
        return (share.bytes, share.count) if share else (0, 0)

    def put(self, cluster_id: int, topic: str, payload: bytes) -> None:
        check(topic, payload)
        self._expire()
        note = Notification(cluster_id, topic, payload, time.time(), time.monotonic())
        share = self._shares.get(cluster_id) or _Share()
        self._admit(cluster_id, share, note)
        queue = self._queues.get(topic)
        if queue is None:
            if len(self._queues) >= MAX_TOPICS:
                param_invalid(f"more than {MAX_TOPICS} topics hold undelivered notifications")
            queue = self._queues[topic] = deque()
        if len(queue) >= MAX_QUEUED_PER_TOPIC:
            self._forget(queue.popleft())
            self.dropped += 1
            log.warning("topic %r: %d notifications waiting; dropped the oldest", topic, MAX_QUEUED_PER_TOPIC)
        queue.append(note)
        self._shares[cluster_id] = share
        share.bytes += note.charge
        share.count += 1
        share.topics[topic] = share.topics.get(topic, 0) + 1
        self.queued_bytes += note.charge
        self.queued += 1
        event = self._arrived.get(topic)
        if event is not None:
            event.set()

    def _admit(self, cluster_id: int, share: _Share, note: Notification) -> None:
        """Refuses `note` (LLM_OUT_OF_MEMORY, nothing changed) where it would take its sender past its share or
        everyone past the whole; the sender's own share is checked first, so a flooding peer learns it is the one."""
        later = "try again once the receiving clients have fetched them"
        if share.bytes + note.charge > MAX_QUEUED_BYTES_PER_PEER or share.count >= MAX_QUEUED_PER_PEER:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"cluster {cluster_id} has {share.count} notifications ({share.bytes} "
                 f"bytes as charged) waiting here, its share (at most {MAX_QUEUED_PER_PEER} and "
                 f"{MAX_QUEUED_BYTES_PER_PEER} bytes); {later}")
        if note.topic not in share.topics and len(share.topics) >= MAX_TOPICS_PER_PEER:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"cluster {cluster_id} has notifications waiting in "
                 f"{MAX_TOPICS_PER_PEER} topics here, its share; {later}")
        if self.queued_bytes + note.charge > MAX_QUEUED_BYTES or self.queued >= MAX_QUEUED:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"{self.queued} notifications ({self.queued_bytes} bytes as charged) "
                 f"wait to be fetched here, the most this daemon holds; {later}")

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
        self.queued_bytes -= n.charge
        self.queued -= 1
        share = self._shares[n.cluster_id]
        share.bytes -= n.charge
        share.count -= 1
        share.topics[n.topic] -= 1
        if not share.topics[n.topic]:
            del share.topics[n.topic]
        if not share.count:
            del self._shares[n.cluster_id]
