"""The P/D proxy against fake prefill and decode servers over real HTTP on loopback.

The servers are fakes because a vLLM server cannot run in this suite (the e2e test in `.ci/run` runs the proxy
against real ones); they answer the way vLLM's OpenAI server does and record what they were sent. Clients are
`http.client` or raw sockets, so that what the proxy does with malformed, slow or abandoned connections is seen as a
client sees it.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvbroker.integrations.vllm_proxy import PdProxy, ProxyConfig, Upstream, _parse_args, count_json_values
from kvbroker.tracecontext import TraceContext
from tests.helpers import comes_true, wait_until

KV_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-1",
    "remote_block_ids": [[3, 9, 4]],
    "remote_host": "127.0.0.1",
    "remote_port": 7101,
    "nested": {"cache_id": 7, "ok": None},
}

Answer = Callable[["_FakeHandler", dict[str, Any]], None]


@dataclass
class FakeServer:
    """A vLLM-like server: `answer` decides each reply, `requests` records (path, headers, body)."""

    answer: Answer
    requests: list[tuple[str, dict[str, str], dict[str, Any]]] = field(default_factory=list)
    httpd: ThreadingHTTPServer | None = None
    health: int = 200
    """What `GET /health` answers."""
    health_checks: int = 0

    @property
    def url(self) -> str:
        assert self.httpd is not None
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"


class _FakeHandler(BaseHTTPRequestHandler):
    fake: FakeServer
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.fake.requests.append((self.path, dict(self.headers.items()), body))
        self.fake.answer(self, body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.fake.health_checks += 1
            self.reply(self.fake.health, b"")
        else:
            self.reply(404, {"error": "no route"})

    def client_left(self, within: float) -> bool:
        """Waits up to `within` seconds for the proxy to close this request's connection."""
        return comes_true(self._closed_by_the_proxy, within=within, poll=0)  # (the select below is the pause)

    def _closed_by_the_proxy(self) -> bool:
        if not select.select([self.connection], [], [], 0.05)[0]:
            return False
        try:
            return bool(self.connection.recv(1, socket.MSG_PEEK) == b"")
        except OSError:
            return True

    def reply(self, status: int, payload: Any, content_type: str = "application/json") -> None:
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a fake whose client (the proxy) hung up on purpose; what a test checks is asserted, not printed


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], FakeServer]]:
    started: list[ThreadingHTTPServer] = []

    def start(answer: Answer) -> FakeServer:
        fake = FakeServer(answer)

        class Handler(_FakeHandler):
            pass

        Handler.fake = fake
        fake.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=fake.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        started.append(fake.httpd)
        return fake

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def prefill_ok(handler: _FakeHandler, body: dict[str, Any]) -> None:
    handler.reply(200, {"id": "cmpl-p", "choices": [{"text": "x"}], "kv_transfer_params": KV_PARAMS})


def decode_json(handler: _FakeHandler, body: dict[str, Any]) -> None:
    handler.reply(200, {"id": "cmpl-d", "choices": [{"text": " decoded", "finish_reason": "length"}]})


def proxy_for(prefill: str, decode: str, prefill_timeout: float = 300.0, decode_timeout: float = 300.0) -> PdProxy:
    config = ProxyConfig(
        (Upstream.parse("prefill", prefill),),
        (Upstream.parse("decode", decode),),
        prefill_timeout=prefill_timeout,
        decode_timeout=decode_timeout,
    )
    return PdProxy(config, "127.0.0.1", 0).start()


def config_for(prefill: list[str], decode: list[str], **options: Any) -> ProxyConfig:
    return ProxyConfig(
        tuple(Upstream.parse("prefill", url) for url in prefill),
        tuple(Upstream.parse("decode", url) for url in decode),
        **options,
    )


def post_full(
    proxy: PdProxy, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], http.client.HTTPResponse]:
    host, port = proxy.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(
            "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})}
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read()), response
    finally:
        conn.close()


