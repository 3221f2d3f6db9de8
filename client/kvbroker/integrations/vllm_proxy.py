"""An OpenAI-compatible prefill/decode proxy for vLLM servers that move KV through kvbroker (or NIXL).

    python -m kvbroker.integrations.vllm_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --port 8000

Each completion or chat completion goes to a prefill server first, as NixlConnector's protocol asks:
`kv_transfer_params={"do_remote_decode": True}`, one output token, no streaming. The prefill answer's
`kv_transfer_params` (where its KV blocks are) go unchanged into the client's request, which the decode server then
serves; its answer goes back to the client as it comes (server-sent events when the client asked for
`"stream": true`). The proxy only forwards JSON: it does not need vLLM, a tokenizer or kvbroker's daemon.

Failures name the server: a prefill or decode server that is down, answers 5xx or garbage gives 502, one that does
not answer in time gives 504; a 4xx (the client's own mistake, e.g. an unknown model) is passed through unchanged.

Standard library only (threads, `http.server`, `http.client`), so that it runs in any environment, vLLM's included.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import signal
import ssl
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

_log = logging.getLogger("kvbroker.integrations.vllm_proxy")

PD_ROUTES = ("/v1/completions", "/v1/chat/completions")
# The headers a vLLM server acts on: its API key and the request id it logs (the same on both servers, so that one
# request can be followed through both logs).
_FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
_STREAM_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class Upstream:
    """One vLLM OpenAI server."""

    role: str
    """`prefill` or `decode`: named in every error about this server."""
    url: str
    """Its base URL as given, e.g. `http://127.0.0.1:8100`."""
    scheme: str
    host: str
    port: int
    base_path: str
    """The URL's path, prefixed to the request's (`/v1/...`): empty unless the server sits behind a path."""

    @classmethod
    def parse(cls, role: str, url: str) -> Upstream:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--{role} {url!r}: expected http://HOST:PORT or https://HOST:PORT")
        if parts.query or parts.fragment:
            raise ValueError(f"--{role} {url!r}: a base URL has no query or fragment")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise ValueError(f"--{role} {url!r}: {exc}") from None
        return cls(role, url.rstrip("/"), parts.scheme, parts.hostname, port, parts.path.rstrip("/"))


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    prefill: tuple[Upstream, ...]
    """Prefill servers, used in turn."""
    decode: tuple[Upstream, ...]
    """Decode servers, used in turn (any decode server can pull from any prefill server)."""
    connect_timeout: float = 5.0
    """Seconds to open a connection to a server."""
    prefill_timeout: float = 300.0
    """Seconds a prefill server may take to answer (it computes the whole prompt before it says anything)."""
    decode_timeout: float = 300.0
    """Seconds the decode server may stay silent: before its first byte, and between two streamed chunks."""
    max_body_bytes: int = 32 * 1024 * 1024
    """Largest request body accepted from a client."""


class UpstreamError(Exception):
    """A server failed; `status` is what the client gets (502 or 504)."""

    def __init__(self, upstream: Upstream, status: HTTPStatus, what: str) -> None:
        super().__init__(f"{upstream.role} server {upstream.url} {what}")
        self.status = status


class ClientRequestError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class PassThrough(Exception):
    """The prefill server's 4xx answer: the request itself is wrong (unknown model, bad parameter), and the client
    gets that answer as it is."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"{status}: {_excerpt(body)}")
        self.status = status
        self.body = body
        self.content_type = content_type


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the prefill server must see it: compute the prompt's KV, keep it for a decode server,
    answer with one token and where the KV is."""
    request = dict(body)
    request["kv_transfer_params"] = {"do_remote_decode": True}
    request["stream"] = False
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    # Both only make sense for the answer the client sees, and `min_tokens` > 1 would be refused next to max 1.
    request.pop("stream_options", None)
    request.pop("min_tokens", None)
    return request


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    request = dict(body)
    request.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        request["kv_transfer_params"] = kv_transfer_params
    return request


class _Exchange:
    """One request to one upstream server; `close()` drops the connection (which also aborts the request there)."""

    def __init__(self, upstream: Upstream, timeout: float, config: ProxyConfig) -> None:
        self.upstream = upstream
        self._timeout = timeout
        self._config = config
        self._conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> http.client.HTTPResponse:
        up = self.upstream
        payload = json.dumps(body).encode()
        if up.scheme == "https":
            self._conn = http.client.HTTPSConnection(
                up.host, up.port, timeout=self._config.connect_timeout, context=ssl.create_default_context()
            )
        else:
            self._conn = http.client.HTTPConnection(up.host, up.port, timeout=self._config.connect_timeout)
        try:
            self._conn.connect()
        except TimeoutError:
            raise UpstreamError(
                up, HTTPStatus.GATEWAY_TIMEOUT, f"did not accept a connection within {self._config.connect_timeout} s"
            ) from None
        except OSError as exc:
            raise UpstreamError(up, HTTPStatus.BAD_GATEWAY, f"is unreachable: {exc}") from None
        assert self._conn.sock is not None
        self._conn.sock.settimeout(self._timeout)
        try:
            self._conn.request(
                "POST",
                up.base_path + path,
                body=payload,
                headers={**headers, "Content-Type": "application/json", "Accept": "application/json"},
            )
            return self._conn.getresponse()
        except TimeoutError:
            raise UpstreamError(up, HTTPStatus.GATEWAY_TIMEOUT, f"did not answer within {self._timeout} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise UpstreamError(up, HTTPStatus.BAD_GATEWAY, f"failed before answering: {exc!r}") from None

    def read_all(self, response: http.client.HTTPResponse) -> bytes:
        try:
            return response.read()
        except TimeoutError:
            raise UpstreamError(
                self.upstream, HTTPStatus.GATEWAY_TIMEOUT, f"stopped answering for {self._timeout} s"
            ) from None
        except (OSError, http.client.HTTPException) as exc:
            raise UpstreamError(self.upstream, HTTPStatus.BAD_GATEWAY, f"broke off its answer: {exc!r}") from None

    def chunks(self, response: http.client.HTTPResponse) -> Iterator[bytes]:
        """The body as it arrives (`read1` returns whatever one read gives, so events are not held back)."""
        while True:
            try:
                chunk = response.read1(_STREAM_CHUNK)
            except TimeoutError:
                raise UpstreamError(
                    self.upstream, HTTPStatus.GATEWAY_TIMEOUT, f"stopped streaming for {self._timeout} s"
                ) from None
            except (OSError, http.client.HTTPException) as exc:
                raise UpstreamError(self.upstream, HTTPStatus.BAD_GATEWAY, f"broke off its stream: {exc!r}") from None
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class _RoundRobin:
    def __init__(self, servers: Sequence[Upstream]) -> None:
        self._cycle = itertools.cycle(servers)
        self._lock = threading.Lock()

    def next(self) -> Upstream:
        with self._lock:
            return next(self._cycle)


class PdProxy:
    """The proxy's HTTP server: `start()` binds and serves on a background thread, `close()` stops it."""

    def __init__(self, config: ProxyConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
        self.config = config
        self._host = host
        self._port = port
        self._prefill_servers = _RoundRobin(config.prefill)
        self._decode_servers = _RoundRobin(config.decode)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port): the real port when started with port 0."""
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> PdProxy:
        proxy = self

        class Handler(_Handler):
            pd = proxy

        server = ThreadingHTTPServer((self._host, self._port), Handler)
        server.daemon_threads = True
        self._server = server
        # A short poll interval only makes `close()` quick; an idle server wakes 5 times a second.
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="pd-proxy", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> PdProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    def handle_pd(self, handler: _Handler, path: str, body: dict[str, Any]) -> None:
        request_id = handler.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
        headers = {name: value for name in _FORWARDED_HEADERS if (value := handler.headers.get(name))}
        headers["X-Request-Id"] = request_id
        wants_stream = bool(body.get("stream", False))

        started = time.perf_counter()
        prefill_server, kv_params = self._prefill(path, body, headers, request_id)
        prefilled = time.perf_counter()

        decode = _Exchange(self._decode_servers.next(), self.config.decode_timeout, self.config)
        try:
            response = decode.post(path, decode_body(body, kv_params), headers)
            if response.status != HTTPStatus.OK or not wants_stream:
                raw = decode.read_all(response)
                if response.status >= 500:
                    raise UpstreamError(
                        decode.upstream, HTTPStatus.BAD_GATEWAY, f"answered {response.status}: {_excerpt(raw)}"
                    )
                handler.send_bytes(response.status, raw, response.getheader("Content-Type") or "application/json")
            else:
                self._relay_stream(handler, decode, response, request_id)
        finally:
            decode.close()
        _log.info(
            "%s %s: prefill %.1f ms on %s, decode %.1f ms on %s",
            request_id,
            path,
            (prefilled - started) * 1e3,
            prefill_server.url,
            (time.perf_counter() - prefilled) * 1e3,
            decode.upstream.url,
        )

    def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str], request_id: str
    ) -> tuple[Upstream, dict[str, Any] | None]:
        """The prefill server used and its answer's `kv_transfer_params`."""
        prefill = _Exchange(self._prefill_servers.next(), self.config.prefill_timeout, self.config)
        try:
            response = prefill.post(path, prefill_body(body), headers)
            raw = prefill.read_all(response)
        finally:
            prefill.close()
        up = prefill.upstream
        if 400 <= response.status < 500:
            # The decode server would refuse the same request: no point in sending it there.
            raise PassThrough(response.status, raw, response.getheader("Content-Type") or "application/json")
        if response.status != HTTPStatus.OK:
            raise UpstreamError(up, HTTPStatus.BAD_GATEWAY, f"answered {response.status}: {_excerpt(raw)}")
        try:
            answer = json.loads(raw)
        except ValueError:
            raise UpstreamError(up, HTTPStatus.BAD_GATEWAY, f"answered with invalid JSON: {_excerpt(raw)}") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if params is not None and not isinstance(params, dict):
            raise UpstreamError(
                up, HTTPStatus.BAD_GATEWAY, f"answered kv_transfer_params that are not an object: {params!r:.200}"
            )
        if params is None:
            # What vLLM does when the prefill finished on its own (a stop token first) or has no KV connector: the
            # decode server then computes the prompt itself. Correct, but not disaggregated; say so.
            _log.warning(
                "%s: %s returned no kv_transfer_params; the decode server recomputes the prompt", request_id, up.url
            )
        return up, params

    def _relay_stream(
        self, handler: _Handler, decode: _Exchange, response: http.client.HTTPResponse, request_id: str
    ) -> None:
        handler.send_response(HTTPStatus.OK)
        handler.send_header("Content-Type", response.getheader("Content-Type") or "text/event-stream")
        handler.send_header("Cache-Control", "no-cache")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        try:
            for chunk in decode.chunks(response):
                handler.write_chunk(chunk)
        except UpstreamError as exc:
            # The status line is gone: tell the client in the stream, the way vLLM reports errors in a stream.
            _log.warning("%s: %s", request_id, exc)
            event = {"error": {"message": str(exc), "type": "upstream_error", "code": int(exc.status)}}
            handler.write_chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
        handler.write_chunk(b"")


