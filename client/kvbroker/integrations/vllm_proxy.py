"""An OpenAI-compatible prefill/decode proxy for vLLM servers that move KV through kvbroker (or NIXL).

    pip install 'kvbroker[proxy]'
    python -m kvbroker.integrations.vllm_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --port 8000

Each completion or chat completion goes to a prefill server first, as NixlConnector's protocol asks:
`kv_transfer_params={"do_remote_decode": True}`, one output token, no streaming. The prefill answer's
`kv_transfer_params` (where its KV blocks are) go unchanged into the client's request, which the decode server then
serves; its answer goes back to the client as it comes (server-sent events when the client asked for
`"stream": true`). The proxy only forwards JSON: it does not need vLLM, a tokenizer or kvbroker's daemon.

From the prefill answer the proxy needs only `kv_transfer_params`: the prefill request carries none of the fields that
only enlarge the answer (logprobs, prompt logprobs, echo, token ids; the decode request keeps them, they are the
client's to ask for), and at most `--max-prefill-answer-bytes` of the answer are read (a larger one gives 502).

What a client controls stops at the proxy: `kv_transfer_params` a client sends are dropped (only the prefill
server's reach the decode server), the request id both servers see is the proxy's own (`X-Request-Id: pd-<uuid>`,
also returned to the client), and a request that would make the prefill server hold KV for several sequences while
only one `kv_transfer_params` comes back (`n` > 1, `best_of` > 1, beam search, a batch of prompts) is refused.

Multi-turn reuse (`--turn-ttl`, off by default): the decode server is asked to keep each finished turn's KV, and the
request that continues the conversation brings that turn to its prefill server, which pulls the history instead of
computing it (`vllm_turns.py` says how a turn is found and why a client cannot name another's).

Failures: a server that is down, answers 5xx or garbage gives 502, one that does not answer in time gives 504; the
client learns only which role failed and the request id, the proxy's log has the server and the error. A 4xx (the
client's own mistake, e.g. an unknown model) is passed through unchanged. A failed prefill is retried once on
another prefill server. Servers are health-checked (`GET /health`) and a server that fails `--eject-after` checks or
requests in a row gets no more requests until a check passes (unless every server of its role is out).

Tracing (docs/tracing.md): with `--otlp-traces-endpoint` (or the standard OTEL_EXPORTER_OTLP_ENDPOINT), a span per
request (`pd.request`, continuing the client's valid `traceparent`) and one per leg (`pd.prefill`, `pd.decode`), each
leg's context passed to its server as `traceparent` and in `kv_transfer_params`. Off (the default), nothing of
OpenTelemetry is imported.

The HTTP side is aiohttp (`kvbroker[proxy]`): one event loop, no thread per connection; request bodies are framed by
aiohttp's parser and capped in size and JSON values, every wait on a client is bounded (`--client-timeout`), the
number of connections is capped, and an error answer always closes its connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import re
import secrets
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

try:
    import aiohttp
    from aiohttp import web
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvbroker's P/D proxy needs aiohttp: pip install 'kvbroker[proxy]'"
    ) from _exc

from kvbroker.integrations.vllm_turns import (
    KEEP_TURN_PARAM,
    Conversation,
    StreamedAnswer,
    TurnMemory,
    added_by,
    conversation_of,
    handed_back,
    running_keys,
    scope_of,
    tenant_of,
)
from kvbroker.tracecontext import TRACEPARENT, TRACESTATE, TraceContext

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

_log = logging.getLogger("kvbroker.integrations.vllm_proxy")
_T = TypeVar("_T")

PD_ROUTES = ("/v1/completions", "/v1/chat/completions")
HEALTH_ROUTES = ("/health", "/healthz")
REQUEST_ID_HEADER = "X-Request-Id"
TRACE_PARAM = "kvbroker_traceparent"
TRACE_STATE_PARAM = "kvbroker_tracestate"
"""`kv_transfer_params` keys of the request's trace context (integrations/vllm/params.py reads them)."""
SERVER_NAME = "kvbroker-pd-proxy"
# The client header a vLLM server acts on besides the request id (which the proxy makes itself): its API key.
_FORWARDED_HEADERS = ("Authorization",)
# Body fields a client may not set: where the KV is comes only from the prefill server, the request id only from us.
_STRIPPED_FIELDS = ("kv_transfer_params", "request_id")
# Fields that only shape the answer the client sees: at the prefill server they would only enlarge an answer the proxy
# reads nothing from but `kv_transfer_params` (prompt logprobs of a long prompt are tens of MB), and `min_tokens` > 1
# would be refused next to `max_tokens` 1. `n` and `best_of` are 1 or absent here (see `single_sequence_problem`).
_PREFILL_DROPPED_FIELDS = (
    "stream_options",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "n",
    "best_of",
)
# Bodies (and prefill answers) larger than this are parsed on a worker thread, so that one big one does not stall the
# others.
_PARSE_INLINE_BYTES = 256 * 1024
# JSON strings (with their escapes); what is left once they are removed is structure, numbers and literals.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


@dataclass(frozen=True, slots=True)
class Upstream:
    """One vLLM OpenAI server."""

    role: str
    """`prefill` or `decode`: named in every log line about this server."""
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


