"""The P/D proxy's spans (a request and its two legs, against the fake servers of test_vllm_proxy) and the vLLM
connector's (`spans.RequestSpans`, driven as its scheduler side drives it), collected by OpenTelemetry's in-memory
exporter; and with tracing off, neither imports OpenTelemetry. The five-process trace: tests/vllm/test_trace_e2e.py."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing needs kvbroker[trace]")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvbroker.integrations.vllm.params import RemoteKv
from kvbroker.integrations.vllm.spans import RequestSpans
from kvbroker.integrations.vllm.stats import RequestTransfer
from kvbroker.integrations.vllm_proxy import PdProxy
from kvbroker.tracecontext import TraceContext
from kvbroker.types import Grant
from tests.helpers import wait_until
from tests.otlp import serving
from tests.unit.test_vllm_proxy import KV_PARAMS, config_for, decode_json, post, prefill_ok, serve  # noqa: F401

CLIENT = TraceContext("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")


@pytest.fixture
def exported() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    spans = exporter.get_finished_spans()
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def hex_id(span: ReadableSpan | None, what: str = "span") -> str:
    assert span is not None
    ctx = span.context if what == "span" else span.parent
    assert ctx is not None
    return f"{ctx.span_id:016x}"


def test_the_proxy_spans_the_request_and_each_leg_and_each_server_continues_its_legs_span(
        serve: Any, exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:  # noqa: F811
    provider, exporter = exported
    p, d = serve(lambda h, body: h.reply(200, {"choices": [{"text": "x"}], "kv_transfer_params": KV_PARAMS,
                                                "usage": {"prompt_tokens": 17, "completion_tokens": 1}})), \
        serve(lambda h, body: h.reply(200, {"choices": [{"text": " y"}], "usage": {"completion_tokens": 5}}))
    with PdProxy(config_for([p.url], [d.url]), "127.0.0.1", 0, tracer=provider.get_tracer("t")).start() as proxy:
        status, _ = post(proxy, "/v1/completions", {"model": "tiny", "prompt": "hi"},
                         {"traceparent": CLIENT.traceparent})
    assert status == 200
    spans = by_name(exporter)
    request, prefill, decode = spans["pd.request"], spans["pd.prefill"], spans["pd.decode"]
    assert {s.context.trace_id for s in spans.values() if s.context} == {int(CLIENT.trace_id, 16)}
    assert hex_id(request, "parent") == CLIENT.span_id
    assert hex_id(prefill, "parent") == hex_id(decode, "parent") == hex_id(request)
    # Each server, and its connector through kv_transfer_params, continues its own leg's span.
    for server, leg in ((p, prefill), (d, decode)):
        ((_, headers, body),) = server.requests
        traceparent = TraceContext.parse(headers["traceparent"])
        assert traceparent is not None and traceparent.span_id == hex_id(leg)
        assert body["kv_transfer_params"]["kvbroker_traceparent"] == traceparent.traceparent
    assert attrs(request)["gen_ai.request.model"] == "tiny"
    assert attrs(request)["kvbroker.request_id"].startswith("pd-")
    assert (attrs(prefill)["server.address"], attrs(decode)["server.address"]) == (p.url, d.url)
    assert (attrs(prefill)["gen_ai.usage.input_tokens"], attrs(decode)["gen_ai.usage.output_tokens"]) == (17, 5)
    assert all(attrs(s)["kvbroker.status"] == "ok" for s in spans.values())
    assert [e.name for e in decode.events] == ["first_token"] and attrs(request)["kvbroker.ttft_ms"] > 0


def test_a_failed_leg_ends_its_span_and_the_requests_with_the_failure(
        serve: Any, exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:  # noqa: F811
    provider, exporter = exported
    p, d = serve(lambda h, body: h.reply(500, {"error": "boom"})), serve(decode_json)
    with PdProxy(config_for([p.url], [d.url]), "127.0.0.1", 0, tracer=provider.get_tracer("t")).start() as proxy:
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 502
    spans = by_name(exporter)
    assert spans.keys() == {"pd.request", "pd.prefill"}
    for span in spans.values():
        assert attrs(span)["kvbroker.status"] == "upstream_502"
        assert span.status.status_code == StatusCode.ERROR
    assert not d.requests


def test_the_proxy_started_with_an_otlp_endpoint_exports_its_spans(serve: Any) -> None:  # noqa: F811
    """The command line as an operator runs it: OTEL_EXPORTER_OTLP_ENDPOINT alone turns the spans on."""
    p, d = serve(prefill_ok), serve(decode_json)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serving() as (receiver, endpoint):
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}", "OTEL_BSP_SCHEDULE_DELAY": "50",
               "OTEL_SERVICE_NAME": "my-proxy"}
        proxy = subprocess.Popen([sys.executable, "-m", "kvbroker.integrations.vllm_proxy", "--prefill", p.url,
                                  "--decode", d.url, "--port", str(port), "--health-interval", "0"], env=env,
                                 stderr=subprocess.PIPE)
        try:
            def answered() -> bool:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                try:
                    conn.request("POST", "/v1/completions", body=b'{"model": "m", "prompt": "hi"}',
                                 headers={"Content-Type": "application/json"})
                    return conn.getresponse().status == 200
                finally:
                    conn.close()

            wait_until(answered, timeout=30, poll=0.2, tolerate=(OSError,), what="the proxy answering")
            spans = wait_until(lambda: receiver.named("pd.request"), timeout=30, what="the proxy's spans")
        finally:
            proxy.terminate()
            proxy.wait(30)
    assert spans is not None and spans[0].service == "my-proxy"


def test_with_tracing_off_neither_the_proxy_nor_the_connectors_spans_import_opentelemetry() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = ("import sys\n"
            "from kvbroker.integrations import otel, vllm_proxy\n"
            "from kvbroker.integrations.vllm import scheduler, spans\n"
            "assert spans.for_engine('e', 'm') is None and not otel.wanted()\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- the connector's spans ---------------------------------------------------------------------------------------------
@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict[str, Any]
    num_prompt_tokens: int = 64
    num_computed_tokens: int = 0
    trace_headers: dict[str, str] = field(default_factory=dict)


PROXY_LEG = TraceContext("00-5bf92f3577b34da6a3ce929d0e0e4736-10f067aa0ba902b7-01")
REMOTE = RemoteKv(7, Grant(b"\x01" * 16, b"\x02" * 16), ((1, 2),), "r", "e", "tag", 64, 1, PROXY_LEG)


def test_the_connectors_decode_spans_wait_pull_and_recompute_in_the_requests_trace(
        exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = exported
    spans = RequestSpans(provider.get_tracer("t"), "engine-d", "tiny")
    pulled, failed = FakeRequest("pulled", {}), FakeRequest("failed", {})
    for request in (pulled, failed):
        spans.arrived(request, REMOTE)
    traced = spans.pull_started("pulled", REMOTE, 64)
    spans.pull_started("failed", REMOTE, 64)
    assert traced.trace is not None and traced.trace.trace_id == PROXY_LEG.trace_id  # the daemon's pull continues it
    spans.pulls_ended({"pulled", "failed"}, {"pulled": RequestTransfer(0.01, 4096, "shm", 64),
                                             "failed": RequestTransfer(0.0, 0, "", 0)})
    failed.num_computed_tokens = 32  # a step computed half of the prompt: still recomputing
    spans.step_output()
    assert not [s for s in exporter.get_finished_spans() if s.name == "kvbroker.recompute"]
    failed.num_computed_tokens = 64  # the step that computed the prompt
    spans.step_output()
    finished = exporter.get_finished_spans()
    assert sorted(s.name for s in finished) == ["kvbroker.pull", "kvbroker.pull", "kvbroker.recompute",
                                                "kvbroker.wait_in_queue", "kvbroker.wait_in_queue"]
    assert all(hex_id(s, "parent") == PROXY_LEG.span_id for s in finished)
    pull = next(s for s in finished if s.name == "kvbroker.pull" and attrs(s)["kvbroker.request_id"] == "pulled")
    assert traced.trace.span_id == hex_id(pull)
    a = attrs(pull)
    assert (a["kvbroker.bytes"], a["kvbroker.backend"], a["kvbroker.status"], a["kvbroker.peer_cluster"],
            a["kvbroker.engine_role"]) == (4096, "shm", "ok", "7", "decode")
    recompute = next(s for s in finished if s.name == "kvbroker.recompute")
    assert attrs(recompute)["kvbroker.reason"] == "pull_failed"


def test_the_connectors_prefill_spans_grant_and_hold_and_a_refusal_recomputes(
        exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = exported
    spans = RequestSpans(provider.get_tracer("t"), "engine-p", "tiny")
    # No kv_transfer_params trace: the request's own trace headers (a traceparent its server got) are the parent.
    prefill = FakeRequest("p", {"do_remote_decode": True}, num_computed_tokens=64,
                          trace_headers={"traceparent": PROXY_LEG.traceparent})
    grant = spans.grant(prefill, 4)
    spans.granted(prefill, grant, "ok", 4)
    spans.holds_ended({"p"})
    refused = FakeRequest("r", {})
    spans.arrived(refused, REMOTE)
    spans.not_pulled("r", "refused_layout")
    spans.finished("r")  # aborted before its prompt was computed: what is open ends
    finished = {s.name: s for s in exporter.get_finished_spans()}
    assert finished.keys() == {"kvbroker.grant", "kvbroker.hold", "kvbroker.wait_in_queue", "kvbroker.recompute"}
    assert all(hex_id(s, "parent") == PROXY_LEG.span_id for s in finished.values())
    assert attrs(finished["kvbroker.grant"]) == {
        "gen_ai.request.model": "tiny", "kvbroker.engine_id": "engine-p", "kvbroker.engine_role": "prefill",
        "kvbroker.request_id": "p", "kvbroker.blocks": 4, "gen_ai.usage.input_tokens": 64, "kvbroker.status": "ok"}
    assert attrs(finished["kvbroker.wait_in_queue"])["kvbroker.status"] == "refused_layout"
    assert attrs(finished["kvbroker.recompute"])["kvbroker.status"] == "finished"


def test_the_scheduler_side_makes_them_as_vllm_drives_it_and_the_daemons_pull_continues_the_pull_span(
        exported: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    from tests.unit.test_vllm_connector import TAG_B, _decode_side, _remote_params
    from tests.unit.test_vllm_connector import FakeRequest as Request

    provider, exporter = exported
    side = _decode_side()
    side.spans = RequestSpans(provider.get_tracer("t"), "engine-d", "tiny")
    leg = {"kvbroker_traceparent": PROXY_LEG.traceparent}
    pulled = Request("d-1", 64, {**_remote_params([10, 11], 64), **leg})
    refused = Request("d-2", 40, {**_remote_params([3, 4], 40, tag=TAG_B), **leg})
    for request in (pulled, refused):
        side.on_new_request(request)
        side.num_new_matched_tokens(request, 0)
    side.after_alloc(pulled, [50, 51], [50, 51], 64)
    side.after_alloc(refused, [8, 9], [8, 9], 0)
    (pull,) = side.take_plan().pulls
    side.on_transfers({"d-1": RequestTransfer(0.01, 4096, "shm", 64)})
    side.on_pulls_ended({"d-1"})
    refused.num_computed_tokens = 40  # the step after its refusal computed its prompt
    side.on_step_output()
    finished = exporter.get_finished_spans()
    assert sorted((s.name, attrs(s)["kvbroker.request_id"], attrs(s)["kvbroker.status"]) for s in finished) == [
        ("kvbroker.pull", "d-1", "ok"), ("kvbroker.recompute", "d-2", "ok"),
        ("kvbroker.wait_in_queue", "d-1", "ok"), ("kvbroker.wait_in_queue", "d-2", "refused_dtype")]
    assert all(hex_id(s, "parent") == PROXY_LEG.span_id for s in finished)
    pull_span = next(s for s in finished if s.name == "kvbroker.pull")
    assert pull.remote.trace is not None and pull.remote.trace.span_id == hex_id(pull_span)
    side.shutdown()


def test_an_engine_without_vllms_tracing_gets_the_connectors_spans_from_the_otel_settings() -> None:
    """No global provider (vLLM started without --otlp-traces-endpoint) but OTEL_EXPORTER_OTLP_ENDPOINT: the
    connector's own provider exports its spans, and flushes them when the engine shuts down."""
    code = ("from kvbroker.integrations.vllm import spans\n"
            "s = spans.for_engine('engine-p', 'tiny')\n"
            "class R: request_id = 'p'; kv_transfer_params = {}; num_computed_tokens = 16\n"
            "s.granted(R, s.grant(R, 1), 'ok', 1)\n"
            "s.shutdown()\n")
    with serving() as (receiver, endpoint):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        spans = wait_until(lambda: receiver.spans if len(receiver.spans) == 2 else None, what="both spans")
    assert spans is not None
    assert {(s.service, s.name) for s in spans} == {("vllm-kvbroker", "kvbroker.grant"),
                                                   ("vllm-kvbroker", "kvbroker.hold")}
