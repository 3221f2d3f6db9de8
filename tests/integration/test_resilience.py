"""What happens when things go away: leases of dead model servers, daemon restarts, peer restarts, releasing a cache
that a transfer uses, and resource limits."""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from kvbroker import (
    CacheDesc,
    CacheIndex,
    Client,
    DataType,
    KvCacheNotExistError,
    LinkState,
    LlmError,
    LlmStatus,
)
from kvbroker import convert as cv
from kvbroker._local import LocalDaemon
from kvbroker.v1 import broker_pb2, broker_pb2_grpc
from kvbrokerd.registry.caches import Registry
from kvbrokerd.registry.sessions import SessionTable
from tests.conftest import cluster_of
from tests.helpers import fill, transfers_in_flight, wait_until

SMALL = CacheDesc(num_tensors=2, shape=(4, 64))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_caches_of_a_dead_model_server_are_released_after_its_lease(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1) as d, d.client(lease_ttl=None) as observer:
        # A model server process that allocates, then dies without cleaning up.
        code = ("import os, kvbroker\n"
                f"c = kvbroker.Client({d.target!r}, lease_ttl=1.0)\n"
                "cache = c.allocate_cache(kvbroker.CacheDesc(num_tensors=2, shape=(4, 64)))\n"
                "print(cache.cache_id, cache.record.shm_dir + '/' + cache.record.tensors[0].segment, flush=True)\n"
                "os._exit(0)\n")
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
        cache_id, segment = out.stdout.split()
        [rec] = [r for r in observer.list_caches() if r.cache_id == int(cache_id)]
        assert rec.owner and rec.lease_expires_unix > time.time()
        wait_until(lambda: all(r.cache_id != int(cache_id) for r in observer.list_caches()),
                   what="the dead model server's cache released")
        assert not Path(segment).exists()
        assert observer.get_cluster_info().num_caches == 0


def test_a_living_client_keeps_its_caches_and_no_lease_means_forever(tmp_path: Path) -> None:
    with LocalDaemon(tmp_path, 1) as d, d.client(lease_ttl=1.0) as alive, d.client(lease_ttl=None) as plain:
        kept = alive.allocate_cache(SMALL)
        forever = plain.allocate_cache(SMALL)
        owners = {r.cache_id: r.owner for r in plain.list_caches()}
        assert owners == {kept.cache_id: alive.session_id, forever.cache_id: ""}
        [first] = [r.lease_expires_unix for r in plain.list_caches() if r.cache_id == kept.cache_id]

        def renewed_past_two_leases() -> bool:
            # A lease that ends two lease lengths after the first one would have was renewed after the first one
            # ran out: only renewals kept the cache that long.
            ends = [r.lease_expires_unix for r in plain.list_caches() if r.cache_id == kept.cache_id]
            return bool(ends) and ends[0] >= first + 2 * 1.0

        wait_until(renewed_past_two_leases, what="the living client's lease renewed past two lease lengths")
        ids = {r.cache_id for r in plain.list_caches()}
        assert {kept.cache_id, forever.cache_id} <= ids
        alive.close()  # stops renewing: the cache goes after its lease
        wait_until(lambda: {r.cache_id for r in plain.list_caches()} == {forever.cache_id},
                   what="only the lease-less cache left")


