"""The connector's spans (docs/tracing.md): a request's grant, hold, wait in queue, pull and recompute as the engine's
scheduler sees them, in the request's trace.

On only where tracing is: vLLM started with `--otlp-traces-endpoint` sets a global tracer provider in its engine
core process too (0.32: `maybe_init_worker_tracer`), and the spans go there, with vLLM's own; else the standard
OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT gives the connector a provider of its own (service `vllm-kvbroker` unless
OTEL_SERVICE_NAME says). Off, `for_engine` returns None and the scheduler side makes no call here (nothing of
OpenTelemetry imported by the connector).

The parent: the trace in the request's `kv_transfer_params` (the P/D proxy's leg), else the request's own trace
headers (a `traceparent` the server got). vLLM's own request span (`llm_request`) cannot be the parent: the front
end makes it when the request has finished, in another process; the connector's spans are its siblings. A span
that ends long after its parent (a hold, which lasts until the decode node releases the grant) is normal."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbroker.integrations import otel
from kvbroker.integrations.vllm.params import RemoteKv, trace_of
from kvbroker.integrations.vllm.stats import RequestTransfer
from kvbroker.tracecontext import TraceContext

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

SERVICE_NAME = "vllm-kvbroker"


def for_engine(engine_id: str, model: str) -> RequestSpans | None:
    """The spans of this engine's requests, or None where tracing is off."""
    provider = otel.global_sdk_provider()
    if provider is not None:
        return RequestSpans(provider.get_tracer("kvbroker.vllm"), engine_id, model)
    if not otel.wanted():
        return None
    own = otel.own_provider(SERVICE_NAME)
    return RequestSpans(own.get_tracer("kvbroker.vllm"), engine_id, model, own)


def request_trace(request: Any) -> TraceContext | None:
    """The trace a request belongs to: its `kv_transfer_params`' (the proxy's), else its own trace headers'."""
    params = request.kv_transfer_params
    trace = trace_of(params) if params else None
    headers = getattr(request, "trace_headers", None)
    if trace is None and headers:
        trace = TraceContext.parse(headers.get("traceparent"), headers.get("tracestate"))
    return trace


@dataclass(eq=False, slots=True)
class _Decode:
    request: Any
    parent: TraceContext | None
    arrived_ns: int
    cluster: int
    pull: Span | None = None
    recompute: Span | None = None