def post(proxy: PdProxy, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    status, answer, _ = post_full(proxy, path, body, headers)
    return status, answer


def get_health(proxy: PdProxy) -> dict[str, Any]:
    host, port = proxy.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        assert response.status == 200
        answer = json.loads(response.read())
        assert isinstance(answer, dict)
        return answer
    finally:
        conn.close()


def open_connections(proxy: PdProxy) -> int:
    """Client connections the proxy serves now: aiohttp's list, which `max_connections` is checked against."""
    runner = proxy._runner
    assert runner is not None and runner.server is not None
    return len(runner.server.connections)


def raw_exchange(proxy: PdProxy, data: bytes, quiet: float = 1.0) -> tuple[bytes, bool]:
    """Sends `data` on a new connection and reads until the proxy closes it (True) or stays silent for `quiet`
    seconds (False)."""
    sock = socket.create_connection(proxy.address, timeout=quiet)
    received = b""
    try:
        sock.sendall(data)
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return received, False
            except ConnectionResetError:
                return received, True
            if not chunk:
                return received, True
            received += chunk
    finally:
        sock.close()


def status_lines(raw: bytes) -> list[int]:
    """The statuses of the answers in `raw`; anything after the last complete answer counts as one more (an answer
    without a status line, as `http.server` sends to a line it cannot parse), -1."""
    statuses = []
    while raw:
        head = re.match(rb"HTTP/1\.[01] (\d{3}) [^\r\n]*\r\n(.*?)\r\n\r\n", raw, re.DOTALL)
        if head is None:
            statuses.append(-1)
            break
        statuses.append(int(head[1]))
        length = re.search(rb"(?im)^content-length:[ \t]*(\d+)", head[2])
        raw = raw[head.end() + (int(length[1]) if length else 0) :]
    return statuses


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_completion_goes_prefill_then_decode_with_the_prefill_kv_params_unchanged(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    request = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "min_tokens": 2, "temperature": 0}
    with proxy_for(p.url, d.url) as proxy:
        status, answer, response = post_full(
            proxy, "/v1/completions", request, {"Authorization": "Bearer k", "X-Request-Id": "r1"}
        )

    assert status == 200
    assert answer["id"] == "cmpl-d"
    ((p_path, p_headers, p_body),) = p.requests
    assert p_path == "/v1/completions"
    assert p_body == {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    ((d_path, d_headers, d_body),) = d.requests
    assert d_path == "/v1/completions"
    assert d_body == {**request, "kv_transfer_params": KV_PARAMS}
    for headers in (p_headers, d_headers):
        assert headers["Authorization"] == "Bearer k"
        # The proxy's own id on both servers (and back to the client), never the client's.
        assert headers["X-Request-Id"] == response.getheader("X-Request-Id")
        assert headers["X-Request-Id"].startswith("pd-")


def test_both_servers_see_one_request_id_when_the_client_sends_none(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200
    assert p.requests[0][1]["X-Request-Id"] == d.requests[0][1]["X-Request-Id"] != ""


PULLED_EVENT = (b'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], '
                b'"kv_transfer_params": {"kvbroker_tokens_pulled": 64, "kvbroker_transfer_bytes": 4096}}\n\n')


def test_chat_completion_stream_is_relayed_event_by_event(serve: Any) -> None:
    first_event_seen = threading.Event()

    def decode_stream(handler: _FakeHandler, body: dict[str, Any]) -> None:
        handler.start_stream()
        handler.chunk(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
        # The rest only once the client has the first event: a proxy that buffered the answer would hang here.
        assert first_event_seen.wait(5)
        handler.chunk(b'data: {"choices": [{"delta": {"content": "b"}}]}\n\n')
        handler.chunk(PULLED_EVENT)  # where the KV came from: the connector's last event (integrations/vllm/streams.py)
        handler.chunk(b"data: [DONE]\n\n")
        handler.chunk(b"")

    p, d = serve(prefill_ok), serve(decode_stream)
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with proxy_for(p.url, d.url) as proxy:
        host, port = proxy.address
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(request))
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type", "").startswith("text/event-stream")
        first = response.readline()
        assert first == b'data: {"choices": [{"delta": {"content": "a"}}]}\n'
        first_event_seen.set()
        rest = response.read()
        conn.close()

    assert rest == b'\ndata: {"choices": [{"delta": {"content": "b"}}]}\n\n' + PULLED_EVENT + b"data: [DONE]\n\n"
    p_body = p.requests[0][2]
    assert p.requests[0][0] == "/v1/chat/completions"
    assert p_body["stream"] is False and "stream_options" not in p_body
    assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1
    assert d.requests[0][2] == {**request, "kv_transfer_params": KV_PARAMS}


def test_a_prefill_answer_without_kv_params_sends_the_plain_request_to_decode(serve: Any) -> None:
    p = serve(lambda h, b: h.reply(200, {"choices": [{"text": "", "finish_reason": "stop"}]}))
    d = serve(decode_json)
    request = {"model": "m", "prompt": "hi", "kv_transfer_params": {"stale": 1}}
    with proxy_for(p.url, d.url) as proxy:
        assert post(proxy, "/v1/completions", request)[0] == 200
    assert d.requests[0][2] == {"model": "m", "prompt": "hi"}


def generic_error(answer: dict[str, Any], role: str, what: str = "failed") -> str:
    """The error's message, checked to say which role failed and nothing about the server."""
    message = answer["error"]["message"]
    assert isinstance(message, str)
    assert message.startswith(f"the {role} server {what} (request pd-"), message
    assert "127.0.0.1" not in message and "http" not in message and "rrno" not in message, message
    return message


def test_an_unreachable_prefill_server_gives_a_502_that_names_it_only_in_the_log(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    d = serve(decode_json)
    dead = f"http://127.0.0.1:{free_port()}"
    with proxy_for(dead, d.url) as proxy:
        status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 502
    generic_error(answer, "prefill")
    assert f"prefill server {dead} is unreachable" in caplog.text
    assert d.requests == []


def test_a_failing_prefill_server_gives_a_502_without_its_answer(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    p = serve(lambda h, b: h.reply(500, {"error": {"message": "engine dead at /opt/secret"}}))
    d = serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 502
    assert "engine dead" not in generic_error(answer, "prefill")
    assert f"prefill server {p.url} answered 500" in caplog.text and "engine dead" in caplog.text
    assert d.requests == []


@pytest.mark.parametrize(
    "reply",
    [b"not json", json.dumps({"kv_transfer_params": [1, 2]}).encode()],
    ids=["invalid-json", "params-not-an-object"],
)
def test_a_garbled_prefill_answer_gives_502(serve: Any, reply: bytes, caplog: pytest.LogCaptureFixture) -> None:
    p, d = serve(lambda h, b: h.reply(200, reply)), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 502
    generic_error(answer, "prefill")
    assert f"prefill server {p.url} answered" in caplog.text
    assert d.requests == []


def test_a_client_error_from_prefill_is_passed_through_and_decode_is_not_asked(serve: Any) -> None:
    refusal = {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404}}
    p, d = serve(lambda h, b: h.reply(404, refusal)), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        assert post(proxy, "/v1/completions", {"model": "x", "prompt": "hi"}) == (404, refusal)
    assert d.requests == []


def test_a_silent_prefill_server_gives_504_within_its_timeout(serve: Any, caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()

    def silent(handler: _FakeHandler, body: dict[str, Any]) -> None:
        release.wait(60)  # silent until the test ends: then it answers as usual
        prefill_ok(handler, body)

    p = serve(silent)
    d = serve(decode_json)
    try:
        with proxy_for(p.url, d.url, prefill_timeout=0.5) as proxy:
            status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})
    finally:
        release.set()
    # The proxy gave up by itself, at the timeout it was given: one that waited for the server would have left this
    # request unanswered past the test client's own 10 s timeout (the server stays silent for 60 s).
    assert status == 504
    generic_error(answer, "prefill", "did not answer in time")
    assert f"prefill server {p.url} did not answer within 0.5 s" in caplog.text
    assert d.requests == []


def test_an_unreachable_decode_server_gives_a_502_that_names_it_only_in_the_log(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    p = serve(prefill_ok)
    dead = f"http://127.0.0.1:{free_port()}"
    with proxy_for(p.url, dead) as proxy:
        status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 502
    generic_error(answer, "decode")
    assert f"decode server {dead} is unreachable" in caplog.text


def test_a_failing_decode_server_gives_502_and_a_decode_refusal_passes_through(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    p = serve(prefill_ok)
    d = serve(lambda h, b: h.reply(500 if b["prompt"] == "boom" else 400, {"error": {"message": b["prompt"]}}))
    with proxy_for(p.url, d.url) as proxy:
        status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "boom"})
        assert status == 502
        assert "boom" not in generic_error(answer, "decode")
        assert f"decode server {d.url} answered 500" in caplog.text
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "bad"}) == (400, {"error": {"message": "bad"}})


def test_a_decode_stream_that_stalls_ends_with_an_error_event(serve: Any, caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()

    def stalling(handler: _FakeHandler, body: dict[str, Any]) -> None:
        handler.start_stream()
        handler.chunk(b'data: {"choices": [{"text": "a"}]}\n\n')
        release.wait(10)

    p, d = serve(prefill_ok), serve(stalling)
    try:
        with proxy_for(p.url, d.url, decode_timeout=0.5) as proxy:
            host, port = proxy.address
            conn = http.client.HTTPConnection(host, port, timeout=10)
            conn.request("POST", "/v1/completions", body=json.dumps({"model": "m", "prompt": "hi", "stream": True}))
            response = conn.getresponse()
            assert response.status == 200
            events = response.read().split(b"\n\n")
            conn.close()
    finally:
        release.set()
    assert events[0] == b'data: {"choices": [{"text": "a"}]}'
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert error["code"] == 504
    generic_error({"error": error}, "decode", "stopped streaming")
    assert f"decode server {d.url} stopped streaming for 0.5 s" in caplog.text


def test_a_client_that_leaves_mid_stream_drops_the_decode_request(serve: Any) -> None:
    dropped = threading.Event()

    def endless(handler: _FakeHandler, body: dict[str, Any]) -> None:
        handler.start_stream()
        try:
            for _ in range(500):  # vLLM aborts a request whose connection closes: so must the proxy make it close
                handler.chunk(b'data: {"choices": [{"text": "a"}]}\n\n')
                time.sleep(0.01)  # a stream's pace (the scenario), not a wait
        except OSError:
            dropped.set()

    p, d = serve(prefill_ok), serve(endless)
    with proxy_for(p.url, d.url) as proxy:
        host, port = proxy.address
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "m", "prompt": "hi", "stream": True}))
        response = conn.getresponse()
        assert response.readline().startswith(b"data: ")
        conn.close()
        assert dropped.wait(4), "the decode server kept streaming to a proxy whose client had left"


