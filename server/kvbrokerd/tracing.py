"""OpenTelemetry traces of the daemon's requests (docs/tracing.md): off unless `--otlp-traces-endpoint` is given.

Off, nothing of OpenTelemetry is imported, the RPC handlers are the plain ones (`trace_rpcs` leaves them), and a
transfer checks `deadline.span is None` at each stage (`stage` then hands back a shared null context). On (`start`),
the SDK exports spans over OTLP/gRPC with a batch processor (a thread of its own; the event loop never waits for the
collector), sampled as OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG say (default: follow the caller's decision,
sample every request that arrives without one), named as OTEL_SERVICE_NAME says (default `kvbrokerd`).

Spans: one per RPC of the local API that moves or grants blocks, continuing the caller's `traceparent` (validated and
bounded by kvbroker.tracecontext: a malformed or oversized one is dropped, and the request starts a trace of its
own); under it the transfer's span (its `Tracked` record), and under that a span per stage (`stage`). A grant keeps
the `traceparent` of the span it was made under, and a pull by it links to that span (`link`)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvbroker.tracecontext import TraceContext

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

tracer: Tracer | None = None
"""The daemon's tracer while tracing is on; None (the default) when off."""
_provider: TracerProvider | None = None

DEFAULT_SERVICE_NAME = "kvbrokerd"
INSTALL_HINT = "pip install 'kvbroker[trace]'"
MAX_ATTRIBUTE_CHARS = 256
"""Texts put in span attributes (error messages, labels) are cut to this."""


class TracingUnavailable(RuntimeError):
    """Tracing was asked for, but OpenTelemetry's SDK and OTLP exporter are not installed."""


