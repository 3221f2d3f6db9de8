"""Notifications linked peers send to this daemon's local clients, queued by topic until fetched.

The use: a decode engine tells the prefill engine, through both sidecars, that it holds a request's blocks, so the
prefill engine can free them. Bounded everywhere: topic and payload sizes, queued notifications per topic (the
oldest are dropped and counted), topics, and age.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from kvbrokerd.errors import LlmStatus, fail, param_invalid

log = logging.getLogger(__name__)

MAX_TOPIC_BYTES = 128
MAX_PAYLOAD_BYTES = 64 << 10
MAX_QUEUED_PER_TOPIC = 65536
MAX_TOPICS = 1024
MAX_QUEUED_BYTES = 64 << 20
"""Payload bytes waiting over all topics: what linked peers can make us hold."""
MAX_AGE_S = 600.0
MAX_FETCH = 65536
DEFAULT_FETCH = 1024
MAX_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class Notification:
    cluster_id: int
    topic: str
    payload: bytes
    received_unix: float
    received: float  # time.monotonic(), for expiry


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
        self.dropped = 0
        self.queued_bytes = 0

    def put(self, cluster_id: int, topic: str, payload: bytes) -> None:
        check(topic, payload)
        self._expire()
        if self.queued_bytes + len(payload) > MAX_QUEUED_BYTES:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"{MAX_QUEUED_BYTES} bytes of notifications wait to be fetched here; "
                 "try again once the receiving clients have fetched them")
        queue = self._queues.get(topic)
        if queue is None:
            if len(self._queues) >= MAX_TOPICS:
                param_invalid(f"more than {MAX_TOPICS} topics hold undelivered notifications")
            queue = self._queues[topic] = deque()
        if len(queue) >= MAX_QUEUED_PER_TOPIC:
            self._forget(queue.popleft())
            self.dropped += 1
            log.warning("topic %r: %d notifications waiting; dropped the oldest", topic, MAX_QUEUED_PER_TOPIC)
        queue.append(Notification(cluster_id, topic, payload, time.time(), time.monotonic()))
        self.queued_bytes += len(payload)
        event = self._arrived.get(topic)
        if event is not None:
            event.set()

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
        out = [queue.popleft() for _ in range(min(max_count, len(queue)))]
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
        self.queued_bytes -= len(n.payload)