def test_a_stopped_daemon_gives_live_clients_a_full_lease_after_it_resumes(tmp_path: Path) -> None:
    """A lease measures the client's silence, not the daemon's: a daemon frozen (SIGSTOP, a starved host) for longer
    than a lease must not release, as soon as it runs again, the caches of clients that were sending KeepAlive all
    along. A client that really is gone still loses its caches, one lease later."""
    ttl = 2.0
    with LocalDaemon(tmp_path, 1) as d, d.client(lease_ttl=None) as observer, d.client(lease_ttl=ttl) as real, \
            grpc.insecure_channel(d.target) as channel:
        stub = broker_pb2_grpc.KvBrokerStub(channel)

        def session(name: str) -> int:
            # A session renewed by hand, so that the test decides when the daemon hears it.
            stub.KeepAlive(broker_pb2.KeepAliveRequest(session_id=name, ttl_ms=int(ttl * 1000)), timeout=5)
            request = broker_pb2.AllocateCacheRequest(desc=cv.desc_to_pb(SMALL), session_id=name)
            return int(stub.AllocateCache(request, timeout=5).cache.cache_id)

        def renew(name: str) -> None:
            stub.KeepAlive(broker_pb2.KeepAliveRequest(session_id=name, ttl_ms=int(ttl * 1000)), timeout=5)

        live, gone = session("live-client"), session("gone-client")
        kept = real.allocate_cache(SMALL).cache_id  # renewed in the background, as model servers do
        d.signal(signal.SIGSTOP)
        try:
            time.sleep(2 * ttl)  # the fault itself: a daemon frozen for two lease lengths
        finally:
            d.signal(signal.SIGCONT)
        time.sleep(ttl / 2)  # the scenario: the live client speaks again well within one lease of the resume
        renew("live-client")
        ids = {r.cache_id for r in observer.list_caches()}
        assert {live, kept, gone} <= ids

        def gone_released() -> bool:
            renew("live-client")
            return gone not in {r.cache_id for r in observer.list_caches()}

        wait_until(gone_released, timeout=4 * ttl, what="the gone client's cache released")
        assert {live, kept} <= {r.cache_id for r in observer.list_caches()}
        assert "did not run for" in d.log_tail(50)