def available() -> bool:
    """Whether `start` can work here (the SDK and the OTLP/gRPC exporter are installed); imports nothing."""
    import importlib.util

    try:
        return all(importlib.util.find_spec(name) is not None for name in
                   ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc"))
    except (ImportError, ValueError):  # a parent that is no package (something else named `opentelemetry`)
        return False


def start(endpoint: str, *, cluster_id: int = 0, exporter: SpanExporter | None = None) -> None:
    """Turns tracing on: spans go to the OTLP/gRPC collector at `endpoint` (HOST:PORT in plaintext, or
    https://HOST:PORT; the exporter's other OTEL_EXPORTER_OTLP_* settings apply) or to `exporter`."""
    global tracer, _provider
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise TracingUnavailable(f"tracing needs OpenTelemetry's SDK ({e}): {INSTALL_HINT}") from None
    if exporter is None:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise TracingUnavailable(f"tracing needs OpenTelemetry's OTLP/gRPC exporter ({e}): {INSTALL_HINT}") \
                from None
        exporter = OTLPSpanExporter(endpoint=endpoint if "://" in endpoint else f"http://{endpoint}")
    attributes: dict[str, Any] = {"kvbroker.cluster_id": str(cluster_id)}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes[SERVICE_NAME] = DEFAULT_SERVICE_NAME
    import kvbrokerd

    attributes["service.version"] = kvbrokerd.__version__
    # No sampler given: the SDK takes OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (default parentbased_always_on).
    _provider = TracerProvider(resource=Resource.create(attributes))
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = _provider.get_tracer("kvbrokerd", kvbrokerd.__version__)


def shutdown() -> None:
    """Exports what is left and turns tracing off (the daemon's stop)."""
    global tracer, _provider
    provider, _provider, tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


# -- contexts --------------------------------------------------------------------------------------------------------
def _context_of(trace_context: TraceContext) -> Context:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": trace_context.traceparent}
    if trace_context.tracestate:
        carrier["tracestate"] = trace_context.tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def _in(span: Span) -> Context:
    from opentelemetry.trace import set_span_in_context

    return set_span_in_context(span)


def traceparent_of(span: Span | None) -> str:
    """`span`'s W3C traceparent, or "" when there is none to link to (no span, or not sampled)."""
    if span is None:
        return ""
    ctx = span.get_span_context()
    if not (ctx.is_valid and ctx.trace_flags.sampled):
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def current_span() -> Span | None:
    from opentelemetry import trace

    span = trace.get_current_span()
    return span if span.get_span_context().is_valid else None


def sampled_trace_id(span: Span) -> str:
    """The trace id (32 hex digits) of a sampled span, "" otherwise (what a metrics exemplar shows)."""
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.trace_flags.sampled else ""


# -- spans -----------------------------------------------------------------------------------------------------------
def transfer_span(op: str, peer: str, parent: TraceContext | None) -> Span:
    """The span of one transfer: under `parent` (a session pull's own context) or else the current span (its RPC's)."""
    assert tracer is not None
    return tracer.start_span(f"transfer {op}", context=None if parent is None else _context_of(parent),
                             attributes={"kvbroker.op": op, "kvbroker.peer_cluster": peer})


def end_transfer(span: Span, transfer_id: str, backend: str, moved: int, outcome: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attributes({"kvbroker.transfer_id": transfer_id, "kvbroker.backend": backend, "kvbroker.bytes": moved,
                         "kvbroker.status": outcome})
    if outcome != "DONE":
        span.set_status(Status(StatusCode.ERROR, outcome))
    span.end()


def link(span: Span, traceparent: str, **attributes: str) -> None:
    """Links `span` to the span `traceparent` names (a grant's), if it is a valid one (a peer's word: validated)."""
    parsed = TraceContext.parse(traceparent)
    if parsed is None:
        return
    from opentelemetry.trace import get_current_span

    span.add_link(get_current_span(_context_of(parsed)).get_span_context(), attributes)


_NO_STAGE: contextlib.nullcontext[None] = contextlib.nullcontext()


def stage(parent: Span | None, name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A span for one stage of a transfer under its span `parent` (nothing when `parent` is None: tracing off)."""
    if parent is None:
        return _NO_STAGE
    return _stage(parent, name, attributes)


@contextlib.contextmanager
def _stage(parent: Span, name: str, attributes: dict[str, Any]) -> Iterator[Span]:
    span = open_stage(parent, name, attributes)
    try:
        yield span
    except BaseException as e:
        close_stage(span, e)
        raise
    close_stage(span, None)


def open_stage(parent: Span, name: str, attributes: dict[str, Any]) -> Span:
    """`stage` for code that cannot wrap the stage in a `with`: `close_stage` ends it."""
    assert tracer is not None
    return tracer.start_span(name, context=_in(parent), attributes=attributes)


def close_stage(span: Span, error: BaseException | None) -> None:
    if error is not None:
        _failed(span, error)
    span.end()


def _failed(span: Span, e: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    status = getattr(getattr(e, "status", None), "name", None) or type(e).__name__
    span.set_attribute("kvbroker.status", status)
    span.set_status(Status(StatusCode.ERROR, f"{status}: {getattr(e, 'message', e)}"[:MAX_ATTRIBUTE_CHARS]))


Handler = Callable[[Any, Any], Awaitable[Any]]


def trace_rpcs(servicer: object, service: str, methods: Sequence[str]) -> None:
    """While tracing is on, gives `servicer` a span per call of each unary method in `methods` (its instance
    attribute, so that gRPC registers the traced one); while it is off, leaves it untouched (no cost per call)."""
    if tracer is None:
        return
    for name in methods:
        setattr(servicer, name, _traced(getattr(servicer, name), service, name))


def _traced(method: Handler, service: str, name: str) -> Handler:
    from opentelemetry import context as otel_context
    from opentelemetry.trace import SpanKind, Status, StatusCode

    @functools.wraps(method)
    async def call(request: Any, context: Any) -> Any:
        assert tracer is not None
        caller = TraceContext.from_metadata(context.invocation_metadata())
        span = tracer.start_span(f"{service}/{name}", context=None if caller is None else _context_of(caller),
                                 kind=SpanKind.SERVER, attributes={"rpc.system": "grpc", "rpc.service": service,
                                                                   "rpc.method": name})
        token = otel_context.attach(_in(span))
        try:
            return await method(request, context)
        except BaseException as e:
            # An LlmError reaches here as gRPC's abort: its status is in the call's details ("LLM_...: message").
            details = str(_called(context, "details") or e)
            status = details.partition(":")[0] if details.startswith("LLM_") else type(e).__name__
            span.set_attribute("kvbroker.status", status)
            code = _called(context, "code")
            if code is not None:
                span.set_attribute("rpc.grpc.status_code", int(getattr(code, "value", (code,))[0]))
            span.set_status(Status(StatusCode.ERROR, details[:MAX_ATTRIBUTE_CHARS]))
            raise
        finally:
            otel_context.detach(token)
            span.end()

    return call


def _called(context: Any, attribute: str) -> Any:
    with contextlib.suppress(Exception):
        return getattr(context, attribute)()
    return None
