"""`Client` (blocking) and `AsyncClient` (asyncio): the model server's handle on its node's kvbrokerd.

Both build the same requests and decode the same responses (`_Calls`); only the way they wait differs.
Constructors do no I/O: the channel is created on first use (inside the running loop, for `AsyncClient`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio

from kvbroker import convert as cv
from kvbroker._errors import error_from_rpc
from kvbroker.shm import Cache
from kvbroker.status import (
    ACCEPT_DETAILS_HEADER,
    ClusterNumExceedLimitError,
    LlmError,
    LlmStatus,
    ParamInvalidError,
)
from kvbroker.types import (
    CacheDesc,
    CacheIndex,
    CacheRecord,
    ClusterInfo,
    ClusterResult,
    ClusterStatus,
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


def _notification_request(cluster_id: int, topic: str, payload: bytes) -> broker_pb2.SendNotificationRequest:
    return broker_pb2.SendNotificationRequest(cluster_id=cluster_id, topic=topic, payload=bytes(payload))


def _fetch_request(topic: str, max_count: int, wait: float) -> broker_pb2.FetchNotificationsRequest:
    if not 0 <= wait <= 30 or not 0 < max_count <= 65536:
        raise ParamInvalidError(LlmStatus.LLM_PARAM_INVALID, f"wait must be in [0, 30] s and max_count in "
                                f"[1, 65536], got wait={wait}, max_count={max_count}")
    return broker_pb2.FetchNotificationsRequest(topic=topic, max_count=max_count, wait_ms=int(wait * 1000))


def _notification(n: broker_pb2.Notification) -> Notification:
    return Notification(n.cluster_id, n.topic, bytes(n.payload), n.received_unix)


def _check_size(size: int) -> None:
    # On the wire 0 means "unset" (= -1), so an explicit 0 is refused here, as LLM-DataDist refuses it.
    if size == 0 or size < -1:
        raise ParamInvalidError(LlmStatus.LLM_PARAM_INVALID, f"size must be -1 or > 0 bytes per tensor, got {size}")


class _Calls:
    """Request builders and response decoders shared by both clients."""

    @staticmethod
    def pull_kv_blocks(
        src_cache_index: CacheIndex,
        dst_cache: CacheRef,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        ext_param: KvCacheExtParam | None,
    ) -> broker_pb2.PullKvBlocksRequest:
        return broker_pb2.PullKvBlocksRequest(
            src_cache_index=cv.cache_index_to_pb(src_cache_index),
            dst_cache_id=_cache_id(dst_cache),
            src_blocks=[int(b) for b in src_blocks],
            dst_blocks=[int(b) for b in dst_blocks],
            ext_param=cv.ext_param_to_pb(ext_param),
        )

    @staticmethod
    def pull_kv_cache(src_cache_index: CacheIndex, dst_cache: CacheRef, batch_index: int, size: int,
                      ext_param: KvCacheExtParam | None) -> broker_pb2.PullKvCacheRequest:
        _check_size(size)
        return broker_pb2.PullKvCacheRequest(
            src_cache_index=cv.cache_index_to_pb(src_cache_index), dst_cache_id=_cache_id(dst_cache),
            batch_index=batch_index, size=size, ext_param=cv.ext_param_to_pb(ext_param))

    @staticmethod
    def push_kv_blocks(src_cache: CacheRef, dst_cache_index: CacheIndex, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None) -> broker_pb2.PushKvBlocksRequest:
        return broker_pb2.PushKvBlocksRequest(
            src_cache_id=_cache_id(src_cache), dst_cache_index=cv.cache_index_to_pb(dst_cache_index),
            src_blocks=[int(b) for b in src_blocks], dst_blocks=[int(b) for b in dst_blocks],
            ext_param=cv.ext_param_to_pb(ext_param))

    @staticmethod
    def push_kv_cache(src_cache: CacheRef, dst_cache_index: CacheIndex, src_batch_index: int, size: int,
                      ext_param: KvCacheExtParam | None) -> broker_pb2.PushKvCacheRequest:
        _check_size(size)
        return broker_pb2.PushKvCacheRequest(
            src_cache_id=_cache_id(src_cache), dst_cache_index=cv.cache_index_to_pb(dst_cache_index),
            src_batch_index=src_batch_index, size=size, ext_param=cv.ext_param_to_pb(ext_param))

    @staticmethod
    def copy_kv_blocks(src_cache: CacheRef, dst_cache: CacheRef, src_blocks: Sequence[int],
                       dst_blocks_list: Sequence[Sequence[int]]) -> broker_pb2.CopyKvBlocksRequest:
        return broker_pb2.CopyKvBlocksRequest(
            src_cache_id=_cache_id(src_cache), dst_cache_id=_cache_id(dst_cache),
            src_blocks=[int(b) for b in src_blocks],
            dst_blocks_list=[broker_pb2.BlockList(blocks=[int(b) for b in lst]) for lst in dst_blocks_list])

    @staticmethod
    def batch(groups: Sequence[PullBlocks | PushBlocks]) -> broker_pb2.TransferKvBlocksBatchRequest:
        req = broker_pb2.TransferKvBlocksBatchRequest()
        for g in groups:
            if isinstance(g, PullBlocks):
                req.groups.add(pull=_Calls.pull_kv_blocks(g.src_cache_index, g.dst_cache, g.src_blocks,
                                                          g.dst_blocks, g.ext_param))
            else:
                req.groups.add(push=_Calls.push_kv_blocks(g.src_cache, g.dst_cache_index, g.src_blocks,
                                                          g.dst_blocks, g.ext_param))
        return req

    @staticmethod
    def progress(msg: broker_pb2.PullKvBlocksProgress) -> LayerLanded | TransferResult:
        if msg.HasField("result"):
            return cv.transfer_result_from_pb(msg.result)
        return LayerLanded(layer=msg.layer, layer_bytes=msg.layer_bytes)

    @staticmethod
    def register(desc: CacheDesc, tensors: Sequence[TensorLocation], session_id: str
                 ) -> broker_pb2.RegisterKvCacheRequest:
        return broker_pb2.RegisterKvCacheRequest(
            desc=cv.desc_to_pb(desc), tensors=[cv.tensor_location_to_pb(t) for t in tensors], session_id=session_id)


_Stub = TypeVar("_Stub")


class _Base(Generic[_Stub]):
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
        self._stub: _Stub | None = None
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


class Client(_Base[broker_pb2_grpc.KvBrokerStub]):
    """Blocking client. Use as a context manager or call `close()`."""

    def __init__(self, target: str, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 lease_ttl: float | None = DEFAULT_LEASE_TTL_S) -> None:
        super().__init__(target, timeout=timeout, lease_ttl=lease_ttl)
        self._channel: grpc.Channel | None = None
        self._keepalive: threading.Thread | None = None
        self._closing = threading.Event()

    def _call(self, method: str, request: Any, timeout: float | None) -> Any:
        if self._stub is None:
            self._channel = grpc.insecure_channel(self.target, options=_channel_options())
            self._stub = broker_pb2_grpc.KvBrokerStub(self._channel)
        try:
            return getattr(self._stub, method)(request, timeout=self._deadline(timeout), metadata=_CALL_METADATA)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None

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

    def get_cluster_info(self, *, timeout: float | None = None) -> ClusterStatus:
        return cv.cluster_status_from_pb(self._call("GetClusterInfo", broker_pb2.GetClusterInfoRequest(), timeout))

    def ping(self, *, timeout: float | None = None) -> None:
        self._call("Ping", broker_pb2.PingRequest(), timeout)

    def allocate_cache(self, desc: CacheDesc, *, timeout: float | None = None) -> Cache:
        """Allocates daemon-owned shared memory; the returned `Cache.tensors` are numpy views over it."""
        self._start_keepalive()
        req = broker_pb2.AllocateCacheRequest(desc=cv.desc_to_pb(desc), session_id=self.session_id)
        cache = Cache.map(cv.cache_record_from_pb(self._call("AllocateCache", req, timeout).cache))
        self._mapped[cache.cache_id] = cache
        return cache

    def deallocate_cache(self, cache: CacheRef, *, timeout: float | None = None) -> None:
        cache_id = _cache_id(cache)
        self._forget(cache_id)
        self._call("DeallocateCache", broker_pb2.DeallocateCacheRequest(cache_id=cache_id), timeout)

    def register_kv_cache(
        self, desc: CacheDesc, tensors: Sequence[TensorLocation], *, timeout: float | None = None
    ) -> Cache:
        """Registers the caller's shared memory (one location per tensor) and returns it mapped."""
        self._start_keepalive()
        resp = self._call("RegisterKvCache", _Calls.register(desc, tensors, self.session_id), timeout)
        cache = Cache.map(cv.cache_record_from_pb(resp.cache))
        self._mapped[cache.cache_id] = cache
        return cache

    def unregister_kv_cache(self, cache: CacheRef, *, timeout: float | None = None) -> None:
        cache_id = _cache_id(cache)
        self._forget(cache_id)
        self._call("UnregisterKvCache", broker_pb2.UnregisterKvCacheRequest(cache_id=cache_id), timeout)

    def list_caches(self, *, timeout: float | None = None) -> list[CacheRecord]:
        resp = self._call("ListCaches", broker_pb2.ListCachesRequest(), timeout)
        return [cv.cache_record_from_pb(c) for c in resp.caches]

    def link_clusters(
        self, clusters: Sequence[ClusterInfo], *, timeout: float | None = None
    ) -> list[ClusterResult]:
        """Links to each cluster; returns one result per cluster (like LLM-DataDist, failures do not raise)."""
        req = broker_pb2.LinkClustersRequest(clusters=_clusters_pb(clusters), timeout_ms=_ms(timeout))
        return [cv.cluster_result_from_pb(r) for r in self._call("LinkClusters", req, _rpc_deadline(timeout)).results]

    def unlink_clusters(
        self, clusters: Sequence[ClusterInfo], *, force: bool = False, timeout: float | None = None
    ) -> list[ClusterResult]:
        req = broker_pb2.UnlinkClustersRequest(clusters=_clusters_pb(clusters), force=force, timeout_ms=_ms(timeout))
        return [cv.cluster_result_from_pb(r) for r in self._call("UnlinkClusters", req, _rpc_deadline(timeout)).results]

    def send_notification(self, cluster_id: int, topic: str, payload: bytes, *,
                          timeout: float | None = None) -> None:
        """Sends `payload` (<= 64 KiB) on `topic` (<= 128 bytes) to the daemon of `cluster_id`, which must be linked
        from this daemon; that daemon's clients get it with `fetch_notifications(topic)`."""
        self._call("SendNotification", _notification_request(cluster_id, topic, payload), timeout)

    def fetch_notifications(self, topic: str, max_count: int = 1024, wait: float = 0.0, *,
                            timeout: float | None = None) -> list[Notification]:
        """Notifications linked peers sent to this daemon on `topic`, oldest first, each returned once; waits up to
        `wait` seconds (at most 30) for the first when there are none."""
        req = _fetch_request(topic, max_count, wait)
        resp = self._call("FetchNotifications", req, self._fetch_deadline(timeout, wait))
        return [_notification(n) for n in resp.notifications]

    def list_links(self, *, timeout: float | None = None) -> list[LinkInfo]:
        resp = self._call("ListLinks", broker_pb2.ListLinksRequest(), timeout)
        return [cv.link_info_from_pb(link) for link in resp.links]

    def pull_kv_blocks(
        self,
        src_cache_index: CacheIndex,
        dst_cache: CacheRef,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        ext_param: KvCacheExtParam | None = None,
        *,
        timeout: float | None = None,
        on_layer: Callable[[LayerLanded], None] | None = None,
    ) -> TransferResult:
        """Pulls `src_blocks` of the remote cache into `dst_blocks` of the local one (LLM-DataDist PullKvBlocks).

        With `on_layer`, the pull runs layer by layer and calls `on_layer` as each destination layer lands, so a
        decode engine can start on layer 0 while later layers are still in flight."""
        req = _Calls.pull_kv_blocks(src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param)
        if on_layer is None:
            return cv.transfer_result_from_pb(self._call("PullKvBlocks", req, timeout))
        try:
            for msg in self._stream("PullKvBlocksStream", req, timeout):
                item = _Calls.progress(msg)
                if isinstance(item, TransferResult):
                    return item
                on_layer(item)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        raise LlmError(LlmStatus.LLM_FAILED, "the progress stream ended without a terminal state")

    def pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: CacheRef, batch_index: int = 0, size: int = -1,
                      ext_param: KvCacheExtParam | None = None, *, timeout: float | None = None) -> TransferResult:
        """Pulls batch row `src_cache_index.batch_index` (its first `size` bytes per tensor; -1 = all) of each
        selected tensor into row `batch_index` of `dst_cache` (LLM-DataDist PullKvCache)."""
        req = _Calls.pull_kv_cache(src_cache_index, dst_cache, batch_index, size, ext_param)
        return cv.transfer_result_from_pb(self._call("PullKvCache", req, timeout))

    def push_kv_blocks(self, src_cache: CacheRef, dst_cache_index: CacheIndex, src_blocks: Sequence[int],
                       dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None, *,
                       timeout: float | None = None) -> TransferResult:
        """Writes `src_blocks` of the local cache into `dst_blocks` of the remote one (LLM-DataDist PushKvBlocks)."""
        req = _Calls.push_kv_blocks(src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param)
        return cv.transfer_result_from_pb(self._call("PushKvBlocks", req, timeout))

    def push_kv_cache(self, src_cache: CacheRef, dst_cache_index: CacheIndex, src_batch_index: int = 0,
                      size: int = -1, ext_param: KvCacheExtParam | None = None, *,
                      timeout: float | None = None) -> TransferResult:
        """Writes row `src_batch_index` of the local cache into row `dst_cache_index.batch_index` of the remote one."""
        req = _Calls.push_kv_cache(src_cache, dst_cache_index, src_batch_index, size, ext_param)
        return cv.transfer_result_from_pb(self._call("PushKvCache", req, timeout))

    def copy_kv_blocks(self, src_cache: CacheRef, dst_cache: CacheRef, src_blocks: Sequence[int],
                       dst_blocks_list: Sequence[Sequence[int]], *, timeout: float | None = None) -> TransferResult:
        """Copies `src_blocks` into each list of `dst_blocks_list` between two local caches (e.g. forking a
        partially filled block for prefix sharing)."""
        req = _Calls.copy_kv_blocks(src_cache, dst_cache, src_blocks, dst_blocks_list)
        return cv.transfer_result_from_pb(self._call("CopyKvBlocks", req, timeout))

    def transfer_kv_blocks_batch(self, groups: Sequence[PullBlocks | PushBlocks], *,
                                 timeout: float | None = None) -> TransferResult:
        """Several block pulls/pushes (K and V caches, MLA parts) as one transfer: all validated before any byte
        moves, one deadline, one terminal state; a failure's `failed_dst_blocks` report covers every group."""
        resp = self._call("TransferKvBlocksBatch", _Calls.batch(groups), timeout)
        return TransferResult(bytes_moved=resp.bytes_moved, backend=",".join(resp.backends),
                              transfer_id=resp.transfer_id, num_runs=resp.num_runs)

    def _stream(self, method: str, request: Any, timeout: float | None) -> Iterator[Any]:
        self._call("Ping", broker_pb2.PingRequest(), timeout)  # creates the channel; fails fast if the daemon is down
        return getattr(self._stub, method)(  # type: ignore[no-any-return]
            request, timeout=self._deadline(timeout), metadata=_CALL_METADATA)


