"""A failed transfer ends within its deadline with the right status and leaves the daemon healthy."""

from __future__ import annotations

import concurrent.futures
import signal
import time
from pathlib import Path

import pytest

from kvbroker import CacheDesc, CacheIndex, DataType, LayerLanded, LinkState, LlmError, LlmStatus, PullBlocks
from kvbroker._local import LocalDaemon
from tests.conftest import cluster_of
from tests.helpers import fill

DESC = CacheDesc(num_tensors=2, shape=(256, 64 << 10), data_type=DataType.UINT8)  # 32 MiB
BLOCKS = list(range(256))


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
            with dst.client() as d:
                t0 = time.monotonic()
                with pytest.raises(LlmError) as info:
                    d.pull_kv_blocks(CacheIndex(1, src_id), dst_id, BLOCKS, BLOCKS, timeout=1.0)
                elapsed = time.monotonic() - t0
            assert info.value.status == LlmStatus.LLM_TIMEOUT
            assert info.value.failed_dst_blocks == BLOCKS  # the frozen peer sent nothing
            assert elapsed < 1.0 + 1.5, f"took {elapsed:.2f} s for a 1 s deadline"
        finally:
            src.signal(signal.SIGCONT)
        _assert_healthy(dst, tmp_path)
        # The peer is back: the link is (or soon becomes) READY by itself and pulls work again.
        with dst.client() as d:
            deadline = time.monotonic() + 10
            while d.list_links()[0].state != LinkState.READY and time.monotonic() < deadline:
                time.sleep(0.2)
            assert d.list_links()[0].state == LinkState.READY
            assert d.pull_kv_blocks(CacheIndex(1, src_id), dst_id, BLOCKS, BLOCKS).bytes_moved == 32 << 20


def test_peer_killed_mid_transfer_gives_link_failed(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst:
        src_id, dst_id = _setup(src, dst)
        src.signal(signal.SIGSTOP)  # the pull starts and then waits on the frozen peer...
        with dst.client() as d, concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(d.pull_kv_blocks, CacheIndex(1, src_id), dst_id, BLOCKS, BLOCKS, timeout=20.0)
            time.sleep(0.5)
            t0 = time.monotonic()
            src.signal(signal.SIGKILL)  # ...until the kernel resets its connections
            with pytest.raises(LlmError) as info:
                pending.result()
            assert time.monotonic() - t0 < 5.0
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
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as remote, LocalDaemon(tmp_path, 2, backends=("tcp",)) as local:
        remote_id, local_id = _setup(remote, local)
        remote.signal(signal.SIGSTOP)
        with local.client() as d, concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(d.push_kv_blocks, local_id, CacheIndex(1, remote_id), BLOCKS, BLOCKS, timeout=20.0)
            time.sleep(0.5)
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
                t0 = time.monotonic()
                with pytest.raises(LlmError) as info:
                    d.pull_kv_blocks(CacheIndex(1, src_id), dst_id, [3], [4], timeout=1.0)
                assert time.monotonic() - t0 < 2.5
                assert info.value.status == LlmStatus.LLM_TIMEOUT and info.value.failed_dst_blocks == [4]
                assert d.get_cluster_info().cluster_id == 2  # the loop was never blocked
        finally:
            src.signal(signal.SIGCONT)


async def test_a_caller_that_cancels_cancels_its_transfer(tmp_path: Path) -> None:
    """The caller gives up (cancels its call): the daemon stops waiting on the frozen peer at once instead of
    holding the transfer until its 60 s deadline."""
    import asyncio
    import urllib.request

    from kvbroker import AsyncClient

    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, \
            LocalDaemon(tmp_path, 2, backends=("tcp",), extra_args=["--metrics-listen", "127.0.0.1:0"]) as dst:
        src_id, dst_id = _setup(src, dst)
        with dst.client() as d:
            metrics_at = d.get_cluster_info().metrics_address

        def in_flight() -> float:
            with urllib.request.urlopen(f"http://{metrics_at}/metrics", timeout=5) as resp:
                lines = resp.read().decode().splitlines()
            return float(next(x for x in lines if x.startswith("kvbroker_transfers_in_flight ")).split()[1])

        src.signal(signal.SIGSTOP)
        try:
            async with AsyncClient(dst.target, timeout=60) as client:
                pull = asyncio.ensure_future(client.pull_kv_blocks(CacheIndex(1, src_id), dst_id, BLOCKS, BLOCKS))
                await asyncio.sleep(0.5)
                assert in_flight() == 1
                pull.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pull
            for _ in range(50):  # polling a remote daemon's state: there is no event to wait on
                if in_flight() == 0:
                    break
                await asyncio.sleep(0.1)
            assert in_flight() == 0
        finally:
            src.signal(signal.SIGCONT)
        with dst.client() as d:  # and the link is not blamed for it
            assert d.list_links()[0].state == LinkState.READY
            assert d.pull_kv_blocks(CacheIndex(1, src_id), dst_id, BLOCKS, BLOCKS).bytes_moved == 32 << 20


def test_a_large_failure_report_reaches_the_caller(tmp_path: Path) -> None:
    """The report of a failed pull travels in the status details (trailing metadata): for 32,768 scattered blocks it
    is ~100 KB, far over gRPC's default 16 KiB metadata limit. The caller gets the transfer's own status and every
    failed block, not a RESOURCE_EXHAUSTED from its own channel (that read as LLM_OUT_OF_MEMORY)."""
    import numpy as np

    n = 1 << 15
    desc = CacheDesc(num_tensors=2, shape=(n, 32), data_type=DataType.UINT8)
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst, \
            src.client() as s, dst.client() as d:
        a, b = s.allocate_cache(desc), d.allocate_cache(desc)
        assert d.link_clusters([cluster_of(src)])[0].ok
        d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [0], [0])  # warm: cache lookup + connections
        rng = np.random.default_rng(3)
        src_blocks, dst_blocks = rng.permutation(n).tolist(), rng.permutation(n).tolist()
        src.signal(signal.SIGSTOP)
        try:
            with pytest.raises(LlmError) as info:
                d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, src_blocks, dst_blocks, timeout=3.0)
        finally:
            src.signal(signal.SIGCONT)
        assert info.value.status == LlmStatus.LLM_TIMEOUT, info.value
        assert info.value.failed_dst_blocks == list(range(n))  # the frozen peer sent nothing
