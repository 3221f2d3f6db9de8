"""The notification box's bounds: what linked peers (token holders, possibly hostile) can make a daemon hold, per
sending host and in all; and the daemon's own grant events, which no peer's notes can refuse or drop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvbroker import LlmStatus
from kvbrokerd.errors import LlmError
from kvbrokerd.links import notifications

_CHARGE_1000 = 1000 + 1 + notifications.NOTE_OVERHEAD_BYTES  # a 1000-byte payload on a one-letter topic


def host(peer: int) -> str:
    """The host a test's peer `peer` links from (one host per peer unless a test says otherwise)."""
    return f"10.0.{peer}.1"


def test_queued_bytes_are_bounded_and_freed_by_fetching(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(notifications, "MAX_QUEUED_BYTES", 3 * _CHARGE_1000)
    box = notifications.NotificationBox()
    for topic in ("a", "b", "c"):
        box.put(7, topic, b"x" * 1000, source=host(7))
    with pytest.raises(LlmError) as err:
        box.put(7, "d", b"x", source=host(7))
    assert err.value.status == LlmStatus.LLM_OUT_OF_MEMORY
    got = asyncio.run(box.fetch("b", 10, 0.0))
    assert [n.payload for n in got] == [b"x" * 1000] and box.queued_bytes == 2 * _CHARGE_1000
    box.put(7, "d", b"y" * 1000, source=host(7))  # room again


def _flood(box: notifications.NotificationBox, cluster_id: int, topic: str | Callable[[int], str], payload: bytes,
           most: int, source: str = "") -> int:
    """Puts until refused (or `most`); how many got in. A refusal must say the sender is out of memory. `source`:
    the sending host (by default, one of the peer's own)."""
    for i in range(most):
        try:
            box.put(cluster_id, topic(i) if callable(topic) else topic, payload, source=source or host(cluster_id))
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
    box.put(8, "release", b"freed 42", source=host(8))
    assert box.share_of(host(8))[1] == 1


def test_empty_notifications_are_charged_and_bounded_per_peer() -> None:
    """Empty notifications cost memory (~400 bytes each) and used to cost nothing against the budget: peer 7 sends
    them to fresh topics (it used to take all 1024) and to one shared topic (it used to push peer 8's notification out
    of it); peer 8 still gets its notifications in, and they stay."""
    box = notifications.NotificationBox()
    box.put(8, "shared", b"mine", source=host(8))
    topics = _flood(box, 7, lambda i: f"t{i}", b"", 2000)
    assert topics < notifications.MAX_TOPICS, "one peer took every topic"
    assert box.queued_bytes >= topics * notifications.NOTE_OVERHEAD_BYTES
    box.put(8, "fresh", b"also mine", source=host(8))
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
        box.put(99, "t", b"", source=host(99))
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


# -- issue 30, finding 4: shares by sending host; the daemon's own events outside every peer's budget ---------------
def test_one_host_claiming_many_cluster_ids_fills_only_its_share() -> None:
    """One token holder links from one host as five cluster ids and floods from each (the shares used to be keyed by
    the claimed id: five shares filled the whole box); what it gets in is one host's share, and a peer on another
    host still gets its note in."""
    box = notifications.NotificationBox()
    payload = b"x" * notifications.MAX_PAYLOAD_BYTES
    got = sum(_flood(box, claimed, "release", payload, 2000, source="10.9.9.9") for claimed in range(71, 76))
    assert got * len(payload) <= notifications.MAX_QUEUED_BYTES_PER_PEER
    box.put(8, "release", b"freed 42", source=host(8))
    assert box.share_of(host(8))[1] == 1


def test_the_daemons_own_events_are_kept_whatever_peers_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers on many hosts fill every byte, count and topic the box gives peers; the daemon's own events (a grant's
    release and lapse) still get in, on a topic no peer used as well as on a full one, and are all delivered."""
    monkeypatch.setattr(notifications, "MAX_QUEUED", 40)
    monkeypatch.setattr(notifications, "MAX_TOPICS", 2)
    box = notifications.NotificationBox()
    got = sum(_flood(box, peer, f"t{peer}-0", b"z" * 50, 50) + _flood(box, peer, f"t{peer}-1", b"z" * 50, 50)
              for peer in range(10))
    assert got == 40  # every note and topic peers may hold
    for topic in ("t0-0", "new"):
        with pytest.raises(LlmError):
            box.put(99, topic, b"", source=host(99))
    box.post_own(1, "t0-0", b"released")
    box.post_own(1, "grant-events", b"lapsed")
    assert box.own_waiting()[1] == 2 and box.dropped == 0
    assert [n.payload for n in asyncio.run(box.fetch("grant-events", 0, 0.0))] == [b"lapsed"]
    assert [n.payload for n in asyncio.run(box.fetch("t0-0", 0, 0.0)) if n.source is None] == [b"released"]
    assert box.own_waiting() == (0, 0)


async def test_a_waiting_fetch_is_woken_by_an_arrival() -> None:
    """The long poll's wake-up, made certain: the daemon-level test cannot tell whether its fetch waited or found the
    note already there."""
    box = notifications.NotificationBox()
    fetch = asyncio.ensure_future(box.fetch("freed", 0, 30.0))
    await asyncio.sleep(0)  # one turn of the loop: the fetch finds its topic empty and waits
    assert not fetch.done()
    box.put(7, "freed", b"req-1", source=host(7))
    got = await asyncio.wait_for(fetch, 10)  # (only a hang detector: the wake-up is at once)
    assert [n.payload for n in got] == [b"req-1"]