def _excerpt(raw: bytes, limit: int = 300) -> str:
    text = raw.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


class _Handler(BaseHTTPRequestHandler):
    pd: PdProxy
    protocol_version = "HTTP/1.1"
    server_version = "kvbroker-pd-proxy"
    answer_started = False

    def send_response(self, code: int, message: str | None = None) -> None:
        self.answer_started = True
        super().send_response(code, message)

    def do_POST(self) -> None:
        self.answer_started = False
        path = self.path.split("?", 1)[0]
        try:
            if path not in PD_ROUTES:
                raise ClientRequestError(
                    HTTPStatus.NOT_FOUND, f"no route {path}; this proxy serves {', '.join(PD_ROUTES)}"
                )
            body = self._read_json_body()
            self.pd.handle_pd(self, path, body)
        except PassThrough as answer:
            self.send_bytes(answer.status, answer.body, answer.content_type)
        except ClientRequestError as exc:
            self.send_error_json(exc.status, str(exc), "invalid_request_error")
        except UpstreamError as exc:
            _log.warning("%s", exc)
            self.send_error_json(exc.status, str(exc), "upstream_error")
        except (BrokenPipeError, ConnectionResetError):
            # The client went away; closing the upstream connection (done above) aborts the request there too.
            self.close_connection = True
        except Exception:
            _log.exception("%s %s failed", self.command, self.path)
            self.close_connection = True
            if not self.answer_started:
                self.send_error_json(HTTPStatus.INTERNAL_SERVER_ERROR, "the proxy failed; see its log", "proxy_error")

    def do_GET(self) -> None:
        if self.path in ("/health", "/healthz"):
            self.send_bytes(HTTPStatus.OK, b'{"status": "ok"}', "application/json")
            return
        self.send_error_json(HTTPStatus.NOT_FOUND, f"no route GET {self.path}", "invalid_request_error")

    def _read_json_body(self) -> dict[str, Any]:
        length_header = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or length_header is None:
            raise ClientRequestError(HTTPStatus.LENGTH_REQUIRED, "send the JSON body with a Content-Length")
        try:
            length = int(length_header)
        except ValueError:
            raise ClientRequestError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length_header!r}") from None
        if length < 0 or length > self.pd.config.max_body_bytes:
            self.close_connection = True
            raise ClientRequestError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes; at most {self.pd.config.max_body_bytes}"
            )
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise ClientRequestError(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ClientRequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return body

    def send_bytes(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def send_error_json(self, status: HTTPStatus, message: str, kind: str) -> None:
        body = {"error": {"message": message, "type": kind, "code": int(status)}}
        self.send_bytes(status, json.dumps(body).encode(), "application/json")

    def write_chunk(self, data: bytes) -> None:
        """One HTTP/1.1 chunk, flushed at once; empty data ends the body."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("%s %s", self.address_string(), format % args)


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, ProxyConfig]:
    parser = argparse.ArgumentParser(
        prog="python -m kvbroker.integrations.vllm_proxy",
        description="OpenAI-compatible proxy for disaggregated prefill/decode between vLLM servers "
        "(KvBrokerConnector or NixlConnector).",
    )
    parser.add_argument(
        "--prefill", action="append", required=True, metavar="URL", help="a prefill server (repeat for several)"
    )
    parser.add_argument(
        "--decode", action="append", required=True, metavar="URL", help="a decode server (repeat for several)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to a server")
    parser.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds a prefill server may take")
    parser.add_argument("--decode-timeout", type=float, default=300.0, help="seconds the decode server may stay silent")
    parser.add_argument(
        "--max-body-bytes", type=int, default=32 * 1024 * 1024, help="largest request body accepted (default 32 MiB)"
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    for name in ("connect_timeout", "prefill_timeout", "decode_timeout", "max_body_bytes"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    try:
        config = ProxyConfig(
            prefill=tuple(Upstream.parse("prefill", url) for url in args.prefill),
            decode=tuple(Upstream.parse("decode", url) for url in args.decode),
            connect_timeout=args.connect_timeout,
            prefill_timeout=args.prefill_timeout,
            decode_timeout=args.decode_timeout,
            max_body_bytes=args.max_body_bytes,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return args, config


def main(argv: Sequence[str] | None = None) -> int:
    args, config = _parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        proxy = PdProxy(config, args.host, args.port).start()
    except OSError as exc:
        _log.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        return 1
    host, port = proxy.address
    _log.info(
        "listening on http://%s:%d; prefill %s, decode %s",
        host,
        port,
        ", ".join(u.url for u in config.prefill),
        ", ".join(u.url for u in config.decode),
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        proxy.close()
    _log.info("stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
