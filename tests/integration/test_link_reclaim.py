"""Links reclaim themselves (issue 20 item 1) and inbound links are held to a share per source and per claimed
cluster id (issue 23 finding 8), against real daemons: dead peers never hold a slot a new link needs, and a token
holder that fills the table from one host cannot lock a real peer out."""

from __future__ import annotations

import re
import socket
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvbroker import CacheDesc, CacheIndex, ClusterInfo, LinkState, LlmStatus
from kvbroker._local import LocalDaemon
from kvbroker.v1 import peer_pb2
from tests import peerkit
from tests.conftest import cluster_of
from tests.helpers import wait_until


def _reclaimed(metrics_address: str) -> dict[tuple[str, str], float]:
    """kvbroker_links_reclaimed_total by (side, reason)."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(side, reason): float(value) for side, reason, value in re.findall(
        r'^kvbroker_links_reclaimed_total\{reason="(\w+)",side="(\w+)"\} (\S+)$', text, re.MULTILINE)
        for side, reason in [(reason, side)]}


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")


def _pull_ok(src: LocalDaemon, dst: LocalDaemon) -> None:
    desc = CacheDesc(num_tensors=1, shape=(2, 16))
    with src.client() as cs, dst.client() as cd:
        a, b = cs.allocate_cache(desc), cd.allocate_cache(desc)
        try:
            a.tensors[0][:] = 7
            cd.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, [0], [1])
            assert (b.tensors[0][1] == 7).all()
        finally:
            cs.deallocate_cache(a)
            cd.deallocate_cache(b)


# ------------------------------------------------------------------------------------------------ outbound side


def test_a_broken_link_past_its_ttl_is_removed_and_counted(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 2, extra_args=["--broken-link-ttl", "1", "--metrics-listen", "127.0.0.1:0"]) as d:
        peer = LocalDaemon(tmp_path, 1).start()
        with d.client() as c:
            assert c.link_clusters([cluster_of(peer)])[0].ok
            peer.stop()
            wait_until(lambda: c.list_links() == [], timeout=20, what="the dead peer's link gone from ListLinks")
            metrics = c.get_cluster_info().metrics_address
            assert _reclaimed(metrics)[("outbound", "broken")] == 1
            assert "removed (broken)" in d.log_tail(50)
            # A call on it says why the link is gone; linking again is an ordinary link.
            [again] = c.link_clusters([ClusterInfo(1, peer.peer_address)], timeout=1.0)
            assert again.status == LlmStatus.LLM_LINK_FAILED  # the peer is still dead
            assert c.list_links() == []


def test_an_unused_link_past_the_idle_ttl_is_removed_and_the_peer_told(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 2, extra_args=["--idle-link-ttl", "1", "--metrics-listen", "127.0.0.1:0"]) as d, \
            LocalDaemon(tmp_path, 1, extra_args=["--metrics-listen", "127.0.0.1:0"]) as peer, d.client() as c:
        assert c.link_clusters([cluster_of(peer)])[0].ok
        wait_until(lambda: c.list_links() == [], timeout=20, what="the unused link gone from ListLinks")
        assert _reclaimed(c.get_cluster_info().metrics_address)[("outbound", "idle")] == 1
        with peer.client() as cp:  # told, not left to expire: its inbound slot is free at once
            assert 'kvbroker_inbound_links 0.0' in urllib.request.urlopen(
                f"http://{cp.get_cluster_info().metrics_address}/metrics", timeout=5).read().decode()
        assert c.link_clusters([cluster_of(peer)])[0].ok  # linking again is an ordinary link


def test_churn_of_many_dead_peers_never_fills_a_small_link_table(tmp_path: Path) -> None:
    """max_links=2 and BROKEN links kept (the default 60 s TTL is not reached): three generations of two peers each,
    every generation stopped before the next links. Every link succeeds without the client unlinking anything; each
    one past the second pushes out the longest-BROKEN link."""
    with LocalDaemon(tmp_path, 100, extra_args=["--max-links", "2", "--metrics-listen", "127.0.0.1:0"]) as d, \
            d.client() as c:
        next_id = 1
        for generation in range(3):
            peers = [LocalDaemon(tmp_path, next_id + i, backends=("tcp",)).start() for i in range(2)]
            next_id += 2
            try:
                results = c.link_clusters([cluster_of(p) for p in peers])
                assert all(r.ok for r in results), (generation, results)
                assert {lk.remote_cluster_id for lk in c.list_links()} == {p.cluster_id for p in peers}
                _pull_ok(peers[0], d)
            finally:
                for p in peers:
                    p.stop()
            wait_until(lambda: all(lk.state == LinkState.BROKEN for lk in c.list_links()), timeout=20,
                       what="the stopped generation's links BROKEN")
        assert _reclaimed(c.get_cluster_info().metrics_address)[("outbound", "room")] == 4


def test_a_full_table_of_live_links_still_refuses(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 100, extra_args=["--max-links", "1"]) as d, LocalDaemon(tmp_path, 1) as a, \
            LocalDaemon(tmp_path, 2) as b, d.client() as c:
        assert c.link_clusters([cluster_of(a)])[0].ok
        [refused] = c.link_clusters([cluster_of(b)])
        assert refused.status == LlmStatus.LLM_OUT_OF_MEMORY and "every link is live" in refused.message
        assert [lk.state for lk in c.list_links()] == [LinkState.READY]


# ------------------------------------------------------------------------------------------------- inbound side


def test_an_inbound_table_full_of_silent_links_makes_room(tmp_path: Path) -> None:
    """Two links made to `d` whose makers fell silent (dead peers) fill its inbound table (max_links=2); a new peer
    links once they have been silent a few seconds, without anyone unlinking (before: refused until the
    --peer-link-ttl of 120 s)."""
    with LocalDaemon(tmp_path, 100, extra_args=["--max-links", "2", "--metrics-listen", "127.0.0.1:0"]) as d, \
            LocalDaemon(tmp_path, 1) as peer:
        token = peerkit.token_of(tmp_path)
        dead = [peerkit.link_as(d.peer_address, token, 50 + i, d.cluster_id) for i in range(2)]
        for link in dead:
            link.close()
        with peer.client() as c:
            [refused] = c.link_clusters([cluster_of(d)])
            assert refused.status == LlmStatus.LLM_LINK_FAILED and "inbound link limit" in refused.message
            wait_until(lambda: c.link_clusters([cluster_of(d)])[0].ok, timeout=20,
                       what="a link into the table of silent links")
        _pull_ok(d, peer)
        with d.client() as cd:
            assert _reclaimed(cd.get_cluster_info().metrics_address)[("inbound", "silent")] == 1


@pytest.fixture
def dual_stack(tmp_path: Path) -> Iterator[LocalDaemon]:
    """A daemon whose peer API listens on [::] (IPv4 and IPv6): token holders dial it from 127.0.0.1, real peers
    from ::1, i.e. from another source host, as two machines of a fleet would."""
    with LocalDaemon(tmp_path, 100, backends=("tcp",), extra_args=["--peer-listen", "[::]:0"]) as d:
        yield d


def _keep_alive(links: list[peerkit.FakePeerLink]) -> int:
    """A heartbeat on each link, as a token holder keeping its links live (never silent, so never evictable as
    such) would send; returns how many of them the daemon still knows."""
    return sum(link.stub.Heartbeat(link.signed("Heartbeat", peer_pb2.HeartbeatRequest()), timeout=5).link_known
               for link in links)


def _port(d: LocalDaemon) -> int:
    return int(d.peer_address.rpartition(":")[2])


@needs_ipv6
def test_impostors_claiming_a_peers_cluster_id_do_not_lock_it_out(dual_stack: LocalDaemon, tmp_path: Path) -> None:
    """Finding 8: 64 live links claiming a real peer's cluster id (made by a token holder on another host) locked
    that peer out with LLM_OUT_OF_MEMORY; now the real peer's network holds fewer and gets in, and the impostors can
    never push the real peer out."""
    d = dual_stack
    token = peerkit.token_of(tmp_path)
    impostors = [peerkit.link_as(f"127.0.0.1:{_port(d)}", token, 7, d.cluster_id, epoch=f"e{i}") for i in range(64)]
    try:
        with LocalDaemon(tmp_path, 7, backends=("tcp",)) as real, real.client() as c:
            assert _keep_alive(impostors) == 64
            assert c.link_clusters([ClusterInfo(d.cluster_id, f"[::1]:{_port(d)}")])[0].ok
            _pull_ok(d, real)
            assert _keep_alive(impostors) == 63  # one gave way to the real peer
            # More impostors displace their own network's links (issue 30 finding 5), never the real peer's.
            impostors += [peerkit.link_as(f"127.0.0.1:{_port(d)}", token, 7, d.cluster_id, epoch=f"more{i}")
                          for i in range(3)]
            assert _keep_alive(impostors) == 63
            assert [lk.state for lk in c.list_links()] == [LinkState.READY]
            _pull_ok(d, real)
        # A restarted peer (new epoch) gets in as well.
        with LocalDaemon(tmp_path, 7, backends=("tcp",)) as again, again.client() as c:
            assert c.link_clusters([ClusterInfo(d.cluster_id, f"[::1]:{_port(d)}")])[0].ok
            _pull_ok(d, again)
    finally:
        for link in impostors:
            link.close()


@pytest.mark.parametrize("sources", ["one address", "64 addresses"])
def test_impostors_on_the_peers_network_cannot_lock_it_out(tmp_path: Path, sources: str) -> None:
    """Issue 30 finding 5: 64 live links claiming a real peer's cluster id, from the peer's own address or from 64
    addresses of its network (127.0.0.2-65: shares counted exact addresses), kept the peer out ("already holds 64
    live links"). Now a full cluster id displaces its least recently active link: the peer links and pulls, the
    impostors can at worst make its link churn."""
    with LocalDaemon(tmp_path, 100, backends=("tcp",), extra_args=["--metrics-listen", "127.0.0.1:0"]) as d, \
            peerkit.SourceRelays(d.peer_address) as relays:
        token = peerkit.token_of(tmp_path)
        impostors = [peerkit.link_as(d.peer_address if sources == "one address" else relays.via(f"127.0.0.{2 + i}"),
                                     token, 7, d.cluster_id, epoch=f"e{i}") for i in range(64)]
        try:
            assert _keep_alive(impostors) == 64
            with LocalDaemon(tmp_path, 7, backends=("tcp",)) as real, real.client() as c:
                [linked] = c.link_clusters([cluster_of(d)])
                assert linked.ok, linked
                _pull_ok(d, real)
                assert _keep_alive(impostors) == 63
            with d.client() as cd:
                assert _reclaimed(cd.get_cluster_info().metrics_address)[("inbound", "displaced")] == 1
            # The displaced link came from where its impostor was (the relays made 64 hosts of one test).
            displaced = re.search(r"inbound link of cluster 7 from 127\.0\.0\.(\d+) dropped \(displaced\)",
                                  d.log_tail(400))
            assert displaced is not None
            assert (displaced.group(1) == "1") == (sources == "one address")
        finally:
            for link in impostors:
                link.close()


def test_the_per_peer_link_shares_are_settings(tmp_path: Path) -> None:
    """--peer-links-per-cluster: a smaller share is full sooner and displaces as well."""
    with LocalDaemon(tmp_path, 100, extra_args=["--peer-links-per-cluster", "2", "--peer-links-per-network", "8",
                                                "--metrics-listen", "127.0.0.1:0"]) as d, d.client() as cd:
        token = peerkit.token_of(tmp_path)
        links = [peerkit.link_as(d.peer_address, token, 7, d.cluster_id, epoch=f"e{i}") for i in range(3)]
        try:
            assert _keep_alive(links) == 2
            assert _reclaimed(cd.get_cluster_info().metrics_address)[("inbound", "displaced")] == 1
        finally:
            for link in links:
                link.close()


@needs_ipv6
def test_a_token_holder_filling_the_inbound_table_cannot_lock_new_peers_out(tmp_path: Path) -> None:
    """Finding 8: a token holder that fills the whole inbound table with live links (here max_links=8) locked out
    every new or restarted peer; now a peer from another host takes a slot from the host holding the most."""
    with LocalDaemon(tmp_path, 100, backends=("tcp",), extra_args=["--peer-listen", "[::]:0", "--max-links", "8"]
                     ) as d:
        token = peerkit.token_of(tmp_path)
        hoard = [peerkit.link_as(f"127.0.0.1:{_port(d)}", token, 200 + i, d.cluster_id) for i in range(8)]
        try:
            with ExitStack() as stack:
                for cluster_id in (1, 2):
                    peer = stack.enter_context(LocalDaemon(tmp_path, cluster_id, backends=("tcp",)))
                    with peer.client() as c:
                        _keep_alive(hoard)
                        assert c.link_clusters([ClusterInfo(d.cluster_id, f"[::1]:{_port(d)}")])[0].ok
                    _pull_ok(d, peer)
        finally:
            for link in hoard:
                link.close()
