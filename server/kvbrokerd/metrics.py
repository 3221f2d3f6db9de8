"""Prometheus metrics: what moved, how it ended, how long it took, and the daemon's state at scrape time.

Names (all prefixed kvbroker_): transfer_bytes_total and transfers_total {op, backend, peer, outcome};
transfer_seconds {op, backend, peer, stage=queue|wire|total}; and, read from the daemon when scraped: links {state}
(the links this daemon made), inbound_links (those peers made to it), links_reclaimed_total {side=outbound|inbound,
reason} (links removed without an unlink: outbound `broken`, `idle`, `room`; inbound `expired`, `silent`,
`fair_share`, `displaced`), caches, registered_bytes, transfers_in_flight, inflight_bytes, sessions, grants,
grants_ended_total {outcome=released|lapsed|capped|cache_removed} (holds of this daemon's blocks that ended, and how),
grants_redeemed_total (RedeemGrant calls answered) and grant_pulls_total {source=remembered|redeemed} (pulls by grant
made, and whether a renewal's answer spared the RedeemGrant round trip).

With tracing on (kvbrokerd.tracing), each bucket of transfer_seconds that a sampled transfer landed in carries the
latest such transfer's trace id as its exemplar ({trace_id="..."}; shown in the OpenMetrics exposition only, which
Prometheus asks for when its exemplar storage is on): a slow bucket on a dashboard links to a trace that was slow.

`peer` is the remote cluster id of the transfer (`local` for a copy within this daemon, `several` for a batch over
more than one peer). Its cardinality is bounded: at most `max_peers` (MAX_PEER_LABELS) linked cluster ids get series
of their own, the first ones seen; the transfers of any further peer, and those naming a cluster this daemon has no
link to, are counted under `peer="other"`. When a link is
removed (unlinked, or reclaimed: dead, idle or making room), that peer's series are removed and its place is free
for the next peer, so a fleet that churns through thousands of pods keeps a bounded set of series.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, Exemplar, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvbrokerd.listen import ListenError, in_use

log = logging.getLogger(__name__)
K = TypeVar("K", str, tuple[str, str])

MAX_PEER_LABELS = 256
"""Distinct `peer` label values with series of their own (a decode daemon's prefill peers; beyond: `other`)."""
_SHARED_PEERS = frozenset({"local", "several", "other"})
_STAGES = ("queue", "wire", "total")
GRANT_END_OUTCOMES = ("released", "lapsed", "capped", "cache_removed")
LINK_RECLAIM_REASONS = (("outbound", ("broken", "idle", "room")),
                        ("inbound", ("expired", "silent", "fair_share", "displaced")))
GRANT_PULL_SOURCES = ("remembered", "redeemed")
"""The label values of the state series above: each one exists at zero from the start (a rate over it is defined
before the first event, as for the connector's series on vLLM's `/metrics`), and docs/vllm.md lists them."""
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BUCKET_LABELS = tuple(repr(float(bound)) for bound in _BUCKETS)
"""The `le` label of each bucket, as prometheus_client writes it ("0.0001", "1.0", "60.0")."""


def _from_zero(counts: dict[K, int], known: Iterable[K]) -> list[tuple[K, int]]:
    """`counts` with every `known` key present (0 until it happened), sorted."""
    return sorted({**dict.fromkeys(known, 0), **counts}.items())


class _TransferCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[CounterMetricFamily | HistogramMetricFamily | GaugeMetricFamily]:
        return self._metrics.transfer_families()


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        state = self._read()
        links = GaugeMetricFamily("kvbroker_links", "Links this daemon made, by state", labels=["state"])
        for name, count in sorted(state["links"].items()):
            links.add_metric([name], count)
        yield links
        yield GaugeMetricFamily("kvbroker_inbound_links", "Links peers made to this daemon",
                                value=state["inbound_links"])
        reclaimed = CounterMetricFamily("kvbroker_links_reclaimed", "Links removed without an unlink (dead, "
                                        "silent, idle or making room), by side and reason", labels=["side", "reason"])
        counts = _from_zero(state["links_reclaimed"], [(side, reason) for side, reasons in LINK_RECLAIM_REASONS
                                                           for reason in reasons])
        for (side, reason), count in counts:
            reclaimed.add_metric([side, reason], count)
        yield reclaimed
        ended = CounterMetricFamily("kvbroker_grants_ended", "Grants of held blocks that ended, by outcome (released "
                                    "by the holder; lapsed: no renewal; capped; cache_removed)", labels=["outcome"])
        by_outcome = {outcome.replace(" ", "_"): count for outcome, count in state.get("grants_ended", {}).items()}
        for outcome, count in _from_zero(by_outcome, GRANT_END_OUTCOMES):
            ended.add_metric([outcome], count)
        yield ended
        yield CounterMetricFamily("kvbroker_grants_redeemed", "Peer.RedeemGrant calls this daemon answered (a peer's "
                                  "pull by grant that could not use a renewal's answer)",
                                  value=state.get("grants_redeemed", 0))
        answers = CounterMetricFamily("kvbroker_grant_pulls", "Pulls by grant this daemon made, by how it learned "
                                      "the grant (remembered: from a renewal's answer; redeemed: a RedeemGrant call)",
                                      labels=["source"])
        for source, count in _from_zero(state.get("grant_answers", {}), GRANT_PULL_SOURCES):
            answers.add_metric([source], count)
        yield answers
        for key, text in (("caches", "Caches held"), ("registered_bytes", "Bytes of all caches held"),
                          ("transfers_in_flight", "Transfers running now"),
                          ("inflight_bytes", "Bytes of the transfers running now"),
                          ("sessions", "Client sessions with a live lease"),
                          ("grants", "Grants of held blocks with a live lease"),
                          ("grant_renewals_in_flight", "Renewals of peers' grants on their way (a pull by one of "
                           "those grants waits for the answer instead of redeeming)"),
                          ("grant_pulls_waiting", "Pulls by grant waiting for a renewal's answer now")):
            yield GaugeMetricFamily(f"kvbroker_{key}", text, value=state[key])


class _Series:
    """One (op, backend, peer, outcome) label set's numbers, and the stage histograms of its (op, backend, peer)."""

    __slots__ = ("count", "created", "moved")

    def __init__(self) -> None:
        self.moved = 0
        self.count = 0
        self.created = time.time()


class _Histograms:
    """Per stage: observations per bucket (the last one past every bound) and their sum; and, once a traced
    transfer was observed, per stage and bucket the latest traced one (trace id, value, unix time): an exemplar."""

    __slots__ = ("buckets", "created", "exemplars", "sums")

    def __init__(self) -> None:
        self.buckets = [[0] * (len(_BUCKETS) + 1) for _ in _STAGES]
        self.sums = [0.0] * len(_STAGES)
        self.created = time.time()
        self.exemplars: list[list[tuple[str, float, float] | None]] | None = None


def _exemplify(histograms: _Histograms, trace_id: str, values: tuple[float, float, float]) -> None:
    if histograms.exemplars is None:
        histograms.exemplars = [[None] * (len(_BUCKETS) + 1) for _ in _STAGES]
    now = time.time()
    for i, value in enumerate(values):
        histograms.exemplars[i][bisect.bisect_left(_BUCKETS, value)] = (trace_id, value, now)


class Metrics:
    def __init__(self, max_peers: int = MAX_PEER_LABELS, linked: Callable[[str], bool] = lambda peer: True) -> None:
        """`linked(peer)`: whether this daemon has a link to `peer` now; a peer without one (a pull naming a cluster
        never linked) gets no series of its own, so calls naming made-up cluster ids cannot use up the places."""
        self.registry = CollectorRegistry()
        self.max_peers = max_peers
        self._linked = linked
        # The transfer series as plain numbers, exposed at scrape (_TransferCollector): prometheus_client's own
        # counters and histograms cost ~10 us a transfer (a lock per value, a Python loop over the buckets), a
        # plain record ~1 us. Written on the event loop only; a scrape reads a copy of the tables.
        self._series: dict[tuple[str, str, str, str], _Series] = {}
        self._histograms: dict[tuple[str, str, str], _Histograms] = {}
        self._peers: dict[str, set[tuple[str, str, str, str]]] = {}
        """Peers with series of their own -> the label sets made for them (to remove them with the peer)."""
        self.registry.register(_TransferCollector(self))

    def _peer_label(self, peer: str) -> str:
        if peer in self._peers or peer in _SHARED_PEERS:
            return peer
        if len(self._peers) >= self.max_peers or not self._linked(peer):
            return "other"
        self._peers[peer] = set()
        return peer

    def forget_peer(self, peer: str) -> None:
        """`peer`'s link is gone: its series go (a scrape no longer shows them) and its place is free. Runs on the
        event loop, as `observe` does."""
        for key in self._peers.pop(peer, ()):
            self._series.pop(key, None)
            self._histograms.pop(key[:3], None)

    def observe(self, op: str, backend: str, peer: str, outcome: str, moved: int, queue_s: float,
                wire_s: float, trace_id: str | None = None) -> None:
        """`trace_id`: the transfer's trace (32 hex digits) if it was sampled: the buckets it lands in show it as
        their exemplar (OpenMetrics), so that a dashboard's slow bucket links to a slow transfer's trace."""
        peer = self._peer_label(peer)
        key = (op, backend, peer, outcome)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series()
            if peer in self._peers:
                self._peers[peer].add(key)
        series.moved += moved
        series.count += 1
        histograms = self._histograms.get(key[:3])
        if histograms is None:
            histograms = self._histograms[key[:3]] = _Histograms()
        for i, value in enumerate((queue_s, wire_s, queue_s + wire_s)):  # the order of _STAGES
            histograms.buckets[i][bisect.bisect_left(_BUCKETS, value)] += 1
            histograms.sums[i] += value
        if trace_id:
            _exemplify(histograms, trace_id, (queue_s, wire_s, queue_s + wire_s))

    def transfer_families(self) -> list[CounterMetricFamily | HistogramMetricFamily | GaugeMetricFamily]:
        """The transfer series as a scrape shows them."""
        labels = ["op", "backend", "peer", "outcome"]
        moved = CounterMetricFamily("kvbroker_transfer_bytes", "Bytes moved by finished transfers", labels=labels)
        count = CounterMetricFamily("kvbroker_transfers", "Transfers by outcome", labels=labels)
        for key, series in sorted(self._series.copy().items()):
            moved.add_metric(key, series.moved, created=series.created)
            count.add_metric(key, series.count, created=series.created)
        seconds = HistogramMetricFamily("kvbroker_transfer_seconds", "Transfer latency: queue (validation, lookup, "
                                        "planning), wire (data movement) and total",
                                        labels=["op", "backend", "peer", "stage"])
        # prometheus_client's histograms show when each series began as a gauge family of its own.
        created = GaugeMetricFamily("kvbroker_transfer_seconds_created", seconds.documentation,
                                    labels=["op", "backend", "peer", "stage"])
        for key3, histograms in sorted(self._histograms.copy().items()):
            exemplars = histograms.exemplars
            for i, (stage, buckets, total) in enumerate(zip(_STAGES, histograms.buckets, histograms.sums,
                                                            strict=True)):
                cumulative = list(itertools.accumulate(buckets))
                rows: list[Any] = [*zip((*_BUCKET_LABELS, "+Inf"), cumulative, strict=True)]
                if exemplars is not None:
                    rows = [row if seen is None else (*row, Exemplar({"trace_id": seen[0]}, seen[1], seen[2]))
                            for row, seen in zip(rows, list(exemplars[i]), strict=True)]
                seconds.add_metric([*key3, stage], rows, total)
                created.add_metric([*key3, stage], histograms.created)
        return [moved, count, seconds, created]

    def watch(self, read_state: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_StateCollector(read_state))

    def serve(self, address: str) -> int:
        host, _, port = address.rpartition(":")
        try:
            server, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
        except OSError as e:  # alone, "[Errno 98] Address already in use" does not say which address
            if e.errno == errno.EADDRINUSE:
                raise in_use(address, "metrics") from None
            raise ListenError(f"cannot listen on {address} (metrics): {e.strerror or e}") from None
        bound = int(server.server_port)
        log.info("metrics on http://%s:%d/metrics", host, bound)
        self._server = server
        return bound

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()
