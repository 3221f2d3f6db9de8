"""One request, one trace: a client-started trace through CreateGrant on a prefill daemon and a pull by that grant on
a decode daemon, collected by an OTLP receiver in the test (OpenTelemetry's own gRPC TraceService, served by grpc
here). Also: a malformed or oversized traceparent is dropped (the call succeeds, in a trace of its own), the pull's
time histogram carries the trace id as an exemplar, and with tracing off a daemon imports no OpenTelemetry at all."""

from __future__ import annotations

import contextlib
import os
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing needs kvbroker[trace]")

from kvbroker import CacheDesc, tracecontext
from kvbroker._local import LocalDaemon
from kvbroker.tracecontext import TraceContext
from kvbroker.v1 import broker_pb2, broker_pb2_grpc
from tests.conftest import cluster_of
from tests.helpers import fill, wait_until
from tests.otlp import Receiver, Span, serving

DESC = CacheDesc(num_tensors=2, shape=(8, 64))
STAGES_OF_A_GRANTED_PULL = {"redeem", "endpoints", "plan", "claim", "copy"}
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # ms: the batch processor sends within a test's patience


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, str]]:
    with serving() as served:
        yield served


@dataclass
class Traced:
    p: LocalDaemon
    d: LocalDaemon
    receiver: Receiver
    endpoint: str


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, receiver: tuple[Receiver, str]) -> Iterator[Traced]:
    collector, endpoint = receiver
    root = tmp_path_factory.mktemp("tracing")
    args = ["--otlp-traces-endpoint", endpoint]
    with LocalDaemon(root, 371, extra_args=args, env={**FAST_EXPORT, "OTEL_SERVICE_NAME": "prefill"}) as p, \
            LocalDaemon(root, 372, extra_args=[*args, "--metrics-listen", "127.0.0.1:0"],
                        env={**FAST_EXPORT, "OTEL_SERVICE_NAME": "decode"}) as d:
        with d.client() as c:
            assert c.link_clusters([cluster_of(p)])[0].ok
        yield Traced(p, d, collector, endpoint)