def _setting(default: float, help: str, *, zero_allowed: bool = False) -> Any:
    """A proxy setting: its default and its help, which the command line takes as they are (`_parse_args`)."""
    return field(default=default, metadata={"help": help, "zero_allowed": zero_allowed})


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    prefill: tuple[Upstream, ...]
    """Prefill servers, used in turn."""
    decode: tuple[Upstream, ...]
    """Decode servers, used in turn (any decode server can pull from any prefill server)."""
    connect_timeout: float = _setting(5.0, "seconds to open a connection to a server")
    prefill_timeout: float = _setting(
        300.0, "seconds a prefill server may stay silent (it computes the whole prompt before it says anything)")
    decode_timeout: float = _setting(
        300.0, "seconds the decode server may stay silent: before its first byte, and between two streamed chunks")
    max_body_bytes: int = _setting(32 * 1024 * 1024, "largest request body accepted from a client (default 32 MiB)")
    max_prefill_answer_bytes: int = _setting(
        1024 * 1024, "most bytes read of a prefill server's answer (one token and kv_transfer_params take a few KiB); "
        "a larger one gives 502 (default 1 MiB)")
    max_json_values: int = _setting(
        2_000_000, "most JSON values (objects, arrays, strings, numbers, literals) a request body may hold: parsed "
        "JSON takes up to ~60 bytes per value, so this, not the body size, bounds the memory a body costs")
    client_timeout: float = _setting(
        60.0, "seconds a client has to send a request (headers, counted from its connection or its previous answer, "
        "then the body) and to take each piece of the answer; an idle keep-alive connection is closed after it")
    max_connections: int = _setting(1024, "client connections open at once; one more is answered 503 and closed")
    health_interval: float = _setting(
        5.0, "seconds between health checks (GET /health) of every server; 0 turns health checks and ejection off",
        zero_allowed=True)
    health_timeout: float = _setting(2.0, "seconds a health check may take")
    eject_after: int = _setting(
        3, "failed health checks or requests in a row after which a server gets no requests until a check passes")
    trace_ratio: float = _setting(
        0.0, "share of requests that come without a W3C traceparent for which the proxy starts a sampled trace, "
        "passed to both servers and their daemons (0: none; a valid traceparent a client sends is always passed on)",
        zero_allowed=True)
    turn_ttl: float = _setting(
        0.0, "seconds a finished turn's KV stays offered for the conversation's next turn (multi-turn reuse: the "
        "decode server holds the turn's blocks under a grant, the next prefill pulls them instead of recomputing the "
        "history; at most the decode server's kvbroker_hold_lease_s); 0: off, the decode server holds nothing",
        zero_allowed=True)
    max_turns: int = _setting(10000, "most finished turns remembered at once (the oldest are forgotten)")
    max_turn_bytes: int = _setting(
        64 * 1024 * 1024, "most bytes of the finished turns' kv_transfer_params (as JSON) remembered at once, all "
        "together (the oldest are forgotten; a turn holds a block id and a hash per block: ~3x this in memory)")


class UpstreamError(Exception):
    """A server failed; `status` is what the client gets (502 or 504). The message (server URL, error) goes to the
    log only; the client gets `public_message`."""

    def __init__(self, upstream: Upstream, status: HTTPStatus, what: str) -> None:
        super().__init__(f"{upstream.role} server {upstream.url} {what}")
        self.upstream = upstream
        self.status = status

    def public_message(self, request_id: str) -> str:
        what = "did not answer in time" if self.status == HTTPStatus.GATEWAY_TIMEOUT else "failed"
        return f"the {self.upstream.role} server {what} (request {request_id}; details in the proxy's log)"


class AnswerTooLarge(UpstreamError):
    """A prefill answer over `max_prefill_answer_bytes`. Not the server's failure (a request may have asked for it),
    and the same request would give the same answer elsewhere: neither counted towards ejection nor retried."""

    def __init__(self, upstream: Upstream, limit: int, what: str) -> None:
        super().__init__(upstream, HTTPStatus.BAD_GATEWAY, f"{what}, over --max-prefill-answer-bytes ({limit})")
        self.limit = limit

    def public_message(self, request_id: str) -> str:
        return (
            f"the {self.upstream.role} server's answer is over the proxy's limit of {self.limit} bytes "
            f"(--max-prefill-answer-bytes; request {request_id})"
        )


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


class _ClientStalled(Exception):
    """The client did not take a piece of the answer within `client_timeout`."""


@dataclass(eq=False, slots=True)
class _Leg:
    """A leg's span while tracing is on, and what the leg learns for it on the way."""

    span: Span
    trace: TraceContext | None
    """The span's context: its server's and its daemon's spans are its children."""
    tokens: int | None = None
    first_token_ns: int = 0
    """When the decode server's first answer bytes arrived (its time to first token)."""


def prefill_body(body: dict[str, Any], trace: TraceContext | None = None,
                 turn: dict[str, Any] | None = None) -> dict[str, Any]:
    """The client's request as the prefill server must see it: compute the prompt's KV, keep it for a decode server,
    answer with one token and where the KV is (and, with a trace, the trace its grant is made under). `turn`: the
    previous turn's KV on a decode server (`vllm_turns`), whose tokens the prefill server pulls where they match."""
    dropped = _STRIPPED_FIELDS + _PREFILL_DROPPED_FIELDS
    request = {key: value for key, value in body.items() if key not in dropped}
    request["kv_transfer_params"] = {**(turn or {}), "do_remote_decode": True, **_trace_params(trace)}
    request["stream"] = False
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None,
                trace: TraceContext | None = None, keep_turn: bool = False) -> dict[str, Any]:
    request = {key: value for key, value in body.items() if key not in _STRIPPED_FIELDS}
    if kv_transfer_params is not None:
        request["kv_transfer_params"] = {**kv_transfer_params, **_trace_params(trace),
                                         **({KEEP_TURN_PARAM: True} if keep_turn else {})}
    return request


