"""The notification box's bounds: what linked peers (token holders, possibly hostile) can make a daemon hold."""

from __future__ import annotations

import asyncio

import pytest

from kvbroker import LlmStatus
from kvbrokerd.errors import LlmError
from kvbrokerd.links import notifications


def test_queued_bytes_are_bounded_and_freed_by_fetching(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notifications, "MAX_QUEUED_BYTES", 3 * 1000)
    box = notifications.NotificationBox()
    for topic in ("a", "b", "c"):
        box.put(7, topic, b"x" * 1000)
    with pytest.raises(LlmError) as err:
        box.put(7, "d", b"x")
    assert err.value.status == LlmStatus.LLM_OUT_OF_MEMORY
    got = asyncio.run(box.fetch("b", 10, 0.0))
    assert [n.payload for n in got] == [b"x" * 1000] and box.queued_bytes == 2000
    box.put(7, "d", b"y" * 1000)  # room again


def test_a_full_topic_drops_its_oldest_and_keeps_the_count_of_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notifications, "MAX_QUEUED_PER_TOPIC", 2)
    box = notifications.NotificationBox()
    for i in range(3):
        box.put(7, "t", bytes([i]) * 10)
    assert box.dropped == 1 and box.queued_bytes == 20
    assert [n.payload[0] for n in asyncio.run(box.fetch("t", 10, 0.0))] == [1, 2]
    assert box.queued_bytes == 0
