"""The P/D proxy against fake prefill and decode servers over real HTTP on loopback.

The servers are fakes because a vLLM server cannot run in this suite (the e2e test in `.ci/run` runs the proxy
against real ones); they answer the way vLLM's OpenAI server does and record what they were sent.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvbroker.integrations.vllm_proxy import PdProxy, ProxyConfig, Upstream, _parse_args

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


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], FakeServer]]:
    started: list[ThreadingHTTPServer] = []

    def start(answer: Answer) -> FakeServer:
        fake = FakeServer(answer)

        class Handler(_FakeHandler):
            pass

        Handler.fake = fake
        fake.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        fake.httpd.daemon_threads = True
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


def post(proxy: PdProxy, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    host, port = proxy.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(
            "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})}
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_completion_goes_prefill_then_decode_with_the_prefill_kv_params_unchanged(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    request = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 16, "min_tokens": 2, "temperature": 0}
    with proxy_for(p.url, d.url) as proxy:
        status, answer = post(proxy, "/v1/completions", request, {"Authorization": "Bearer k", "X-Request-Id": "r1"})

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
        assert headers["X-Request-Id"] == "r1"


def test_both_servers_see_one_request_id_when_the_client_sends_none(serve: Any) -> None:
    p, d = serve(prefill_ok), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200
    assert p.requests[0][1]["X-Request-Id"] == d.requests[0][1]["X-Request-Id"] != ""


def test_chat_completion_stream_is_relayed_event_by_event(serve: Any) -> None:
    first_event_seen = threading.Event()

    def decode_stream(handler: _FakeHandler, body: dict[str, Any]) -> None:
        handler.start_stream()
        handler.chunk(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
        # The rest only once the client has the first event: a proxy that buffered the answer would hang here.
        assert first_event_seen.wait(5)
        handler.chunk(b'data: {"choices": [{"delta": {"content": "b"}}]}\n\n')
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

    assert rest == b'\ndata: {"choices": [{"delta": {"content": "b"}}]}\n\ndata: [DONE]\n\n'
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


def test_an_unreachable_prefill_server_gives_502_naming_it(serve: Any) -> None:
    d = serve(decode_json)
    dead = f"http://127.0.0.1:{free_port()}"
    with proxy_for(dead, d.url) as proxy:
        status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 502
    assert answer["error"]["message"].startswith(f"prefill server {dead} is unreachable")
    assert d.requests == []


def test_a_failing_prefill_server_gives_502_with_its_answer(serve: Any) -> None:
    p = serve(lambda h, b: h.reply(500, {"error": {"message": "engine dead"}}))
    d = serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 502
    message = answer["error"]["message"]
    assert message.startswith(f"prefill server {p.url} answered 500") and "engine dead" in message
    assert d.requests == []


@pytest.mark.parametrize(
    "reply",
    [b"not json", json.dumps({"kv_transfer_params": [1, 2]}).encode()],
    ids=["invalid-json", "params-not-an-object"],
)
def test_a_garbled_prefill_answer_gives_502(serve: Any, reply: bytes) -> None:
    p, d = serve(lambda h, b: h.reply(200, reply)), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 502
    assert answer["error"]["message"].startswith(f"prefill server {p.url} answered")
    assert d.requests == []


def test_a_client_error_from_prefill_is_passed_through_and_decode_is_not_asked(serve: Any) -> None:
    refusal = {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404}}
    p, d = serve(lambda h, b: h.reply(404, refusal)), serve(decode_json)
    with proxy_for(p.url, d.url) as proxy:
        assert post(proxy, "/v1/completions", {"model": "x", "prompt": "hi"}) == (404, refusal)
    assert d.requests == []


def test_a_silent_prefill_server_gives_504_within_its_timeout(serve: Any) -> None:
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
    assert answer["error"]["message"] == f"prefill server {p.url} did not answer within 0.5 s"
    assert d.requests == []


def test_an_unreachable_decode_server_gives_502_naming_it(serve: Any) -> None:
    p = serve(prefill_ok)
    dead = f"http://127.0.0.1:{free_port()}"
    with proxy_for(p.url, dead) as proxy:
        status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "hi"})
    assert status == 502
    assert answer["error"]["message"].startswith(f"decode server {dead} is unreachable")


def test_a_failing_decode_server_gives_502_and_a_decode_refusal_passes_through(serve: Any) -> None:
    p = serve(prefill_ok)
    d = serve(lambda h, b: h.reply(500 if b["prompt"] == "boom" else 400, {"error": {"message": b["prompt"]}}))
    with proxy_for(p.url, d.url) as proxy:
        status, answer = post(proxy, "/v1/completions", {"model": "m", "prompt": "boom"})
        assert status == 502
        assert answer["error"]["message"].startswith(f"decode server {d.url} answered 500")
        assert post(proxy, "/v1/completions", {"model": "m", "prompt": "bad"}) == (400, {"error": {"message": "bad"}})


def test_a_decode_stream_that_stalls_ends_with_an_error_event(serve: Any) -> None:
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
    assert error["message"] == f"decode server {d.url} stopped streaming for 0.5 s"


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
        # The connection stays usable after an error (HTTP/1.1 keep-alive).
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