def request_trace(headers: Mapping[str, str], ratio: float) -> TraceContext | None:
    """The trace a request belongs to: the client's (a valid `traceparent`; anything else is dropped), else a new
    one for `ratio` of requests (sampled: the servers and daemons that trace record it), else none."""
    client = TraceContext.parse(headers.get(TRACEPARENT), headers.get(TRACESTATE))
    if client is not None or ratio <= 0 or random.random() >= ratio:
        return client
    return TraceContext(f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")


def _trace_params(trace: TraceContext | None) -> dict[str, str]:
    """The trace as `kv_transfer_params` carry it to the connector (which passes it to its daemon: the prefill's
    grant and the decode's pull then join the request's trace)."""
    if trace is None:
        return {}
    return {TRACE_PARAM: trace.traceparent, **({TRACE_STATE_PARAM: trace.tracestate} if trace.tracestate else {})}


def single_sequence_problem(path: str, body: dict[str, Any]) -> str | None:
    """Why the request cannot go through P/D as one prefill and one decode, or None.

    vLLM runs each prompt of a batch and each of `n` / `best_of` samples (and each beam) as a request of its own: the
    prefill server would hold KV blocks for every one of them while its answer carries one `kv_transfer_params`, so
    the others stay held until they time out, and a decode server handed that one set for every sequence would pull
    one sequence's KV into all of them."""
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is not None and value != 1:
            return f"`{key}` must be 1 through the P/D proxy (got {value!r:.40}): send one request per sample"
    if body.get("use_beam_search"):
        return "beam search is not served through the P/D proxy"
    if path == "/v1/completions":
        for key in ("prompt", "prompt_embeds"):
            value = body.get(key)
            if isinstance(value, list) and len(value) > 1 and not isinstance(value[0], int | float):
                return f"a batch of {len(value)} prompts is not served through the P/D proxy: send one request each"
    return None


def count_json_values(raw: bytes | bytearray) -> int:
    """An upper bound of the values the JSON document in `raw` holds, without building them: strings are dropped,
    then commas and openers counted (1 + commas + containers; exact for valid JSON without empty containers)."""
    rest = _JSON_STRING.sub(b"", raw)
    return rest.count(b",") + rest.count(b"[") + rest.count(b"{") + 1


def _encode_json(document: dict[str, Any]) -> bytes:
    return json.dumps(document).encode()


def _parse_body(raw: bytearray, max_values: int) -> dict[str, Any]:
    values = count_json_values(raw)
    if values > max_values:
        raise ClientRequestError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of about {values} JSON values; at most {max_values}"
        )
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ClientRequestError(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ClientRequestError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
    return body


class _Pool:
    """The servers of one role: round-robin over those in service; health state per server.

    Runs on the proxy's event loop only (no locks)."""

    def __init__(self, servers: Sequence[Upstream], eject_after: int, ejection: bool) -> None:
        self.servers = tuple(servers)
        self._eject_after = eject_after
        self._ejection = ejection
        self._next = 0
        self._failures = dict.fromkeys(self.servers, 0)
        self.ejected: set[Upstream] = set()

    def pick(self, exclude: Upstream | None = None) -> Upstream | None:
        """The next server in service other than `exclude`; if all others are out, the next other one anyway (a
        request to a server that may have come back beats refusing it); None if there is no other server."""
        candidates = [s for s in self.servers if s != exclude]
        if not candidates:
            return None
        usable = [s for s in candidates if s not in self.ejected] or candidates
        for _ in range(len(self.servers)):
            server = self.servers[self._next % len(self.servers)]
            self._next += 1
            if server in usable:
                return server
        return usable[0]  # pragma: no cover - the loop above always finds one

    def failed(self, server: Upstream, why: str) -> None:
        self._failures[server] += 1
        if self._ejection and server not in self.ejected and self._failures[server] >= self._eject_after:
            self.ejected.add(server)
            _log.warning(
                "%s server %s ejected after %d failures in a row (last: %s); it gets no requests until a health "
                "check passes",
                server.role,
                server.url,
                self._failures[server],
                why,
            )

    def succeeded(self, server: Upstream) -> None:
        self._failures[server] = 0
        if server in self.ejected:
            self.ejected.discard(server)
            _log.warning("%s server %s is back in service", server.role, server.url)

    @property
    def in_service(self) -> int:
        return len(self.servers) - len(self.ejected)


class _Refuse(asyncio.Protocol):
    """A connection over `max_connections`: a 503 and the connection closed, nothing read."""

    BODY = json.dumps(
        {"error": {"message": "too many connections", "type": "proxy_busy", "code": HTTPStatus.SERVICE_UNAVAILABLE}}
    ).encode()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(self.BODY), self.BODY)
        )
        transport.close()


