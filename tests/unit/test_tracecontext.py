"""kvbroker.tracecontext: W3C trace context as the client sends it and the daemon reads it, validated and bounded;
and the client stays free of OpenTelemetry (it reads the current span only where the application imported it)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.tracecontext import MAX_TRACESTATE_CHARS, TraceContext, current, use

VALID = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_valid_context_is_kept_and_read() -> None:
    t = TraceContext.parse(VALID, "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7")
    assert t is not None
    assert (t.trace_id, t.span_id, t.sampled) == ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", True)
    assert t.metadata() == (("traceparent", VALID), ("tracestate", "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"))
    assert TraceContext.from_metadata([("x", "y"), ("traceparent", VALID.encode())]) == TraceContext(VALID)


@pytest.mark.parametrize("bad", [
    "", "00", VALID + "-", VALID.upper(), "ff" + VALID[2:], VALID[:-1], VALID.replace("-", "_"),
    "00-" + "0" * 32 + VALID[35:], VALID[:36] + "0" * 16 + VALID[52:], VALID + "x" * 300, "\u00e9" * 55,
])
def test_a_malformed_or_oversized_traceparent_is_none(bad: str) -> None:
    assert TraceContext.parse(bad) is None


def test_a_later_version_is_read_as_version_00_and_a_bad_tracestate_alone_is_dropped() -> None:
    later = TraceContext.parse("01" + VALID[2:] + "-more", "k=" + "v" * MAX_TRACESTATE_CHARS)
    assert later == TraceContext(VALID)
    assert TraceContext.parse(VALID, "no equals sign") == TraceContext(VALID)
    assert TraceContext.parse(VALID, ",".join(f"k{i}=v" for i in range(33))) == TraceContext(VALID)


@given(st.one_of(st.text(max_size=400), st.binary(max_size=400)), st.one_of(st.none(), st.text(max_size=700)))
def test_parsing_never_raises_and_what_it_keeps_is_bounded(traceparent: str | bytes, tracestate: str | None) -> None:
    t = TraceContext.parse(traceparent, tracestate)
    if t is not None:
        assert len(t.traceparent) == 55 and len(t.tracestate) <= MAX_TRACESTATE_CHARS
        assert TraceContext.parse(t.traceparent, t.tracestate) == t


def test_the_context_sent_is_explicit_then_used_then_none() -> None:
    given_one = TraceContext(VALID)
    assert current(None) is None and current(given_one) is given_one
    with use(given_one):
        assert current() is given_one
        with use(None):
            assert current() is None


def test_the_client_imports_no_opentelemetry() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, kvbroker, kvbroker.tracecontext\n"
                          "from kvbroker import Client, AsyncClient\n"
                          "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_current_opentelemetry_span_is_sent_when_the_application_has_one() -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider

    with TracerProvider().get_tracer("t").start_as_current_span("s") as span:
        t = current()
    assert t is not None and t.trace_id == f"{span.get_span_context().trace_id:032x}"
    assert t.span_id == f"{span.get_span_context().span_id:016x}" and t.sampled
