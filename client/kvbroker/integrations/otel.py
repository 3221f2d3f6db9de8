"""OpenTelemetry for the P/D proxy and the vLLM connector (docs/tracing.md): a tracer when tracing is asked for,
nothing of OpenTelemetry imported when it is not.

Asked for: an explicit endpoint (the proxy's `--otlp-traces-endpoint`), or the standard settings
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` in the environment, unless `OTEL_SDK_DISABLED`
is true. The provider exports over OTLP/gRPC with a batch processor (its own thread: a request never waits for the
collector), named by `OTEL_SERVICE_NAME` (else the caller's default) and sampled as `OTEL_TRACES_SAMPLER` says
(default: follow the caller's decision, sample what starts here). Needs `kvbroker[trace]`.

Spans here are made with explicit start and end times (nanoseconds of `time.time_ns`, as OpenTelemetry counts), so
that an interval whose start and end are seen at different places (a request's wait in the queue) is one span."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from kvbroker.tracecontext import TraceContext

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

ENDPOINT_SETTINGS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
INSTALL_HINT = "pip install 'kvbroker[trace]'"


def wanted(endpoint: str = "") -> bool:
    """Whether tracing is asked for (`endpoint`, or the environment's OTLP endpoint); imports nothing."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(endpoint or any(os.environ.get(name) for name in ENDPOINT_SETTINGS))


def own_provider(service_name: str, endpoint: str = "", sampler_ratio: float = 0.0,
                 attributes: dict[str, Any] | None = None) -> TracerProvider:
    """A provider of our own (never the process's global one) exporting to `endpoint` (HOST:PORT or a URL), else to
    the environment's OTLP endpoint. `sampler_ratio` > 0: sample that share of the traces that start here (and
    follow the caller's decision); else OTEL_TRACES_SAMPLER. ImportError (naming the extra) without the SDK."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as e:
        raise ImportError(f"tracing needs OpenTelemetry's SDK and OTLP/gRPC exporter ({e}): {INSTALL_HINT}") from None
    resource = dict(attributes or {})
    if not os.environ.get("OTEL_SERVICE_NAME"):
        resource[SERVICE_NAME] = service_name
    sampler = ParentBased(TraceIdRatioBased(sampler_ratio)) if sampler_ratio > 0 else None
    provider = TracerProvider(resource=Resource.create(resource), sampler=sampler)
    exporter = OTLPSpanExporter(endpoint=(endpoint if "://" in endpoint else f"http://{endpoint}") if endpoint
                                else None)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def global_sdk_provider() -> Any:
    """The process's global tracer provider when the application (vLLM's `--otlp-traces-endpoint`) has set an SDK
    one, else None; imports nothing that is not imported already."""
    api = sys.modules.get("opentelemetry.trace")
    if api is None or "opentelemetry.sdk.trace" not in sys.modules:
        return None
    from opentelemetry.sdk.trace import TracerProvider

    provider = api.get_tracer_provider()
    return provider if isinstance(provider, TracerProvider) else None


def context_of(trace: TraceContext | None) -> Any:
    """An OpenTelemetry context whose parent is `trace` (None: a root)."""
    if trace is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": trace.traceparent}
    if trace.tracestate:
        carrier["tracestate"] = trace.tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def trace_of(span: Span) -> TraceContext | None:
    """`span` as the W3C context its children continue (sampled or not: the flag says), or None if invalid."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    state = ctx.trace_state.to_header() if ctx.trace_state else ""
    return TraceContext.parse(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}", state)


def start(tracer: Tracer, name: str, parent: TraceContext | None, attributes: dict[str, Any],
          start_ns: int | None = None, kind: Any = None) -> Span:
    from opentelemetry.trace import SpanKind

    return tracer.start_span(name, context=context_of(parent), kind=kind or SpanKind.INTERNAL,
                             attributes=attributes, start_time=start_ns)


def end(span: Span, status: str = "ok", attributes: dict[str, Any] | None = None, end_ns: int | None = None) -> None:
    """Ends `span` with `kvbroker.status` = `status` (an error status unless "ok") and more attributes (None
    values left out)."""
    from opentelemetry.trace import Status, StatusCode

    more = {k: v for k, v in (attributes or {}).items() if v is not None}
    span.set_attributes({"kvbroker.status": status, **more})
    if status != "ok":
        span.set_status(Status(StatusCode.ERROR, status[:256]))
    span.end(end_time=end_ns)