class PdProxy:
    """The proxy's HTTP server: `start()` binds and serves on a background thread (its own event loop), `close()`
    stops it."""

    def __init__(self, config: ProxyConfig, host: str = "127.0.0.1", port: int = 8000,
                 tracer: Tracer | None = None) -> None:
        """`tracer`: the proxy's spans go there (None: no spans; see `tracer_of`)."""
        self.config = config
        self._tracer = tracer
        self._host = host
        self._port = port
        ejection = config.health_interval > 0
        self._prefill_pool = _Pool(config.prefill, config.eject_after, ejection)
        self._decode_pool = _Pool(config.decode, config.eject_after, ejection)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._address: tuple[str, int] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.ServerRunner | None = None
        self._listener: asyncio.Server | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._refused_logged_at = 0.0
        self._turns = TurnMemory(config.turn_ttl, config.max_turns, config.max_turn_bytes)

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port): the real port when started with port 0."""
        if self._address is None:
            raise RuntimeError("the proxy is not started")
        return self._address

    def start(self) -> PdProxy:
        """Bind and serve (once: a started proxy is returned as it is); raises OSError when the address cannot be
        bound."""
        if self._thread is not None:
            return self
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(self._open())
            except BaseException as exc:
                failure.append(exc)
                loop.run_until_complete(self._shutdown())
                loop.close()
                started.set()
                return
            self._loop = loop
            started.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=run, name="pd-proxy", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def close(self) -> None:
        loop, self._loop = self._loop, None
        thread, self._thread = self._thread, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join()
        self._address = None

    def __enter__(self) -> PdProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- life cycle (on the proxy's loop) ----------------------------------------------------------------------

    async def _open(self) -> None:
        cfg = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            # Only what the proxy sets: no cookies kept from one request for the next, no proxy from the environment.
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
        )
        server = web.Server(
            self._handle,
            handler_cancellation=True,  # a client that leaves cancels its request, and so the server's
            keepalive_timeout=cfg.client_timeout,  # counts from the connection or the previous answer
            access_log=None,  # one line per request comes from `_handle_pd`
            lingering_time=min(cfg.client_timeout, 10.0),
        )
        self._runner = web.ServerRunner(server, shutdown_timeout=1.0)
        await self._runner.setup()

        def protocol() -> asyncio.BaseProtocol:
            if len(server.connections) >= cfg.max_connections:
                now = time.monotonic()
                if now - self._refused_logged_at > 10:
                    self._refused_logged_at = now
                    _log.warning("%d client connections open: refusing more", cfg.max_connections)
                return _Refuse()
            return server()

        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(protocol, self._host, self._port, reuse_address=True)
        host, port = self._listener.sockets[0].getsockname()[:2]
        self._address = (str(host), int(port))
        if cfg.health_interval > 0:
            self._health_task = loop.create_task(self._health_loop())

    async def _shutdown(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ---- health ------------------------------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        pools = (self._prefill_pool, self._decode_pool)
        while True:
            try:
                await asyncio.gather(*(self._check(pool, server) for pool in pools for server in pool.servers))
            except Exception:  # never end the checks: a server left out would stay as it is for good
                _log.exception("health checks failed")
            await asyncio.sleep(self.config.health_interval)

    async def _check(self, pool: _Pool, server: Upstream) -> None:
        assert self._session is not None
        try:
            async with self._session.get(
                server.url + "/health", timeout=aiohttp.ClientTimeout(total=self.config.health_timeout)
            ) as response:
                await response.read()
                status = response.status
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            pool.failed(server, f"health check: {exc!r}")
            return
        if status == HTTPStatus.OK:
            pool.succeeded(server)
        else:
            pool.failed(server, f"health check answered {status}")

    # ---- requests ----------------------------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        request_id = f"pd-{uuid.uuid4().hex}"
        try:
            if request.method == "GET" and request.path in HEALTH_ROUTES:
                health = {
                    "status": "ok",
                    "prefill_servers_in_service": self._prefill_pool.in_service,
                    "decode_servers_in_service": self._decode_pool.in_service,
                }
                return await self._send(request, HTTPStatus.OK, json.dumps(health).encode(), "application/json")
            if request.method != "POST" or request.path not in PD_ROUTES:
                raise ClientRequestError(
                    HTTPStatus.NOT_FOUND,
                    f"no route {request.method} {request.path:.200}; this proxy serves POST {', '.join(PD_ROUTES)}",
                )
            return await self._handle_pd(request, request_id)
        except PassThrough as answer:
            return await self._send(request, answer.status, answer.body, answer.content_type, request_id)
        except ClientRequestError as exc:
            return await self._send_error(request, exc.status, str(exc), "invalid_request_error", request_id)
        except UpstreamError as exc:
            _log.warning("%s: %s", request_id, exc)
            return await self._send_error(request, exc.status, exc.public_message(request_id), "upstream_error",
                                          request_id)
        except (_ClientStalled, ConnectionError) as exc:
            _log.info("%s: the client %s; dropping the request", request_id,
                      "stopped reading" if isinstance(exc, _ClientStalled) else "went away")
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=HTTPStatus.INTERNAL_SERVER_ERROR)  # never reaches anyone
        except Exception:
            _log.exception("%s: %s %s failed", request_id, request.method, request.path)
            return await self._send_error(
                request, HTTPStatus.INTERNAL_SERVER_ERROR, f"the proxy failed (request {request_id})", "proxy_error",
                request_id
            )

    async def _handle_pd(self, request: web.BaseRequest, request_id: str) -> web.StreamResponse:
        path = request.path
        body, body_size = await self._read_json_body(request)
        problem = single_sequence_problem(path, body)
        if problem is not None:
            raise ClientRequestError(HTTPStatus.BAD_REQUEST, problem)
        headers = {name: value for name in _FORWARDED_HEADERS if (value := request.headers.get(name))}
        headers[REQUEST_ID_HEADER] = request_id
        if (client_id := request.headers.get(REQUEST_ID_HEADER)) is not None:
            _log.info("%s: the client's X-Request-Id is %.200r", request_id, client_id)
        wants_stream = bool(body.get("stream", False))
        if self._tracer is not None:
            return await self._traced_pd(request, request_id, path, body, body_size, headers, wants_stream)
        trace = request_trace(request.headers, self.config.trace_ratio)
        if trace is not None:  # both servers' own spans (vLLM's --otlp-traces-endpoint) join the request's trace
            headers.update(trace.metadata())

        turn, remember = await self._turn_of(request, path, body, body_size)
        started = time.perf_counter()
        prefill_request = await self._encode(prefill_body(body, trace, turn), body_size)
        prefill_server, kv_params = await self._prefill(path, prefill_request, headers, request_id)
        prefilled = time.perf_counter()

        decode = self._decode_pool.pick()
        assert decode is not None
        decode_request = await self._encode(decode_body(body, kv_params, trace, keep_turn=remember is not None),
                                            body_size)
        answer = await self._decode(request, decode, path, decode_request, headers, wants_stream, request_id,
                                    on_answer=remember)
        _log.info(
            "%s %s: prefill %.1f ms on %s, decode %.1f ms on %s",
            request_id,
            path,
            (prefilled - started) * 1e3,
            prefill_server.url,
            (time.perf_counter() - prefilled) * 1e3,
            decode.url,
        )
        return answer

    async def _turn_of(self, request: web.BaseRequest, path: str, body: dict[str, Any], body_size: int
                       ) -> tuple[dict[str, Any] | None, Callable[[dict[str, Any]], None] | None]:
        """Multi-turn reuse (`--turn-ttl`): the earlier turn this request continues, whose KV its prefill may pull
        (None: none), and what remembers this turn's answer for the next one (None: not kept; a streamed answer is
        read as it is relayed: `StreamedAnswer`). The conversation is read and hashed on a worker thread where the
        body is large, as it was parsed; the memory of turns is touched on the event loop only."""
        if self.config.turn_ttl <= 0:
            return None, None
        tenant = tenant_of(request.headers, _FORWARDED_HEADERS)

        def read() -> tuple[Conversation | None, bytes]:
            return conversation_of(path, body), scope_of(tenant, path, body)

        inline = body_size <= _PARSE_INLINE_BYTES
        conversation, scope = read() if inline else await self._off_loop(read)
        if conversation is None:
            return None, None
        lengths = self._turns.lengths(scope, len(conversation))
        keys, running = (running_keys(scope, conversation, lengths) if inline else
                         await self._off_loop(lambda: running_keys(scope, conversation, lengths)))
        turn = self._turns.take_keys(keys)

        def remember(answer: dict[str, Any]) -> None:
            params = handed_back(answer.get("kv_transfer_params"))
            if params is not None:  # (the answer's part hashed only: the request's was, above)
                self._turns.remember_key(scope, *running.extended(added_by(conversation, path, answer)), params)

        return turn, remember

    async def _traced_pd(self, request: web.BaseRequest, request_id: str, path: str, body: dict[str, Any],
                         body_size: int, headers: dict[str, str], wants_stream: bool) -> web.StreamResponse:
        """`_handle_pd` with spans: the request's, continuing the client's valid traceparent, and one per leg, whose
        context its server and (through kv_transfer_params) its daemon continue."""
        from opentelemetry.trace import SpanKind

        from kvbroker.integrations import otel

        assert self._tracer is not None
        model = body.get("model")
        attributes = {"http.route": path, "kvbroker.request_id": request_id, "kvbroker.stream": wants_stream,
                      **({"gen_ai.request.model": model[:256]} if isinstance(model, str) else {})}
        started_ns = time.time_ns()
        root = otel.start(self._tracer, "pd.request", TraceContext.parse(request.headers.get(TRACEPARENT),
                                                                         request.headers.get(TRACESTATE)),
                          attributes, started_ns, SpanKind.SERVER)
        parent = otel.trace_of(root)
        leg: _Leg | None = None
        try:
            # (inside: a client that leaves while a large body's conversation is read still ends the request's span)
            turn, remember = await self._turn_of(request, path, body, body_size)
            leg = self._leg("prefill", parent, attributes)
            prefill_request = await self._encode(prefill_body(body, leg.trace, turn), body_size)
            prefill_server, kv_params = await self._prefill(path, prefill_request, _with_trace(headers, leg.trace),
                                                            request_id, leg)
            prompt_tokens = leg.tokens
            otel.end(leg.span, attributes={"server.address": prefill_server.url, "gen_ai.usage.input_tokens":
                                           prompt_tokens, "kvbroker.kv_transfer_params": kv_params is not None})
            decode = self._decode_pool.pick()
            assert decode is not None
            leg = self._leg("decode", parent, {**attributes, "server.address": decode.url})
            decode_request = await self._encode(decode_body(body, kv_params, leg.trace,
                                                            keep_turn=remember is not None), body_size)
            answer = await self._decode(request, decode, path, decode_request, _with_trace(headers, leg.trace),
                                        wants_stream, request_id, leg, on_answer=remember)
            first_token_ns = leg.first_token_ns or time.time_ns()
            _log.info("%s %s: prefill on %s, decode on %s, first token after %.1f ms (trace %s)", request_id, path,
                      prefill_server.url, decode.url, (first_token_ns - started_ns) / 1e6,
                      parent.trace_id if parent is not None else "-")
            leg.span.add_event("first_token", timestamp=first_token_ns)
            otel.end(leg.span, attributes={"http.response.status_code": answer.status,
                                           "gen_ai.usage.output_tokens": leg.tokens})
            leg = None
            root.add_event("first_token", timestamp=first_token_ns)
            otel.end(root, attributes={"http.response.status_code": answer.status,
                                       "gen_ai.usage.input_tokens": prompt_tokens,
                                       "kvbroker.ttft_ms": round((first_token_ns - started_ns) / 1e6, 3)})
            return answer
        except BaseException as e:
            status = _span_status(e)
            if leg is not None:
                otel.end(leg.span, status)
            otel.end(root, status)
            raise

    def _leg(self, role: str, parent: TraceContext | None, attributes: dict[str, Any]) -> _Leg:
        from opentelemetry.trace import SpanKind

        from kvbroker.integrations import otel

        assert self._tracer is not None
        span = otel.start(self._tracer, f"pd.{role}", parent, {**attributes, "kvbroker.engine_role": role},
                          kind=SpanKind.CLIENT)
        return _Leg(span, otel.trace_of(span))

    @staticmethod
    async def _off_loop(work: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(None, work)

    @staticmethod
    async def _encode(document: dict[str, Any], body_size: int) -> bytes:
        """`document` (a client's body of `body_size` bytes, rewritten) as JSON: off the event loop when it is large,
        as it was parsed (32 MiB of JSON takes ~0.2 s to write)."""
        if body_size <= _PARSE_INLINE_BYTES:
            return _encode_json(document)
        return await asyncio.get_running_loop().run_in_executor(None, _encode_json, document)

    async def _read_json_body(self, request: web.BaseRequest) -> tuple[dict[str, Any], int]:
        """The client's body and its size in bytes."""
        cfg = self.config
        length = request.content_length
        if length is not None and length > cfg.max_body_bytes:
            raise ClientRequestError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes; at most {cfg.max_body_bytes}"
            )
        raw = bytearray()

        async def read() -> None:
            # aiohttp's parser frames the body (Content-Length or chunked), so no byte of it is ever read as a request.
            while chunk := await request.content.readany():
                if len(raw) + len(chunk) > cfg.max_body_bytes:
                    raise ClientRequestError(
                        HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {cfg.max_body_bytes} bytes"
                    )
                raw.extend(chunk)

        try:
            await asyncio.wait_for(read(), cfg.client_timeout)
        except asyncio.TimeoutError:
            raise ClientRequestError(
                HTTPStatus.REQUEST_TIMEOUT, f"the body did not arrive within {cfg.client_timeout:g} s"
            ) from None
        if len(raw) <= _PARSE_INLINE_BYTES:
            return _parse_body(raw, cfg.max_json_values), len(raw)
        body = await asyncio.get_running_loop().run_in_executor(None, _parse_body, raw, cfg.max_json_values)
        return body, len(raw)

    async def _post(
        self, server: Upstream, path: str, data: bytes, headers: dict[str, str], timeout: float
    ) -> aiohttp.ClientResponse:
        assert self._session is not None
        try:
            return await self._session.post(
                server.url + path,
                data=data,
                headers={**headers, "Content-Type": "application/json", "Accept": "application/json"},
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=None, sock_connect=self.config.connect_timeout, sock_read=timeout
                ),
                allow_redirects=False,
            )
        except aiohttp.ConnectionTimeoutError:
            raise UpstreamError(
                server,
                HTTPStatus.GATEWAY_TIMEOUT,
                f"did not accept a connection within {self.config.connect_timeout:g} s",
            ) from None
        except aiohttp.ServerTimeoutError:
            raise UpstreamError(server, HTTPStatus.GATEWAY_TIMEOUT, f"did not answer within {timeout:g} s") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(server, HTTPStatus.BAD_GATEWAY, f"is unreachable: {exc}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(server, HTTPStatus.BAD_GATEWAY, f"failed before answering: {exc!r}") from None

    @contextlib.asynccontextmanager
    async def _exchange(
        self, server: Upstream, path: str, data: bytes, headers: dict[str, str], timeout: float
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request to `server`: its connection is reused only when the answer was read to its end; anything
        else (the client left, an error) closes it, which also aborts the request on the server."""
        response = await self._post(server, path, data, headers, timeout)
        try:
            yield response
        except BaseException:
            response.close()
            raise
        finally:
            response.release()

    @staticmethod
    async def _read_all(server: Upstream, response: aiohttp.ClientResponse, timeout: float) -> bytes:
        try:
            return await response.read()
        except aiohttp.ServerTimeoutError:
            raise UpstreamError(server, HTTPStatus.GATEWAY_TIMEOUT, f"stopped answering for {timeout:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(server, HTTPStatus.BAD_GATEWAY, f"broke off its answer: {exc!r}") from None

    @staticmethod
    async def _read_bounded(server: Upstream, response: aiohttp.ClientResponse, timeout: float, limit: int) -> bytes:
        """The answer's body, or AnswerTooLarge as soon as it is known to be over `limit` bytes (the rest is never
        read: leaving `_exchange` with the error closes the connection)."""
        length = response.content_length
        if length is not None and length > limit:
            raise AnswerTooLarge(server, limit, f"answered {response.status} with a body of {length} bytes")
        raw = bytearray()
        try:
            while chunk := await response.content.readany():
                if len(raw) + len(chunk) > limit:
                    raise AnswerTooLarge(server, limit, f"answered {response.status} with a body over {limit} bytes")
                raw.extend(chunk)
        except aiohttp.ServerTimeoutError:
            raise UpstreamError(server, HTTPStatus.GATEWAY_TIMEOUT, f"stopped answering for {timeout:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(server, HTTPStatus.BAD_GATEWAY, f"broke off its answer: {exc!r}") from None
        return bytes(raw)

    async def _prefill(
        self, path: str, data: bytes, headers: dict[str, str], request_id: str, leg: _Leg | None = None
    ) -> tuple[Upstream, dict[str, Any] | None]:
        """The prefill server used and its answer's `kv_transfer_params`; a failed prefill is tried once more on
        another server."""
        server = self._prefill_pool.pick()
        assert server is not None
        try:
            return server, await self._prefill_on(server, path, data, headers, request_id, leg)
        except AnswerTooLarge:
            raise
        except UpstreamError as exc:
            other = self._prefill_pool.pick(exclude=server)
            if other is None:
                raise
            _log.warning("%s: %s; trying %s", request_id, exc, other.url)
            if leg is not None:
                leg.span.add_event("retry", {"server.address": server.url, "kvbroker.status": int(exc.status)})
        return other, await self._prefill_on(other, path, data, headers, request_id, leg)

    async def _prefill_on(
        self, server: Upstream, path: str, data: bytes, headers: dict[str, str], request_id: str, leg: _Leg | None
    ) -> dict[str, Any] | None:
        try:
            params = await self._prefill_answer(server, path, data, headers, request_id, leg)
        except AnswerTooLarge:
            raise
        except UpstreamError as exc:
            self._prefill_pool.failed(server, str(exc))
            raise
        self._prefill_pool.succeeded(server)
        return params

    async def _prefill_answer(
        self, server: Upstream, path: str, data: bytes, headers: dict[str, str], request_id: str,
        leg: _Leg | None = None
    ) -> dict[str, Any] | None:
        timeout = self.config.prefill_timeout
        async with self._exchange(server, path, data, headers, timeout) as response:
            raw = await self._read_bounded(server, response, timeout, self.config.max_prefill_answer_bytes)
            status, content_type = response.status, response.headers.get("Content-Type")
        if 400 <= status < 500:
            # The decode server would refuse the same request: no point in sending it there.
            raise PassThrough(status, raw, content_type or "application/json")
        if status != HTTPStatus.OK:
            raise UpstreamError(server, HTTPStatus.BAD_GATEWAY, f"answered {status}: {_excerpt(raw)}")
        try:
            if len(raw) <= _PARSE_INLINE_BYTES:
                answer = json.loads(raw)
            else:
                answer = await asyncio.get_running_loop().run_in_executor(None, json.loads, raw)
        except ValueError:
            raise UpstreamError(
                server, HTTPStatus.BAD_GATEWAY, f"answered with invalid JSON: {_excerpt(raw)}"
            ) from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if leg is not None:
            leg.tokens = _usage(answer, "prompt_tokens")
        if params is not None and not isinstance(params, dict):
            raise UpstreamError(
                server, HTTPStatus.BAD_GATEWAY, f"answered kv_transfer_params that are not an object: {params!r:.200}"
            )
        if params is None:
            # What vLLM does when the prefill finished on its own (a stop token first) or has no KV connector: the
            # decode server then computes the prompt itself. Correct, but not disaggregated; say so.
            _log.warning(
                "%s: %s returned no kv_transfer_params; the decode server recomputes the prompt", request_id, server.url
            )
        return params

    async def _decode(
        self,
        request: web.BaseRequest,
        server: Upstream,
        path: str,
        data: bytes,
        headers: dict[str, str],
        wants_stream: bool,
        request_id: str,
        leg: _Leg | None = None,
        on_answer: Callable[[dict[str, Any]], None] | None = None,
    ) -> web.StreamResponse:
        """`on_answer`: given a non-streamed 200 answer's JSON (unless it is over `_PARSE_INLINE_BYTES`)."""
        timeout = self.config.decode_timeout
        try:
            async with self._exchange(server, path, data, headers, timeout) as response:
                if response.status != HTTPStatus.OK or not wants_stream:
                    raw = await self._read_all(server, response, timeout)
                    if leg is not None:
                        leg.first_token_ns = time.time_ns()
                        with contextlib.suppress(ValueError):
                            leg.tokens = _usage(json.loads(raw), "completion_tokens")
                    if response.status >= 500:
                        raise UpstreamError(
                            server, HTTPStatus.BAD_GATEWAY, f"answered {response.status}: {_excerpt(raw)}"
                        )
                    self._decode_pool.succeeded(server)
                    if on_answer is not None and response.status == HTTPStatus.OK and len(raw) <= _PARSE_INLINE_BYTES:
                        with contextlib.suppress(ValueError):  # relayed as it is: the client sees what is wrong
                            if isinstance(document := json.loads(raw), dict):
                                on_answer(document)
                    content_type = response.headers.get("Content-Type", "application/json")
                    return await self._send(request, response.status, raw, content_type, request_id)
                self._decode_pool.succeeded(server)
                return await self._relay_stream(request, server, response, request_id, leg, on_answer, path)
        except UpstreamError as exc:
            self._decode_pool.failed(server, str(exc))
            raise

    async def _relay_stream(
        self, request: web.BaseRequest, server: Upstream, response: aiohttp.ClientResponse, request_id: str,
        leg: _Leg | None = None, on_answer: Callable[[dict[str, Any]], None] | None = None, path: str = ""
    ) -> web.StreamResponse:
        """`on_answer`: given the answer as a non-streamed one would be, once the stream ended whole and readable."""
        answer = web.StreamResponse(
            status=HTTPStatus.OK,
            headers={
                "Content-Type": response.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "Server": SERVER_NAME,
                REQUEST_ID_HEADER: request_id,
            },
        )
        await self._bounded(answer.prepare(request))
        timeout = self.config.decode_timeout
        streamed = StreamedAnswer(path) if on_answer is not None else None
        while True:
            try:
                chunk = await response.content.readany()
            except aiohttp.ServerTimeoutError:
                error = UpstreamError(server, HTTPStatus.GATEWAY_TIMEOUT, f"stopped streaming for {timeout:g} s")
            except (aiohttp.ClientError, OSError) as exc:
                error = UpstreamError(server, HTTPStatus.BAD_GATEWAY, f"broke off its stream: {exc!r}")
            else:
                if not chunk:
                    break
                if leg is not None and not leg.first_token_ns:
                    leg.first_token_ns = time.time_ns()
                await self._bounded(answer.write(chunk))
                if streamed is not None:
                    streamed.feed(chunk)
                continue
            # The status line is gone: tell the client in the stream, the way vLLM reports errors in a stream.
            _log.warning("%s: %s", request_id, error)
            self._decode_pool.failed(server, str(error))
            what = "stopped streaming" if error.status == HTTPStatus.GATEWAY_TIMEOUT else "broke off its stream"
            message = f"the {server.role} server {what} (request {request_id}; details in the proxy's log)"
            event = {"error": {"message": message, "type": "upstream_error", "code": int(error.status)}}
            await self._bounded(answer.write(b"data: " + json.dumps(event).encode() + b"\n\n"))
            answer.force_close()
            streamed = None
            break
        await self._bounded(answer.write_eof())
        if streamed is not None and on_answer is not None and (whole := streamed.answer()) is not None:
            on_answer(whole)
        return answer

    async def _bounded(self, write: Awaitable[Any]) -> None:
        """A write to the client, given `client_timeout` to go out (a client that stops reading holds nothing)."""
        try:
            await asyncio.wait_for(write, self.config.client_timeout)
        except asyncio.TimeoutError:
            raise _ClientStalled from None

    async def _send(
        self,
        request: web.BaseRequest,
        status: int,
        payload: bytes,
        content_type: str,
        request_id: str | None = None,
    ) -> web.StreamResponse:
        headers = {"Content-Type": content_type, "Server": SERVER_NAME}
        if request_id is not None:
            headers[REQUEST_ID_HEADER] = request_id
        response = web.Response(status=status, body=payload, headers=headers)
        if status >= 400:
            # After any error the connection is not reused: whatever the client sent next is not read as a request.
            response.force_close()
        await self._bounded(response.prepare(request))
        await self._bounded(response.write_eof())
        return response

    async def _send_error(
        self, request: web.BaseRequest, status: HTTPStatus, message: str, kind: str, request_id: str
    ) -> web.StreamResponse:
        body = {"error": {"message": message, "type": kind, "code": int(status)}}
        return await self._send(request, status, json.dumps(body).encode(), "application/json", request_id)


def _with_trace(headers: dict[str, str], trace: TraceContext | None) -> dict[str, str]:
    """`headers` with a leg's trace context (vLLM's own spans, `--otlp-traces-endpoint`, continue it)."""
    return {**headers, **dict(trace.metadata())} if trace is not None else headers


def _usage(answer: Any, key: str) -> int | None:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _span_status(e: BaseException) -> str:
    """What a failed request's spans say (`kvbroker.status`)."""
    if isinstance(e, PassThrough):
        return f"http_{e.status}"
    if isinstance(e, UpstreamError):
        return f"upstream_{int(e.status)}"
    if isinstance(e, ClientRequestError):
        return f"http_{int(e.status)}"
    return "client_gone" if isinstance(e, _ClientStalled | ConnectionError | asyncio.CancelledError) \
        else type(e).__name__


def _excerpt(raw: bytes, limit: int = 300) -> str:
    text = raw.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


_SETTINGS = [f for f in fields(ProxyConfig) if f.name not in ("prefill", "decode")]


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, ProxyConfig]:
    """The command line: the servers, where to listen, and every setting of `ProxyConfig` as its own flag."""
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
    for setting in _SETTINGS:
        parser.add_argument("--" + setting.name.replace("_", "-"), type=type(setting.default), default=setting.default,
                            help=setting.metadata["help"] + " (default %(default)s)")
    parser.add_argument(
        "--otlp-traces-endpoint", default="", metavar="HOST:PORT",
        help="send the proxy's spans (a request, its prefill and decode legs) over OTLP/gRPC to this collector "
        "(https://HOST:PORT for TLS); default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT if "
        "set, else no spans. OTEL_SERVICE_NAME and OTEL_TRACES_SAMPLER apply; --trace-ratio, if set, is the sampler's "
        "share of the requests that come without a traceparent")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    for setting in _SETTINGS:
        value, flag = getattr(args, setting.name), "--" + setting.name.replace("_", "-")
        if setting.metadata["zero_allowed"] and value < 0:
            parser.error(f"{flag} must be >= 0")
        if not setting.metadata["zero_allowed"] and value <= 0:
            parser.error(f"{flag} must be > 0")
    try:
        config = ProxyConfig(prefill=tuple(Upstream.parse("prefill", url) for url in args.prefill),
                             decode=tuple(Upstream.parse("decode", url) for url in args.decode),
                             **{s.name: getattr(args, s.name) for s in _SETTINGS})
    except ValueError as exc:
        parser.error(str(exc))
    return args, config


DEFAULT_SERVICE_NAME = "kvbroker-pd-proxy"


def main(argv: Sequence[str] | None = None) -> int:
    args, config = _parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvbroker.integrations import otel

    provider = None
    if otel.wanted(args.otlp_traces_endpoint):
        try:
            provider = otel.own_provider(DEFAULT_SERVICE_NAME, args.otlp_traces_endpoint, config.trace_ratio)
        except ImportError as exc:
            _log.error("--otlp-traces-endpoint (or OTEL_EXPORTER_OTLP_ENDPOINT): %s", exc)
            return 1
    try:
        proxy = PdProxy(config, args.host, args.port,
                        tracer=provider.get_tracer("kvbroker.pd_proxy") if provider is not None else None).start()
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
        if provider is not None:
            provider.shutdown()  # exports the spans still batched
    _log.info("stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
