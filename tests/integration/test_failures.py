"""A failed transfer ends within its deadline with the right status and leaves the daemon healthy."""

from __future__ import annotations

import concurrent.futures
import signal
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvbroker import CacheDesc, CacheIndex, DataType, LayerLanded, LinkState, LlmError, LlmStatus, PullBlocks
from kvbroker._errors import error_from_rpc
from kvbroker._local import LocalDaemon
from kvbroker.v1 import broker_pb2, broker_pb2_grpc, types_pb2
from tests.conftest import cluster_of
from tests.helpers import fill, transfers_in_flight, wait_until, wait_until_async

DESC = CacheDesc(num_tensors=2, shape=(256, 64 << 10), data_type=DataType.UINT8)  # 32 MiB
BLOCKS = list(range(256))
METRICS = ["--metrics-listen", "127.0.0.1:0"]
"""For a daemon whose transfers in flight a test waits on."""


def _setup(src: LocalDaemon, dst: LocalDaemon) -> tuple[int, int]:
    with src.client() as s, dst.client() as d:
        a, b = s.allocate_cache(DESC), d.allocate_cache(DESC)
        fill(a, 1)
        assert d.link_clusters([cluster_of(src)])[0].ok
        d.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, BLOCKS, BLOCKS)  # warm: lookup + connections
        return a.cache_id, b.cache_id


def _assert_healthy(dst: LocalDaemon, tmp_path: Path) -> None:
    """The daemon still serves: a fresh peer links and a pull from it succeeds."""
    with LocalDaemon(tmp_path, 9, backends=("tcp",)) as other, other.client() as o, dst.client() as d:
        assert d.get_cluster_info().cluster_id == dst.cluster_id
        assert d.link_clusters([cluster_of(other)])[0].ok
        src = o.allocate_cache(CacheDesc(num_tensors=2, shape=(4, 16)))
        dst_cache = d.allocate_cache(CacheDesc(num_tensors=2, shape=(4, 16)))
        assert d.pull_kv_blocks(CacheIndex(9, src.cache_id), dst_cache, [0], [1]).bytes_moved == 2 * 16 * 2


