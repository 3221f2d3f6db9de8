"""Security of the peer API and the data plane: mutual TLS, link proofs on data connections, hostile bytes."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker import CacheDesc, CacheIndex, ClusterInfo, LlmStatus
from kvbroker._local import LocalDaemon
from kvbroker.v1 import broker_pb2, broker_pb2_grpc, peer_pb2, peer_pb2_grpc
from kvbrokerd.links import linkauth
from tests import peerkit
from tests.conftest import cluster_of
from tests.helpers import fill
from tests.tlsgen import Ca


def _pull_works(src: LocalDaemon, dst: LocalDaemon) -> str:
    with src.client() as s, dst.client() as d:
        [linked] = d.link_clusters([cluster_of(src)])
        assert linked.ok, linked
        a, b = s.allocate_cache(CacheDesc(2, (8, 256))), d.allocate_cache(CacheDesc(2, (8, 256)))
        fill(a, 4)
        result = d.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, [1, 2], [6, 7])
        assert np.array_equal(b.tensors[1][6:8].view(np.uint8), a.tensors[1][1:3].view(np.uint8))
        return result.backend


@pytest.mark.parametrize(("backends", "data_tls"), [(("tcp",), True), (("tcp",), False), (("shm",), False)])
def test_mutual_tls_links_and_pulls(tmp_path: Path, backends: tuple[str, ...], data_tls: bool) -> None:
    ca = Ca(tmp_path, "cluster")
    with LocalDaemon(tmp_path, 1, backends=backends, extra_args=ca.flags("a", data_tls)) as a, \
            LocalDaemon(tmp_path, 2, backends=backends, extra_args=ca.flags("b", data_tls)) as b:
        assert _pull_works(a, b) == backends[0]


def test_peer_without_a_certificate_cannot_link(tmp_path: Path) -> None:
    ca = Ca(tmp_path, "cluster")
    with LocalDaemon(tmp_path, 1, extra_args=ca.flags("a")) as secured, LocalDaemon(tmp_path, 2) as plain, \
            plain.client() as c:
        [result] = c.link_clusters([cluster_of(secured)], timeout=2.0)
        assert result.status == LlmStatus.LLM_LINK_FAILED


def test_peer_with_a_certificate_from_another_ca_cannot_link(tmp_path: Path) -> None:
    ca, rogue = Ca(tmp_path, "cluster"), Ca(tmp_path, "rogue")
    with LocalDaemon(tmp_path, 1, extra_args=ca.flags("a")) as secured, \
            LocalDaemon(tmp_path, 2, extra_args=[*rogue.flags("b")[:4], "--tls-ca", ca.path]) as intruder, \
            intruder.client() as c:
        [result] = c.link_clusters([cluster_of(secured)], timeout=2.0)
        assert result.status == LlmStatus.LLM_LINK_FAILED
        # The plain (insecure) peer port answers nothing either.
        with grpc.insecure_channel(secured.peer_address) as ch, pytest.raises(grpc.RpcError):
            peer_pb2_grpc.PeerStub(ch).Heartbeat(peer_pb2.HeartbeatRequest(), timeout=2)


def test_a_certificate_naming_a_cluster_id_cannot_claim_another(tmp_path: Path) -> None:
    """Issue 30 finding 5: under mutual TLS any certified peer could claim any cluster id (and with 64 links claiming
    a real peer's, keep it out). A certificate that names cluster ids (URI SANs kvbroker://cluster/<id>) now claims
    only those; one that names none claims any, as before."""
    ca = Ca(tmp_path, "cluster")
    with LocalDaemon(tmp_path, 1, extra_args=ca.flags("a", cluster_ids=[1])) as a, \
            LocalDaemon(tmp_path, 2, extra_args=ca.flags("liar", cluster_ids=[3])) as liar, \
            LocalDaemon(tmp_path, 3, extra_args=ca.flags("named", cluster_ids=[3])) as named, \
            LocalDaemon(tmp_path, 4, extra_args=ca.flags("unnamed")) as unnamed:
        with liar.client() as c:
            [refused] = c.link_clusters([cluster_of(a)], timeout=5.0)
            assert refused.status == LlmStatus.LLM_LINK_FAILED and "names cluster 3, not 2" in refused.message
        assert _pull_works(a, named) == "shm"
        assert _pull_works(a, unnamed) == "shm"
        # By hand, with the named peer's certificate: its own id links, another does not.
        cert, key = (Path(p).read_bytes() for p in (tmp_path / "named.crt", tmp_path / "named.key"))
        credentials = grpc.ssl_channel_credentials(Path(ca.path).read_bytes(), key, cert)
        peerkit.link_as(a.peer_address, None, 3, a.cluster_id, epoch="again", credentials=credentials).close()
        with pytest.raises(grpc.RpcError) as info:
            peerkit.link_as(a.peer_address, None, 2, a.cluster_id, credentials=credentials)
        assert "names cluster 3, not 2" in (info.value.details() or "")


# -- the data port ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    with LocalDaemon(tmp_path_factory.mktemp("victim"), 1, backends=("tcp",)) as d:
        yield d


_fake_links: dict[str, tuple[bytes, int]] = {}


def _fake_link(d: LocalDaemon) -> tuple[bytes, int]:
    """Links to `d` (once per daemon) as a made-up peer holding the deployment token: (link secret, data port)."""
    if d.peer_address not in _fake_links:
        link = peerkit.link_as(d.peer_address, peerkit.token_of(d.workdir), 77, 1)
        link.close()
        _fake_links[d.peer_address] = link.secret, link.data_port
    return _fake_links[d.peer_address]


def _open(port: int) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    greeting = sock.recv(4 + linkauth.NONCE_BYTES, socket.MSG_WAITALL)
    assert greeting[:4] == b"KVCH"
    return sock, greeting[4:]


def _hello(lid: bytes, mac: bytes) -> bytes:
    return struct.pack(f"<4sHH{linkauth.ID_BYTES}s{linkauth.MAC_BYTES}s", b"KVHI", 1, 0, lid, mac)


def _answer(sock: socket.socket) -> bytes:
    try:
        return sock.recv(64)
    except (ConnectionResetError, TimeoutError):
        return b""


def test_valid_proof_is_accepted_and_a_replay_is_not(victim: LocalDaemon) -> None:
    secret, port = _fake_link(victim)
    lid = linkauth.link_id(secret)
    first, nonce = _open(port)
    hello = _hello(lid, linkauth.proof(secret, nonce, lid))
    first.sendall(hello)
    assert first.recv(4, socket.MSG_WAITALL) == b"KVOK"
    first.close()
    second, _ = _open(port)
    second.sendall(hello)  # the proof of another connection's nonce
    assert _answer(second) == b""
    second.close()


@pytest.mark.parametrize("payload", [
    b"",
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    _hello(b"\0" * linkauth.ID_BYTES, b"\0" * linkauth.MAC_BYTES),
    b"KVRQ" + b"\xff" * 100,
])
def test_stranger_gets_nothing(victim: LocalDaemon, payload: bytes) -> None:
    sock, _ = _open(int(_fake_link(victim)[1]))
    sock.sendall(payload)
    if not payload:
        sock.shutdown(socket.SHUT_WR)
    assert _answer(sock) == b""
    sock.close()
    with victim.client() as c:
        assert c.get_cluster_info().cluster_id == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(min_size=1, max_size=4096))
def test_random_bytes_on_the_data_port(victim: LocalDaemon, junk: bytes) -> None:
    sock, _ = _open(int(_fake_link(victim)[1]))
    sock.sendall(junk)
    sock.shutdown(socket.SHUT_WR)
    assert _answer(sock) in (b"",)
    sock.close()


def test_daemon_healthy_after_probing(victim: LocalDaemon) -> None:
    with victim.client() as c:
        info = c.get_cluster_info()
        assert info.cluster_id == 1


def test_peer_calls_need_the_link_secret(victim: LocalDaemon) -> None:
    link = peerkit.link_as(victim.peer_address, peerkit.token_of(victim.workdir), 77, 1)
    forged = peerkit.FakePeerLink(b"x" * 32, link.description, link.channel)
    try:
        for request in (peer_pb2.GetCacheInfoRequest(cache_id=1),
                        forged.signed("GetCacheInfo", peer_pb2.GetCacheInfoRequest(cache_id=1)),
                        link.signed("Heartbeat", peer_pb2.GetCacheInfoRequest(cache_id=1))):  # wrong method
            with pytest.raises(grpc.RpcError) as info:
                link.stub.GetCacheInfo(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        link.close()


def test_malformed_protobuf_on_the_local_api(victim: LocalDaemon) -> None:
    with grpc.insecure_channel(victim.target) as ch:
        raw = ch.unary_unary("/kvbroker.v1.KvBroker/PullKvBlocks", request_serializer=None,
                             response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff\xff\x0f" * 10, timeout=5)
        # grpc's own deserializer answers before our code runs: UNKNOWN with a clear message.
        assert info.value.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
        assert "Error parsing message" in (info.value.details() or "")
        stub = broker_pb2_grpc.KvBrokerStub(ch)
        assert stub.GetClusterInfo(broker_pb2.GetClusterInfoRequest(), timeout=5).cluster_id == 1


def test_link_to_unlinked_cluster_id_is_a_clean_error(victim: LocalDaemon) -> None:
    with victim.client() as c:
        [r] = c.link_clusters([ClusterInfo(5, victim.peer_address)])
        assert r.status == LlmStatus.LLM_LINK_FAILED