def test_bad_client_requests_are_refused_without_asking_any_server(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        host, port = proxy.address
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("POST", "/v1/completions", body=b"{not json")
        response = conn.getresponse()
        assert response.status == 400
        assert "not JSON" in json.loads(response.read())["error"]["message"]
        # An error answer ends its connection: nothing the client sent after it is read as a request.
        assert response.getheader("Connection") == "close"
        conn.close()
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("POST", "/v1/completions", body=b"[1, 2]")
        response = conn.getresponse()
        assert response.status == 400
        assert json.loads(response.read())["error"]["message"] == "the body must be a JSON object"
        conn.close()
        assert post(proxy, "/v1/embeddings", {"input": "x"})[0] == 404
    assert p.requests == [] and d.requests == []


def test_a_body_over_the_limit_is_refused_before_it_is_read(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    config = ProxyConfig((Upstream.parse("prefill", p.url),), (Upstream.parse("decode", d.url),), max_body_bytes=100)
    with PdProxy(config, "127.0.0.1", 0) as proxy:
        big = {"model": "m", "prompt": "x" * 200}
        status, answer = post(proxy, "/v1/completions", big)
        assert status == 413
        assert answer["error"]["message"] == f"body of {len(json.dumps(big))} bytes; at most 100"
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "x" * 10})[0] == 200
    assert len(p.requests) == len(d.requests) == 1


