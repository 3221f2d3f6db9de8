"""`kvbroker.v1.KvBroker`: the local API for model servers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar

import grpc.aio

import kvbrokerd
from kvbroker import blockruns
from kvbroker import convert as cv
from kvbroker.convert import desc_to_pb, tensor_location_from_pb, tensor_location_to_pb
from kvbroker.status import LlmStatus
from kvbroker.tracecontext import TraceContext
from kvbroker.types import CUDA_REREGISTER, TransferResult
from kvbroker.v1 import broker_pb2, broker_pb2_grpc, types_pb2
from kvbrokerd import backends as backend_index
from kvbrokerd import tracing
from kvbrokerd.dataplane.pairs import BlockPairs
from kvbrokerd.errors import LlmError, fail
from kvbrokerd.limits import MAX_ADDRESS_BYTES, MAX_CACHE_LISTING_BYTES, MAX_LAYOUT_TAG_BYTES, check_text
from kvbrokerd.links import notifications
from kvbrokerd.links.peeraddress import check_peer_address
from kvbrokerd.links.table import PROTOCOL_VERSION
from kvbrokerd.node import Node
from kvbrokerd.registry import devicemem, grants
from kvbrokerd.registry.caches import CacheEntry, desc_from_wire
from kvbrokerd.service.errors import llm_errors, status_of, time_remaining, to_rpc_status
from kvbrokerd.service.pullsession import MAX_PULL_SESSIONS, PullSession
from kvbrokerd.transfers.planner import DEFAULT_TENSOR_NUM_PER_LAYER, LayerSelection
from kvbrokerd.transfers.requests import BlocksRequest, CacheRequest, Direction, GrantClaim

log = logging.getLogger(__name__)

SERVICE_NAME = "kvbroker.v1.KvBroker"
TRACED_RPCS = ("PullKvBlocks", "PushKvBlocks", "PullKvCache", "PushKvCache", "CopyKvBlocks", "TransferKvBlocksBatch",
               "CreateGrant", "RenewGrant", "ReleaseGrant", "LinkClusters", "UnlinkClusters", "AllocateCache",
               "DeallocateCache", "RegisterKvCache", "UnregisterKvCache")
"""The calls that get a span of their own while tracing is on: those that move or grant blocks, and those that make
or drop what a transfer needs (links, caches), which a slow first request may be waiting on."""
MAX_CLUSTERS_PER_CALL = 16
FEATURES = (CUDA_REREGISTER,)
"""GetClusterInfo's `features`: what this daemon does that older ones do not."""
DEFAULT_LINK_TIMEOUT_S = 3.0


def cache_info(entry: CacheEntry, shm_dir: str, lease_expires_unix: float = 0.0) -> broker_pb2.CacheInfo:
    return broker_pb2.CacheInfo(
        owner=entry.owner,
        lease_expires_unix=lease_expires_unix,
        cache_id=entry.cache_id,
        desc=desc_to_pb(entry.desc),
        tensors=[tensor_location_to_pb(t) for t in entry.tensors],
        shm_dir=shm_dir,
        daemon_owned=entry.daemon_owned,
        tensor_nbytes=entry.desc.tensor_nbytes,
    )


def _desc(msg: types_pb2.CacheDesc) -> object:
    check_text("desc.layout_tag", msg.layout_tag, MAX_LAYOUT_TAG_BYTES)
    return desc_from_wire(msg.num_tensors, msg.data_type, msg.shape, msg.placement, msg.layout_tag)


def _layers(ext: types_pb2.KvCacheExtParam, present: bool) -> LayerSelection:
    if not present:
        return LayerSelection()
    src = (ext.src_layer_range.first, ext.src_layer_range.second) if ext.HasField("src_layer_range") else (-1, -1)
    dst = (ext.dst_layer_range.first, ext.dst_layer_range.second) if ext.HasField("dst_layer_range") else (-1, -1)
    return LayerSelection(src, dst, ext.tensor_num_per_layer or DEFAULT_TENSOR_NUM_PER_LAYER)


def _result(cluster_id: int, err: LlmError | None) -> broker_pb2.ClusterResult:
    status = LlmStatus.LLM_SUCCESS if err is None else err.status
    return broker_pb2.ClusterResult(remote_cluster_id=cluster_id, status=status.name, status_code=int(status),
                                    message="" if err is None else err.message)


