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


def test_the_transfer_series_read_as_prometheus_clients_own_would() -> None:
    """Metrics keeps the transfer series as plain numbers (prometheus_client's objects cost ~10 us a transfer): a
    scrape shows the same families, samples and values as its Counter and Histogram fed the same transfers."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from kvbrokerd import metrics

    reference = CollectorRegistry()
    labels = ["op", "backend", "peer", "outcome"]
    moved = Counter("kvbroker_transfer_bytes", "Bytes moved by finished transfers", labels, registry=reference)
    count = Counter("kvbroker_transfers", "Transfers by outcome", labels, registry=reference)
    seconds = Histogram("kvbroker_transfer_seconds", "Transfer latency: queue (validation, lookup, planning), wire "
                        "(data movement) and total", ["op", "backend", "peer", "stage"], buckets=metrics._BUCKETS,
                        registry=reference)
    m = Metrics()
    for i, queue_s in enumerate([0.00005, 0.0001, 0.0003, 1, 1.5, 60, 61, 0.02, 0.0]):
        key = ("pull_blocks", "tcp" if i % 3 else "shm", str(i % 2), "DONE" if i % 4 else "LLM_TIMEOUT")
        m.observe(*key, 100 * i, queue_s, queue_s / 2)
        moved.labels(*key).inc(100 * i)
        count.labels(*key).inc()
        for stage, value in zip(("queue", "wire", "total"), (queue_s, queue_s / 2, queue_s + queue_s / 2), strict=True):
            seconds.labels(*key[:3], stage).observe(value)

    def exposed(registry: CollectorRegistry) -> list[str]:
        # Creation timestamps differ (the two were made at different instants): their names must not.
        return sorted(line.rpartition(" ")[0] if "_created{" in line else line
                      for line in generate_latest(registry).decode().splitlines()
                      if line.startswith(("kvbroker_transfer", "# TYPE kvbroker_transfer", "# HELP kvbroker_transfer")))

    assert exposed(m.registry) == exposed(reference)