def test_hung_peer_gives_timeout_within_the_deadline(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst:
        src_id, dst_id = _setup(src, dst)
        src.signal(signal.SIGSTOP)
        try:
            with dst.client() as d, pytest.raises(LlmError) as info:
                d.pull_kv_blocks(CacheIndex(1, src_id), dst_id, BLOCKS, BLOCKS, timeout=1.0)
            # Within the deadline: this is the daemon's own answer (its transfer report lists the blocks). Had it
            # answered after the call's 1 s gRPC deadline, the caller would hold a bare DEADLINE_EXCEEDED, no report.
            assert info.value.status == LlmStatus.LLM_TIMEOUT
            assert info.value.failed_dst_blocks == BLOCKS  # the frozen peer sent nothing
        finally:
            src.signal(signal.SIGCONT)
        _assert_healthy(dst, tmp_path)
        # The peer is back: the link is (or soon becomes) READY by itself and pulls work again.
        with dst.client() as d:
            wait_until(lambda: d.list_links()[0].state == LinkState.READY, timeout=10, what="the link READY again")
            assert d.pull_kv_blocks(CacheIndex(1, src_id), dst_id, BLOCKS, BLOCKS).bytes_moved == 32 << 20


def test_peer_killed_mid_transfer_gives_link_failed(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, \
            LocalDaemon(tmp_path, 2, backends=("tcp",), extra_args=METRICS) as dst:
        src_id, dst_id = _setup(src, dst)
        src.signal(signal.SIGSTOP)  # the pull starts and then waits on the frozen peer...
        with dst.client() as d, concurrent.futures.ThreadPoolExecutor(1) as pool:
            metrics_at = d.get_cluster_info().metrics_address
            pending = pool.submit(d.pull_kv_blocks, CacheIndex(1, src_id), dst_id, BLOCKS, BLOCKS, timeout=20.0)
            wait_until(lambda: transfers_in_flight(metrics_at) == 1, what="the pull running")
            src.signal(signal.SIGKILL)  # ...until the kernel resets its connections
            with pytest.raises(LlmError) as info:
                pending.result()
        # Ended by the kill, not waited out: a pull that sat out its 20 s deadline would end in LLM_TIMEOUT.
        assert info.value.status == LlmStatus.LLM_LINK_FAILED
        assert info.value.details.get("backend") == "tcp" and info.value.details.get("transfer_id")
        failed = info.value.failed_dst_blocks
        assert failed is not None and 0 < len(failed) <= len(BLOCKS) and set(failed) <= set(BLOCKS)
        with dst.client() as d:
            [link] = d.list_links()
            assert link.state == LinkState.BROKEN
        _assert_healthy(dst, tmp_path)


def test_layer_stream_failure_reports_completed_layers(tmp_path: Path) -> None:
    """The source dies after the first layer landed: the error says which layers landed and that every requested
    block still misses the later layers."""
    big = CacheDesc(num_tensors=8, shape=(64, 1 << 20), data_type=DataType.UINT8)  # 4 layers x 128 MiB
    blocks = list(range(64))
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst, \
            src.client() as s, dst.client(timeout=60) as d:
        a, b = s.allocate_cache(big), d.allocate_cache(big)
        assert d.link_clusters([cluster_of(src)])[0].ok
        landed: list[int] = []

        def on_layer(item: LayerLanded) -> None:
            landed.append(item.layer)
            if item.layer == 0:
                src.signal(signal.SIGKILL)

        with pytest.raises(LlmError) as info:
            d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, blocks, blocks, on_layer=on_layer)
        assert info.value.status in (LlmStatus.LLM_LINK_FAILED, LlmStatus.LLM_TIMEOUT)
        report = info.value.details["transfer_report"]
        assert list(report.completed_layers) == landed and landed[0] == 0 and 3 not in landed
        assert info.value.failed_dst_blocks == blocks


def test_batch_failure_reports_each_group(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as frozen, LocalDaemon(tmp_path, 3, backends=("tcp",)) as ok, \
            LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst:
        frozen_id, dst_id = _setup(frozen, dst)
        with ok.client() as o, dst.client() as d:
            good = o.allocate_cache(DESC)
            fill(good, 3)
            assert d.link_clusters([cluster_of(ok)])[0].ok
            d.pull_kv_blocks(CacheIndex(3, good.cache_id), dst_id, [0], [0])  # warm the cache lookup
            other = d.allocate_cache(DESC)
            frozen.signal(signal.SIGSTOP)
            try:
                with pytest.raises(LlmError) as info:
                    d.transfer_kv_blocks_batch([
                        PullBlocks(CacheIndex(1, frozen_id), dst_id, tuple(BLOCKS), tuple(BLOCKS)),
                        PullBlocks(CacheIndex(3, good.cache_id), other.cache_id, (1, 2), (3, 4)),
                    ], timeout=1.0)
            finally:
                frozen.signal(signal.SIGCONT)
            assert info.value.status == LlmStatus.LLM_TIMEOUT
            groups = info.value.details["transfer_report"].groups
            assert [g.done for g in groups] == [False, True]
            assert list(groups[0].failed_dst_blocks) == BLOCKS and list(groups[1].failed_dst_blocks) == []
            assert (other.tensors[0][3:5].view("u1") == good.tensors[0][1:3].view("u1")).all()


def test_push_to_a_killed_peer_gives_link_failed(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as remote, \
            LocalDaemon(tmp_path, 2, backends=("tcp",), extra_args=METRICS) as local:
        remote_id, local_id = _setup(remote, local)
        remote.signal(signal.SIGSTOP)
        with local.client() as d, concurrent.futures.ThreadPoolExecutor(1) as pool:
            metrics_at = d.get_cluster_info().metrics_address
            pending = pool.submit(d.push_kv_blocks, local_id, CacheIndex(1, remote_id), BLOCKS, BLOCKS, timeout=20.0)
            wait_until(lambda: transfers_in_flight(metrics_at) == 1, what="the push running")
            remote.signal(signal.SIGKILL)
            with pytest.raises(LlmError) as info:
                pending.result()
        assert info.value.status == LlmStatus.LLM_LINK_FAILED
        assert info.value.failed_dst_blocks  # the remote's blocks that may hold partial data
        _assert_healthy(local, tmp_path)


def test_small_pull_from_a_hung_peer_times_out_on_the_event_loop_path(tmp_path: Path) -> None:
    """Small tcp pulls run on the event loop (no worker thread): they honour the deadline the same way."""
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst:
        src_id, dst_id = _setup(src, dst)
        src.signal(signal.SIGSTOP)
        try:
            with dst.client() as d:
                with pytest.raises(LlmError) as info:
                    d.pull_kv_blocks(CacheIndex(1, src_id), dst_id, [3], [4], timeout=1.0)
                # The daemon's own deadline error (with its report), hence within the call's 1 s gRPC deadline.
                assert info.value.status == LlmStatus.LLM_TIMEOUT and info.value.failed_dst_blocks == [4]
                assert d.get_cluster_info().cluster_id == 2  # the loop was never blocked
        finally:
            src.signal(signal.SIGCONT)



def test_a_failure_listing_40k_scattered_blocks_reaches_the_caller(tmp_path: Path) -> None:
    """Listing ~40k scattered blocks takes ~120 KB, far over gRPC's default 16 KiB metadata limit: the caller used to
    get RESOURCE_EXHAUSTED instead of the LLM status. The client now receives the whole list; a caller that does not
    say how much it accepts (any other gRPC client) gets the status, with the block lists left out and flagged."""
    gaps = np.random.default_rng(7).integers(2, 6, size=40_000)  # never two adjacent blocks: no run is longer than 1
    blocks = (np.cumsum(gaps) - 2).tolist()
    scattered = CacheDesc(num_tensors=2, shape=(blocks[-1] + 1, 32), data_type=DataType.UINT8)
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst, \
            src.client() as s, dst.client() as d:
        a, b = s.allocate_cache(scattered), d.allocate_cache(scattered)
        assert d.link_clusters([cluster_of(src)])[0].ok
        index = CacheIndex(1, a.cache_id)
        d.pull_kv_blocks(index, b, [0], [0])  # warm: the lookup of the source cache
        src.signal(signal.SIGSTOP)
        try:
            with pytest.raises(LlmError) as info:
                d.pull_kv_blocks(index, b, blocks, blocks, timeout=1.0)
            assert info.value.status == LlmStatus.LLM_TIMEOUT
            assert info.value.failed_dst_blocks == blocks

            with grpc.insecure_channel(dst.target) as channel, pytest.raises(grpc.RpcError) as raw:
                request = broker_pb2.PullKvBlocksRequest(
                    src_cache_index=types_pb2.CacheIndex(cluster_id=1, cache_id=a.cache_id),
                    dst_cache_id=b.cache_id, src_blocks=blocks, dst_blocks=blocks)
                broker_pb2_grpc.KvBrokerStub(channel).PullKvBlocks(request, timeout=1.0)
            err = raw.value
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
            assert err.details().startswith("LLM_TIMEOUT: ")
            report = error_from_rpc(err).details["transfer_report"]
            assert report.block_lists_omitted and not report.failed_dst_blocks
        finally:
            src.signal(signal.SIGCONT)
        assert d.pull_kv_blocks(index, b, blocks[:4], blocks[:4]).bytes_moved == 4 * 2 * 32


async def test_a_caller_that_cancels_cancels_its_transfer(tmp_path: Path) -> None:
    """The caller gives up (cancels its call): the daemon stops waiting on the frozen peer at once instead of
    holding the transfer until its 60 s deadline."""
    import asyncio

    from kvbroker import AsyncClient

    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, \
            LocalDaemon(tmp_path, 2, backends=("tcp",), extra_args=["--metrics-listen", "127.0.0.1:0"]) as dst:
        src_id, dst_id = _setup(src, dst)
        with dst.client() as d:
            metrics_at = d.get_cluster_info().metrics_address

        def in_flight() -> float:
            return transfers_in_flight(metrics_at)

        src.signal(signal.SIGSTOP)
        try:
            async with AsyncClient(dst.target, timeout=60) as client:
                pull = asyncio.ensure_future(client.pull_kv_blocks(CacheIndex(1, src_id), dst_id, BLOCKS, BLOCKS))
                await wait_until_async(lambda: in_flight() == 1, what="the pull running")
                pull.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pull
            # Polling a remote daemon's state: there is no event to wait on. Well short of the 60 s deadline.
            await wait_until_async(lambda: in_flight() == 0, timeout=5, what="the cancelled transfer ended")
        finally:
            src.signal(signal.SIGCONT)
        with dst.client() as d:  # and the link is not blamed for it
            assert d.list_links()[0].state == LinkState.READY
            assert d.pull_kv_blocks(CacheIndex(1, src_id), dst_id, BLOCKS, BLOCKS).bytes_moved == 32 << 20


def test_the_daemon_answers_by_the_budget_the_caller_states(tmp_path: Path) -> None:
    """kvbroker's client states each call's budget (`kvbroker-timeout-ms`) and waits a grace longer than it: the
    daemon answers by the budget, with its report, however much later the call's gRPC deadline is. Without the header
    (any other gRPC client) the gRPC deadline is the budget."""
    desc = CacheDesc(num_tensors=2, shape=(8, 64), data_type=DataType.UINT8)
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst, \
            src.client() as s, dst.client() as d:
        a, b = s.allocate_cache(desc), d.allocate_cache(desc)
        assert d.link_clusters([cluster_of(src)])[0].ok
        d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [0], [0])  # warm: the lookup of the source cache
        src.signal(signal.SIGSTOP)  # the pull can only end at its budget
        try:
            request = broker_pb2.PullKvBlocksRequest(
                src_cache_index=types_pb2.CacheIndex(cluster_id=1, cache_id=a.cache_id), dst_cache_id=b.cache_id,
                src_blocks=[1, 2], dst_blocks=[1, 2])
            with grpc.insecure_channel(dst.target) as channel:
                call = broker_pb2_grpc.KvBrokerStub(channel).PullKvBlocks.with_call
                with pytest.raises(grpc.RpcError) as raw:  # a 60 s gRPC deadline; a stated budget of 0.5 s
                    call(request, timeout=60, metadata=(("kvbroker-timeout-ms", "500"),))
            err = raw.value
            # the daemon's own answer (a gRPC deadline would say "Deadline Exceeded"), with its report: had it
            # ignored the header, the call would still be waiting
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and err.details().startswith("LLM_TIMEOUT: "), err
            assert error_from_rpc(err).failed_dst_blocks == [1, 2]
            with pytest.raises(LlmError) as info:  # the client: the same answer, through its own grace
                d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [3], [3], timeout=0.5)
            assert info.value.status == LlmStatus.LLM_TIMEOUT and info.value.failed_dst_blocks == [3]
        finally:
            src.signal(signal.SIGCONT)
