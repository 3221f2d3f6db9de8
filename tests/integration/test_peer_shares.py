"""Every shared limit is per peer as well as global: one linked peer (a token holder, possibly hostile) or one
stranger exhausts only its own share, and replies never exceed what gRPC can send (issue 23, findings 5, 6, 7, 9)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
import numpy as np

from kvbroker import CacheDesc, CacheIndex, DataType
from kvbroker._local import LocalDaemon
from kvbroker.v1 import peer_pb2
from kvbrokerd.links import notifications
from tests import dataport
from tests.conftest import cluster_of
from tests.helpers import fill, snapshot, wait_until
from tests.peerkit import link_as, token_of

SMALL = CacheDesc(num_tensors=2, shape=(8, 16 << 10), data_type=DataType.FLOAT32)  # 64 KiB blocks


# -- 5: data connections ---------------------------------------------------------------------------------------------
def test_one_link_hoarding_data_connections_leaves_other_peers_their_share(tmp_path: Path) -> None:
    """A linked peer opens idle authenticated data connections until the daemon refuses one (it used to get all 512,
    the global cap, and every other peer's tcp transfers failed); a real linked peer still pulls."""
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst, \
            src.client() as s, dst.client() as d:
        a, b = s.allocate_cache(SMALL), d.allocate_cache(SMALL)
        fill(a, 3)
        secret, port = dataport.fake_link(src, cluster_id=77)
        held: list[socket.socket] = []
        try:
            for _ in range(600):
                try:
                    held.append(dataport.connect(port, secret, timeout=5.0))
                except (ConnectionError, OSError):
                    break  # refused: this link holds its share
            assert len(held) < 512, "one link took every data connection the daemon serves"
            [linked] = d.link_clusters([cluster_of(src)])
            assert linked.ok, linked
            d.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, [0, 1, 2], [5, 6, 7], timeout=10)
            assert all(np.array_equal(x.view(np.uint8)[[0, 1, 2]], y.view(np.uint8)[[5, 6, 7]])
                       for x, y in zip(snapshot(a), snapshot(b), strict=True))
        finally:
            for sock in held:
                sock.close()


# -- 7: a fetch never builds a reply gRPC cannot send, and loses nothing --------------------------------------------
def test_fetching_a_full_topic_delivers_every_notification(tmp_path: Path) -> None:
    """Linked peers queue 64 KiB notifications until refused (64 MiB in all used to fit, and the default fetch then
    built a reply over the 64 MiB send limit: the call failed and what it had dequeued was gone). Fetches with the
    default max_count now return every one of them, each reply under the limit."""
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as d, d.client() as c:
        payload = b"z" * notifications.MAX_PAYLOAD_BYTES
        sent = 0
        for cluster_id in (71, 72, 73, 74, 75):
            link = link_as(d.peer_address, token_of(d.workdir), cluster_id, d.cluster_id)
            try:
                for _ in range(1100):
                    try:
                        note = peer_pb2.PeerNotifyRequest(topic="big", payload=payload)
                        link.stub.Notify(link.signed("Notify", note), timeout=10)
                    except grpc.RpcError:
                        break
                    sent += 1
            finally:
                link.close()
        assert sent * len(payload) > 48 << 20
        fetched = 0
        while got := c.fetch_notifications("big", timeout=30):
            fetched += len(got)
        assert fetched == sent


# -- 9: the peer port holds a bounded number of connections ----------------------------------------------------------
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        while chunk := sock.recv(65536, socket.MSG_DONTWAIT):
            del chunk
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def test_idle_strangers_on_the_peer_port_cannot_take_the_daemons_descriptors(tmp_path: Path) -> None:
    """Strangers (no token) open 400 completed HTTP/2 connections to the peer port of a daemon limited to 256
    descriptors and hold them (they used to be kept until the descriptors ran out: AllocateCache failed and the data
    port stopped accepting). The port now holds at most a quarter of the limit and closes the others at once; the
    daemon allocates caches and a linked peer still pulls."""
    with LocalDaemon(tmp_path, 1, backends=("tcp",), wrapper=["prlimit", "--nofile=256:256"]) as src, \
            LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst, src.client() as s, dst.client() as d:
        [linked] = d.link_clusters([cluster_of(src)])  # before the strangers: its peer-port connection is made
        assert linked.ok, linked
        port = int(src.peer_address.rpartition(":")[2])
        strangers: list[socket.socket] = []
        try:
            for _ in range(400):
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(_HTTP2_PREFACE)
                sock.setblocking(False)
                strangers.append(sock)
            wait_until(lambda: sum(map(_closed_by_peer, strangers)) >= 400 - 256 // 4, timeout=10,
                       what="the peer port closing the strangers past its cap")
            caches = [s.allocate_cache(SMALL) for _ in range(8)]  # each needs descriptors
            fill(caches[0], 4)
            b = d.allocate_cache(SMALL)
            d.pull_kv_blocks(CacheIndex(src.cluster_id, caches[0].cache_id), b, [1], [2], timeout=10)
            assert all(np.array_equal(x.view(np.uint8)[[1]], y.view(np.uint8)[[2]])
                       for x, y in zip(snapshot(caches[0]), snapshot(b), strict=True))
        finally:
            for sock in strangers:
                sock.close()


async def test_an_honest_pullers_concurrent_small_pulls_stay_inside_its_share(tmp_path: Path) -> None:
    """128 concurrent small tcp pulls from one link (the benchmark's concurrency series, and a decode engine under
    load) all land: the puller queues them on a bounded set of connections instead of opening one each past the
    data server's per-link share."""
    from kvbroker import AsyncClient

    desc = CacheDesc(num_tensors=2, shape=(2048, 32 << 10), data_type=DataType.UINT8)  # 1 MiB pulls: they overlap
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst, \
            src.client() as s:
        a = s.allocate_cache(desc)
        fill(a, 5)
        async with AsyncClient(dst.target) as d:
            [linked] = await d.link_clusters([cluster_of(src)])
            assert linked.ok, linked
            b = await d.allocate_cache(desc)
            blocks = [list(range(16 * i, 16 * i + 16)) for i in range(128)]
            results = await asyncio.gather(*(d.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, bs, bs)
                                              for bs in blocks))
            assert all(r.backend == "tcp" for r in results)
            for t in range(2):
                assert np.array_equal(b.tensors[t], a.tensors[t])
