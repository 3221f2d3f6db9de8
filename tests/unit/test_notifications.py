"""The notification box's bounds: what linked peers (token holders, possibly hostile) can make a daemon hold, per
sending peer and in all."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvbroker import LlmStatus
from kvbrokerd.errors import LlmError
from kvbrokerd.links import notifications

_CHARGE_1000 = 1000 + 1 + notifications.NOTE_OVERHEAD_BYTES  # a 1000-byte payload on a one-letter topic


def test_queued_bytes_are_bounded_and_freed_by_fetching(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notifications, "MAX_QUEUED_BYTES", 3 * _CHARGE_1000)
    box = notifications.NotificationBox()
    for topic in ("a", "b", "c"):
        box.put(7, topic, b"x" * 1000)
    with pytest.raises(LlmError) as err:
        box.put(7, "d", b"x")
    assert err.value.status == LlmStatus.LLM_OUT_OF_MEMORY
    got = asyncio.run(box.fetch("b", 10, 0.0))
    assert [n.payload for n in got] == [b"x" * 1000] and box.queued_bytes == 2 * _CHARGE_1000
    box.put(7, "d", b"y" * 1000)  # room again


def test_a_full_topic_drops_its_oldest_and_keeps_the_count_of_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notifications, "MAX_QUEUED_PER_TOPIC", 2)
    box = notifications.NotificationBox()
    for i in range(3):
        box.put(7, "t", bytes([i]) * 10)
    assert box.dropped == 1 and box.queued_bytes == 2 * (10 + 1 + notifications.NOTE_OVERHEAD_BYTES)
    assert [n.payload[0] for n in asyncio.run(box.fetch("t", 10, 0.0))] == [1, 2]
    assert box.queued_bytes == 0 and box.share_of(7) == (0, 0)


def _flood(box: notifications.NotificationBox, cluster_id: int, topic: str | Callable[[int], str], payload: bytes,
           most: int) -> int:
    """Puts until refused (or `most`); how many got in. A refusal must say the sender is out of memory."""
    for i in range(most):
        try:
            box.put(cluster_id, topic(i) if callable(topic) else topic, payload)
        except LlmError as e:
            assert e.status == LlmStatus.LLM_OUT_OF_MEMORY, e
            return i
    return most


# -- issue 23, finding 6: one peer exhausts only its own share --------------------------------------------------------
def test_one_peer_filling_the_bytes_leaves_other_peers_room() -> None:
    """Peer 7 sends 64 KiB notifications until refused (it used to fill the daemon's 64 MiB in ~1 s and every other
    peer was refused for up to 10 minutes); peer 8's block release still gets in."""
    box = notifications.NotificationBox()
    got = _flood(box, 7, "release", b"x" * notifications.MAX_PAYLOAD_BYTES, 2000)
    assert got < 1024, "one peer took the whole notification budget"
    box.put(8, "release", b"freed 42")
    assert box.share_of(8)[1] == 1


def test_empty_notifications_are_charged_and_bounded_per_peer() -> None:
    """Empty notifications cost memory (~400 bytes each) and used to cost nothing against the budget: peer 7 sends
    them to fresh topics (it used to take all 1024) and to one shared topic (it used to push peer 8's notification out
    of it); peer 8 still gets its notifications in, and they stay."""
    box = notifications.NotificationBox()
    box.put(8, "shared", b"mine")
    topics = _flood(box, 7, lambda i: f"t{i}", b"", 2000)
    assert topics < notifications.MAX_TOPICS, "one peer took every topic"
    assert box.queued_bytes >= topics * notifications.NOTE_OVERHEAD_BYTES
    box.put(8, "fresh", b"also mine")
    _flood(box, 7, "shared", b"", 70000)
    assert box.dropped == 0
    got = asyncio.run(box.fetch("shared", 1, 0.0))
    assert [(n.cluster_id, n.payload) for n in got] == [(8, b"mine")]
    assert [n.payload for n in asyncio.run(box.fetch("fresh", 0, 0.0))] == [b"also mine"]


def test_the_global_limits_still_hold_over_many_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notifications, "MAX_QUEUED", 10)
    box = notifications.NotificationBox()
    assert sum(_flood(box, peer, "t", b"", 3) for peer in range(5)) == 10
    with pytest.raises(LlmError) as err:
        box.put(99, "t", b"")
    assert err.value.status == LlmStatus.LLM_OUT_OF_MEMORY and "the most this daemon holds" in err.value.message


# -- issue 23, finding 7: a fetch answers what one reply can carry and leaves the rest queued ------------------------
def test_a_fetch_is_bounded_by_bytes_and_leaves_the_rest_queued() -> None:
    box = notifications.NotificationBox()
    payload = b"y" * notifications.MAX_PAYLOAD_BYTES
    sent = sum(_flood(box, peer, "big", payload, 2000) for peer in (1, 2, 3, 4, 5))
    assert sent * len(payload) > notifications.MAX_FETCH_REPLY_BYTES
    fetched = 0
    while got := asyncio.run(box.fetch("big", 0, 0.0)):
        assert sum(n.wire_bytes for n in got) <= notifications.MAX_FETCH_REPLY_BYTES
        fetched += len(got)
    assert fetched == sent and box.queued == 0 and box.queued_bytes == 0
