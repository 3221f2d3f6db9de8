"""An OTLP/gRPC receiver for tests: OpenTelemetry's own TraceService (the protocol a collector speaks), served by grpc
in the test process, keeping every span it is sent (tests/integration/test_tracing.py, tests/vllm/test_trace_e2e.py).
Needs `kvbroker[trace]` (opentelemetry-proto comes with the exporter)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    links: tuple[tuple[str, str], ...]
    """(trace id, span id) of each link."""
    attributes: dict[str, Any]
    start_ns: int = 0
    end_ns: int = 0
    events: tuple[tuple[str, int], ...] = ()
    """(name, time in ns) of each event."""

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
               ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans += [_span(service, s) for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def of(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def named(self, name: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.name == name]


def _value(v: object) -> object:
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(v, kind) if kind else None


def _span(service: str, s: trace_pb2.Span) -> Span:
    return Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                {a.key: _value(a.value) for a in s.attributes}, s.start_time_unix_nano, s.end_time_unix_nano,
                tuple((e.name, e.time_unix_nano) for e in s.events))


@contextlib.contextmanager
def serving() -> Iterator[tuple[Receiver, str]]:
    """A receiver listening on loopback: (it, its HOST:PORT)."""
    collector = Receiver()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, f"127.0.0.1:{port}"
    finally:
        server.stop(0)
