"""Pending cache lookups (GetCacheInfo calls under way, which may wait for a backend to register the cache) are
bounded per link as well as in all: one peer that keeps lookups pending holds up only its own (issue 23, finding 9).
The counting is the service's own; a lookup that really waits needs a registering backend (hccl/nixl tests)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from kvbroker import LlmStatus
from kvbrokerd.errors import LlmError
from kvbrokerd.links.inbound import InboundLink
from kvbrokerd.service import peer


def _link() -> InboundLink:
    return InboundLink(remote_cluster_id=7, remote_epoch="e", created=0.0, secret=b"s" * 32, last_heard=0.0)


def test_one_link_keeping_lookups_pending_leaves_other_links_theirs() -> None:
    service = peer.PeerService(node=None)  # type: ignore[arg-type]
    greedy, honest = _link(), _link()
    with contextlib.ExitStack() as held:
        for _ in range(peer.MAX_PENDING_LOOKUPS_PER_LINK):
            held.enter_context(service._lookup(greedy))
        with pytest.raises(LlmError) as err, service._lookup(greedy):
            pass
        assert err.value.status == LlmStatus.LLM_LINK_BUSY
        with service._lookup(honest):
            pass
    with service._lookup(greedy):  # every pending one counted back
        assert service._pending == 1


def test_pending_lookups_are_bounded_in_all(monkeypatch: Any) -> None:
    monkeypatch.setattr(peer, "MAX_PENDING_LOOKUPS", 3)
    service = peer.PeerService(node=None)  # type: ignore[arg-type]
    with contextlib.ExitStack() as held:
        for _ in range(3):
            held.enter_context(service._lookup(_link()))
        with pytest.raises(LlmError) as err, service._lookup(_link()):
            pass
        assert err.value.status == LlmStatus.LLM_LINK_BUSY
    assert service._pending == 0 and not service._lookups
