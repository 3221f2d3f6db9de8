"""Link lifecycle between real daemons: link, double link, unlink, pull after unlink, unreachable or wrong peers."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbroker import CacheDesc, CacheIndex, ClusterInfo, LinkState, LlmError, LlmStatus, NotYetLinkError
from kvbroker._local import LocalDaemon
from tests.conftest import cluster_of
from tests.helpers import wait_until, wait_until_async


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[LocalDaemon, LocalDaemon]]:
    with LocalDaemon(tmp_path, 1) as a, LocalDaemon(tmp_path, 2) as b:
        yield a, b


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_link_double_link_unlink_and_pull_after_unlink(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    a, b = pair
    desc = CacheDesc(num_tensors=2, shape=(4, 8))
    with a.client() as ca, b.client() as cb:
        src, dst = ca.allocate_cache(desc), cb.allocate_cache(desc)
        [first] = cb.link_clusters([cluster_of(a)])
        assert first.ok and first.status == LlmStatus.LLM_SUCCESS
        [again] = cb.link_clusters([cluster_of(a)])
        assert again.status == LlmStatus.LLM_ALREADY_LINK
        [link] = cb.list_links()
        assert link.remote_cluster_id == 1 and link.state == LinkState.READY and link.backend == "shm"
        assert link.remote_epoch == ca.get_cluster_info().instance_epoch
        cb.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, [0], [1])
        [gone] = cb.unlink_clusters([cluster_of(a)])
        assert gone.ok
        assert cb.list_links() == []
        with pytest.raises(NotYetLinkError) as info:
            cb.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, [0], [1])
        assert info.value.details["grpc_code"] == "FAILED_PRECONDITION"
        [twice] = cb.unlink_clusters([cluster_of(a)])
        assert twice.status == LlmStatus.LLM_NOT_YET_LINK
        [relink] = cb.link_clusters([cluster_of(a)])
        assert relink.ok
        cb.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, [0], [1])


def test_unreachable_peer_fails_within_timeout(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    _, b = pair
    with b.client() as cb:
        [result] = cb.link_clusters([ClusterInfo(9, f"127.0.0.1:{_free_port()}")], timeout=1.0)
        assert result.status == LlmStatus.LLM_LINK_FAILED and "9" in result.message
        assert cb.list_links() == []


def test_peer_with_another_cluster_id_is_refused(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    a, b = pair
    with b.client() as cb:
        [result] = cb.link_clusters([ClusterInfo(7, a.peer_address)])
        assert result.status == LlmStatus.LLM_LINK_FAILED
        # It says which id it expected, and never which id the peer really has (that is the peer's to hide).
        assert "is not cluster 7" in result.message and f"cluster {a.cluster_id}" not in result.message


def test_linking_to_own_cluster_id_is_refused(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    a, b = pair
    with b.client() as cb:
        [result] = cb.link_clusters([ClusterInfo(2, a.peer_address)])
        assert result.status == LlmStatus.LLM_PARAM_INVALID


def test_per_cluster_results_in_request_order(pair: tuple[LocalDaemon, LocalDaemon]) -> None:
    a, b = pair
    with b.client() as cb:
        results = cb.link_clusters([ClusterInfo(5, f"127.0.0.1:{_free_port()}"), cluster_of(a)], timeout=1.0)
        assert [r.remote_cluster_id for r in results] == [5, 1]
        assert [r.status for r in results] == [LlmStatus.LLM_LINK_FAILED, LlmStatus.LLM_SUCCESS]


def test_force_unlink_of_a_dead_peer(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 2) as b:
        a = LocalDaemon(tmp_path, 1).start()
        with b.client() as cb:
            assert cb.link_clusters([cluster_of(a)])[0].ok
            a.stop()
            [soft] = cb.unlink_clusters([cluster_of(a)], timeout=0.5)
            assert soft.status == LlmStatus.LLM_UNLINK_FAILED
            [hard] = cb.unlink_clusters([cluster_of(a)], force=True, timeout=0.5)
            assert hard.ok
            assert cb.list_links() == []


def test_peer_death_breaks_the_link(tmp_path: Path) -> None:
    """A stopped peer stops answering heartbeats: the link turns BROKEN and transfers say so."""
    with LocalDaemon(tmp_path, 2) as b:
        a = LocalDaemon(tmp_path, 1).start()
        with b.client() as cb:
            assert cb.link_clusters([cluster_of(a)])[0].ok
            a.stop()
            wait_until(lambda: cb.list_links()[0].state == LinkState.BROKEN, what="the link to the stopped peer BROKEN")
            [link] = cb.list_links()
            assert link.state == LinkState.BROKEN and link.reason
            dst = cb.allocate_cache(CacheDesc(num_tensors=2, shape=(4, 8)))
            with pytest.raises(Exception) as info:
                cb.pull_kv_blocks(CacheIndex(1, 1), dst, [0], [0])
            assert getattr(info.value, "status", None) == LlmStatus.LLM_LINK_FAILED


async def test_concurrent_first_transfers_of_a_remote_cache_share_one_description(tmp_path: Path,
                                                                                  shm_dir: Path) -> None:
    """Six transfers that meet a remote cache for the first time at once share one lookup, hence one RemoteCache:
    its identity keys the locks that keep two writes out of the same blocks (with six lookups, six shm pushes into
    the same blocks of the peer ran at once and tore them)."""
    import asyncio

    from kvbroker import AsyncClient
    from kvbrokerd.config import load
    from kvbrokerd.daemon import Daemon

    with LocalDaemon(tmp_path, 1) as src, src.client() as s:
        target = s.allocate_cache(CacheDesc(num_tensors=1, shape=(4, 64)))
        config, _ = load(["--cluster-id", "2", "--listen", f"unix://{tmp_path}/d2.sock", "--peer-listen",
                          "127.0.0.1:0", "--backends", "shm,tcp", "--shm-dir", str(shm_dir),
                          "--peer-token-file", str(tmp_path / "peer.token")])
        daemon = Daemon(config)
        await daemon.start()
        try:
            async with AsyncClient(daemon.local_address) as d:
                assert (await d.link_clusters([cluster_of(src)]))[0].ok
            assert daemon.node is not None
            link = daemon.node.links.get_ready(1)
            # A caller with a short deadline starts the lookup while the peer is stopped; one with a long deadline
            # joins it. The first times out; the second, whose own time is not over, still gets its answer.
            late = s.allocate_cache(CacheDesc(num_tensors=1, shape=(4, 64)))
            src.signal(signal.SIGSTOP)
            try:
                hasty = asyncio.ensure_future(link.remote_cache(late.cache_id, 0.3))
                await wait_until_async(lambda: late.cache_id in link._lookups, what="the hasty caller's lookup started")
                patient = asyncio.ensure_future(link.remote_cache(late.cache_id, 10.0))
                with pytest.raises(LlmError) as info:
                    await hasty
                assert info.value.status == LlmStatus.LLM_TIMEOUT
            finally:
                src.signal(signal.SIGCONT)
            assert (await patient).cache_id == late.cache_id

            found = await asyncio.gather(*(link.remote_cache(target.cache_id, 10.0) for _ in range(6)))
            assert all(r is found[0] for r in found), "concurrent lookups made several descriptions of one cache"
            assert await link.remote_cache(target.cache_id, 10.0) is found[0]
        finally:
            await daemon.stop(grace=0)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
@pytest.mark.parametrize(("backend", "listen", "dial"), [
    ("tcp", "[::1]:0", "[::1]"), ("shm", "[::1]:0", "[::1]"),
    ("tcp", "[::]:0", "127.0.0.1"),  # a daemon on [::] serves IPv4 peers on its data port too
])
def test_link_and_pull_over_ipv6(tmp_path: Path, backend: str, listen: str, dial: str) -> None:
    """Issue 20: peer addresses work as IPv6 literals wherever IPv4 ones do (link, advertise, data channel, probe)."""
    with LocalDaemon(tmp_path, 1, backends=(backend,), extra_args=["--peer-listen", listen]) as a, \
            LocalDaemon(tmp_path, 2, backends=(backend,), extra_args=["--peer-listen", "[::1]:0"]) as b, \
            a.client() as ca, b.client() as cb:
        assert b.peer_address.startswith("[::1]:")
        port = a.peer_address.rpartition(":")[2]
        desc = CacheDesc(num_tensors=1, shape=(4, 8))
        src, dst = ca.allocate_cache(desc), cb.allocate_cache(desc)
        src.tensors[0][:] = 5
        [linked] = cb.link_clusters([ClusterInfo(1, f"{dial}:{port}")])
        assert linked.ok, linked.message
        [link] = cb.list_links()
        assert link.backend == backend and link.state == LinkState.READY
        assert cb.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, [0], [2]).backend == backend
        assert (dst.tensors[0][2] == 5).all()