async def _per_cluster(clusters: Iterable[broker_pb2.ClusterInfo],
                       op: Callable[[broker_pb2.ClusterInfo], Awaitable[object]]) -> list[broker_pb2.ClusterResult]:
    """LLM-DataDist's per-cluster results: every cluster gets its own status. The handshakes run concurrently, so
    one unreachable peer does not delay the others."""

    async def one(c: broker_pb2.ClusterInfo) -> broker_pb2.ClusterResult:
        try:
            await op(c)
            return _result(c.remote_cluster_id, None)
        except LlmError as err:
            return _result(c.remote_cluster_id, err)

    return list(await asyncio.gather(*map(one, clusters)))


def _check_cluster_count(n: int) -> None:
    if n > MAX_CLUSTERS_PER_CALL:
        fail(LlmStatus.LLM_CLUSTER_NUM_EXCEED_LIMIT, f"{n} clusters in one call; at most {MAX_CLUSTERS_PER_CALL}")


def _checked_address(c: broker_pb2.ClusterInfo) -> str:
    check_text("remote_address", c.remote_address, MAX_ADDRESS_BYTES)
    return c.remote_address


class KvBrokerService(broker_pb2_grpc.KvBrokerServicer):
    def __init__(self, node: Node) -> None:
        self.node = node
        self._listing_bytes: dict[int, int] = {}
        """Size of each cache's entry in the ListCaches reply, by cache id (see MAX_CACHE_LISTING_BYTES)."""
        self._orphans: set[asyncio.Task[None]] = set()
        """Releases of caches whose callers gave up while they were made (kept referenced until they finish)."""
        self._pull_sessions = 0
        """Open PullKvBlocksSession streams (at most MAX_PULL_SESSIONS)."""
        tracing.trace_rpcs(self, SERVICE_NAME, TRACED_RPCS)

    @property
    def _shm_dir(self) -> str:
        return str(self.node.registry.shm_dir)

    @llm_errors
    async def GetClusterInfo(self, request: broker_pb2.GetClusterInfoRequest, context: grpc.aio.ServicerContext
                             ) -> broker_pb2.GetClusterInfoResponse:
        n = self.node
        return broker_pb2.GetClusterInfoResponse(
            cluster_id=n.cluster_id, version=kvbrokerd.__version__, peer_address=n.peer_address,
            backends=list(n.backends), instance_epoch=n.epoch, num_caches=len(n.registry),
            num_links=len(n.links.links), protocol_version=PROTOCOL_VERSION, metrics_address=n.metrics_address,
            features=list(FEATURES),
        )

    async def Ping(self, request: broker_pb2.PingRequest, context: grpc.aio.ServicerContext
                   ) -> broker_pb2.PingResponse:
        return broker_pb2.PingResponse()

    @llm_errors
    async def AllocateCache(self, request: broker_pb2.AllocateCacheRequest, context: grpc.aio.ServicerContext
                            ) -> broker_pb2.AllocateCacheResponse:
        if request.session_id:
            self.node.sessions.touch(request.session_id)
        _check_caller_waits(context, "AllocateCache")
        # Reserving the memory takes about a second per GiB on a loaded host: off the event loop.
        if request.view_of:  # no memory to reserve: on the loop
            desc = _desc(request.desc)
            entry = self.node.registry.allocate_view(desc, request.session_id, request.view_of)  # type: ignore[arg-type]
            return broker_pb2.AllocateCacheResponse(cache=await self._admit(entry))
        entry = await self._unless_caller_gone(context, asyncio.to_thread(
            self.node.registry.allocate, _desc(request.desc), request.session_id))  # type: ignore[arg-type]
        return broker_pb2.AllocateCacheResponse(cache=await self._admit(entry))

    async def _unless_caller_gone(self, context: grpc.aio.ServicerContext, making: Awaitable[CacheEntry]
                                  ) -> CacheEntry:
        """The cache that `making` adds, once made, if its caller still waits for the answer. A caller that gave up
        (cancelled, or its deadline passed) never learns the cache's id, and a cache without a lease would live
        forever: the daemon releases it then, even if the work that makes it finishes only after the caller left."""
        work = asyncio.ensure_future(making)
        try:
            entry = await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(self._release_orphan)
            raise
        if context.cancelled() or context.done() or time_remaining(context) == 0.0:
            await self._release(entry)
            fail(LlmStatus.LLM_TIMEOUT, f"the caller gave up before cache {entry.cache_id} was ready; it was "
                 "released again")
        return entry

    def _release_orphan(self, work: asyncio.Future[CacheEntry]) -> None:
        if work.cancelled() or work.exception() is not None:
            return  # nothing was made (a failure left nothing behind)
        task = asyncio.ensure_future(self._release(work.result()))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _release(self, entry: CacheEntry) -> None:
        try:
            await self.node.registry.remove(entry.cache_id, daemon_owned=None, wait_s=0.0)
            log.warning("released cache %d: its caller gave up before it was ready", entry.cache_id)
        except LlmError as e:  # no one else knows the id: nothing can be using it, so this is not expected
            log.error("could not release cache %d, whose caller gave up: %s", entry.cache_id, e)

    @llm_errors
    async def DeallocateCache(self, request: broker_pb2.DeallocateCacheRequest, context: grpc.aio.ServicerContext
                              ) -> broker_pb2.DeallocateCacheResponse:
        await self.node.registry.remove(request.cache_id, daemon_owned=True, wait_s=_wait(context))
        return broker_pb2.DeallocateCacheResponse()

    @llm_errors
    async def RegisterKvCache(self, request: broker_pb2.RegisterKvCacheRequest, context: grpc.aio.ServicerContext
                              ) -> broker_pb2.RegisterKvCacheResponse:
        tensors = [tensor_location_from_pb(t) for t in request.tensors]
        if request.session_id:
            self.node.sessions.touch(request.session_id)
        if devicemem.is_device(tensors) or request.desc.placement == types_pb2.PLACEMENT_DEVICE:
            # Opening IPC handles and registering device memory with an engine can take a while: off the event loop.
            _check_caller_waits(context, "RegisterKvCache")
            entry = await self._unless_caller_gone(context, asyncio.to_thread(
                devicemem.register, _desc(request.desc), tensors, self.node.links.backends,  # type: ignore[arg-type]
                owner=request.session_id, known=backend_index.device_kinds()))
        else:
            entry = self.node.registry.register(_desc(request.desc), tensors,  # type: ignore[arg-type]
                                                owner=request.session_id)
        return broker_pb2.RegisterKvCacheResponse(cache=await self._admit(entry))

    @llm_errors
    async def UnregisterKvCache(self, request: broker_pb2.UnregisterKvCacheRequest,
                                context: grpc.aio.ServicerContext) -> broker_pb2.UnregisterKvCacheResponse:
        await self.node.registry.remove(request.cache_id, daemon_owned=False, wait_s=_wait(context))
        return broker_pb2.UnregisterKvCacheResponse()

    @llm_errors
    async def ListCaches(self, request: broker_pb2.ListCachesRequest, context: grpc.aio.ServicerContext
                         ) -> broker_pb2.ListCachesResponse:
        return broker_pb2.ListCachesResponse(caches=[self._info(e) for e in self.node.registry.list()])

    @llm_errors
    async def KeepAlive(self, request: broker_pb2.KeepAliveRequest, context: grpc.aio.ServicerContext
                        ) -> broker_pb2.KeepAliveResponse:
        self.node.sessions.touch(request.session_id, request.ttl_ms / 1000 if request.ttl_ms else None)
        owned = sum(1 for e in self.node.registry.list() if e.owner == request.session_id)
        return broker_pb2.KeepAliveResponse(num_caches=owned)

    def _info(self, entry: CacheEntry) -> broker_pb2.CacheInfo:
        expires = self.node.sessions.expires_unix(entry.owner) if entry.owner else 0.0
        return cache_info(entry, self._shm_dir, expires)

    async def _admit(self, entry: CacheEntry) -> broker_pb2.CacheInfo:
        """The new cache's description, unless it would make the ListCaches reply too large for anyone to receive:
        then the cache is removed again and the call refused."""
        info = self._info(entry)
        live = {e.cache_id for e in self.node.registry.list()}
        sizes = {cache_id: n for cache_id, n in self._listing_bytes.items() if cache_id in live}
        size = info.ByteSize() + 6  # + its tag and length prefix in the repeated field
        if sum(sizes.values()) + size > MAX_CACHE_LISTING_BYTES:
            await self.node.registry.remove(entry.cache_id, daemon_owned=None, wait_s=0.0)
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"the descriptions of all caches would exceed {MAX_CACHE_LISTING_BYTES} "
                 f"bytes (the ListCaches limit); this one takes {size} (its tensors' segment names); release caches "
                 "or register fewer, larger tensors")
        sizes[entry.cache_id] = size
        self._listing_bytes = sizes
        return info

    @llm_errors
    async def LinkClusters(self, request: broker_pb2.LinkClustersRequest, context: grpc.aio.ServicerContext
                           ) -> broker_pb2.LinkClustersResponse:
        _check_cluster_count(len(request.clusters))
        timeout = _timeout(request.timeout_ms, context)
        # HOST:PORT only, refused before any connection: gRPC would dial unix: and other schemes as well.
        results = await _per_cluster(request.clusters, lambda c: self.node.links.link(
            c.remote_cluster_id, check_peer_address(c.remote_address), timeout))
        return broker_pb2.LinkClustersResponse(results=results)

    @llm_errors
    async def UnlinkClusters(self, request: broker_pb2.UnlinkClustersRequest, context: grpc.aio.ServicerContext
                             ) -> broker_pb2.UnlinkClustersResponse:
        _check_cluster_count(len(request.clusters))
        timeout = _timeout(request.timeout_ms, context)

        async def unlink(c: broker_pb2.ClusterInfo) -> None:
            _checked_address(c)  # unused (the cluster id names the link), but bounded like everywhere else
            await self.node.links.unlink(c.remote_cluster_id, request.force, timeout)

        results = await _per_cluster(request.clusters, unlink)
        return broker_pb2.UnlinkClustersResponse(results=results)

    @llm_errors
    async def ListLinks(self, request: broker_pb2.ListLinksRequest, context: grpc.aio.ServicerContext
                        ) -> broker_pb2.ListLinksResponse:
        links = sorted(self.node.links.links.values(), key=lambda link: link.remote_cluster_id)
        return broker_pb2.ListLinksResponse(links=[
            broker_pb2.LinkInfo(remote_cluster_id=link.remote_cluster_id, remote_address=link.remote_address,
                                state=int(link.state), backend=link.backend,  # type: ignore[arg-type]
                                remote_epoch=link.remote_epoch, last_seen_unix=link.last_seen, reason=link.reason)
            for link in links
        ])

    @llm_errors
    async def PullKvBlocks(self, request: broker_pb2.PullKvBlocksRequest, context: grpc.aio.ServicerContext
                           ) -> broker_pb2.PullKvBlocksResponse:
        result = await self.node.transfers.transfer_blocks(Direction.PULL, _pull_blocks(request),
                                                           time_remaining(context))
        return _summary(broker_pb2.PullKvBlocksResponse, result)

    async def PullKvBlocksStream(self, request: broker_pb2.PullKvBlocksRequest, context: grpc.aio.ServicerContext
                                 ) -> AsyncIterator[broker_pb2.PullKvBlocksProgress]:
        result: TransferResult | None = None
        # A stream has no RPC span of its own (tracing.trace_rpcs wraps unary calls): its transfer continues the
        # caller's trace itself.
        trace = None if tracing.tracer is None else TraceContext.from_metadata(context.invocation_metadata())
        try:
            async for item in self.node.transfers.pull_blocks_by_layer(_pull_blocks(request),
                                                                       time_remaining(context), trace):
                if isinstance(item, TransferResult):
                    # Held back until the transfer has ended (and been counted DONE): a caller that closes the
                    # stream as soon as it has the result must not turn a finished pull into a CANCELLED one.
                    result = item
                else:
                    yield broker_pb2.PullKvBlocksProgress(layer=item[0], layer_bytes=item[1])
            if result is None:
                fail(LlmStatus.LLM_FAILED, "the layer-wise pull ended without a result")
        except Exception as exc:
            await context.abort_with_status(status_of(exc, "PullKvBlocksStream", context))
            return
        yield broker_pb2.PullKvBlocksProgress(result=_summary(broker_pb2.PullKvBlocksResponse, result))

    async def PullKvBlocksSession(self, request_iterator: AsyncIterator[broker_pb2.PullSessionRequest],
                                  context: grpc.aio.ServicerContext
                                  ) -> AsyncIterator[broker_pb2.PullSessionResponse]:
        # The same gate as every other call of the local API: the socket's permissions (T1); a session adds no
        # per-pull metadata to check.
        if self._pull_sessions >= MAX_PULL_SESSIONS:
            await context.abort_with_status(to_rpc_status(LlmError(
                LlmStatus.LLM_OUT_OF_MEMORY, f"{self._pull_sessions} pull sessions are open (at most "
                f"{MAX_PULL_SESSIONS}); close one or use PullKvBlocks")))
            return
        self._pull_sessions += 1
        try:
            stream_trace = None
            if tracing.tracer is not None:
                stream_trace = TraceContext.from_metadata(context.invocation_metadata())
            session = PullSession(self.node.transfers, _pull_blocks, time_remaining(context),
                                  self.node.max_session_message_pairs, stream_trace)
            async for msg in session.serve(request_iterator):
                yield msg
        except LlmError as err:  # a bound that no completion can answer: the stream ends with it
            await context.abort_with_status(to_rpc_status(err))
        finally:
            self._pull_sessions -= 1

    @llm_errors
    async def PullKvCache(self, request: broker_pb2.PullKvCacheRequest, context: grpc.aio.ServicerContext
                          ) -> broker_pb2.PullKvCacheResponse:
        idx = request.src_cache_index
        req = CacheRequest(remote_cluster_id=idx.cluster_id, remote_cache_id=idx.cache_id,
                           local_cache_id=request.dst_cache_id, src_batch_index=idx.batch_index,
                           dst_batch_index=request.batch_index, size=_size(request.size),
                           layers=_layers(request.ext_param, request.HasField("ext_param")))
        result = await self.node.transfers.transfer_cache(Direction.PULL, req, time_remaining(context))
        return _summary(broker_pb2.PullKvCacheResponse, result)

    @llm_errors
    async def PushKvBlocks(self, request: broker_pb2.PushKvBlocksRequest, context: grpc.aio.ServicerContext
                           ) -> broker_pb2.PushKvBlocksResponse:
        result = await self.node.transfers.transfer_blocks(Direction.PUSH, _push_blocks(request),
                                                           time_remaining(context))
        return _summary(broker_pb2.PushKvBlocksResponse, result)

    @llm_errors
    async def PushKvCache(self, request: broker_pb2.PushKvCacheRequest, context: grpc.aio.ServicerContext
                          ) -> broker_pb2.PushKvCacheResponse:
        idx = request.dst_cache_index
        req = CacheRequest(remote_cluster_id=idx.cluster_id, remote_cache_id=idx.cache_id,
                           local_cache_id=request.src_cache_id, src_batch_index=request.src_batch_index,
                           dst_batch_index=idx.batch_index, size=_size(request.size),
                           layers=_layers(request.ext_param, request.HasField("ext_param")))
        result = await self.node.transfers.transfer_cache(Direction.PUSH, req, time_remaining(context))
        return _summary(broker_pb2.PushKvCacheResponse, result)

    @llm_errors
    async def CopyKvBlocks(self, request: broker_pb2.CopyKvBlocksRequest, context: grpc.aio.ServicerContext
                           ) -> broker_pb2.CopyKvBlocksResponse:
        result = await self.node.transfers.copy_blocks(
            request.src_cache_id, request.dst_cache_id, request.src_blocks,
            [lst.blocks for lst in request.dst_blocks_list], time_remaining(context))
        return _summary(broker_pb2.CopyKvBlocksResponse, result)

    @llm_errors
    async def TransferKvBlocksBatch(self, request: broker_pb2.TransferKvBlocksBatchRequest,
                                    context: grpc.aio.ServicerContext
                                    ) -> broker_pb2.TransferKvBlocksBatchResponse:
        groups: list[tuple[Direction, BlocksRequest]] = []
        for i, group in enumerate(request.groups):
            kind = group.WhichOneof("op")
            if kind == "pull":
                groups.append((Direction.PULL, _pull_blocks(group.pull)))
            elif kind == "push":
                groups.append((Direction.PUSH, _push_blocks(group.push)))
            else:
                fail(LlmStatus.LLM_PARAM_INVALID, f"group {i} is neither a pull nor a push")
        result, backends = await self.node.transfers.transfer_batch(groups, time_remaining(context))
        return broker_pb2.TransferKvBlocksBatchResponse(bytes_moved=result.bytes_moved,
                                                        transfer_id=result.transfer_id, num_runs=result.num_runs,
                                                        backends=backends)

    @llm_errors
    async def SendNotification(self, request: broker_pb2.SendNotificationRequest,
                               context: grpc.aio.ServicerContext) -> broker_pb2.SendNotificationResponse:
        notifications.check(request.topic, request.payload)
        link = self.node.links.get_ready(request.cluster_id)
        remaining = time_remaining(context)
        await link.notify(request.topic, bytes(request.payload), 10.0 if remaining is None else remaining)
        return broker_pb2.SendNotificationResponse()

    @llm_errors
    async def FetchNotifications(self, request: broker_pb2.FetchNotificationsRequest,
                                 context: grpc.aio.ServicerContext) -> broker_pb2.FetchNotificationsResponse:
        wait_s = request.wait_ms / 1000
        remaining = time_remaining(context)
        if remaining is not None:
            wait_s = min(wait_s, max(0.0, remaining - 0.05))  # answer before the caller's deadline
        got = await self.node.notifications.fetch(request.topic, request.max_count, wait_s)
        return broker_pb2.FetchNotificationsResponse(notifications=[
            broker_pb2.Notification(cluster_id=n.cluster_id, topic=n.topic, payload=n.payload,
                                    received_unix=n.received_unix) for n in got])

    @llm_errors
    async def CreateGrant(self, request: broker_pb2.CreateGrantRequest, context: grpc.aio.ServicerContext
                          ) -> broker_pb2.CreateGrantResponse:
        registry = self.node.registry
        grant, secret = self.node.grants.create(
            list(request.cache_ids), list(request.blocks), request.lease_ms, request.max_hold_ms, request.label,
            list(request.event_topics), lambda cache_id: registry.get(cache_id).desc.shape[0],
            request.units_per_block, list(request.view_cache_ids), request.view_units_per_block,
            "" if tracing.tracer is None else _grant_span(request))
        return broker_pb2.CreateGrantResponse(grant=broker_pb2.GrantRef(grant_id=grant.grant_id, secret=secret),
                                              expires_in_ms=grant.expires_in_ms())

    @llm_errors
    async def RenewGrant(self, request: broker_pb2.RenewGrantRequest, context: grpc.aio.ServicerContext
                         ) -> broker_pb2.RenewGrantResponse:
        _check_ref(request.grant)
        grants.lease_of(request.lease_ms, optional=True)
        ref = request.grant
        if request.cluster_id in (0, self.node.cluster_id):
            grant = self.node.grants.renew(ref.grant_id, ref.secret, request.lease_ms)
            return broker_pb2.RenewGrantResponse(expires_in_ms=grant.expires_in_ms())
        link = self.node.links.get_ready(request.cluster_id)
        expires_in_ms = await link.renew_grant(bytes(ref.grant_id), bytes(ref.secret), request.lease_ms,
                                               _peer_timeout(context))
        return broker_pb2.RenewGrantResponse(expires_in_ms=expires_in_ms)

    @llm_errors
    async def ReleaseGrant(self, request: broker_pb2.ReleaseGrantRequest, context: grpc.aio.ServicerContext
                           ) -> broker_pb2.ReleaseGrantResponse:
        _check_ref(request.grant)
        ref = request.grant
        if request.cluster_id in (0, self.node.cluster_id):
            self.node.grants.release(ref.grant_id, ref.secret)
        else:
            await self.node.links.get_ready(request.cluster_id).release_grant(
                bytes(ref.grant_id), bytes(ref.secret), _peer_timeout(context))
        return broker_pb2.ReleaseGrantResponse()


