"""The daemon's transfer series (server/kvbrokerd/metrics.py) against a real prometheus_client registry: the `peer`
label is bounded (at most `max_peers` linked clusters get series of their own, the rest share `other`) and a peer's
series go when its link does, freeing its place. The same against real daemons: tests/integration/test_observability.py.
"""

from __future__ import annotations

from kvbrokerd.metrics import Metrics


def _peers(m: Metrics) -> set[str]:
    return {s.labels["peer"] for family in m.registry.collect() if family.name.startswith("kvbroker_transfer")
            for s in family.samples}


def _count(m: Metrics, peer: str) -> float:
    return m.registry.get_sample_value("kvbroker_transfers_total", {"op": "pull_blocks", "backend": "tcp",
                                                                     "peer": peer, "outcome": "DONE"}) or 0.0


def test_peer_labels_are_capped_and_a_forgotten_peer_frees_its_place() -> None:
    linked = {"1", "2", "3", "4"}
    m = Metrics(max_peers=2, linked=lambda peer: peer in linked)
    for peer in ("1", "2", "3", "99", "local", "several"):
        m.observe("pull_blocks", "tcp", peer, "DONE", 10, 0.001, 0.002)
    assert _peers(m) == {"1", "2", "other", "local", "several"}  # 3: past the cap; 99: never linked
    assert _count(m, "other") == 2
    m.observe("pull_blocks", "tcp", "1", "LLM_TIMEOUT", 0, 0.001, 0.002)
    m.forget_peer("1")  # its link was reclaimed: every series of it goes, histograms included
    assert _peers(m) == {"2", "other", "local", "several"}
    assert m.registry.get_sample_value("kvbroker_transfer_seconds_count", {
        "op": "pull_blocks", "backend": "tcp", "peer": "1", "stage": "wire"}) is None
    m.observe("pull_blocks", "tcp", "4", "DONE", 10, 0.001, 0.002)  # the freed place goes to the next peer
    assert _count(m, "4") == 1
    m.forget_peer("other")  # the shared labels are never a peer's to drop
    m.forget_peer("never seen")
    assert "other" in _peers(m)
    m.observe("pull_blocks", "tcp", "1", "DONE", 10, 0.001, 0.002)  # back, but the places are taken
    assert _count(m, "1") == 0 and _count(m, "other") == 3
