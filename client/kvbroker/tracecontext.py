"""W3C trace context (`traceparent`, `tracestate`) as kvbroker carries it: validated, bounded, never trusted for
anything but linking spans. No dependency: OpenTelemetry is consulted only when the application has imported it.

The client sends the caller's trace context to its daemon as gRPC metadata; a daemon with tracing on continues that
trace (docs/tracing.md). Where a context comes from, in order: an explicit `trace_context=` of a call (or of a
`SessionPull`), the one `use()` made current, else the current OpenTelemetry span when the application has
imported `opentelemetry.trace` (the client never imports it)."""

from __future__ import annotations

import contextlib
import contextvars
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
MAX_TRACEPARENT_CHARS = 256
"""A traceparent longer than this is dropped unread (version 00 takes 55; later versions may append fields)."""
MAX_TRACESTATE_CHARS = 512
"""W3C's own bound for tracestate (32 members of at most 256 chars together would exceed it; vendors keep to 512)."""
MAX_TRACESTATE_MEMBERS = 32

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[!-~]*)?")
_TRACESTATE_MEMBER = re.compile(r"[a-z0-9][a-z0-9_\-*/@]{0,255}=[ -+\--<>-~]{0,255}[!-+\--<>-~]")


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A valid W3C trace context: `traceparent` (version, trace id, parent span id, flags) and an optional
    `tracestate`. Make one with `parse` (which refuses anything malformed or oversized) or `current`."""

    traceparent: str
    tracestate: str = ""

    @classmethod
    def parse(cls, traceparent: str | bytes | None, tracestate: str | bytes | None = None) -> TraceContext | None:
        """The context these headers carry, or None when `traceparent` is missing, malformed or oversized (an
        all-zero trace or span id, version ff, upper-case hex...). A malformed or oversized `tracestate` alone is
        dropped: the trace still continues, without it."""
        parent = _text(traceparent, MAX_TRACEPARENT_CHARS)
        if parent is None:
            return None
        m = _TRACEPARENT.fullmatch(parent)
        if m is None:
            return None
        version, trace_id, span_id, _flags, rest = m.groups()
        if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or span_id == "0" * 16:
            return None
        # A later version's extra fields are dropped: what we pass on is version 00, the one we understand.
        return cls(f"00-{trace_id}-{span_id}-{_flags}", _valid_tracestate(tracestate))

    @classmethod
    def from_metadata(cls, metadata: Iterable[tuple[str, str | bytes]] | None) -> TraceContext | None:
        """The context of a gRPC call's invocation metadata (the first of each header counts), or None."""
        parent: str | bytes | None = None
        state: str | bytes | None = None
        for key, value in metadata or ():
            if key == TRACEPARENT and parent is None:
                parent = value
            elif key == TRACESTATE and state is None:
                state = value
        return cls.parse(parent, state) if parent is not None else None

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]

    @property
    def span_id(self) -> str:
        return self.traceparent[36:52]

    @property
    def sampled(self) -> bool:
        return bool(int(self.traceparent[53:55], 16) & 1)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """As gRPC metadata."""
        if self.tracestate:
            return (TRACEPARENT, self.traceparent), (TRACESTATE, self.tracestate)
        return ((TRACEPARENT, self.traceparent),)


def _text(value: str | bytes | None, limit: int) -> str | None:
    if value is None or len(value) > limit:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return value


def _valid_tracestate(value: str | bytes | None) -> str:
    text = _text(value, MAX_TRACESTATE_CHARS)
    if not text:
        return ""
    members = [m.strip() for m in text.split(",") if m.strip()]
    if len(members) > MAX_TRACESTATE_MEMBERS or not all(_TRACESTATE_MEMBER.fullmatch(m) for m in members):
        return ""
    return ",".join(members)


UNSET = TraceContext("")
"""No context chosen (by an argument or by `use`): `current` falls through to OpenTelemetry's."""
_CURRENT: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar("kvbroker_trace_context",
                                                                              default=UNSET)


@contextlib.contextmanager
def use(context: TraceContext | None) -> Iterator[None]:
    """Makes `context` the one the client's calls send while the block runs (in this thread or task, and tasks it
    starts); None sends none, even under a current OpenTelemetry span."""
    token = _CURRENT.set(context)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current(explicit: TraceContext | None = UNSET) -> TraceContext | None:
    """The context a call sends: `explicit` if given (None: none), else `use()`'s, else the current
    OpenTelemetry span's (only when the application imported OpenTelemetry; its API is never imported here)."""
    if explicit is not UNSET:
        return explicit
    if (chosen := _CURRENT.get()) is not UNSET:
        return chosen
    otel = sys.modules.get("opentelemetry.trace")
    if otel is None:
        return None
    return _from_opentelemetry(otel)


def _from_opentelemetry(otel: object) -> TraceContext | None:
    span_context = otel.get_current_span().get_span_context()  # type: ignore[attr-defined]
    if not span_context.is_valid:
        return None
    parent = f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"
    state = span_context.trace_state.to_header() if span_context.trace_state else ""
    return TraceContext.parse(parent, state)


__all__ = ["MAX_TRACEPARENT_CHARS", "MAX_TRACESTATE_CHARS", "TRACEPARENT", "TRACESTATE", "UNSET", "TraceContext",
           "current", "use"]