def test_health_answers_without_the_servers() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with proxy_for(dead, dead) as proxy:
        host, port = proxy.address
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()


def test_several_servers_are_used_in_turn(serve: Any) -> None:
    prefills = [serve(prefill_ok), serve(prefill_ok)]
    decodes = [serve(decode_json), serve(decode_json)]
    config = ProxyConfig(
        tuple(Upstream.parse("prefill", s.url) for s in prefills),
        tuple(Upstream.parse("decode", s.url) for s in decodes),
    )
    with PdProxy(config, "127.0.0.1", 0) as proxy:
        for _ in range(4):
            assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200
    assert [len(s.requests) for s in prefills + decodes] == [2, 2, 2, 2]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("127.0.0.1:8100", "expected http://HOST:PORT"),
        ("ftp://127.0.0.1:8100", "expected http://HOST:PORT"),
        ("http://127.0.0.1:99999", "out of range"),
        ("http://127.0.0.1:8100/?x=1", "no query"),
    ],
)
def test_bad_server_urls_are_refused_at_start(url: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse_args(["--prefill", url, "--decode", "http://127.0.0.1:8200"])
    assert message in capsys.readouterr().err


def test_a_base_path_is_kept() -> None:
    up = Upstream.parse("decode", "https://example.invalid/vllm/")
    assert (up.scheme, up.host, up.port, up.base_path, up.url) == (
        "https",
        "example.invalid",
        443,
        "/vllm",
        "https://example.invalid/vllm",
    )


# ---- what a client controls stops at the proxy (issue 23) ----------------------------------------------------------


def test_the_request_id_is_the_proxys_own_whatever_the_client_sends(serve: Any) -> None:
    """Both servers key a request (and the prefill server its held blocks) by the request id: a client must not be
    able to choose it, nor make two requests share one."""
    p, d = serve(prefill_ok), serve(decode_json)
    request = {"model": "m", "prompt": "hi", "request_id": "victim"}
    with proxy_for(p.url, d.url) as proxy:
        for _ in range(2):
            assert post(proxy, "/v1/completions", request, {"X-Request-Id": "victim"})[0] == 200
    ids = [headers["X-Request-Id"] for server in (p, d) for _, headers, _ in server.requests]
    assert all(i.startswith("pd-") for i in ids), ids
    assert ids[0] == ids[2] != ids[1] == ids[3]  # one id per request, the same on both servers
    assert all("request_id" not in body for server in (p, d) for _, _, body in server.requests)


def test_client_kv_transfer_params_reach_neither_server(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    forged = {"do_remote_prefill": True, "remote_block_ids": [[0, 1, 2]], "kvbroker_peer_address": "unix:/x"}
    with proxy_for(p.url, d.url) as proxy:
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi", "kv_transfer_params": forged})[0] == 200
    assert p.requests[0][2]["kv_transfer_params"] == {"do_remote_decode": True}
    assert d.requests[0][2]["kv_transfer_params"] == KV_PARAMS


@pytest.mark.parametrize(
    ("path", "extra", "word"),
    [
        ("/v1/completions", {"n": 2}, "`n`"),
        ("/v1/chat/completions", {"n": 3}, "`n`"),
        ("/v1/completions", {"best_of": 2}, "`best_of`"),
        ("/v1/completions", {"use_beam_search": True}, "beam search"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "batch of 2 prompts"),
        ("/v1/completions", {"prompt": [[1, 2], [3, 4], [5]]}, "batch of 3 prompts"),
    ],
    ids=["n", "chat-n", "best_of", "beam", "batch-text", "batch-tokens"],
)
def test_requests_for_several_sequences_are_refused_before_any_server(
    serve: Any, path: str, extra: dict[str, Any], word: str
) -> None:
    """vLLM would run each prompt or sample as a request of its own: the prefill server would hold blocks for every
    one while one `kv_transfer_params` comes back, and the decode server would pull one sequence's KV for all."""
    p, d = serve(prefill_ok), serve(decode_json)
    body = {"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], **extra}
    with proxy_for(p.url, d.url) as proxy:
        status, answer = post(proxy, path, body)
    assert status == 400
    assert word in answer["error"]["message"]
    assert p.requests == [] and d.requests == []


@pytest.mark.parametrize("prompt", ["hi", ["hi"], [1, 2, 3], [[1, 2, 3]]], ids=["text", "one-text", "tokens", "one"])
def test_one_prompt_in_any_shape_is_served(serve: Any, prompt: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": prompt, "n": 1})[0] == 200
    assert d.requests[0][2]["prompt"] == prompt


# ---- finding 10: a request body is never read as a request -------------------------------------------------------

SMUGGLED = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/nothing HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(SMUGGLED), SMUGGLED),
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (len(SMUGGLED), SMUGGLED),
        b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(SMUGGLED), SMUGGLED),
    ],
    ids=["404", "chunked", "get-with-body"],
)
def test_a_request_body_is_never_read_as_a_request(serve: Any, request_bytes: bytes) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        raw, _ = raw_exchange(proxy, request_bytes)
    assert len(status_lines(raw)) == 1, raw
    assert p.requests == [] and d.requests == []