def _peer_timeout(context: grpc.aio.ServicerContext) -> float:
    """A call forwarded to a peer answers within the caller's deadline (or 10 s)."""
    remaining = time_remaining(context)
    return 10.0 if remaining is None else max(0.001, remaining - 0.05)


# Constrained, not bound to Message: each response type's constructor is checked with the summary fields.
_Summary = TypeVar("_Summary", broker_pb2.PullKvBlocksResponse, broker_pb2.PushKvBlocksResponse,
                   broker_pb2.PullKvCacheResponse, broker_pb2.PushKvCacheResponse, broker_pb2.CopyKvBlocksResponse)


def _size(size: int) -> int:
    """0 (unset on the wire) means the whole row, like -1; other negative sizes are refused by the planner."""
    return -1 if size == 0 else size


def _summary(cls: type[_Summary], result: TransferResult) -> _Summary:
    """The four summary fields every transfer response shares."""
    return cls(bytes_moved=result.bytes_moved, backend=result.backend, transfer_id=result.transfer_id,
               num_runs=result.num_runs)


def _pull_blocks(request: broker_pb2.PullKvBlocksRequest) -> BlocksRequest:
    idx = request.src_cache_index
    grant = _claim(request.grant) if request.HasField("grant") else None
    return BlocksRequest(remote_cluster_id=idx.cluster_id, remote_cache_id=idx.cache_id,
                         remote_batch_index=idx.batch_index, local_cache_id=request.dst_cache_id,
                         pairs=_block_pairs(request, sourced_by_grant=grant is not None),
                         layers=_layers(request.ext_param, request.HasField("ext_param")), grant=grant)