class AsyncClient(_Base[broker_pb2_grpc.KvBrokerStub]):
    """asyncio client with the same methods as `Client`, awaited. Use `async with` or `await close()`."""

    def __init__(self, target: str, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 lease_ttl: float | None = DEFAULT_LEASE_TTL_S) -> None:
        super().__init__(target, timeout=timeout, lease_ttl=lease_ttl)
        self._channel: grpc.aio.Channel | None = None
        self._keepalive: asyncio.Task[None] | None = None

    async def _call(self, method: str, request: Any, timeout: float | None) -> Any:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.target, options=_channel_options())
            self._stub = broker_pb2_grpc.KvBrokerStub(self._channel)
        try:
            return await getattr(self._stub, method)(request, timeout=self._deadline(timeout), metadata=_CALL_METADATA)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None

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

    async def get_cluster_info(self, *, timeout: float | None = None) -> ClusterStatus:
        resp = await self._call("GetClusterInfo", broker_pb2.GetClusterInfoRequest(), timeout)
        return cv.cluster_status_from_pb(resp)

    async def ping(self, *, timeout: float | None = None) -> None:
        await self._call("Ping", broker_pb2.PingRequest(), timeout)

    async def allocate_cache(self, desc: CacheDesc, *, timeout: float | None = None) -> Cache:
        await self._start_keepalive()
        req = broker_pb2.AllocateCacheRequest(desc=cv.desc_to_pb(desc), session_id=self.session_id)
        cache = Cache.map(cv.cache_record_from_pb((await self._call("AllocateCache", req, timeout)).cache))
        self._mapped[cache.cache_id] = cache
        return cache

    async def deallocate_cache(self, cache: CacheRef, *, timeout: float | None = None) -> None:
        cache_id = _cache_id(cache)
        self._forget(cache_id)
        await self._call("DeallocateCache", broker_pb2.DeallocateCacheRequest(cache_id=cache_id), timeout)

    async def register_kv_cache(
        self, desc: CacheDesc, tensors: Sequence[TensorLocation], *, timeout: float | None = None
    ) -> Cache:
        await self._start_keepalive()
        resp = await self._call("RegisterKvCache", _Calls.register(desc, tensors, self.session_id), timeout)
        cache = Cache.map(cv.cache_record_from_pb(resp.cache))
        self._mapped[cache.cache_id] = cache
        return cache

    async def unregister_kv_cache(self, cache: CacheRef, *, timeout: float | None = None) -> None:
        cache_id = _cache_id(cache)
        self._forget(cache_id)
        await self._call("UnregisterKvCache", broker_pb2.UnregisterKvCacheRequest(cache_id=cache_id), timeout)

    async def list_caches(self, *, timeout: float | None = None) -> list[CacheRecord]:
        resp = await self._call("ListCaches", broker_pb2.ListCachesRequest(), timeout)
        return [cv.cache_record_from_pb(c) for c in resp.caches]

    async def link_clusters(
        self, clusters: Sequence[ClusterInfo], *, timeout: float | None = None
    ) -> list[ClusterResult]:
        req = broker_pb2.LinkClustersRequest(clusters=_clusters_pb(clusters), timeout_ms=_ms(timeout))
        resp = await self._call("LinkClusters", req, _rpc_deadline(timeout))
        return [cv.cluster_result_from_pb(r) for r in resp.results]

    async def unlink_clusters(
        self, clusters: Sequence[ClusterInfo], *, force: bool = False, timeout: float | None = None
    ) -> list[ClusterResult]:
        req = broker_pb2.UnlinkClustersRequest(clusters=_clusters_pb(clusters), force=force, timeout_ms=_ms(timeout))
        resp = await self._call("UnlinkClusters", req, _rpc_deadline(timeout))
        return [cv.cluster_result_from_pb(r) for r in resp.results]

    async def send_notification(self, cluster_id: int, topic: str, payload: bytes, *,
                          timeout: float | None = None) -> None:
        """Sends `payload` (<= 64 KiB) on `topic` (<= 128 bytes) to the daemon of `cluster_id`, which must be linked
        from this daemon; that daemon's clients get it with `fetch_notifications(topic)`."""
        await self._call("SendNotification", _notification_request(cluster_id, topic, payload), timeout)

    async def fetch_notifications(self, topic: str, max_count: int = 1024, wait: float = 0.0, *,
                            timeout: float | None = None) -> list[Notification]:
        """Notifications linked peers sent to this daemon on `topic`, oldest first, each returned once; waits up to
        `wait` seconds (at most 30) for the first when there are none."""
        req = _fetch_request(topic, max_count, wait)
        resp = await self._call("FetchNotifications", req, self._fetch_deadline(timeout, wait))
        return [_notification(n) for n in resp.notifications]

    async def list_links(self, *, timeout: float | None = None) -> list[LinkInfo]:
        resp = await self._call("ListLinks", broker_pb2.ListLinksRequest(), timeout)
        return [cv.link_info_from_pb(link) for link in resp.links]

    async def pull_kv_blocks(
        self,
        src_cache_index: CacheIndex,
        dst_cache: CacheRef,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        ext_param: KvCacheExtParam | None = None,
        *,
        timeout: float | None = None,
    ) -> TransferResult:
        req = _Calls.pull_kv_blocks(src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param)
        return cv.transfer_result_from_pb(await self._call("PullKvBlocks", req, timeout))

    async def pull_kv_blocks_stream(
        self, src_cache_index: CacheIndex, dst_cache: CacheRef, src_blocks: Sequence[int],
        dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None, *, timeout: float | None = None,
    ) -> AsyncIterator[LayerLanded | TransferResult]:
        """Layer-wise pull: yields a LayerLanded per destination layer as it lands, then the TransferResult.
        A failure raises LlmError; its `failed_dst_blocks` and details["transfer_report"].completed_layers say
        what landed."""
        req = _Calls.pull_kv_blocks(src_cache_index, dst_cache, src_blocks, dst_blocks, ext_param)
        await self._call("Ping", broker_pb2.PingRequest(), timeout)  # creates the channel in this loop
        call = self._stub.PullKvBlocksStream(  # type: ignore[union-attr]
            req, timeout=self._deadline(timeout), metadata=_CALL_METADATA)
        try:
            async for msg in call:
                yield _Calls.progress(msg)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None

    async def pull_kv_cache(self, src_cache_index: CacheIndex, dst_cache: CacheRef, batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None, *,
                            timeout: float | None = None) -> TransferResult:
        req = _Calls.pull_kv_cache(src_cache_index, dst_cache, batch_index, size, ext_param)
        return cv.transfer_result_from_pb(await self._call("PullKvCache", req, timeout))

    async def push_kv_blocks(self, src_cache: CacheRef, dst_cache_index: CacheIndex, src_blocks: Sequence[int],
                             dst_blocks: Sequence[int], ext_param: KvCacheExtParam | None = None, *,
                             timeout: float | None = None) -> TransferResult:
        req = _Calls.push_kv_blocks(src_cache, dst_cache_index, src_blocks, dst_blocks, ext_param)
        return cv.transfer_result_from_pb(await self._call("PushKvBlocks", req, timeout))

    async def push_kv_cache(self, src_cache: CacheRef, dst_cache_index: CacheIndex, src_batch_index: int = 0,
                            size: int = -1, ext_param: KvCacheExtParam | None = None, *,
                            timeout: float | None = None) -> TransferResult:
        req = _Calls.push_kv_cache(src_cache, dst_cache_index, src_batch_index, size, ext_param)
        return cv.transfer_result_from_pb(await self._call("PushKvCache", req, timeout))

    async def copy_kv_blocks(self, src_cache: CacheRef, dst_cache: CacheRef, src_blocks: Sequence[int],
                             dst_blocks_list: Sequence[Sequence[int]], *,
                             timeout: float | None = None) -> TransferResult:
        req = _Calls.copy_kv_blocks(src_cache, dst_cache, src_blocks, dst_blocks_list)
        return cv.transfer_result_from_pb(await self._call("CopyKvBlocks", req, timeout))

    async def transfer_kv_blocks_batch(self, groups: Sequence[PullBlocks | PushBlocks], *,
                                       timeout: float | None = None) -> TransferResult:
        resp = await self._call("TransferKvBlocksBatch", _Calls.batch(groups), timeout)
        return TransferResult(bytes_moved=resp.bytes_moved, backend=",".join(resp.backends),
                              transfer_id=resp.transfer_id, num_runs=resp.num_runs)