def test_a_chunked_request_is_served(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    with proxy_for(p.url, d.url) as proxy:
        raw, _ = raw_exchange(
            proxy,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (body[:5], len(body) - 5, body[5:]),
            quiet=0.5,
        )
    assert status_lines(raw) == [200]
    assert d.requests[0][2]["prompt"] == "hi"


def test_an_error_answer_closes_its_connection(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        raw, closed = raw_exchange(proxy, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n{x}")
    assert status_lines(raw) == [400]
    assert closed


# ---- finding 11: connections cost no thread, and every wait on a client is bounded --------------------------------


def test_idle_connections_hold_no_thread_and_are_closed_after_the_client_timeout(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    config = config_for([p.url], [d.url], client_timeout=1.0, health_interval=0)
    with PdProxy(config, "127.0.0.1", 0) as proxy:
        before = threading.active_count()
        idle = [socket.create_connection(proxy.address, timeout=5) for _ in range(100)]
        try:
            wait_until(lambda: open_connections(proxy) == 100, what="the proxy serving the 100 idle connections")
            assert threading.active_count() - before < 5
            for sock in idle:
                assert sock.recv(1) == b""  # the proxy closed it (a socket it kept open times out after 5 s)
        finally:
            for sock in idle:
                sock.close()
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200


@pytest.mark.parametrize(
    ("partial", "expected"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", []),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"", [408]),
    ],
    ids=["headers", "body"],
)
def test_a_client_that_trickles_its_request_is_cut_off(serve: Any, partial: bytes, expected: list[int]) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    config = config_for([p.url], [d.url], client_timeout=0.5, health_interval=0)
    with PdProxy(config, "127.0.0.1", 0) as proxy:
        raw, closed = raw_exchange(proxy, partial, quiet=5)  # closed: the proxy hung up within the 5 s of quiet
    assert closed and status_lines(raw) == expected, raw
    assert p.requests == []


def test_a_client_that_stops_reading_a_stream_is_dropped_with_its_decode_request(serve: Any) -> None:
    dropped = threading.Event()

    def flood(handler: _FakeHandler, body: dict[str, Any]) -> None:
        handler.start_stream()
        try:
            for _ in range(4000):
                handler.chunk(b"data: " + b"x" * 65536 + b"\n\n")
        except OSError:
            dropped.set()

    p, d = serve(prefill_ok), serve(flood)
    config = config_for([p.url], [d.url], client_timeout=0.5, health_interval=0)
    with PdProxy(config, "127.0.0.1", 0) as proxy:
        host, port = proxy.address
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "m", "prompt": "hi", "stream": True}))
        assert conn.getresponse().status == 200  # and never read
        try:
            assert dropped.wait(8), "the proxy kept the decode request of a client that stopped reading"
        finally:
            conn.close()


def test_a_client_that_leaves_during_the_prefill_aborts_it_without_a_traceback(
    serve: Any, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    left = threading.Event()

    def slow_prefill(handler: _FakeHandler, body: dict[str, Any]) -> None:
        if handler.client_left(3):
            left.set()
        else:
            prefill_ok(handler, body)

    p, d = serve(slow_prefill), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        sock = socket.create_connection(proxy.address)
        body = json.dumps({"model": "m", "prompt": "hi"}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: len(p.requests) == 1, timeout=5, poll=0.02, what="the prefill server to get the request")
        sock.close()
        assert left.wait(2.5), "the prefill request went on after its client left"
    # No pause for a decode to show: the proxy decodes only after a prefill's answer, and this prefill gave none.
    assert d.requests == []
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_connections_over_the_cap_are_refused_with_503(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    config = config_for([p.url], [d.url], max_connections=4, health_interval=0)
    with PdProxy(config, "127.0.0.1", 0) as proxy:
        held = [socket.create_connection(proxy.address) for _ in range(4)]
        wait_until(lambda: open_connections(proxy) == 4, what="the proxy serving the 4 connections of its cap")
        raw, closed = raw_exchange(proxy, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert closed and status_lines(raw) in ([503], []), raw
        for sock in held:
            sock.close()
        wait_until(lambda: open_connections(proxy) == 0, what="the proxy to see the 4 connections closed")
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200


def test_json_values_are_counted_without_strings() -> None:
    assert count_json_values(b'{"a": [1, 2, 3], "b": "x,y,[z]{", "c": "q\\",\\"r"}') == 7
    assert count_json_values(b"[{},{},{}]") == 7  # 4 values: an empty container counts one too many


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
def test_a_body_of_many_tiny_json_values_is_refused_without_building_them(tmp_path: Any) -> None:
    """32 MiB of `[{},{},...]` (the default body limit) made the proxy's peak RSS grow from ~60 to ~920 MiB."""
    dead = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "proxy.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvbroker.integrations.vllm_proxy", "--prefill", dead, "--decode", dead,
             "--port", "0"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    try:
        wait_until(lambda: "listening on" in log.read_text(), timeout=30, poll=0.02, what="the proxy to listen")
        port = int(re.findall(r"listening on http://127\.0\.0\.1:(\d+)", log.read_text())[0])

        def peak_mib() -> float:
            with open(f"/proc/{proc.pid}/status") as f:
                status = f.read()
            return int(re.findall(r"VmHWM:\s+(\d+) kB", status)[0]) / 1024

        before = peak_mib()
        body = b'{"model": "m", "prompt": [' + b"{}," * (32 * 1024 * 1024 // 3 - 20) + b"{}]}"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = response.read()
        conn.close()
        grown = peak_mib() - before
    finally:
        proc.terminate()
        proc.wait(10)
    assert grown < 200, f"peak RSS grew by {grown:.0f} MiB"
    assert response.status == 413, answer
    assert b"JSON values" in answer


# ---- issue 20: health checks, ejection, one retry of a prefill -------------------------------------------------


def test_a_dead_prefill_server_fails_no_request_each_is_retried_once_on_another(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    p, d = serve(prefill_ok), serve(decode_json)
    with PdProxy(config_for([dead, p.url], [d.url], health_interval=0), "127.0.0.1", 0) as proxy:
        for _ in range(4):
            assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200
    assert len(p.requests) == len(d.requests) == 4
    assert f"prefill server {dead} is unreachable" in caplog.text and f"trying {p.url}" in caplog.text

    other_dead = f"http://127.0.0.1:{free_port()}"
    with PdProxy(config_for([dead, other_dead], [d.url], health_interval=0), "127.0.0.1", 0) as proxy:
        status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 502  # one retry, then the client hears of it
    generic_error(answer, "prefill")


def test_a_server_failing_requests_is_ejected(serve: Any, caplog: pytest.LogCaptureFixture) -> None:
    failing = serve(lambda h, b: h.reply(500, {"error": {"message": "engine dead"}}))
    p, d = serve(prefill_ok), serve(decode_json)
    config = config_for([failing.url, p.url], [d.url], health_interval=60, eject_after=2)
    with PdProxy(config, "127.0.0.1", 0) as proxy:
        wait_until(lambda: failing.health_checks == 1 and p.health_checks == 1 and d.health_checks == 1,
                   timeout=5, poll=0.02, what="one health check of every server")
        for _ in range(6):
            assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200
        assert get_health(proxy)["prefill_servers_in_service"] == 1
    assert len(failing.requests) == 2 and len(p.requests) == 6
    assert f"prefill server {failing.url} ejected after 2 failures in a row" in caplog.text


def test_a_server_failing_its_health_checks_is_ejected_and_readmitted(serve: Any) -> None:
    a, b, d = serve(prefill_ok), serve(prefill_ok), serve(decode_json)
    a.health = 503
    config = config_for([a.url, b.url], [d.url], health_interval=0.1, eject_after=1)
    with PdProxy(config, "127.0.0.1", 0) as proxy:
        wait_until(lambda: get_health(proxy).get("prefill_servers_in_service") == 1,
                   timeout=5, poll=0.02, what="one prefill server in service")
        for _ in range(4):
            assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200
        assert (len(a.requests), len(b.requests)) == (0, 4)
        a.health = 200
        wait_until(lambda: get_health(proxy).get("prefill_servers_in_service") == 2,
                   timeout=5, poll=0.02, what="both prefill servers in service")
        for _ in range(4):
            assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200
        assert (len(a.requests), len(b.requests)) == (2, 6)


def test_requests_still_go_out_when_every_server_of_a_role_is_ejected(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    p.health = d.health = 503
    config = config_for([p.url], [d.url], health_interval=0.1, eject_after=1)
    with PdProxy(config, "127.0.0.1", 0) as proxy:
        wait_until(lambda: get_health(proxy).get("decode_servers_in_service") == 0,
                   timeout=5, poll=0.02, what="no decode server in service")
        assert get_health(proxy)["prefill_servers_in_service"] == 0
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200


# ---- issue 30: the proxy reads only kv_transfer_params from a prefill answer ------------------------------------


@pytest.mark.parametrize(
    ("path", "request_body"),
    [
        (
            "/v1/completions",
            {"model": "m", "prompt": "hi", "max_tokens": 16, "logprobs": 5, "echo": True, "prompt_logprobs": 3,
             "return_token_ids": True, "return_tokens_as_token_ids": True, "n": 1, "best_of": 1},
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 16,
             "logprobs": True, "top_logprobs": 3, "echo": True, "prompt_logprobs": 2, "return_token_ids": True},
        ),
    ],
    ids=["completion", "chat"],
)
def test_the_prefill_request_asks_for_no_logprobs_or_echo_and_the_decode_request_keeps_them(
    serve: Any, path: str, request_body: dict[str, Any]
) -> None:
    """Prompt logprobs or an echo of a long prompt make the prefill answer tens of MB, of which the proxy reads only
    `kv_transfer_params`; the client asked for them, so the decode server (whose answer the client gets) sees them."""
    p, d = serve(prefill_ok), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        assert post(proxy, path, request_body)[0] == 200

    p_body = p.requests[0][2]
    kept = {key: value for key, value in request_body.items() if key in ("model", "prompt", "messages")}
    limits = {"max_tokens": 1} | ({"max_completion_tokens": 1} if "max_completion_tokens" in request_body else {})
    assert p_body == {**kept, **limits, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    assert d.requests[0][2] == {**request_body, "kv_transfer_params": KV_PARAMS}


def test_the_prefill_answer_limit_is_a_setting_of_1_mib_by_default() -> None:
    servers = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]
    assert _parse_args(servers)[1].max_prefill_answer_bytes == 1024 * 1024
    assert _parse_args([*servers, "--max-prefill-answer-bytes", "4096"])[1].max_prefill_answer_bytes == 4096
    with pytest.raises(SystemExit):
        _parse_args([*servers, "--max-prefill-answer-bytes", "0"])


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_oversized_prefill_answer_gives_a_502_naming_the_limit_while_other_clients_are_served(
    serve: Any, framing: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefill answer over `--max-prefill-answer-bytes` is not read to its end (nor parsed): the proxy hangs up on
    the server and answers 502; the request is neither retried on another prefill server nor counted against the
    server, and clients whose answers are small are served meanwhile and after."""
    limit = 64 * 1024
    # What `prompt_logprobs` make of a long prompt, in small: valid JSON that carries the kv_transfer_params.
    logprobs = [{"1": -0.5}] * limit
    raw = json.dumps({"choices": [{"text": "x", "prompt_logprobs": logprobs}], "kv_transfer_params": KV_PARAMS})
    pieces = [raw[start : start + limit // 2].encode() for start in range(0, len(raw), limit // 2)]
    small_served = threading.Event()
    hung_up = threading.Event()

    def prefill(handler: _FakeHandler, body: dict[str, Any]) -> None:
        if body.get("prompt") != "big":
            prefill_ok(handler, body)
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if framing == "content-length":
            handler.send_header("Content-Length", str(len(raw)))
        else:
            handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        try:
            for index, piece in enumerate(pieces):
                if framing == "content-length":
                    handler.wfile.write(piece)
                    handler.wfile.flush()
                else:
                    handler.chunk(piece)
                if index == 0:  # the rest only once another client was served through the proxy meanwhile
                    assert small_served.wait(10)
            if framing == "chunked":
                handler.chunk(b"")
        except OSError:
            hung_up.set()
            return
        if handler.client_left(5):  # what was sent fits in the socket buffers: the proxy hangs up all the same
            hung_up.set()

    p, other_p, d = serve(prefill), serve(prefill), serve(decode_json)
    config = config_for(
        [p.url, other_p.url], [d.url], max_prefill_answer_bytes=limit, health_interval=60, eject_after=1
    )
    with PdProxy(config, "127.0.0.1", 0) as proxy:
        wait_until(lambda: p.health_checks == other_p.health_checks == 1,
                   timeout=5, poll=0.02, what="one health check of each prefill server")
        big: list[tuple[int, dict[str, Any]]] = []
        client = threading.Thread(
            target=lambda: big.append(post(proxy, "/v1/completions", {"model": "m", "prompt": "big"}))
        )
        client.start()
        try:
            wait_until(lambda: len(p.requests) == 1, timeout=5, poll=0.02, what="the prefill server to get the request")
            for _ in range(2):
                assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200
        finally:
            small_served.set()
            client.join(15)
        ((status, answer),) = big
        assert status == 502, answer
        assert answer["error"]["message"].startswith(
            f"the prefill server's answer is over the proxy's limit of {limit} bytes (--max-prefill-answer-bytes; "
            "request pd-"
        )
        assert hung_up.wait(5), "the proxy read the prefill answer to its end"
        assert get_health(proxy)["prefill_servers_in_service"] == 2
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200
    big_prefills = [body for s in (p, other_p) for _, _, body in s.requests if body["prompt"] == "big"]
    assert len(big_prefills) == 1
    assert [body["prompt"] for _, _, body in d.requests] == ["hi", "hi", "hi"]
    assert f"prefill server {p.url} answered 200 with a body" in caplog.text
    assert f"over --max-prefill-answer-bytes ({limit})" in caplog.text


def test_a_large_request_is_written_out_to_the_servers_off_the_event_loop(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large bodies are parsed on a worker thread; writing one out for each server (~0.2 s for 32 MiB) must not stall
    the proxy's loop either."""
    from kvbroker.integrations import vllm_proxy

    encoded_on: list[tuple[str, str]] = []
    encode = vllm_proxy._encode_json

    def recording(document: dict[str, Any]) -> bytes:
        encoded_on.append((document["prompt"][:5], threading.current_thread().name))
        return encode(document)

    monkeypatch.setattr(vllm_proxy, "_encode_json", recording)
    p, d = serve(prefill_ok), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "small"})[0] == 200
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "large" + "x" * 300_000})[0] == 200
    assert [(prompt, name == "pd-proxy") for prompt, name in encoded_on] == [
        ("small", True), ("small", True), ("large", False), ("large", False)
    ]
    assert d.requests[1][2]["prompt"] == "large" + "x" * 300_000


def test_every_setting_of_the_proxy_is_a_flag_with_its_default() -> None:
    """The parser is made from ProxyConfig: a new setting is a flag at once, with the dataclass's default."""
    import dataclasses

    servers = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]
    config = _parse_args(servers)[1]
    settings = [f for f in dataclasses.fields(ProxyConfig) if f.name not in ("prefill", "decode")]
    assert settings and all(getattr(config, f.name) == f.default for f in settings)
    doubled = [*servers]
    for f in settings:
        doubled += ["--" + f.name.replace("_", "-"), str(f.default * 2)]  # type: ignore[operator]
    config = _parse_args(doubled)[1]
    assert all(getattr(config, f.name) == f.default * 2 for f in settings)  # type: ignore[operator]


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_a_clients_trace_reaches_both_servers_and_their_kv_transfer_params(serve: Any, ratio: float) -> None:
    """A valid `traceparent` goes on to both servers (their own spans join it) and, in `kv_transfer_params`, to both
    connectors (the prefill's grant and the decode's pull join it), whatever the proxy's own ratio."""
    p, d = serve(prefill_ok), serve(decode_json)
    with PdProxy(config_for([p.url], [d.url], trace_ratio=ratio), "127.0.0.1", 0).start() as proxy:
        status, _ = post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"},
                         {"traceparent": TRACEPARENT, "tracestate": "k=v"})
    assert status == 200
    ((_, p_headers, p_body),) = p.requests
    ((_, d_headers, d_body),) = d.requests
    for headers in (p_headers, d_headers):
        assert (headers["traceparent"], headers["tracestate"]) == (TRACEPARENT, "k=v")
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "kvbroker_traceparent": TRACEPARENT,
                                            "kvbroker_tracestate": "k=v"}
    assert d_body["kv_transfer_params"] == {**KV_PARAMS, "kvbroker_traceparent": TRACEPARENT,
                                            "kvbroker_tracestate": "k=v"}


@pytest.mark.parametrize("traceparent", ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", "x" * 5000,
                                         "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"])
def test_a_malformed_trace_is_dropped_and_without_a_ratio_no_trace_is_made(serve: Any, traceparent: str) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"}, {"traceparent": traceparent})[0] == 200
    for server in (p, d):
        ((_, headers, body),) = server.requests
        assert "traceparent" not in headers and "kvbroker_traceparent" not in body["kv_transfer_params"]


def test_with_a_ratio_of_one_the_proxy_starts_one_sampled_trace_for_both_legs(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    with PdProxy(config_for([p.url], [d.url], trace_ratio=1.0), "127.0.0.1", 0).start() as proxy:
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200
    started = p.requests[0][1]["traceparent"]
    context = TraceContext.parse(started)
    assert context is not None and context.sampled
    assert d.requests[0][1]["traceparent"] == started
    assert p.requests[0][2]["kv_transfer_params"]["kvbroker_traceparent"] == started
    assert d.requests[0][2]["kv_transfer_params"]["kvbroker_traceparent"] == started
