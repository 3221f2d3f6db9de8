"""Every shared limit is per peer as well as global: one linked peer (a token holder, possibly hostile) or one
stranger exhausts only its own share, and replies never exceed what gRPC can send (issue 23, findings 5, 6, 7, 9)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kvbroker import CacheDesc, CacheIndex, DataType
from kvbroker._client import Client
from kvbroker._local import LocalDaemon
from kvbroker.v1 import broker_pb2, peer_pb2
from kvbrokerd.links import notifications
from tests import dataport
from tests.conftest import cluster_of
from tests.helpers import fill, snapshot, wait_until
from tests.peerkit import FakePeerLink, from_host, link_as, token_of

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


def _flood_from(source_ip: str, daemon: LocalDaemon, cluster_ids: list[int], topic: str) -> tuple[int, int]:
    """A token holder on host `source_ip` links to `daemon` once per claimed cluster id and, on each link, sends 64
    KiB notes until refused, then empty ones until refused (to fill the last bytes too); (notes, payload bytes)
    that got in."""
    notes = sent = 0
    with from_host(daemon.peer_address, source_ip) as relay:
        links: list[FakePeerLink] = []
        try:
            for cluster_id in cluster_ids:
                links.append(link := link_as(relay, token_of(daemon.workdir), cluster_id, daemon.cluster_id))
                for payload in (b"z" * notifications.MAX_PAYLOAD_BYTES, b""):
                    for _ in range(70000):
                        if not _notify(link, topic, payload):
                            break
                        notes, sent = notes + 1, sent + len(payload)
        finally:
            for link in links:
                link.close()
    return notes, sent


def _notify(link: FakePeerLink, topic: str, payload: bytes) -> bool:
    """Whether the note got in; a refusal must be for room."""
    try:
        link.stub.Notify(link.signed("Notify", peer_pb2.PeerNotifyRequest(topic=topic, payload=payload)), timeout=10)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED or "OUT_OF_MEMORY" in str(e.details()), e
        return False
    return True


TOPIC = "kvbroker.vllm/engine/0/release"
"""The topic a vLLM prefill engine's rank 0 fetches its grants' events on."""


def _grant_events(client: Client, topic: str) -> list[tuple[int, str, str]]:
    """(sender, label, outcome) of the GrantEvents waiting on `topic`, fetching every note there."""
    events = []
    while got := client.fetch_notifications(topic, timeout=30):
        for note in got:
            event = broker_pb2.GrantEvent()
            with contextlib.suppress(DecodeError):
                event.ParseFromString(note.payload)
            if event.outcome:
                events.append((note.cluster_id, event.label, event.outcome))
    return events


def _both_grant_events(client: Client) -> list[tuple[int, str, str]]:
    """The release's and the lapse's events, waiting for the lapse to be posted."""
    events: list[tuple[int, str, str]] = []

    def two() -> bool:
        events.extend(_grant_events(client, TOPIC))
        return len(events) >= 2

    wait_until(two, timeout=10, what="both grant events")
    return events


# -- issue 30, finding 4: a flood from one host, claiming many cluster ids --------------------------------------------


def test_a_token_holder_claiming_many_cluster_ids_leaves_room_for_peers_and_grant_events(tmp_path: Path) -> None:
    """A token holder on another host links as five cluster ids and floods 64 KiB notes on the prefill engine's
    grant-event topic from each (the shares were keyed by the claimed id: the five filled the whole 64 MiB box, the
    honest decode daemon's note was refused and the daemon's own GrantEvents were dropped). Now it gets one host's
    share; the honest peer's note gets in, and the grant's release and a grant's lapse are both delivered."""
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as p, LocalDaemon(tmp_path, 2, backends=("tcp",)) as d, \
            p.client() as pc, d.client() as dc:
        cache = pc.allocate_cache(SMALL)
        released = pc.create_grant([cache.cache_id], [0, 1], 30.0, label="released", event_topics=[TOPIC])
        [linked] = dc.link_clusters([cluster_of(p)])
        assert linked.ok, linked
        _, sent = _flood_from("127.0.1.2", p, [71, 72, 73, 74, 75], TOPIC)
        assert sent <= notifications.MAX_QUEUED_BYTES_PER_PEER
        dc.send_notification(p.cluster_id, "kv-held", b"request 7 pulled")
        pc.release_grant(released)
        pc.create_grant([cache.cache_id], [2], 0.2, label="lapsing", event_topics=[TOPIC])
        assert [(n.cluster_id, n.payload) for n in pc.fetch_notifications("kv-held", wait=5)] == [
            (d.cluster_id, b"request 7 pulled")]
        assert sorted(_both_grant_events(pc)) == [(p.cluster_id, "lapsing", "lapsed"),
                                                  (p.cluster_id, "released", "released")]


def test_the_daemons_grant_events_get_in_when_peers_fill_everything_they_may(tmp_path: Path) -> None:
    """Token holders on five hosts fill every byte the box gives peers (64 MiB); the daemon's own GrantEvents (a
    release and a lapse), posted outside the peers' budget, are still delivered and none is dropped."""
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as p, p.client() as pc:
        cache = pc.allocate_cache(SMALL)
        released = pc.create_grant([cache.cache_id], [0, 1], 30.0, label="released", event_topics=[TOPIC])
        for host in range(1, 6):
            _flood_from(f"127.0.{host}.2", p, [80 + host], TOPIC)
        with from_host(p.peer_address, "127.0.6.2") as relay:
            probe = link_as(relay, token_of(p.workdir), 86, p.cluster_id)
            assert not _notify(probe, TOPIC, b""), "the peers have room left: the flood did not fill the box"
            probe.close()
        pc.release_grant(released)
        pc.create_grant([cache.cache_id], [2], 0.2, label="lapsing", event_topics=[TOPIC])
        assert sorted(_both_grant_events(pc)) == [(p.cluster_id, "lapsing", "lapsed"),
                                                  (p.cluster_id, "released", "released")]


# -- 7: a fetch never builds a reply gRPC cannot send, and loses nothing --------------------------------------------
def test_fetching_a_full_topic_delivers_every_notification(tmp_path: Path) -> None:
    """Linked peers queue 64 KiB notifications until refused (64 MiB in all used to fit, and the default fetch then
    built a reply over the 64 MiB send limit: the call failed and what it had dequeued was gone). Fetches with the
    default max_count now return every one of them, each reply under the limit."""
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as d, d.client() as c:
        floods = [_flood_from(f"127.0.{host}.2", d, [70 + host], "big") for host in range(1, 6)]
        sent = sum(notes for notes, _ in floods)
        assert sum(size for _, size in floods) > 48 << 20
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