def _claim(msg: broker_pb2.GrantClaim) -> GrantClaim:
    _check_ref(msg.grant)
    return GrantClaim(bytes(msg.grant.grant_id), bytes(msg.grant.secret), msg.cache_slot, msg.first_block)


def _check_ref(ref: broker_pb2.GrantRef) -> None:
    # Checked here, so that a malformed grant is the caller's LLM_PARAM_INVALID, never a peer's refusal.
    if len(ref.grant_id) != grants.ID_BYTES or len(ref.secret) != grants.SECRET_BYTES:
        fail(LlmStatus.LLM_PARAM_INVALID, f"a grant is a {grants.ID_BYTES}-byte id and a {grants.SECRET_BYTES}-byte "
             "secret")


def _block_pairs(request: broker_pb2.PullKvBlocksRequest | broker_pb2.PushKvBlocksRequest,
                 sourced_by_grant: bool = False) -> BlockPairs:
    """The request's pairs, as lists or as runs (kept as runs: nothing downstream writes them out unless it must).
    A pull by a grant may name only destination blocks: the grant's blocks in order are their sources."""
    try:
        runs = cv.block_runs_from_pb(request)
    except blockruns.RunsError as e:
        fail(LlmStatus.LLM_PARAM_INVALID, str(e))
    if runs is not None:
        return BlockPairs.of_runs(runs)
    if sourced_by_grant and not len(request.src_blocks):
        return BlockPairs.unsourced(request.dst_blocks)
    return BlockPairs.listed(request.src_blocks, request.dst_blocks)