def test_stalls_shift_leases_and_a_long_one_leaves_a_full_ttl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease arithmetic alone (no daemon, no reaper): stalls move a lease on by exactly their length, so that a
    client that is gone is still released by a daemon that keeps stalling briefly; after a stall as long as the TTL,
    even a lease that had just run out (not yet reaped) gets a full TTL."""
    clock = SimpleNamespace(now=1000.0)  # the sessions module's clock, moved on by the test instead of by sleeping
    wall = 1.7e9
    monkeypatch.setattr(sys.modules[SessionTable.__module__], "time",
                        SimpleNamespace(monotonic=lambda: clock.now, time=lambda: wall + clock.now))
    table = SessionTable(Registry(tmp_path))
    table.touch("gone", 2.0)
    before = table.expires_unix("gone")
    for _ in range(10):
        table.forgive_stall(0.3)
    assert table.expires_unix("gone") - before == pytest.approx(3.0)

    table.touch("quiet", 2.0)
    table.touch("lapsed", 1.0)
    clock.now += 1.5  # "quiet" has 0.5 s left, "lapsed" ran out 0.5 s ago
    table.forgive_stall(1.2)
    assert table.expires_unix("quiet") - (wall + clock.now) == pytest.approx(1.7)
    assert table.expires_unix("lapsed") - (wall + clock.now) == pytest.approx(1.0)


def test_client_reconnects_after_a_daemon_restart(tmp_path: Path) -> None:
    first = LocalDaemon(tmp_path, 1).start()
    client = Client(first.target, timeout=10.0, lease_ttl=None)
    try:
        epoch = client.get_cluster_info().instance_epoch
        first.stop()
        second = LocalDaemon(tmp_path, 1)
        second.start()
        try:
            info = client.get_cluster_info()  # the same Client object: reconnect + retry, no new channel by hand
            assert info.instance_epoch != epoch and info.num_caches == 0
        finally:
            second.stop()
    finally:
        client.close()


@pytest.mark.parametrize("auto_relink", [False, True])
def test_peer_restart_is_detected_and_old_caches_are_not_served(tmp_path: Path, auto_relink: bool) -> None:
    port = _free_port()
    peer_args = ["--peer-listen", f"127.0.0.1:{port}"]
    extra = ["--auto-relink"] if auto_relink else []
    with LocalDaemon(tmp_path, 2, backends=("tcp",), extra_args=extra) as dst, dst.client() as d:
        src = LocalDaemon(tmp_path, 1, backends=("tcp",), extra_args=peer_args).start()
        with src.client(lease_ttl=None) as s:
            old = s.allocate_cache(SMALL)
        dst_cache = d.allocate_cache(SMALL)
        assert d.link_clusters([cluster_of(src)])[0].ok
        old_epoch = d.list_links()[0].remote_epoch
        d.pull_kv_blocks(CacheIndex(1, old.cache_id), dst_cache, [0], [0])
        src.stop()
        src = LocalDaemon(tmp_path, 1, backends=("tcp",), extra_args=peer_args).start()
        try:
            with src.client(lease_ttl=None) as s:
                new = s.allocate_cache(SMALL)
                fill(new, 5)
                expected_row = new.tensors[0][1].view("u1").copy()
            if auto_relink:
                wait_until(lambda: d.list_links()[0].remote_epoch not in ("", old_epoch)
                           and d.list_links()[0].state == LinkState.READY,
                           what="the link re-made to the restarted peer")
            else:
                # Under load the restart may first show as missed heartbeats; then the new incarnation is seen.
                wait_until(lambda: d.list_links()[0].state == LinkState.BROKEN
                           and "restarted" in d.list_links()[0].reason,
                           what="the link BROKEN for the peer's restart")
                with pytest.raises(LlmError) as broken:
                    d.pull_kv_blocks(CacheIndex(1, new.cache_id), dst_cache, [0], [0])
                assert broken.value.status == LlmStatus.LLM_LINK_FAILED
                d.unlink_clusters([cluster_of(src)], force=True)
                assert d.link_clusters([cluster_of(src)])[0].ok  # nobody had to restart
            with pytest.raises(KvCacheNotExistError):
                d.pull_kv_blocks(CacheIndex(1, old.cache_id), dst_cache, [0], [0])
            d.pull_kv_blocks(CacheIndex(1, new.cache_id), dst_cache, [1], [1])
            assert (dst_cache.tensors[0][1].view("u1") == expected_row).all()
        finally:
            src.stop()


def test_releasing_a_cache_in_use_waits_then_refuses(tmp_path: Path) -> None:
    big = CacheDesc(num_tensors=2, shape=(64, 1 << 16), data_type=DataType.UINT8)
    blocks = list(range(64))
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, \
            LocalDaemon(tmp_path, 2, backends=("tcp",), extra_args=["--metrics-listen", "127.0.0.1:0"]) as dst, \
            src.client() as s, dst.client() as d:
        a, b = s.allocate_cache(big), d.allocate_cache(big)
        metrics_at = d.get_cluster_info().metrics_address
        assert d.link_clusters([cluster_of(src)])[0].ok
        d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, blocks, blocks)
        src.signal(signal.SIGSTOP)  # the next pull hangs on the frozen peer, holding the destination
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(d.pull_kv_blocks, CacheIndex(1, a.cache_id), b.cache_id, blocks, blocks,
                                      timeout=4.0)
                wait_until(lambda: transfers_in_flight(metrics_at) == 1, what="the pull running (on the frozen peer)")
                with dst.client() as other, pytest.raises(LlmError) as busy:
                    other.deallocate_cache(b.cache_id, timeout=1.0)
                assert busy.value.status == LlmStatus.LLM_LINK_BUSY
                assert any(r.cache_id == b.cache_id for r in d.list_caches())
                with pytest.raises(LlmError):
                    pending.result()
        finally:
            src.signal(signal.SIGCONT)
        d.deallocate_cache(b)  # the transfer has ended: now it goes
        assert all(r.cache_id != b.cache_id for r in d.list_caches())


def test_resource_limits_are_clear_refusals(tmp_path: Path) -> None:
    limits = ["--max-inflight-bytes", "512", "--max-caches", "3", "--max-links", "1"]
    with LocalDaemon(tmp_path, 1) as src, LocalDaemon(tmp_path, 3) as third, \
            LocalDaemon(tmp_path, 2, extra_args=limits) as dst, src.client() as s, dst.client() as d:
        a = s.allocate_cache(SMALL)
        b = d.allocate_cache(SMALL)
        assert d.link_clusters([cluster_of(src)])[0].ok
        [refused] = d.link_clusters([cluster_of(third)])
        assert refused.status == LlmStatus.LLM_OUT_OF_MEMORY and "link limit" in refused.message
        d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [0], [0])  # 2 x 128 bytes: within the limit
        with pytest.raises(LlmError) as too_big:
            d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [0, 1, 2, 3], [0, 1, 2, 3])
        assert too_big.value.status == LlmStatus.LLM_OUT_OF_MEMORY
        assert too_big.value.details["grpc_code"] == "RESOURCE_EXHAUSTED"
        d.allocate_cache(SMALL)
        d.allocate_cache(SMALL)
        with pytest.raises(LlmError) as full:
            d.allocate_cache(SMALL)
        assert full.value.status == LlmStatus.LLM_OUT_OF_MEMORY and "cache limit" in full.value.message
        assert d.get_cluster_info().num_caches == 3
