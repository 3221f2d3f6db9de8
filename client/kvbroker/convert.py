"""Conversions between the public value types (`kvbroker.types`) and their protobuf messages (`kvbroker.v1`).

Shared with the daemon (`kvbrokerd`), so that both ends of the wire convert the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbroker import blockruns
from kvbroker.status import LlmStatus
from kvbroker.types import (
    CacheDesc,
    CacheIndex,
    CacheRecord,
    ClusterInfo,
    ClusterResult,
    ClusterStatus,
    DataType,
    DeviceMemory,
    KvCacheExtParam,
    LinkInfo,
    LinkState,
    Placement,
    TensorLocation,
    TransferResult,
)
from kvbroker.v1 import broker_pb2, types_pb2


def desc_to_pb(desc: CacheDesc) -> types_pb2.CacheDesc:
    return types_pb2.CacheDesc(
        num_tensors=desc.num_tensors,
        data_type=int(desc.data_type),  # type: ignore[arg-type]
        shape=list(desc.shape),
        placement=int(desc.placement),  # type: ignore[arg-type]
        layout_tag=desc.layout_tag,
    )


def desc_from_pb(msg: types_pb2.CacheDesc) -> CacheDesc:
    """Trusts `msg` to come from a daemon that validated it; the daemon validates client input itself."""
    return CacheDesc(
        num_tensors=msg.num_tensors,
        shape=tuple(msg.shape),
        data_type=DataType(msg.data_type),
        placement=Placement(msg.placement or Placement.HOST),
        layout_tag=msg.layout_tag,
    )


def cache_index_to_pb(index: CacheIndex) -> types_pb2.CacheIndex:
    return types_pb2.CacheIndex(cluster_id=index.cluster_id, cache_id=index.cache_id, batch_index=index.batch_index)


def ext_param_to_pb(ext: KvCacheExtParam | None) -> types_pb2.KvCacheExtParam | None:
    if ext is None:
        return None
    return types_pb2.KvCacheExtParam(
        src_layer_range=types_pb2.LayerRange(first=ext.src_layer_range[0], second=ext.src_layer_range[1]),
        dst_layer_range=types_pb2.LayerRange(first=ext.dst_layer_range[0], second=ext.dst_layer_range[1]),
        tensor_num_per_layer=ext.tensor_num_per_layer,
    )


def tensor_location_to_pb(loc: TensorLocation) -> types_pb2.TensorLocation:
    msg = types_pb2.TensorLocation(segment=loc.segment, offset=loc.offset)
    if loc.device is not None:
        d = loc.device
        msg.device.CopyFrom(types_pb2.DeviceMemory(kind=d.kind, device=d.device, ipc_handle=d.ipc_handle,
                                                   allocation_bytes=d.allocation_bytes))
    return msg


def tensor_location_from_pb(msg: types_pb2.TensorLocation) -> TensorLocation:
    device = None
    if msg.HasField("device"):
        d = msg.device
        device = DeviceMemory(d.kind, d.device, bytes(d.ipc_handle), d.allocation_bytes)
    return TensorLocation(msg.segment, msg.offset, device)


def cache_record_from_pb(msg: broker_pb2.CacheInfo) -> CacheRecord:
    return CacheRecord(
        cache_id=msg.cache_id,
        desc=desc_from_pb(msg.desc),
        tensors=tuple(tensor_location_from_pb(t) for t in msg.tensors),
        shm_dir=msg.shm_dir,
        daemon_owned=msg.daemon_owned,
        owner=msg.owner,
        lease_expires_unix=msg.lease_expires_unix,
    )


def cluster_info_to_pb(info: ClusterInfo) -> broker_pb2.ClusterInfo:
    return broker_pb2.ClusterInfo(remote_cluster_id=info.remote_cluster_id, remote_address=info.remote_address)


def cluster_result_from_pb(msg: broker_pb2.ClusterResult) -> ClusterResult:
    try:
        status = LlmStatus(msg.status_code)
    except ValueError:
        status = LlmStatus.LLM_FAILED
    return ClusterResult(remote_cluster_id=msg.remote_cluster_id, status=status, message=msg.message)


def link_info_from_pb(msg: broker_pb2.LinkInfo) -> LinkInfo:
    return LinkInfo(
        remote_cluster_id=msg.remote_cluster_id,
        remote_address=msg.remote_address,
        state=LinkState(msg.state),
        backend=msg.backend,
        remote_epoch=msg.remote_epoch,
        last_seen_unix=msg.last_seen_unix,
        reason=msg.reason,
    )


def cluster_status_from_pb(msg: broker_pb2.GetClusterInfoResponse) -> ClusterStatus:
    return ClusterStatus(
        cluster_id=msg.cluster_id,
        version=msg.version,
        peer_address=msg.peer_address,
        backends=tuple(msg.backends),
        instance_epoch=msg.instance_epoch,
        num_caches=msg.num_caches,
        num_links=msg.num_links,
        protocol_version=msg.protocol_version,
        metrics_address=msg.metrics_address,
        features=tuple(msg.features),
    )


def transfer_result_from_pb(msg: Any) -> TransferResult:
    """From any transfer response (they share bytes_moved, backend, transfer_id, num_runs)."""
    return TransferResult(
        bytes_moved=msg.bytes_moved, backend=msg.backend, transfer_id=msg.transfer_id, num_runs=msg.num_runs
    )


def blocks_to_runs(blocks: Any) -> np.ndarray:
    """Block indices, in their order, as flattened (first, count) pairs of ascending runs: [5, 6, 7, 2] becomes
    [5, 3, 2, 1]. Shorter on the wire whenever runs are longer than two blocks on average."""
    b = np.asarray(blocks, dtype=np.uint64).reshape(-1)
    if not len(b):
        return np.zeros(0, dtype=np.uint64)
    nxt, prev = b[1:], b[:-1]
    starts = np.concatenate(([0], np.flatnonzero((nxt <= prev) | (nxt - prev != 1)) + 1))
    counts = np.diff(np.concatenate((starts, [len(b)])))
    return np.column_stack((b[starts], counts.astype(np.uint64))).reshape(-1)


def runs_to_blocks(runs: Any) -> np.ndarray:
    """The inverse of `blocks_to_runs`; ValueError for an odd number of values."""
    r = np.asarray(runs, dtype=np.uint64).reshape(-1)
    if len(r) % 2:
        raise ValueError(f"block runs come in (first, count) pairs, got {len(r)} values")
    firsts, counts = r[0::2], r[1::2].astype(np.int64)
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(firsts, counts) + offsets.astype(np.uint64)


def set_block_pairs(req: broker_pb2.PullKvBlocksRequest | broker_pb2.PushKvBlocksRequest,
                    src_blocks: Sequence[int] | np.ndarray, dst_blocks: Sequence[int] | np.ndarray,
                    runs: blockruns.Runs | None = None) -> None:
    """Long, mostly consecutive lists go as `block_runs`; others as the plain lists (the daemon checks them). Given
    `runs` (the caller knows its pairs' structure), they go as they are and the lists must be empty."""
    if runs is not None:
        if len(src_blocks) or len(dst_blocks):
            raise ValueError("give either block runs or src_blocks and dst_blocks, not both")
    else:
        runs = blockruns.find(src_blocks, dst_blocks)
    if runs is None:
        req.src_blocks.extend(_ints(src_blocks))
        req.dst_blocks.extend(_ints(dst_blocks))
        return
    out = req.block_runs
    out.src_first.extend(runs.src_first.tolist())
    out.dst_first.extend(runs.dst_first.tolist())
    out.length.extend(runs.length.tolist())
    if bool((runs.count != 1).any()):
        out.count.extend(runs.count.tolist())
        out.src_stride.extend(runs.src_stride.tolist())
        out.dst_stride.extend(runs.dst_stride.tolist())


def block_runs_from_pb(req: broker_pb2.PullKvBlocksRequest | broker_pb2.PushKvBlocksRequest
                       ) -> blockruns.Runs | None:
    """A request's checked `block_runs` (None: it has none). RunsError: malformed runs, or both forms set."""
    if not req.HasField("block_runs"):
        return None
    if len(req.src_blocks) or len(req.dst_blocks):
        raise blockruns.RunsError("set either block_runs or src_blocks and dst_blocks, not both")
    r = req.block_runs
    return blockruns.check(r.src_first, r.dst_first, r.length, r.count, r.src_stride, r.dst_stride)


def block_pairs_from_pb(req: broker_pb2.PullKvBlocksRequest | broker_pb2.PushKvBlocksRequest
                        ) -> tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray]:
    """(src_blocks, dst_blocks) of a request in either form. RunsError: malformed runs, or both forms set."""
    runs = block_runs_from_pb(req)
    return (req.src_blocks, req.dst_blocks) if runs is None else blockruns.expand(runs)


def _ints(blocks: Sequence[int] | np.ndarray) -> list[int]:
    if isinstance(blocks, np.ndarray):
        return blocks.tolist()  # type: ignore[no-any-return]
    return [int(b) for b in blocks]