def _push_blocks(request: broker_pb2.PushKvBlocksRequest) -> BlocksRequest:
    idx = request.dst_cache_index
    return BlocksRequest(remote_cluster_id=idx.cluster_id, remote_cache_id=idx.cache_id,
                         remote_batch_index=idx.batch_index, local_cache_id=request.src_cache_id,
                         pairs=_block_pairs(request), layers=_layers(request.ext_param, request.HasField("ext_param")))


def _timeout(timeout_ms: int, context: grpc.aio.ServicerContext) -> float:
    """Per-handshake timeout, kept inside the call's own deadline so that results get back in time."""
    remaining = time_remaining(context)
    timeout = timeout_ms / 1000 if timeout_ms else DEFAULT_LINK_TIMEOUT_S
    return timeout if remaining is None else max(0.001, min(timeout, remaining - 0.1))


def _check_caller_waits(context: grpc.aio.ServicerContext, what: str) -> None:
    """Refuses work that makes a cache when the caller's deadline has already passed: it could not learn the id."""
    if time_remaining(context) == 0.0:
        fail(LlmStatus.LLM_TIMEOUT, f"{what}: the call's deadline passed before it started")


def _wait(context: grpc.aio.ServicerContext) -> float:
    """How long a release may wait for transfers using the cache: at most 10 s, and short of the caller's deadline
    so that the caller hears LLM_LINK_BUSY rather than a bare timeout."""
    remaining = time_remaining(context)
    if remaining is None:
        return 10.0
    return max(0.0, min(10.0, remaining - min(0.1, remaining * 0.2)))



def _grant_span(request: broker_pb2.CreateGrantRequest) -> str:
    """The traceparent of the span CreateGrant runs under (its RPC's), described for operators; "" if none."""
    span = tracing.current_span()
    if span is None:
        return ""
    span.set_attributes({"kvbroker.blocks": len(request.blocks), "kvbroker.caches": len(request.cache_ids),
                         "kvbroker.grant_label": request.label[:tracing.MAX_ATTRIBUTE_CHARS]})
    return tracing.traceparent_of(span)