class RequestSpans:
    def __init__(self, tracer: Tracer, engine_id: str, model: str, own_provider: Any = None) -> None:
        self.tracer = tracer
        self._own_provider = own_provider
        """A provider of the connector's own (not vLLM's): flushed and shut down with the engine."""
        self.common = {"gen_ai.request.model": model, "kvbroker.engine_id": engine_id}
        self._holds: dict[str, Span] = {}
        self._decodes: dict[str, _Decode] = {}

    def _start(self, name: str, parent: TraceContext | None, role: str, request_id: str,
               more: Mapping[str, Any] = {}, start_ns: int | None = None) -> Span:
        return otel.start(self.tracer, name, parent, {**self.common, "kvbroker.engine_role": role,
                                                      "kvbroker.request_id": request_id, **more}, start_ns)

    # -- prefill ----------------------------------------------------------------------------------------------------
    def grant(self, request: Any, blocks: int) -> Span:
        """`kvbroker.grant`: the CreateGrant of a finished prefill request (its daemon's span is the child)."""
        return self._start("kvbroker.grant", request_trace(request), "prefill", request.request_id,
                           {"kvbroker.blocks": blocks, "gen_ai.usage.input_tokens": request.num_computed_tokens})

    def granted(self, request: Any, span: Span, status: str, blocks: int) -> None:
        """The grant's outcome; a made grant's `kvbroker.hold` starts: the blocks stay until it ends."""
        otel.end(span, status)
        if status == "ok":
            self._holds[request.request_id] = self._start("kvbroker.hold", request_trace(request), "prefill",
                                                          request.request_id, {"kvbroker.blocks": blocks})

    def holds_ended(self, request_ids: Iterable[str]) -> None:
        """The engine frees the blocks (vLLM's finished_sending): the grant was released, lapsed or capped."""
        for request_id in request_ids:
            span = self._holds.pop(request_id, None)
            if span is not None:
                otel.end(span)

    # -- decode -----------------------------------------------------------------------------------------------------
    def arrived(self, request: Any, remote: RemoteKv) -> None:
        """A request that will pull arrived at the scheduler: its `kvbroker.wait_in_queue` starts."""
        self._decodes[request.request_id] = _Decode(request, remote.trace or request_trace(request),
                                                    time.time_ns(), remote.cluster_id)

    def pull_started(self, request_id: str, remote: RemoteKv, tokens: int) -> RemoteKv:
        """The request got its blocks and its pull goes to the workers: its wait ends, its `kvbroker.pull` starts;
        `remote` with the pull's span as the trace the daemon's pull continues."""
        d = self._decodes.get(request_id)
        if d is None:
            return remote
        now = time.time_ns()
        self._wait(d, "ok", now)
        d.pull = self._start("kvbroker.pull", d.parent, "decode", request_id,
                             {"kvbroker.peer_cluster": str(d.cluster), "kvbroker.tokens": tokens}, now)
        return RemoteKv(remote.cluster_id, remote.grant, remote.block_ids, remote.request_id, remote.engine_id,
                        remote.layout_tag, remote.num_tokens, remote.tp_size, otel.trace_of(d.pull))

    def not_pulled(self, request_id: str, reason: str) -> None:
        """The scheduler computes the request's KV itself (`reason`): its wait ends, a refusal's recompute starts."""
        d = self._decodes.get(request_id)
        if d is None:
            return
        now = time.time_ns()
        self._wait(d, reason, now)
        if reason == "cached":
            self._decodes.pop(request_id, None)
        else:
            self._recompute(d, reason, now)

    def pulls_ended(self, request_ids: Iterable[str], transfers: Mapping[str, RequestTransfer]) -> None:
        """Every rank's pull of these requests ended (vLLM's finished_recving); a failed one's recompute starts."""
        now = time.time_ns()
        for request_id in request_ids:
            d = self._decodes.get(request_id)
            if d is None or d.pull is None:
                continue
            t = transfers.get(request_id)
            ok = t is not None and t.tokens > 0
            otel.end(d.pull, "ok" if ok else "failed", {
                "kvbroker.bytes": t.nbytes if t else None, "kvbroker.backend": t.backend if t and t.backend else None,
                "kvbroker.tokens_pulled": t.tokens if t else 0,
                "kvbroker.transfer_ms": round(t.seconds * 1e3, 3) if t else None}, now)
            d.pull = None
            if ok:
                self._decodes.pop(request_id, None)
            else:
                self._recompute(d, "pull_failed", now)

    def step_output(self) -> None:
        """A step's output (before the pulls it reports end): a recompute ends with the step that computed the
        prompt's last token (vLLM counts a step's tokens as computed when it schedules them; a request whose pull
        failed counts only what landed, from the next step on)."""
        for request_id, d in list(self._decodes.items()):
            if d.recompute is None:
                continue
            if d.request.num_computed_tokens >= d.request.num_prompt_tokens:
                otel.end(d.recompute, "ok", {"kvbroker.tokens": d.request.num_prompt_tokens})
                del self._decodes[request_id]

    def finished(self, request_id: str) -> None:
        """The request finished (or was aborted): what is still open ends here."""
        d = self._decodes.pop(request_id, None)
        if d is None:
            return
        for span in (d.pull, d.recompute):
            if span is not None:
                otel.end(span, "finished")
        if d.pull is None and d.recompute is None and d.arrived_ns:
            self._wait(d, "finished", time.time_ns())

    def _wait(self, d: _Decode, status: str, now: int) -> None:
        if not d.arrived_ns:
            return
        span = self._start("kvbroker.wait_in_queue", d.parent, "decode", d.request.request_id,
                           {"kvbroker.peer_cluster": str(d.cluster)}, d.arrived_ns)
        otel.end(span, status, end_ns=now)
        d.arrived_ns = 0

    def _recompute(self, d: _Decode, reason: str, now: int) -> None:
        d.recompute = self._start("kvbroker.recompute", d.parent, "decode", d.request.request_id,
                                  {"kvbroker.peer_cluster": str(d.cluster), "kvbroker.reason": reason}, now)

    def shutdown(self) -> None:
        for span in self._holds.values():
            otel.end(span, "shutdown")
        self._holds.clear()
        if self._own_provider is not None:
            self._own_provider.shutdown()
