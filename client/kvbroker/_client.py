"""`Client` (blocking) and `AsyncClient` (asyncio): the model server's handle on its node's kvbrokerd.

Both are built from one table of calls (`_Calls`): one method per RPC, with the public signature and docstring, that
builds the request and says how to decode the response. `Client` runs a row and returns its result, `AsyncClient`
awaits it; only the way they wait differs (`CALLS` names the rows). Constructors do no I/O: the channel is created on
first use (inside the running loop, for `AsyncClient`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import threading
import types
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Concatenate, Generic, ParamSpec, TypeVar, overload

import grpc
import grpc.aio

from kvbroker import convert as cv
from kvbroker import tracecontext
from kvbroker._errors import error_from_rpc
from kvbroker._session import AsyncPullSession, PullSession
from kvbroker.blockruns import Runs
from kvbroker.shm import Cache
from kvbroker.status import (
    ACCEPT_DETAILS_HEADER,
    TIMEOUT_HEADER,
    ClusterNumExceedLimitError,
    LlmError,
    LlmStatus,
    ParamInvalidError,
    reply_grace,
)
from kvbroker.tracecontext import UNSET, TraceContext
from kvbroker.types import (
    Blocks,
    CacheDesc,
    CacheIndex,
    CacheRecord,
    ClusterInfo,
    ClusterResult,
    ClusterStatus,
    Grant,
    KvCacheExtParam,
    LayerLanded,
    LinkInfo,
    Notification,
    PullBlocks,
    PushBlocks,
    TensorLocation,
    TransferResult,
)
from kvbroker.v1 import broker_pb2, broker_pb2_grpc

# Large block lists (80 layers x 4,096 blocks and more) must fit; the daemon enforces the same ceiling.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 30.0
MAX_CLUSTERS_PER_CALL = 16
LINK_CALL_MARGIN_S = 5.0

CacheRef = Cache | int
DEFAULT_LEASE_TTL_S = 30.0
MIN_LEASE_TTL_S = 1.0
# Calls that are safe to repeat: after a daemon restart (or a blip of its socket) the channel reconnects and gRPC
# retries these with exponential backoff, within the call's deadline. Transfers and allocations are not retried.
_IDEMPOTENT = ("GetClusterInfo", "Ping", "ListCaches", "ListLinks", "KeepAlive")
_SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": "kvbroker.v1.KvBroker", "method": m} for m in _IDEMPOTENT],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "1s", "backoffMultiplier": 2.5,
                    "retryableStatusCodes": ["UNAVAILABLE"]},
}]})


# Every call says how large an error's details may be: a failed transfer's report lists its failed blocks, and no
# report is larger than the request that caused it. The channel accepts that much trailing metadata, plus headroom
# for the other trailers (gRPC's default, 8 KiB, would turn such an error into RESOURCE_EXHAUSTED).
_CALL_METADATA = ((ACCEPT_DETAILS_HEADER, str(MAX_MESSAGE_BYTES)),)


def _channel_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # A failed transfer's report (every failed destination block) comes back in the status details, i.e. in
        # trailing metadata: ~3 bytes a block, far over gRPC's default 8/16 KiB (soft/hard) metadata limits for
        # large pulls. Over the limit the channel itself fails the call (RESOURCE_EXHAUSTED) and the report is lost.
        ("grpc.max_metadata_size", MAX_MESSAGE_BYTES + (1 << 20)),
        ("grpc.absolute_max_metadata_size", MAX_MESSAGE_BYTES + (1 << 20)),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", _SERVICE_CONFIG),
        # Reconnect quickly after a daemon restart instead of waiting out gRPC's default backoff (up to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def _cache_id(cache: CacheRef) -> int:
    return cache.cache_id if isinstance(cache, Cache) else int(cache)


def _clusters_pb(clusters: Sequence[ClusterInfo]) -> list[broker_pb2.ClusterInfo]:
    # Checked here as well as in the daemon so that LLM-DataDist code fails the same way without a round trip.
    if len(clusters) > MAX_CLUSTERS_PER_CALL:
        raise ClusterNumExceedLimitError(
            LlmStatus.LLM_CLUSTER_NUM_EXCEED_LIMIT,
            f"{len(clusters)} clusters in one call; at most {MAX_CLUSTERS_PER_CALL}",
        )
    return [cv.cluster_info_to_pb(c) for c in clusters]


def _ms(timeout: float | None) -> int:
    return 0 if timeout is None else max(1, int(timeout * 1000))


def _rpc_deadline(handshake_timeout: float | None) -> float | None:
    """(Un)link `timeout` bounds each peer handshake (LLM-DataDist's timeout_in_millis); the call itself gets a
    margin on top so that per-cluster results come back instead of a bare deadline error."""
    return None if handshake_timeout is None else handshake_timeout + LINK_CALL_MARGIN_S


def _notification(n: broker_pb2.Notification) -> Notification:
    return Notification(n.cluster_id, n.topic, bytes(n.payload), n.received_unix)


def _check_size(size: int) -> None:
    # On the wire 0 means "unset" (= -1), so an explicit 0 is refused here, as LLM-DataDist refuses it.
    if size == 0 or size < -1:
        raise ParamInvalidError(LlmStatus.LLM_PARAM_INVALID, f"size must be -1 or > 0 bytes per tensor, got {size}")


def _blocks(blocks: Sequence[int]) -> list[int]:
    return [int(b) for b in blocks]


def _pull_request(src_cache_index: CacheIndex, dst_cache: CacheRef, src_blocks: Blocks,
                  dst_blocks: Blocks, ext_param: KvCacheExtParam | None, runs: Runs | None = None
                  ) -> broker_pb2.PullKvBlocksRequest:
    req = broker_pb2.PullKvBlocksRequest(
        src_cache_index=cv.cache_index_to_pb(src_cache_index), dst_cache_id=_cache_id(dst_cache),
        ext_param=cv.ext_param_to_pb(ext_param))
    cv.set_block_pairs(req, src_blocks, dst_blocks, runs)
    return req


def _push_request(src_cache: CacheRef, dst_cache_index: CacheIndex, src_blocks: Blocks,
                  dst_blocks: Blocks, ext_param: KvCacheExtParam | None) -> broker_pb2.PushKvBlocksRequest:
    req = broker_pb2.PushKvBlocksRequest(
        src_cache_id=_cache_id(src_cache), dst_cache_index=cv.cache_index_to_pb(dst_cache_index),
        ext_param=cv.ext_param_to_pb(ext_param))
    cv.set_block_pairs(req, src_blocks, dst_blocks)
    return req


def _batch_request(groups: Sequence[PullBlocks | PushBlocks]) -> broker_pb2.TransferKvBlocksBatchRequest:
    req = broker_pb2.TransferKvBlocksBatchRequest()
    for g in groups:
        if isinstance(g, PullBlocks):
            req.groups.add(pull=_pull_request(g.src_cache_index, g.dst_cache, g.src_blocks, g.dst_blocks,
                                              g.ext_param))
        else:
            req.groups.add(push=_push_request(g.src_cache, g.dst_cache_index, g.src_blocks, g.dst_blocks,
                                              g.ext_param))
    return req


def _batch_result(resp: broker_pb2.TransferKvBlocksBatchResponse) -> TransferResult:
    return TransferResult(bytes_moved=resp.bytes_moved, backend=",".join(resp.backends),
                          transfer_id=resp.transfer_id, num_runs=resp.num_runs)


def _progress(msg: broker_pb2.PullKvBlocksProgress) -> LayerLanded | TransferResult:
    if msg.HasField("result"):
        return cv.transfer_result_from_pb(msg.result)
    return LayerLanded(layer=msg.layer, layer_bytes=msg.layer_bytes)


def _grant_ref(grant: Grant) -> broker_pb2.GrantRef:
    return broker_pb2.GrantRef(grant_id=grant.grant_id, secret=grant.secret)


def _grant(resp: broker_pb2.CreateGrantResponse) -> Grant:
    return Grant(bytes(resp.grant.grant_id), bytes(resp.grant.secret), resp.expires_in_ms / 1000)


def _nothing(resp: object) -> None:
    return None


def _cluster_results(resp: broker_pb2.LinkClustersResponse | broker_pb2.UnlinkClustersResponse
                     ) -> list[ClusterResult]:
    return [cv.cluster_result_from_pb(r) for r in resp.results]


# ------------------------------------------------------------------------------------------- the table of calls

_R = TypeVar("_R")
_P = ParamSpec("_P")


@dataclasses.dataclass(slots=True)
class _Call(Generic[_R]):
    """One unary call, ready to send: what a row of the table makes of its arguments."""

    method: str
    """The RPC's name in kvbroker.v1.KvBroker."""
    request: Any
    decode: Callable[[Any], _R]
    """Turns the response message into the method's return value."""
    timeout: float | None
    """Seconds; None: the client's default (`_Calls._deadline` checks and fills it in)."""
    trace_context: TraceContext | None = UNSET
    """The caller's trace, sent as `traceparent` metadata (UNSET: the current one, `tracecontext.current`)."""


if TYPE_CHECKING:
    _Spec = Callable[Concatenate["_Calls", _P], _Call[_R]]


class _Rpc(Generic[_P, _R]):
    """A row of the table: a method of `_Calls` whose body builds the `_Call` (request, response decoder, deadline)
    and whose signature and docstring are the public method's. On `Client` it reads as a blocking method, on
    `AsyncClient` as a coroutine method with the same signature; both run the same row.

    `session`: the call creates a cache the client's session owns, so the session's keep-alive starts (and sets the
    lease) first."""

    def __init__(self, spec: _Spec[_P, _R], session: bool) -> None:
        self.spec = spec
        self.session = session
        self.name = spec.__name__
        signature = inspect.signature(spec)
        returns = str(signature.return_annotation)
        # Annotations are strings (`from __future__ import annotations`): "_Call[X]" -> "X".
        if not (returns.startswith("_Call[") and returns.endswith("]")):
            raise TypeError(f"the table's {self.name} must be annotated to return a _Call[...]")
        self.signature = signature.replace(return_annotation=returns[len("_Call["):-1])

        def blocking(client: Client, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            if session:
                client._start_keepalive()
            return client._run(spec(client, *args, **kwargs))

        async def awaitable(client: AsyncClient, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            if session:
                await client._start_keepalive()
            return await client._run(spec(client, *args, **kwargs))

        self.blocking = self._named(blocking, "Client")
        self.awaitable = self._named(awaitable, "AsyncClient")

    def _named(self, fn: Callable[..., Any], owner: str) -> Any:
        fn.__name__ = self.name
        fn.__qualname__ = f"{owner}.{self.name}"
        fn.__doc__ = self.spec.__doc__
        fn.__module__ = self.spec.__module__
        fn.__signature__ = self.signature  # type: ignore[attr-defined]
        return fn

    @overload
    def __get__(self, obj: None, owner: type[AsyncClient]
                ) -> Callable[Concatenate[AsyncClient, _P], Coroutine[Any, Any, _R]]: ...

    @overload
    def __get__(self, obj: None, owner: type[Client]) -> Callable[Concatenate[Client, _P], _R]: ...

    @overload
    def __get__(self, obj: AsyncClient, owner: type[Any] | None = None
                ) -> Callable[_P, Coroutine[Any, Any, _R]]: ...

    @overload
    def __get__(self, obj: Client, owner: type[Any] | None = None) -> Callable[_P, _R]: ...

    def __get__(self, obj: object, owner: type[Any] | None = None) -> Any:
        # Only `_Calls.<name>` (the row itself) comes here: each client class holds the row's plain function, put
        # there by `_Calls.__init_subclass__`. These overloads tell the type checker what that function is.
        if obj is None:
            return self
        return types.MethodType(self.awaitable if isinstance(obj, _Calls) and obj._awaits else self.blocking, obj)


def _rpc(*, session: bool = False) -> Callable[[_Spec[_P, _R]], _Rpc[_P, _R]]:
    def row(spec: _Spec[_P, _R]) -> _Rpc[_P, _R]:
        return _Rpc(spec, session)

    return row


class _Calls:
    """The state both clients share and the table of calls: one `@_rpc` method per RPC, with the public signature
    and docstring, whose body builds the request and says how to decode the response. `Client` and `AsyncClient`
    add only how they wait (`_call`, `_run`, `_start_keepalive`, `close`) and their own extras."""

    _awaits: ClassVar[bool] = False
    """The class's calls are coroutines (AsyncClient)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Gives the new client class each row as a plain function (blocking or coroutine, per `_awaits`), unless
        it or a class between it and `_Calls` defines that method itself."""
        super().__init_subclass__(**kwargs)
        for name, row in vars(_Calls).items():
            if isinstance(row, _Rpc) and inspect.getattr_static(cls, name) is row:
                setattr(cls, name, row.awaitable if cls._awaits else row.blocking)

    def __init__(self, target: str, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 lease_ttl: float | None = DEFAULT_LEASE_TTL_S) -> None:
        """`target`: "unix:///path/to/kvbroker.sock" or "host:port". `timeout`: default deadline of every call.

        `lease_ttl`: caches this client allocates or registers belong to its session, which the client keeps alive
        in the background; if the process dies, the daemon releases them `lease_ttl` seconds later. None: caches
        live until released explicitly (LLM-DataDist's behaviour)."""
        if lease_ttl is not None and lease_ttl < MIN_LEASE_TTL_S:
            raise ValueError(f"lease_ttl must be >= {MIN_LEASE_TTL_S} s or None")
        self.target = target
        self.default_timeout = timeout
        self.lease_ttl = lease_ttl
        self.session_id = uuid.uuid4().hex if lease_ttl is not None else ""
        self._stub: broker_pb2_grpc.KvBrokerStub | None = None
        self._mapped: dict[int, Cache] = {}

    def _keepalive_request(self) -> broker_pb2.KeepAliveRequest:
        assert self.lease_ttl is not None
        return broker_pb2.KeepAliveRequest(session_id=self.session_id, ttl_ms=int(self.lease_ttl * 1000))

    @property
    def _keepalive_every(self) -> float:
        return (self.lease_ttl or DEFAULT_LEASE_TTL_S) / 3

    def _deadline(self, timeout: float | None) -> float | None:
        if timeout is not None and timeout <= 0:
            # gRPC would round a zero deadline up to a millisecond and sometimes let the call through.
            raise ParamInvalidError(LlmStatus.LLM_PARAM_INVALID, f"timeout must be > 0 seconds, got {timeout}")
        return self.default_timeout if timeout is None else timeout

    def _options(self, timeout: float | None, trace_context: TraceContext | None = UNSET) -> dict[str, Any]:
        """A call's gRPC deadline and metadata. The daemon is told the call's own budget (`TIMEOUT_HEADER`) and
        answers within it; the call waits `reply_grace` longer for that answer, so that on a busy host the caller
        still gets the daemon's status and report rather than a bare DEADLINE_EXCEEDED. The caller's trace context
        (`trace_context`, else the current one) goes along as `traceparent` (and `tracestate`)."""
        budget = self._deadline(timeout)
        metadata: tuple[tuple[str, str], ...] = _CALL_METADATA
        trace = tracecontext.current(trace_context)
        if trace is not None:
            metadata = (*metadata, *trace.metadata())
        if budget is None:
            return {"timeout": None, "metadata": metadata}
        return {"timeout": budget + reply_grace(budget),
                "metadata": (*metadata, (TIMEOUT_HEADER, str(max(1, round(budget * 1000)))))}

    def _fetch_deadline(self, timeout: float | None, wait: float) -> float | None:
        """A long poll outlives a default deadline shorter than its wait."""
        deadline = self._deadline(timeout)
        if timeout is None and deadline is not None:
            deadline = max(deadline, wait + LINK_CALL_MARGIN_S)
        return deadline

    def _forget(self, cache_id: int) -> None:
        cache = self._mapped.pop(cache_id, None)
        if cache is not None:
            cache.close()

    def _adopt(self, resp: broker_pb2.AllocateCacheResponse | broker_pb2.RegisterKvCacheResponse) -> Cache:
        """Maps a cache the daemon just created for this client; `close()` unmaps it."""
        cache = Cache.map(cv.cache_record_from_pb(resp.cache))
        self._mapped[cache.cache_id] = cache
        return cache

    # ------------------------------------------------------------------------------------------------ the table

    @_rpc()
    def get_cluster_info(self, *, timeout: float | None = None) -> _Call[ClusterStatus]:
        """The daemon's identity and counts.

        Args:
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            Its cluster id, version, peer address, backends, instance epoch, cache and link counts.

        Raises:
            ParamInvalidError: `timeout` is not > 0.
            LlmError: the daemon could not be reached (LLM_FAILED) or did not answer in time (LlmTimeoutError).
        """
        return _Call("GetClusterInfo", broker_pb2.GetClusterInfoRequest(), cv.cluster_status_from_pb, timeout)

    @_rpc()
    def ping(self, *, timeout: float | None = None) -> _Call[None]:
        """Checks that the daemon answers.

        Args:
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            None once the daemon has answered.

        Raises:
            ParamInvalidError: `timeout` is not > 0.
            LlmError: the daemon could not be reached (LLM_FAILED) or did not answer in time (LlmTimeoutError).
        """
        return _Call("Ping", broker_pb2.PingRequest(), _nothing, timeout)

    @_rpc(session=True)
    def allocate_cache(self, desc: CacheDesc, *, view_of: CacheRef | None = None,
                       timeout: float | None = None) -> _Call[Cache]:
        """Allocates daemon-owned shared memory for a cache and maps it in this process.

        The cache belongs to this client's session (see `lease_ttl`); the first such call starts the keep-alive.

        Args:
            desc: the cache's tensors: how many, their shape (blocks first) and data type.
            view_of: no new memory: the cache is another view of the memory of this cache, which this session
                allocated (the same tensors of the same bytes, cut into other blocks); released on its own.
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            The mapped cache: `cache_id`, `desc`, and `tensors`, numpy views over the shared memory.

        Raises:
            ParamInvalidError: `desc` or `timeout` is invalid.
            OutOfMemoryError: the daemon is out of memory or cache slots.
            OSError: the cache's shared memory could not be mapped here.
            LlmError: any other failure, as the subclass of its status (LLM_FAILED: the daemon is unreachable).
        """
        req = broker_pb2.AllocateCacheRequest(desc=cv.desc_to_pb(desc), session_id=self.session_id,
                                              view_of=0 if view_of is None else _cache_id(view_of))
        return _Call("AllocateCache", req, self._adopt, timeout)

    @_rpc()
    def deallocate_cache(self, cache: CacheRef, *, timeout: float | None = None) -> _Call[None]:
        """Releases a cache made by `allocate_cache`, unmapping it here first.

        Args:
            cache: the cache, or its id.
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            None once the daemon has released the cache.

        Raises:
            ParamInvalidError: `timeout` is not > 0, or the cache is caller-owned (use `unregister_kv_cache`).
            KvCacheNotExistError: the daemon has no such cache.
            LlmError: a transfer kept using the cache past the deadline (LLM_LINK_BUSY), or any other failure, as
                the subclass of its status (LLM_FAILED: the daemon is unreachable).
        """
        cache_id = _cache_id(cache)
        self._forget(cache_id)
        return _Call("DeallocateCache", broker_pb2.DeallocateCacheRequest(cache_id=cache_id), _nothing, timeout)

    @_rpc(session=True)
    def register_kv_cache(self, desc: CacheDesc, tensors: Sequence[TensorLocation], *,
                          timeout: float | None = None) -> _Call[Cache]:
        """Registers the caller's memory (one location per tensor) as a cache and returns it mapped.

        The cache belongs to this client's session (see `lease_ttl`); the first such call starts the keep-alive.

        Args:
            desc: the cache's tensors: how many, their shape (blocks first) and data type.
            tensors: where each tensor lives: a shared memory segment and offset, or device memory.
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            The cache; host memory is mapped (`tensors`), device memory is not (the caller has it).

        Raises:
            ParamInvalidError: `desc`, `tensors` or `timeout` is invalid.
            FeatureNotEnabledError: device memory that no backend of the daemon can import.
            OutOfMemoryError: the daemon is out of cache slots.
            OSError: the cache's shared memory could not be mapped here.
            LlmError: any other failure, as the subclass of its status (LLM_FAILED: the daemon is unreachable).
        """
        req = broker_pb2.RegisterKvCacheRequest(desc=cv.desc_to_pb(desc),
                                                tensors=[cv.tensor_location_to_pb(t) for t in tensors],
                                                session_id=self.session_id)
        return _Call("RegisterKvCache", req, self._adopt, timeout)

    @_rpc()
    def unregister_kv_cache(self, cache: CacheRef, *, timeout: float | None = None) -> _Call[None]:
        """Unregisters a cache made by `register_kv_cache`, unmapping it here first; the memory stays the caller's.

        Args:
            cache: the cache, or its id.
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            None once the daemon has let go of the memory.

        Raises:
            ParamInvalidError: `timeout` is not > 0, or the cache is daemon-owned (use `deallocate_cache`).
            KvCacheNotExistError: the daemon has no such cache.
            LlmError: a transfer kept using the cache past the deadline (LLM_LINK_BUSY), or any other failure, as
                the subclass of its status (LLM_FAILED: the daemon is unreachable).
        """
        cache_id = _cache_id(cache)
        self._forget(cache_id)
        return _Call("UnregisterKvCache", broker_pb2.UnregisterKvCacheRequest(cache_id=cache_id), _nothing, timeout)

    @_rpc()
    def list_caches(self, *, timeout: float | None = None) -> _Call[list[CacheRecord]]:
        """The daemon's caches, whoever made them.

        Args:
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            One record per cache: id, description, tensor locations, owner and lease.

        Raises:
            ParamInvalidError: `timeout` is not > 0.
            LlmError: the daemon could not be reached (LLM_FAILED) or did not answer in time (LlmTimeoutError).
        """
        return _Call("ListCaches", broker_pb2.ListCachesRequest(),
                     lambda resp: [cv.cache_record_from_pb(c) for c in resp.caches], timeout)

    @_rpc()
    def link_clusters(self, clusters: Sequence[ClusterInfo], *,
                      timeout: float | None = None) -> _Call[list[ClusterResult]]:
        """Links the daemon to each cluster (LLM-DataDist LinkLlmClusters); the handshakes run concurrently.

        Args:
            clusters: at most 16 remote clusters: id and peer address (host:port) each.
            timeout: seconds each handshake may take (LLM-DataDist's timeout_in_millis); the call itself gets a
                few seconds more, so that the per-cluster results come back. Default: the client's `timeout`.

        Returns:
            One result per cluster; like LLM-DataDist, a cluster that fails to link does not raise.

        Raises:
            ClusterNumExceedLimitError: more than 16 clusters (refused before any call).
            ParamInvalidError: `timeout` is not > 0, or an address is too long.
            LlmError: the daemon could not be reached (LLM_FAILED) or did not answer in time (LlmTimeoutError).
        """
        req = broker_pb2.LinkClustersRequest(clusters=_clusters_pb(clusters), timeout_ms=_ms(timeout))
        return _Call("LinkClusters", req, _cluster_results, _rpc_deadline(timeout))

    @_rpc()
    def unlink_clusters(self, clusters: Sequence[ClusterInfo], *, force: bool = False,
                        timeout: float | None = None) -> _Call[list[ClusterResult]]:
        """Unlinks the daemon from each cluster (LLM-DataDist UnlinkLlmClusters).

        Args:
            clusters: at most 16 remote clusters; the id names the link (the address is not used).
            force: drop the link here even if the remote daemon does not answer.
            timeout: seconds each remote unlink may take; the call itself gets a few seconds more, so that the
                per-cluster results come back. Default: the client's `timeout`.

        Returns:
            One result per cluster (e.g. LLM_NOT_YET_LINK for a cluster that was not linked); failures do not raise.

        Raises:
            ClusterNumExceedLimitError: more than 16 clusters (refused before any call).
            ParamInvalidError: `timeout` is not > 0, or an address is too long.
            LlmError: the daemon could not be reached (LLM_FAILED) or did not answer in time (LlmTimeoutError).
        """
        req = broker_pb2.UnlinkClustersRequest(clusters=_clusters_pb(clusters), force=force, timeout_ms=_ms(timeout))
        return _Call("UnlinkClusters", req, _cluster_results, _rpc_deadline(timeout))

    @_rpc()
    def send_notification(self, cluster_id: int, topic: str, payload: bytes, *,
                          timeout: float | None = None) -> _Call[None]:
        """Sends `payload` on `topic` to the daemon of `cluster_id`, whose clients get it with
        `fetch_notifications(topic)`.

        Args:
            cluster_id: a cluster this daemon is linked to.
            topic: at most 128 bytes.
            payload: at most 64 KiB.
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            None once the remote daemon has queued the notification.

        Raises:
            ParamInvalidError: `topic`, `payload` or `timeout` is out of bounds.
            NotYetLinkError: this daemon has no ready link to `cluster_id`.
            LlmError: any other failure, as the subclass of its status (LLM_FAILED: the daemon is unreachable).
        """
        req = broker_pb2.SendNotificationRequest(cluster_id=cluster_id, topic=topic, payload=bytes(payload))
        return _Call("SendNotification", req, _nothing, timeout)

    @_rpc()
    def create_grant(self, cache_ids: Sequence[int], blocks: Sequence[int], lease: float, *, max_hold: float = 0.0,
                     label: str = "", event_topics: Sequence[str] = (), units_per_block: int = 1,
                     view_cache_ids: Sequence[int] = (), view_units_per_block: int = 1,
                     timeout: float | None = None, trace_context: TraceContext | None = UNSET) -> _Call[Grant]:
        """Grants linked peers the right to pull `blocks` of local caches `cache_ids` (e.g. a finished prefill
        request's KV, one cache per TP rank) for `lease` seconds unless renewed.

        Args:
            cache_ids: 1..64 local caches, in slot order.
            blocks: 1..65536 distinct block indices, valid in every one of the caches.
            lease: seconds (0.1..3600) until the grant lapses unless renewed.
            max_hold: renewals never keep it past this many seconds from now (0: 24 h).
            label: echoed in the GrantEvent (e.g. the request id).
            event_topics: topics on which this daemon posts a GrantEvent when the grant ends (FetchNotifications;
                the notification's cluster_id is this daemon's own).
            units_per_block: each granted block stands for this many consecutive blocks of the caches (block b:
                b * units_per_block onwards), e.g. an engine block addressed in finer units; 1..65536.
            view_cache_ids: the same blocks in these caches too (views of the caches' memory: `allocate_cache`'s
                `view_of`), in slots len(cache_ids) onwards, each granted block standing for `view_units_per_block`
                of their blocks. A peer daemon that predates them reads only `cache_ids`.
            view_units_per_block: 1..65536.
            timeout: deadline in seconds (default: the client's `timeout`).
            trace_context: the trace this call belongs to (`kvbroker.tracecontext`); when the daemon traces, the
                grant remembers its span, which a peer's pull by the grant links to. Default: the current one
                (`tracecontext.use`, else OpenTelemetry's current span); None: none.

        Returns:
            The grant: hand `grant.token()` to the peer that will pull, keep it to renew or release.

        Raises:
            ParamInvalidError: an argument is out of range.
            KvCacheNotExistError: a cache does not exist.
            OutOfMemoryError: the daemon holds as many grants as it may.
        """
        req = broker_pb2.CreateGrantRequest(cache_ids=list(cache_ids), blocks=_blocks(blocks),
                                            lease_ms=_ms(lease), max_hold_ms=_ms(max_hold or None), label=label,
                                            event_topics=list(event_topics), units_per_block=units_per_block,
                                            view_cache_ids=list(view_cache_ids),
                                            view_units_per_block=view_units_per_block)
        return _Call("CreateGrant", req, _grant, timeout, trace_context)

    @_rpc()
    def renew_grant(self, grant: Grant, lease: float = 0.0, *, cluster_id: int = 0,
                    timeout: float | None = None) -> _Call[float]:
        """Renews a grant's lease, on this daemon (`cluster_id` 0) or on the linked cluster that made it.

        Args:
            grant: the grant (its id and secret).
            lease: seconds of the new lease (0: the grant's own lease).
            cluster_id: the linked cluster that made the grant (0: this daemon).
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            Seconds until it lapses unless renewed again.

        Raises:
            KvCacheNotExistError: the grant is unknown, lapsed or released (or the secret is wrong).
            NotYetLinkError: `cluster_id` has no READY link.
            LinkFailedError: the cluster that made it cannot be reached.
        """
        req = broker_pb2.RenewGrantRequest(cluster_id=cluster_id, grant=_grant_ref(grant), lease_ms=_ms(lease or None))
        return _Call("RenewGrant", req, lambda resp: resp.expires_in_ms / 1000, timeout)

    @_rpc()
    def release_grant(self, grant: Grant, *, cluster_id: int = 0, timeout: float | None = None) -> _Call[None]:
        """Ends a grant (its holder will not read the blocks): on this daemon or on the linked cluster that made it.

        Args:
            grant: the grant (its id and secret).
            cluster_id: the linked cluster that made the grant (0: this daemon).
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            None once the grant has ended (its maker's daemon posts the GrantEvent).

        Raises:
            KvCacheNotExistError: the grant is unknown, lapsed or already released.
            NotYetLinkError: `cluster_id` has no READY link.
            LinkFailedError: the cluster that made it cannot be reached.
        """
        req = broker_pb2.ReleaseGrantRequest(cluster_id=cluster_id, grant=_grant_ref(grant))
        return _Call("ReleaseGrant", req, _nothing, timeout)

    @_rpc()
    def pull_granted_kv_blocks(self, cluster_id: int, grant: Grant, dst_cache: CacheRef, dst_blocks: Blocks,
                               *, cache_slot: int = 0, first_block: int = 0, src_blocks: Blocks = (),
                               ext_param: KvCacheExtParam | None = None, timeout: float | None = None,
                               block_runs: Runs | None = None, trace_context: TraceContext | None = UNSET
                               ) -> _Call[TransferResult]:
        """PullKvBlocks of blocks that `cluster_id` granted: its daemon names the cache and the blocks.

        Args:
            cluster_id: the linked cluster that made the grant.
            grant: the grant.
            dst_cache: the local destination cache, or its id.
            dst_blocks: destination block indices.
            cache_slot: which of the grant's caches (e.g. the TP rank).
            first_block: with no `src_blocks`, the grant's blocks from this index on land in `dst_blocks`.
            src_blocks: else these blocks, each of which the grant must cover.
            ext_param: layer selection, as in `pull_kv_blocks`.
            timeout: deadline in seconds (default: the client's `timeout`).
            block_runs: instead of `src_blocks` and `dst_blocks` (then empty), the pairs as runs
                (`kvbroker.blockruns.Runs`, e.g. a remap's few strided runs), sent as they are.
            trace_context: the trace this call belongs to (`kvbroker.tracecontext`), continued by the daemon's spans
                when it traces; default: the current one (`tracecontext.use`, else OpenTelemetry's current span);
                None: none.

        Returns:
            The TransferResult, as `pull_kv_blocks` returns it.

        Raises:
            KvCacheNotExistError: the grant is unknown, lapsed or released; nothing was moved.
            ParamInvalidError: the grant does not cover the blocks (or slot); nothing was moved.
            LlmError: as `pull_kv_blocks` otherwise (links, timeouts, partial transfers with their report).
        """
        req = _pull_request(CacheIndex(cluster_id, 0), dst_cache, src_blocks, dst_blocks, ext_param, block_runs)
        req.grant.CopyFrom(broker_pb2.GrantClaim(grant=_grant_ref(grant), cache_slot=cache_slot,
                                                 first_block=first_block))
        return _Call("PullKvBlocks", req, cv.transfer_result_from_pb, timeout, trace_context)

    @_rpc()
    def fetch_notifications(self, topic: str, max_count: int = 1024, wait: float = 0.0, *,
                            timeout: float | None = None) -> _Call[list[Notification]]:
        """Notifications linked peers sent to this daemon on `topic`, oldest first, each returned once.

        Args:
            topic: the topic the peers sent on.
            max_count: at most this many (1 to 65536).
            wait: seconds (0 to 30) to wait for the first when there are none.
            timeout: deadline in seconds (default: the client's `timeout`, or `wait` plus a margin when that is
                longer).

        Returns:
            Up to `max_count` notifications, and at most 16 MiB of them (the daemon leaves the rest queued for
            the next fetch); empty when none came within `wait`.

        Raises:
            ParamInvalidError: `wait`, `max_count` or `timeout` is out of bounds (refused before any call).
            LlmError: the daemon could not be reached (LLM_FAILED) or did not answer in time (LlmTimeoutError).
        """
        if not 0 <= wait <= 30 or not 0 < max_count <= 65536:
            raise ParamInvalidError(LlmStatus.LLM_PARAM_INVALID, f"wait must be in [0, 30] s and max_count in "
                                    f"[1, 65536], got wait={wait}, max_count={max_count}")
        req = broker_pb2.FetchNotificationsRequest(topic=topic, max_count=max_count, wait_ms=int(wait * 1000))
        return _Call("FetchNotifications", req, lambda resp: [_notification(n) for n in resp.notifications],
                     self._fetch_deadline(timeout, wait))

    @_rpc()
    def list_links(self, *, timeout: float | None = None) -> _Call[list[LinkInfo]]:
        """The daemon's links to other clusters (LLM-DataDist query_register_mem_status).

        Args:
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            One entry per link, by remote cluster id: address, state (LINKING, READY, BROKEN, ...), backend.

        Raises:
            ParamInvalidError: `timeout` is not > 0.
            LlmError: the daemon could not be reached (LLM_FAILED) or did not answer in time (LlmTimeoutError).
        """
        return _Call("ListLinks", broker_pb2.ListLinksRequest(),
                     lambda resp: [cv.link_info_from_pb(link) for link in resp.links], timeout)

    @_rpc()
    def pull_kv_blocks(self, src_cache_index: CacheIndex, dst_cache: CacheRef, src_blocks: Blocks,
                       dst_blocks: Blocks, ext_param: KvCacheExtParam | None = None, *,
                       timeout: float | None = None, trace_context: TraceContext | None = UNSET
                       ) -> _Call[TransferResult]:
        """Pulls blocks of a linked cluster's cache into blocks of a local cache (LLM-DataDist PullKvBlocks).

        Args:
            src_cache_index: the remote cache: its cluster id and cache id.
            dst_cache: the local destination cache, or its id.
            src_blocks: source block indices; `src_blocks[i]` lands in `dst_blocks[i]`.
            dst_blocks: destination block indices, as many as `src_blocks`.
            ext_param: layer ranges (source and destination) and tensors per layer; None: every layer.
            timeout: deadline in seconds (default: the client's `timeout`).
            trace_context: the trace this call belongs to (`kvbroker.tracecontext`), continued by the daemon's spans
                when it traces; default: the current one (`tracecontext.use`, else OpenTelemetry's current span);
                None: none.

        Returns:
            Bytes moved, the backend that moved them, the transfer id and the number of byte runs.

        Raises:
            ParamInvalidError: blocks, layer ranges or `timeout` out of range; nothing was moved.
            KvCacheNotExistError: either cache does not exist.
            NotYetLinkError: the source cluster is not linked.
            LlmTimeoutError: the deadline passed; `failed_dst_blocks` (and `details["transfer_report"]`) say
                which destination blocks may be incomplete.
            LlmError: any other failure, as the subclass of its status, with the same report.
        """
        req = _pull_request(src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param)
        return _Call("PullKvBlocks", req, cv.transfer_result_from_pb, timeout, trace_context)

    @_rpc()
    def pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: CacheRef, batch_index: int = 0, size: int = -1,
                      ext_param: KvCacheExtParam | None = None, *,
                      timeout: float | None = None) -> _Call[TransferResult]:
        """Pulls one batch row of a linked cluster's cache into a row of a local cache (LLM-DataDist PullKvCache).

        Args:
            src_cache_index: the remote cache and its row (`batch_index`).
            dst_cache: the local destination cache, or its id.
            batch_index: the destination row.
            size: bytes per tensor to pull from the start of the row; -1: the whole row.
            ext_param: layer ranges (source and destination) and tensors per layer; None: every layer.
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            Bytes moved, the backend that moved them, the transfer id and the number of byte runs.

        Raises:
            ParamInvalidError: `size` is 0 or below -1 (refused before any call), or rows, sizes, layer ranges or
                `timeout` are out of range.
            KvCacheNotExistError: either cache does not exist.
            NotYetLinkError: the source cluster is not linked.
            LlmTimeoutError: the deadline passed.
            LlmError: any other failure, as the subclass of its status.
        """
        _check_size(size)
        req = broker_pb2.PullKvCacheRequest(
            src_cache_index=cv.cache_index_to_pb(src_cache_index), dst_cache_id=_cache_id(dst_cache),
            batch_index=batch_index, size=size, ext_param=cv.ext_param_to_pb(ext_param))
        return _Call("PullKvCache", req, cv.transfer_result_from_pb, timeout)

    @_rpc()
    def push_kv_blocks(self, src_cache: CacheRef, dst_cache_index: CacheIndex, src_blocks: Blocks,
                       dst_blocks: Blocks, ext_param: KvCacheExtParam | None = None, *,
                       timeout: float | None = None, trace_context: TraceContext | None = UNSET
                       ) -> _Call[TransferResult]:
        """Writes blocks of a local cache into blocks of a linked cluster's cache (LLM-DataDist PushKvBlocks).

        Args:
            src_cache: the local source cache, or its id.
            dst_cache_index: the remote cache: its cluster id and cache id.
            src_blocks: source block indices; `src_blocks[i]` lands in `dst_blocks[i]`.
            dst_blocks: destination block indices, as many as `src_blocks`.
            ext_param: layer ranges (source and destination) and tensors per layer; None: every layer.
            timeout: deadline in seconds (default: the client's `timeout`).
            trace_context: the trace this call belongs to (`kvbroker.tracecontext`), continued by the daemon's spans
                when it traces; default: the current one (`tracecontext.use`, else OpenTelemetry's current span);
                None: none.

        Returns:
            Bytes moved, the backend that moved them, the transfer id and the number of byte runs.

        Raises:
            ParamInvalidError: blocks, layer ranges or `timeout` out of range; nothing was moved.
            KvCacheNotExistError: either cache does not exist.
            NotYetLinkError: the destination cluster is not linked.
            LlmTimeoutError: the deadline passed; `failed_dst_blocks` says which remote blocks may be incomplete.
            LlmError: any other failure, as the subclass of its status, with the same report.
        """
        req = _push_request(src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param)
        return _Call("PushKvBlocks", req, cv.transfer_result_from_pb, timeout, trace_context)

    @_rpc()
    def push_kv_cache(self, src_cache: CacheRef, dst_cache_index: CacheIndex, src_batch_index: int = 0,
                      size: int = -1, ext_param: KvCacheExtParam | None = None, *,
                      timeout: float | None = None) -> _Call[TransferResult]:
        """Writes one batch row of a local cache into a row of a linked cluster's cache (LLM-DataDist PushKvCache).

        Args:
            src_cache: the local source cache, or its id.
            dst_cache_index: the remote cache and its row (`batch_index`).
            src_batch_index: the source row.
            size: bytes per tensor to push from the start of the row; -1: the whole row.
            ext_param: layer ranges (source and destination) and tensors per layer; None: every layer.
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            Bytes moved, the backend that moved them, the transfer id and the number of byte runs.

        Raises:
            ParamInvalidError: `size` is 0 or below -1 (refused before any call), or rows, sizes, layer ranges or
                `timeout` are out of range.
            KvCacheNotExistError: either cache does not exist.
            NotYetLinkError: the destination cluster is not linked.
            LlmTimeoutError: the deadline passed.
            LlmError: any other failure, as the subclass of its status.
        """
        _check_size(size)
        req = broker_pb2.PushKvCacheRequest(
            src_cache_id=_cache_id(src_cache), dst_cache_index=cv.cache_index_to_pb(dst_cache_index),
            src_batch_index=src_batch_index, size=size, ext_param=cv.ext_param_to_pb(ext_param))
        return _Call("PushKvCache", req, cv.transfer_result_from_pb, timeout)

    @_rpc()
    def copy_kv_blocks(self, src_cache: CacheRef, dst_cache: CacheRef, src_blocks: Sequence[int],
                       dst_blocks_list: Sequence[Sequence[int]], *,
                       timeout: float | None = None) -> _Call[TransferResult]:
        """Copies blocks between two local caches, once into each destination list (LLM-DataDist V1 CopyKvBlocks),
        e.g. to fork a partly filled block for prefix sharing.

        Args:
            src_cache: the local source cache, or its id.
            dst_cache: the local destination cache (may be the source), or its id.
            src_blocks: source block indices.
            dst_blocks_list: one or more lists of destination blocks, each as long as `src_blocks`.
            timeout: deadline in seconds (default: the client's `timeout`).

        Returns:
            Bytes moved, the backend that moved them, the transfer id and the number of byte runs.

        Raises:
            ParamInvalidError: blocks or `timeout` out of range; nothing was moved.
            KvCacheNotExistError: either cache does not exist.
            LlmTimeoutError: the deadline passed.
            LlmError: any other failure, as the subclass of its status.
        """
        req = broker_pb2.CopyKvBlocksRequest(
            src_cache_id=_cache_id(src_cache), dst_cache_id=_cache_id(dst_cache), src_blocks=_blocks(src_blocks),
            dst_blocks_list=[broker_pb2.BlockList(blocks=_blocks(lst)) for lst in dst_blocks_list])
        return _Call("CopyKvBlocks", req, cv.transfer_result_from_pb, timeout)

    @_rpc()
    def transfer_kv_blocks_batch(self, groups: Sequence[PullBlocks | PushBlocks], *,
                                 timeout: float | None = None, trace_context: TraceContext | None = UNSET
                                 ) -> _Call[TransferResult]:
        """Several block pulls and pushes (K and V caches, MLA parts) as one transfer: all validated before any byte
        moves, one deadline, one terminal state.

        Args:
            groups: the pulls and pushes, each as `pull_kv_blocks` or `push_kv_blocks` would take it.
            timeout: deadline in seconds (default: the client's `timeout`).
            trace_context: the trace this call belongs to (`kvbroker.tracecontext`), continued by the daemon's spans
                when it traces; default: the current one (`tracecontext.use`, else OpenTelemetry's current span);
                None: none.

        Returns:
            Bytes moved in all, the backends used (comma-separated), the transfer id and the number of byte runs.

        Raises:
            ParamInvalidError: a group's blocks or layer ranges, or `timeout`, out of range; nothing was moved.
            KvCacheNotExistError: a cache does not exist.
            NotYetLinkError: a remote cluster is not linked.
            LlmTimeoutError: the deadline passed; the `failed_dst_blocks` report covers every group.
            LlmError: any other failure, as the subclass of its status, with the same report.
        """
        return _Call("TransferKvBlocksBatch", _batch_request(groups), _batch_result, timeout, trace_context)


CALLS: tuple[str, ...] = tuple(name for name, row in vars(_Calls).items() if isinstance(row, _Rpc))
"""The names of the table's rows: the methods `Client` and `AsyncClient` both have, with one signature and one
docstring each."""


class Client(_Calls):
    """Blocking client: every call of the table (`CALLS`) as a method that returns its result. Use as a context
    manager or call `close()`."""

    def __init__(self, target: str, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 lease_ttl: float | None = DEFAULT_LEASE_TTL_S) -> None:
        super().__init__(target, timeout=timeout, lease_ttl=lease_ttl)
        self._channel: grpc.Channel | None = None
        self._keepalive: threading.Thread | None = None
        self._closing = threading.Event()

    def _call(self, method: str, request: Any, timeout: float | None,
              trace_context: TraceContext | None = UNSET) -> Any:
        if self._stub is None:
            self._channel = grpc.insecure_channel(self.target, options=_channel_options())
            self._stub = broker_pb2_grpc.KvBrokerStub(self._channel)
        try:
            return getattr(self._stub, method)(request, **self._options(timeout, trace_context))
        except grpc.RpcError as err:
            raise error_from_rpc(err, method) from None

    def _run(self, call: _Call[_R]) -> _R:
        return call.decode(self._call(call.method, call.request, call.timeout, call.trace_context))

    def _start_keepalive(self) -> None:
        if self.lease_ttl is None or self._keepalive is not None:
            return
        self._closing.clear()
        self._call("KeepAlive", self._keepalive_request(), None)  # sets the lease length before anything is owned

        def renew() -> None:
            while not self._closing.wait(self._keepalive_every):
                with contextlib.suppress(LlmError):  # a daemon restart: the next round retries
                    self._call("KeepAlive", self._keepalive_request(), self._keepalive_every)

        self._keepalive = threading.Thread(target=renew, name="kvbroker-keepalive", daemon=True)
        self._keepalive.start()

    def close(self) -> None:
        """Stops renewing the lease, unmaps the caches this client mapped and closes the channel; idempotent.
        The daemon keeps the caches until released or until the lease expires."""
        self._closing.set()
        if self._keepalive is not None:
            self._keepalive.join()
            self._keepalive = None
        for cache_id in list(self._mapped):
            self._forget(cache_id)
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pull_kv_blocks(
        self,
        src_cache_index: CacheIndex,
        dst_cache: CacheRef,
        src_blocks: Blocks,
        dst_blocks: Blocks,
        ext_param: KvCacheExtParam | None = None,
        *,
        timeout: float | None = None,
        trace_context: TraceContext | None = UNSET,
        on_layer: Callable[[LayerLanded], None] | None = None,
    ) -> TransferResult:
        """Pulls blocks of a linked cluster's cache into blocks of a local cache (LLM-DataDist PullKvBlocks).

        The table's `pull_kv_blocks`, plus `on_layer` (`AsyncClient.pull_kv_blocks_stream` is the asyncio form).

        Args:
            src_cache_index: the remote cache: its cluster id and cache id.
            dst_cache: the local destination cache, or its id.
            src_blocks: source block indices; `src_blocks[i]` lands in `dst_blocks[i]`.
            dst_blocks: destination block indices, as many as `src_blocks`.
            ext_param: layer ranges (source and destination) and tensors per layer; None: every layer.
            timeout: deadline in seconds (default: the client's `timeout`).
            trace_context: the trace this call belongs to (`kvbroker.tracecontext`), continued by the daemon's spans
                when it traces; default: the current one (`tracecontext.use`, else OpenTelemetry's current span);
                None: none.
            on_layer: called with each destination layer as it lands: the pull then runs layer by layer, so that a
                decode engine can start on layer 0 while later layers are still in flight.

        Returns:
            Bytes moved, the backend that moved them, the transfer id and the number of byte runs.

        Raises:
            ParamInvalidError: blocks, layer ranges or `timeout` out of range; nothing was moved.
            KvCacheNotExistError: either cache does not exist.
            NotYetLinkError: the source cluster is not linked.
            LlmTimeoutError: the deadline passed; `failed_dst_blocks` (and `details["transfer_report"]`) say
                which destination blocks may be incomplete.
            LlmError: any other failure, as the subclass of its status, with the same report.
        """
        if on_layer is None:
            return super().pull_kv_blocks(src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param,
                                          timeout=timeout, trace_context=trace_context)
        req = _pull_request(src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param)
        try:
            for msg in self._stream("PullKvBlocksStream", req, timeout, trace_context):
                item = _progress(msg)
                if isinstance(item, TransferResult):
                    return item
                on_layer(item)
        except grpc.RpcError as err:
            raise error_from_rpc(err, "PullKvBlocksStream") from None
        raise LlmError(LlmStatus.LLM_FAILED, "the progress stream ended without a terminal state")

    def open_pull_session(self, *, timeout: float | None = None) -> PullSession:
        """Opens a pull session: one long-lived stream that carries many pulls (plain or granted) and their
        completions, without a call's set-up per pull (e.g. one per engine worker; the daemon runs each `submit`'s
        pulls as one step, planned together per peer).

        Args:
            timeout: deadline of the whole stream in seconds (None: none; each pull has its own,
                `SessionPull.timeout` or the client's `timeout`).

        Returns:
            The PullSession: `submit(pulls)` returns one future per pull (its TransferResult, or the LlmError
            `pull_kv_blocks` would raise); `close()` waits for the pulls in flight.

        Raises:
            ParamInvalidError: `timeout` is not > 0.
            LlmError: the daemon could not be reached (LLM_FAILED). A session the daemon refuses (too many open:
                LLM_OUT_OF_MEMORY) fails its pulls and later submits with that error.
        """
        deadline = None if timeout is None else self._deadline(timeout)
        self._call("Ping", broker_pb2.PingRequest(), None)  # creates the channel; fails fast if the daemon is down
        return PullSession(self._stub, _CALL_METADATA, self.default_timeout, deadline)

    def _stream(self, method: str, request: Any, timeout: float | None,
                trace_context: TraceContext | None = UNSET) -> Iterator[Any]:
        self._call("Ping", broker_pb2.PingRequest(), timeout)  # creates the channel; fails fast if the daemon is down
        options = self._options(timeout, trace_context)
        return getattr(self._stub, method)(request, **options)  # type: ignore[no-any-return]


class AsyncClient(_Calls):
    """asyncio client: every call of the table (`CALLS`) as a coroutine method with the same signature as
    `Client`'s, plus `pull_kv_blocks_stream`. Use `async with` or `await close()`."""

    _awaits = True

    def __init__(self, target: str, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 lease_ttl: float | None = DEFAULT_LEASE_TTL_S) -> None:
        super().__init__(target, timeout=timeout, lease_ttl=lease_ttl)
        self._channel: grpc.aio.Channel | None = None
        self._keepalive: asyncio.Task[None] | None = None

    async def _call(self, method: str, request: Any, timeout: float | None,
                    trace_context: TraceContext | None = UNSET) -> Any:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.target, options=_channel_options())
            self._stub = broker_pb2_grpc.KvBrokerStub(self._channel)
        try:
            return await getattr(self._stub, method)(request, **self._options(timeout, trace_context))
        except grpc.RpcError as err:
            raise error_from_rpc(err, method) from None

    async def _run(self, call: _Call[_R]) -> _R:
        return call.decode(await self._call(call.method, call.request, call.timeout, call.trace_context))

    async def _start_keepalive(self) -> None:
        if self.lease_ttl is None or self._keepalive is not None:
            return
        await self._call("KeepAlive", self._keepalive_request(), None)

        async def renew() -> None:
            while True:
                await asyncio.sleep(self._keepalive_every)
                with contextlib.suppress(LlmError):
                    await self._call("KeepAlive", self._keepalive_request(), self._keepalive_every)

        self._keepalive = asyncio.get_running_loop().create_task(renew())

    async def close(self) -> None:
        """Stops renewing the lease, unmaps the caches this client mapped and closes the channel; idempotent.
        The daemon keeps the caches until released or until the lease expires."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
            self._keepalive = None
        for cache_id in list(self._mapped):
            self._forget(cache_id)
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open_pull_session(self, *, timeout: float | None = None) -> AsyncPullSession:
        """Opens a pull session: one long-lived stream that carries many pulls (plain or granted) and their
        completions, without a call's set-up per pull (e.g. one per engine worker; the daemon runs each `submit`'s
        pulls as one step, planned together per peer).

        Args:
            timeout: deadline of the whole stream in seconds (None: none; each pull has its own,
                `SessionPull.timeout` or the client's `timeout`).

        Returns:
            The AsyncPullSession: `await submit(pulls)` returns one future per pull (its TransferResult, or the
            LlmError `pull_kv_blocks` would raise); `await close()` waits for the pulls in flight.

        Raises:
            ParamInvalidError: `timeout` is not > 0.
            LlmError: the daemon could not be reached (LLM_FAILED). A session the daemon refuses (too many open:
                LLM_OUT_OF_MEMORY) fails its pulls and later submits with that error.
        """
        deadline = None if timeout is None else self._deadline(timeout)
        await self._call("Ping", broker_pb2.PingRequest(), None)  # creates the channel in this loop
        call = self._stub.PullKvBlocksSession(  # type: ignore[union-attr]
            metadata=_CALL_METADATA, timeout=deadline)
        return AsyncPullSession(call, self.default_timeout)

    async def pull_kv_blocks_stream(
        self, src_cache_index: CacheIndex, dst_cache: CacheRef, src_blocks: Blocks,
        dst_blocks: Blocks, ext_param: KvCacheExtParam | None = None, *, timeout: float | None = None,
    ) -> AsyncIterator[LayerLanded | TransferResult]:
        """Layer-wise `pull_kv_blocks`: yields each destination layer as it lands, then the result.

        Args:
            src_cache_index: the remote cache: its cluster id and cache id.
            dst_cache: the local destination cache, or its id.
            src_blocks: source block indices; `src_blocks[i]` lands in `dst_blocks[i]`.
            dst_blocks: destination block indices, as many as `src_blocks`.
            ext_param: layer ranges (source and destination) and tensors per layer; None: every layer.
            timeout: deadline in seconds (default: the client's `timeout`), for the whole pull.

        Returns:
            An async iterator of a LayerLanded per destination layer, then the TransferResult.

        Raises:
            ParamInvalidError: blocks, layer ranges or `timeout` out of range; nothing was moved.
            KvCacheNotExistError: either cache does not exist.
            NotYetLinkError: the source cluster is not linked.
            LlmTimeoutError: the deadline passed.
            LlmError: any other failure, as the subclass of its status; its `failed_dst_blocks` and
                `details["transfer_report"].completed_layers` say what landed.
        """
        req = _pull_request(src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param)
        await self._call("Ping", broker_pb2.PingRequest(), timeout)  # creates the channel in this loop
        call = self._stub.PullKvBlocksStream(req, **self._options(timeout))  # type: ignore[union-attr]
        try:
            async for msg in call:
                yield _progress(msg)
        except grpc.RpcError as err:
            raise error_from_rpc(err, "PullKvBlocksStream") from None