@contextlib.contextmanager
def client_tracer(endpoint: str) -> Iterator[object]:
    """The test process as the client's application: an OpenTelemetry SDK of its own, exporting to the receiver."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "client"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"http://{endpoint}")))
    try:
        yield provider.get_tracer("test")
    finally:
        provider.shutdown()


def test_one_trace_across_the_client_and_both_daemons_and_the_pull_links_to_its_grant(traced: Traced) -> None:
    with traced.p.client() as pc, traced.d.client() as dc, client_tracer(traced.endpoint) as tracer:
        src, dst = pc.allocate_cache(DESC), dc.allocate_cache(DESC)
        fill(src, 1)
        with tracer.start_as_current_span("request") as root:  # type: ignore[attr-defined]
            grant = pc.create_grant([src.cache_id], [1, 2, 3], 30.0, label="req-7")
            result = dc.pull_granted_kv_blocks(traced.p.cluster_id, grant, dst, [4, 5, 6])
        trace_id = f"{root.get_span_context().trace_id:032x}"
    assert result.bytes_moved > 0
    r = traced.receiver

    def complete() -> list[Span]:
        spans = r.of(trace_id)
        names = {s.name for s in spans}
        wanted = {"request", "kvbroker.v1.KvBroker/CreateGrant", "kvbroker.v1.KvBroker/PullKvBlocks",
                  "transfer pull_blocks", *STAGES_OF_A_GRANTED_PULL}
        return spans if wanted <= names else []

    spans = wait_until(complete, what="the spans of the request's trace")
    by_name = {s.name: s for s in spans}
    assert {s.service for s in spans} == {"client", "prefill", "decode"}  # one trace id, three processes
    request = by_name["request"]
    grant_rpc = by_name["kvbroker.v1.KvBroker/CreateGrant"]
    pull_rpc = by_name["kvbroker.v1.KvBroker/PullKvBlocks"]
    pull = by_name["transfer pull_blocks"]
    assert (grant_rpc.service, grant_rpc.parent) == ("prefill", request.span_id)
    assert (pull_rpc.service, pull_rpc.parent) == ("decode", request.span_id)
    assert pull.parent == pull_rpc.span_id
    for name in STAGES_OF_A_GRANTED_PULL:
        assert by_name[name].parent == pull.span_id and by_name[name].service == "decode", name
    assert (trace_id, grant_rpc.span_id) in pull.links  # the decode pull links to the grant it pulled by
    assert pull.attributes["kvbroker.peer_cluster"] == str(traced.p.cluster_id)
    assert pull.attributes["kvbroker.bytes"] == result.bytes_moved
    assert pull.attributes["kvbroker.blocks"] == 3
    assert pull.attributes["kvbroker.status"] == "DONE"
    assert pull.attributes["kvbroker.transfer_id"] == result.transfer_id
    assert by_name["copy"].attributes["kvbroker.backend"] == result.backend == pull.attributes["kvbroker.backend"]
    assert grant_rpc.attributes["kvbroker.grant_label"] == "req-7"
    # The pull's time histogram names the trace (an exemplar, in the OpenMetrics exposition only).
    address = dc.get_cluster_info().metrics_address
    scrape = urllib.request.Request(f"http://{address}/metrics",
                                    headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(scrape, timeout=5) as resp:
        text = resp.read().decode()
    assert any(line.startswith("kvbroker_transfer_seconds_bucket{") and 'op="pull_blocks"' in line
               and f'# {{trace_id="{trace_id}"}}' in line for line in text.splitlines()), text[-2000:]


def test_an_explicit_trace_context_and_a_session_pull_of_its_own_are_continued(traced: Traced) -> None:
    parent = TraceContext.parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "vendor=value")
    assert parent is not None
    other = TraceContext.parse("00-5bf92f3577b34da6a3ce929d0e0e4736-10f067aa0ba902b7-01")
    assert other is not None
    with traced.p.client() as pc, traced.d.client() as dc:
        src, dst = pc.allocate_cache(DESC), dc.allocate_cache(DESC)
        grant = pc.create_grant([src.cache_id], [0, 1], 30.0, trace_context=parent)
        with tracecontext.use(other):  # a session's pull carries its own (the one current when submitted)
            from kvbroker import CacheIndex, SessionPull

            session = dc.open_pull_session()
            try:
                (future,) = session.submit([SessionPull(CacheIndex(traced.p.cluster_id, 0), dst.cache_id, (2, 3),
                                                        grant=grant)])
                future.result(timeout=30)
            finally:
                session.close()
    r = traced.receiver
    grant_rpc = wait_until(lambda: r.of(parent.trace_id), what="CreateGrant's span")[0]
    assert grant_rpc.parent == parent.span_id
    pull = wait_until(lambda: [s for s in r.of(other.trace_id) if s.name == "transfer pull_blocks"],
                      what="the session pull's span")[0]
    assert pull.parent == other.span_id
    assert (parent.trace_id, grant_rpc.span_id) in pull.links  # across traces: the grant's request, the pull's


def test_a_pull_by_a_grant_its_daemon_described_in_a_renewal_links_to_the_grant_too(traced: Traced) -> None:
    parent = TraceContext.parse("00-7bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert parent is not None
    with traced.p.client() as pc, traced.d.client() as dc:
        src, dst = pc.allocate_cache(DESC), dc.allocate_cache(DESC)
        grant = pc.create_grant([src.cache_id], [0, 1], 30.0, trace_context=parent)
        dc.renew_grant(grant, 30.0, cluster_id=traced.p.cluster_id)  # the decode side now knows it: no redeem
        dc.pull_granted_kv_blocks(traced.p.cluster_id, grant, dst, [2, 3], trace_context=parent)
    r = traced.receiver
    grant_rpc = wait_until(lambda: [s for s in r.of(parent.trace_id) if s.name.endswith("/CreateGrant")],
                           what="CreateGrant's span")[0]
    pull = wait_until(lambda: [s for s in r.of(parent.trace_id) if s.name == "transfer pull_blocks"],
                      what="the pull's span")[0]
    assert (parent.trace_id, grant_rpc.span_id) in pull.links


def test_a_failed_pull_and_a_layer_wise_pull_are_traced_with_their_status(traced: Traced) -> None:
    from kvbroker import CacheIndex, NotYetLinkError

    parent = TraceContext.parse("00-8bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert parent is not None
    with traced.p.client() as pc, traced.d.client() as dc:
        src, dst = pc.allocate_cache(DESC), dc.allocate_cache(DESC)
        with pytest.raises(NotYetLinkError):  # no link from the decode daemon to cluster 999
            dc.pull_kv_blocks(CacheIndex(999, 1), dst, [0], [1], trace_context=parent)
        layers: list[object] = []
        with tracecontext.use(parent):
            dc.pull_kv_blocks(CacheIndex(traced.p.cluster_id, src.cache_id), dst, [0, 1], [2, 3],
                              on_layer=layers.append)
    assert layers
    r = traced.receiver

    def both() -> dict[object, Span]:
        ops = {s.attributes["kvbroker.op"]: s for s in r.of(parent.trace_id) if s.name.startswith("transfer")}
        return ops if {"pull_blocks", "pull_blocks_stream"} <= ops.keys() else {}

    by_op = wait_until(both, what="the spans of both pulls")  # each exported when its batch is
    failed = by_op["pull_blocks"]
    assert failed.attributes["kvbroker.status"] == "LLM_NOT_YET_LINK"
    rpc = next(s for s in r.of(parent.trace_id) if s.span_id == failed.parent)
    assert rpc.name == "kvbroker.v1.KvBroker/PullKvBlocks" and rpc.attributes["kvbroker.status"] == "LLM_NOT_YET_LINK"
    stream = by_op["pull_blocks_stream"]
    assert stream.parent == parent.span_id and stream.attributes["kvbroker.status"] == "DONE"


@pytest.mark.parametrize("traceparent", [
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",  # a flag digit short
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # an all-zero trace id
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
    # huge (within gRPC's own 8 KiB of metadata: gRPC refuses more itself, RESOURCE_EXHAUSTED, before any handler)
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" + "-x" * 1500,
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # the version W3C forbids
])
def test_a_malformed_or_huge_traceparent_is_dropped_and_the_call_succeeds_in_a_trace_of_its_own(
        traced: Traced, traceparent: str) -> None:
    label = f"malformed-{abs(hash(traceparent))}"
    with grpc.insecure_channel(traced.p.target) as channel, traced.p.client() as pc:
        src = pc.allocate_cache(DESC)
        stub = broker_pb2_grpc.KvBrokerStub(channel)
        answer = stub.CreateGrant(broker_pb2.CreateGrantRequest(cache_ids=[src.cache_id], blocks=[0], lease_ms=5000,
                                                                label=label),
                                  metadata=[("traceparent", traceparent), ("tracestate", "k=" + "v" * 3000)],
                                  timeout=10)
        assert answer.grant.grant_id
    r = traced.receiver
    (span,) = wait_until(lambda: [s for s in r.named("kvbroker.v1.KvBroker/CreateGrant")
                                  if s.attributes.get("kvbroker.grant_label") == label], what="the call's span")
    assert span.parent == "" and span.trace_id not in traceparent


def test_with_tracing_off_a_daemon_imports_no_opentelemetry_and_calls_with_a_trace_succeed(
        tmp_path: Path) -> None:
    # A sitecustomize in the daemons' path writes, at their exit, which OpenTelemetry modules they had loaded.
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(
        "import atexit, os, sys\n"
        "def _dump():\n"
        "    with open(os.environ['KVBROKER_TEST_MODULES'] + str(os.getpid()), 'w') as f:\n"
        "        f.write(' '.join(m for m in sys.modules if m.startswith('opentelemetry')) + '\\n')\n"
        "atexit.register(_dump)\n")
    env = {"PYTHONPATH": os.pathsep.join([str(probe), os.environ.get("PYTHONPATH", "")]),
           "KVBROKER_TEST_MODULES": str(tmp_path / "modules-")}
    parent = TraceContext.parse("00-6bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    with LocalDaemon(tmp_path, 381, env=env) as p, LocalDaemon(tmp_path, 382, env=env) as d, \
            d.client() as dc, p.client() as pc:
        assert dc.link_clusters([cluster_of(p)])[0].ok
        src, dst = pc.allocate_cache(DESC), dc.allocate_cache(DESC)
        grant = pc.create_grant([src.cache_id], [0], 30.0, trace_context=parent)
        assert dc.pull_granted_kv_blocks(p.cluster_id, grant, dst, [1], trace_context=parent).bytes_moved
    dumps = sorted(tmp_path.glob("modules-*"))
    assert len(dumps) == 2, "both daemons exited and said what they had loaded"
    assert all(path.read_text().strip() == "" for path in dumps), [path.read_text() for path in dumps]
    assert parent is not None


def test_asking_for_tracing_without_opentelemetry_installed_is_a_clear_error(tmp_path: Path) -> None:
    # OpenTelemetry hidden from the daemon: a package `opentelemetry` of its own, without the SDK, comes first.
    shadow = tmp_path / "shadow"
    (shadow / "opentelemetry").mkdir(parents=True)
    (shadow / "opentelemetry" / "__init__.py").write_text("")
    import subprocess

    out = subprocess.run([sys.executable, "-m", "kvbrokerd", "--cluster-id", "1", "--insecure-peers",
                          "--otlp-traces-endpoint", "127.0.0.1:4317", "--print-config"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH",
                                                                                                       "")])})
    assert out.returncode != 0
    assert "otlp_traces_endpoint" in out.stderr and "kvbroker[trace]" in out.stderr, out.stderr




def test_linking_and_cache_calls_are_traced_under_the_callers_trace(traced: Traced) -> None:
    """A slow first request may wait on its link or its cache: those calls have spans of their own too."""
    from kvbroker import ClusterInfo

    parent = TraceContext.parse("00-9cf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert parent is not None
    with tracecontext.use(parent), traced.d.client() as dc:
        cache = dc.allocate_cache(DESC)
        dc.link_clusters([ClusterInfo(traced.p.cluster_id, traced.p.peer_address)])
        dc.deallocate_cache(cache.cache_id)
    def names() -> set[str] | None:
        seen = {span.name.rpartition("/")[2] for span in traced.receiver.of(parent.trace_id)}
        return seen if {"AllocateCache", "LinkClusters", "DeallocateCache"} <= seen else None

    wait_until(names, what="the spans of AllocateCache, LinkClusters and DeallocateCache")
