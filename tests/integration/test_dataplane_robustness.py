"""The tcp data plane cannot be wedged, a vanished cache memory fails only its transfer, and concurrent writes
into the same blocks never tear them (issue 10, findings 3, 5 and 9)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker import AsyncClient, Cache, CacheDesc, CacheIndex, Client, DataType, LinkState, LlmError, LlmStatus
from kvbroker._local import LocalDaemon
from kvbroker.types import TensorLocation
from kvbrokerd.backends.tcp import wire as tcp
from tests import dataport
from tests.conftest import cluster_of
from tests.helpers import Allocations, fill, snapshot, transfers_in_flight, wait_until

SMALL = CacheDesc(num_tensors=2, shape=(8, 16 << 10), data_type=DataType.FLOAT32)  # 64 KiB blocks
LARGE = CacheDesc(num_tensors=2, shape=(8, 1 << 20), data_type=DataType.UINT8)  # 1 MiB blocks


def _blocks_equal(a: Cache, a_blocks: list[int], b: Cache, b_blocks: list[int]) -> bool:
    return all(np.array_equal(x.view(np.uint8)[a_blocks], y.view(np.uint8)[b_blocks])
               for x, y in zip(a.tensors, b.tensors, strict=True))


def _link(dst: LocalDaemon, src: LocalDaemon) -> None:
    with dst.client() as d:
        [result] = d.link_clusters([cluster_of(src)])
        assert result.ok, result


def _link_state(d: Client, cluster_id: int) -> LinkState:
    return next(link.state for link in d.list_links() if link.remote_cluster_id == cluster_id)


# -- 5a: the accept loop outlives a lack of file descriptors ---------------------------------------------------------
def test_data_port_survives_running_out_of_file_descriptors(tmp_path: Path) -> None:
    """A daemon limited to few descriptors is flooded with (authenticated) data connections until accept(2) fails
    with EMFILE. Once they close, a linked peer pulls through the data port again (the accept thread used to end
    for good on the first EMFILE)."""
    with LocalDaemon(tmp_path, 1, backends=("tcp",), wrapper=["prlimit", "--nofile=160:160"]) as src, \
            LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst, src.client() as s, dst.client() as d:
        a, b = s.allocate_cache(SMALL), d.allocate_cache(SMALL)
        fill(a, 1)
        # Several links: one link's own share of data connections is smaller than the descriptors to exhaust.
        links = [dataport.fake_link(src, cluster_id) for cluster_id in range(77, 81)]
        port = links[0][1]
        health = grpc.insecure_channel(src.target)  # connected before the flood: it needs no new descriptor
        check = health_pb2_grpc.HealthStub(health).Check
        assert check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        held: list[socket.socket] = []
        try:
            for i in range(400):
                try:
                    held.append(dataport.connect(port, links[i % len(links)][0], timeout=1.0))
                except (TimeoutError, ConnectionError, OSError):
                    break  # no greeting: the daemon cannot accept any more
            else:
                pytest.fail("the daemon accepted 400 connections with 160 file descriptors")
            # Health follows the data plane: a load balancer or kubelet sees the daemon cannot serve peers now.
            wait_until(lambda: check(health_pb2.HealthCheckRequest(), timeout=5).status ==
                       health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5,
                       what="health NOT_SERVING while the data port cannot accept")
        finally:
            for sock in held:
                sock.close()
        _link(dst, src)  # a new link: its pull needs a new data connection
        d.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, [0, 5], [2, 3], timeout=10)
        assert _blocks_equal(a, [0, 5], b, [2, 3])
        wait_until(lambda: check(health_pb2.HealthCheckRequest(), timeout=5).status ==
                   health_pb2.HealthCheckResponse.SERVING, timeout=5, what="health SERVING again with the data port")
        health.close()
        log = src.log_tail(500)
        assert "cannot accept connections" in log and "accepts connections again" in log, log


# -- 5b: a reader that stops reading does not pin the cache ----------------------------------------------------------
@pytest.mark.parametrize("deadline_ms", [None, 300_000], ids=["version1", "version2-long-deadline"])
def test_a_reader_that_stops_reading_does_not_keep_the_cache(tmp_path: Path, deadline_ms: int | None) -> None:
    """A linked peer asks for 64 MiB and never reads the reply. DeallocateCache still succeeds at once: the serving
    thread, blocked in send, gives up when the cache is being released (it used to answer LLM_LINK_BUSY for as long
    as the stranger stayed)."""
    desc = CacheDesc(num_tensors=2, shape=(32, 1 << 20), data_type=DataType.UINT8)
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, src.client() as s:
        cache = s.allocate_cache(desc)
        secret, port = dataport.fake_link(src)
        with contextlib.closing(dataport.connect(port, secret, version=1 if deadline_ms is None else 2,
                                                 rcvbuf=4096)) as sock:
            sock.sendall(dataport.read_request(cache.cache_id, [(0, 0, 32 << 20), (1, 0, 32 << 20)], deadline_ms))
            magic, status, size = tcp.REPLY.unpack(sock.recv(tcp.REPLY.size, socket.MSG_WAITALL))
            assert (magic, status, size) == (b"KVRS", 0, 64 << 20)  # the server is sending: the cache is pinned
            # The case under test: the serving thread blocked in send, its socket's queue full and still.
            queued = [-1]

            def stuck_in_send() -> bool:
                seen, queued[0] = queued[0], dataport.unsent_to(sock)
                return queued[0] > 0 and queued[0] == seen

            wait_until(stuck_in_send, what="the daemon's send stuck behind a reader that reads nothing")
            # The daemon lets a release wait for the cache's transfers only until just short of the call's deadline,
            # then refuses it with LLM_LINK_BUSY: a release that succeeds within 3 s means the serving thread gave up.
            s.deallocate_cache(cache, timeout=3)
        assert s.get_cluster_info().cluster_id == 1


# -- 5c: slow handshakes do not lock peers out -----------------------------------------------------------------------
class _Dribblers:
    """`count` connections to a data port that each send one byte per second and reconnect when dropped."""

    def __init__(self, port: int, count: int) -> None:
        self._port = port
        self._count = count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.connected = 0
        self.rounds = 0
        """Rounds of one byte per connection sent so far."""

    def _open(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self._port), timeout=2)
        except OSError:
            return None
        sock.setblocking(False)
        return sock

    def _alive(self, sock: socket.socket) -> bool:
        try:
            if sock.recv(4096) == b"":
                return False
        except BlockingIOError:
            pass
        except OSError:
            return False
        try:
            sock.send(b"K")
        except BlockingIOError:
            pass
        except OSError:
            return False
        return True

    def _run(self) -> None:
        socks: list[socket.socket | None] = [self._open() for _ in range(self._count)]
        while True:
            for i, sock in enumerate(socks):
                if sock is None or not self._alive(sock):
                    if sock is not None:
                        sock.close()
                    socks[i] = self._open()
            self.connected = sum(s is not None for s in socks)
            self.rounds += 1
            if self._stop.wait(1.0):
                break
        for sock in socks:
            if sock is not None:
                sock.close()

    def __enter__(self) -> _Dribblers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_slow_handshakes_do_not_lock_linked_peers_out(tmp_path: Path) -> None:
    """600 connections drip one byte per second into the handshake (more than the daemon's connection limit) and
    reconnect when dropped; a linked peer still opens data connections and pulls, again and again."""
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, LocalDaemon(tmp_path, 2, backends=("tcp",)) as dst, \
            src.client() as s, dst.client() as d:
        a, b = s.allocate_cache(SMALL), d.allocate_cache(SMALL)
        fill(a, 2)
        port = dataport.fake_link(src)[1]
        with _Dribblers(port, 600) as flood:
            wait_until(lambda: flood.connected >= 600, timeout=30, what="600 dribbling connections")
            dripped = flood.rounds
            wait_until(lambda: flood.rounds >= dripped + 2, what="two more rounds of dribbling from all 600")
            for i in range(3):
                [linked] = d.link_clusters([cluster_of(src)])  # a new link: new data connections
                assert linked.ok, linked
                d.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, [i, i + 1], [7, 6], timeout=10)
                assert _blocks_equal(a, [i, i + 1], b, [7, 6])
                d.unlink_clusters([cluster_of(src)])
        assert s.get_cluster_info().cluster_id == 1


# -- 3 (tcp): a cache whose memory vanished fails its transfer, not the link -----------------------------------------
@contextlib.contextmanager
def _registered(client: Client, desc: CacheDesc, seed: int) -> Iterator[tuple[Cache, Path]]:
    """A cache in a segment this test (the model server) owns: filled, registered, and its file path."""
    name = f"kvbroker-test-{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, desc.tensor_nbytes * desc.num_tensors)
    finally:
        os.close(fd)
    try:
        cache = client.register_kv_cache(desc, [TensorLocation(name, i * desc.tensor_nbytes)
                                                for i in range(desc.num_tensors)])
        fill(cache, seed)
        try:
            yield cache, path
        finally:
            with contextlib.suppress(LlmError):
                client.unregister_kv_cache(cache)
    finally:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def tcp_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalDaemon, LocalDaemon]]:
    workdir = tmp_path_factory.mktemp("vanish")
    with LocalDaemon(workdir, 1, backends=("tcp",)) as src, LocalDaemon(workdir, 2, backends=("tcp",)) as dst:
        _link(dst, src)
        yield src, dst
        for d in (src, dst):
            assert d.proc is not None and d.proc.poll() is None, d.log_tail()


@pytest.mark.parametrize("desc", [SMALL, LARGE], ids=["small", "large"])
@pytest.mark.parametrize(("op", "vanishing"), [("pull", "source"), ("pull", "destination"),
                                               ("push", "source"), ("push", "destination")])
def test_a_truncated_segment_fails_its_transfer_not_the_link(tcp_pair: tuple[LocalDaemon, LocalDaemon], op: str,
                                                             vanishing: str, desc: CacheDesc) -> None:
    """The model server truncates a registered segment; a transfer from or into it over tcp fails with
    LLM_KV_CACHE_NOT_EXIST naming the cache and reporting every block, the link stays READY (it used to turn BROKEN
    with `[Errno 14] Bad address`), neither daemon dies, and the next transfer works."""
    src, dst = tcp_pair
    blocks, dst_blocks = [1, 2, 5], [0, 3, 4]
    with src.client() as s, dst.client() as d:
        # The pulling/pushing daemon is `dst`; the side whose memory vanishes is the transfer's source or destination.
        local, remote = (d, s)
        truncated_side = {("pull", "source"): s, ("pull", "destination"): d,
                          ("push", "source"): d, ("push", "destination"): s}[(op, vanishing)]
        healthy_side = s if truncated_side is d else d
        allocations = Allocations()
        try:
            with _registered(truncated_side, desc, 3) as (gone, path):
                other = allocations.alloc(healthy_side, desc, 4)
                os.truncate(path, 0)
                src_cache, dst_cache = (gone, other) if vanishing == "source" else (other, gone)
                with pytest.raises(LlmError) as info:
                    if op == "pull":
                        local.pull_kv_blocks(CacheIndex(src.cluster_id, src_cache.cache_id), dst_cache, blocks,
                                             dst_blocks, timeout=10)
                    else:
                        local.push_kv_blocks(src_cache, CacheIndex(src.cluster_id, dst_cache.cache_id), blocks,
                                             dst_blocks, timeout=10)
                err = info.value
                assert err.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST, err
                assert str(gone.cache_id) in err.message and "memory" in err.message, err
                assert sorted(err.failed_dst_blocks or []) == dst_blocks, err
                assert _link_state(local, src.cluster_id) == LinkState.READY
            # The same link (and the same data connections, where they survived) carries the next transfer.
            a, b = allocations.alloc(remote, desc, 5), allocations.alloc(local, desc, 6)
            local.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, blocks, dst_blocks, timeout=10)
            assert _blocks_equal(a, blocks, b, dst_blocks)
            local.push_kv_blocks(b, CacheIndex(src.cluster_id, a.cache_id), dst_blocks, [7, 6, 0], timeout=10)
            assert _blocks_equal(b, dst_blocks, a, [7, 6, 0])
            assert _link_state(local, src.cluster_id) == LinkState.READY
        finally:
            allocations.release()


# -- 9: concurrent writes into the same destination blocks are never torn --------------------------------------------
TORN = CacheDesc(num_tensors=2, shape=(8, 1 << 20), data_type=DataType.UINT8)
SOURCES = 6


@pytest.mark.parametrize("op", ["pull", "copy", "push"])
async def test_concurrent_writes_into_the_same_blocks_are_never_torn(
        linked_pair: tuple[LocalDaemon, LocalDaemon], op: str) -> None:
    """Six transfers from six different sources write the same eight 2 MiB destination blocks at once (pulls into
    a local cache, local copies, or pushes into the peer's cache); afterwards every destination block equals one
    source's block byte for byte, never a mix (they used to interleave across connections and copy threads)."""
    src, dst = linked_pair
    blocks = list(range(8))
    allocations = Allocations()
    with src.client() as s, dst.client() as d:
        try:
            source_side, target_side = {"pull": (s, d), "copy": (d, d), "push": (d, s)}[op]
            sources = [allocations.alloc(source_side, TORN, 100 + i) for i in range(SOURCES)]
            target = allocations.alloc(target_side, TORN, 99)
            async with AsyncClient(dst.target, timeout=60) as client:
                for _ in range(3):
                    if op == "pull":
                        calls = [client.pull_kv_blocks(CacheIndex(src.cluster_id, c.cache_id), target.cache_id,
                                                       blocks, blocks) for c in sources]
                    elif op == "copy":
                        calls = [client.copy_kv_blocks(c.cache_id, target.cache_id, blocks, [blocks])
                                 for c in sources]
                    else:
                        calls = [client.push_kv_blocks(c.cache_id, CacheIndex(src.cluster_id, target.cache_id),
                                                       blocks, blocks) for c in sources]
                    await asyncio.gather(*calls)
                    for blk in blocks:
                        matches = [i for i, c in enumerate(sources) if _blocks_equal(c, [blk], target, [blk])]
                        assert len(matches) == 1, f"block {blk} is not one source's block (matches {matches})"
        finally:
            allocations.release()


def test_a_write_that_waits_for_its_turn_past_its_deadline_writes_nothing(tmp_path: Path) -> None:
    """A pull from a frozen peer holds destination blocks 0 and 1; a local copy into blocks 1 and 5 waits for its
    turn, then fails with LLM_TIMEOUT at its own deadline, reporting both blocks, having written neither."""
    with LocalDaemon(tmp_path, 1, backends=("tcp",)) as src, \
            LocalDaemon(tmp_path, 2, backends=("tcp",), extra_args=["--metrics-listen", "127.0.0.1:0"]) as dst, \
            src.client() as s, dst.client() as d:
        _link(dst, src)
        metrics_at = d.get_cluster_info().metrics_address
        a = s.allocate_cache(LARGE)
        b, c = d.allocate_cache(LARGE), d.allocate_cache(LARGE)
        for seed, cache in enumerate((a, b, c)):
            fill(cache, seed)
        d.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, [7], [7])  # learns the source cache
        src.signal(signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                stalled = pool.submit(d.pull_kv_blocks, CacheIndex(src.cluster_id, a.cache_id), b, [0, 1], [0, 1],
                                      timeout=4)
                wait_until(lambda: transfers_in_flight(metrics_at) == 1, what="the pull from the frozen peer running")
                before = snapshot(b)
                with pytest.raises(LlmError) as info:
                    d.copy_kv_blocks(c, b, [2, 1], [[5, 1]], timeout=1)
                assert info.value.status == LlmStatus.LLM_TIMEOUT, info.value
                assert "same destination blocks" in info.value.message
                assert sorted(info.value.failed_dst_blocks or []) == [1, 5]
                assert all(np.array_equal(x[5], y[5]) for x, y in zip(b.tensors, before, strict=True))
                with pytest.raises(LlmError) as hung:
                    stalled.result()
                assert hung.value.status == LlmStatus.LLM_TIMEOUT
        finally:
            src.signal(signal.SIGCONT)
        d.copy_kv_blocks(c, b, [2, 1], [[5, 1]], timeout=10)  # the blocks are free again
        assert _blocks_equal(c, [2, 1], b, [5, 1])


# -- issue 23, finding 4: a peer that trickles is held to a minimum rate ------------------------------------------
# A one-second window keeps the test short; the daemon's default (10 s) is judged the same way.
_ONE_SECOND_WINDOWS = {"KVBROKER_TCP_RATE_WINDOW_S": "1"}
_TRICKLE_BYTES = 4096
_TRICKLE_EVERY_S = 0.05  # 80 KiB/s: steady progress, never a stall, far below the 1 MiB/s minimum


def _trickle(sock: socket.socket, op: str, stop: threading.Event) -> None:
    """Reads (or writes) 4 KiB every 50 ms until the daemon drops the connection or the test ends."""
    chunk = bytes(_TRICKLE_BYTES)
    with contextlib.suppress(OSError):
        while not stop.wait(_TRICKLE_EVERY_S):
            if op == "read" and not sock.recv(_TRICKLE_BYTES):
                return
            if op == "write":
                sock.sendall(chunk)


@pytest.mark.parametrize(("op", "release"), [("read", "deallocate"), ("write", "lease"), ("read", "lease")])
def test_a_peer_that_trickles_is_abandoned_so_the_cache_can_be_released(tmp_path: Path, op: str,
                                                                        release: str) -> None:
    """A linked peer reads a 64 MiB reply (or writes a 64 MiB payload) 4 KiB every 50 ms: it always makes progress,
    so neither the stall timeout nor the release's wake-up ended it, and its pin kept the cache for the request's
    whole deadline (DeallocateCache answered LLM_LINK_BUSY, an expired lease freed nothing). Below the minimum rate
    the daemon abandons it, and the release or the lease expiry goes through."""
    from kvbroker.convert import desc_to_pb
    from kvbroker.v1 import broker_pb2, broker_pb2_grpc

    desc = CacheDesc(num_tensors=2, shape=(32, 1 << 20), data_type=DataType.UINT8)
    with LocalDaemon(tmp_path, 1, backends=("tcp",), env=_ONE_SECOND_WINDOWS) as src, src.client() as s, \
            grpc.insecure_channel(src.target) as ch:
        stub = broker_pb2_grpc.KvBrokerStub(ch)
        # The owner: a session with a one-second lease that it never renews (a model server that died).
        session = f"trickle-{uuid.uuid4().hex[:8]}"
        stub.KeepAlive(broker_pb2.KeepAliveRequest(session_id=session, ttl_ms=1000), timeout=5)
        cache_id = stub.AllocateCache(broker_pb2.AllocateCacheRequest(
            desc=desc_to_pb(desc), session_id=session if release == "lease" else ""), timeout=10).cache.cache_id
        secret, port = dataport.fake_link(src)
        stop = threading.Event()
        with contextlib.closing(dataport.connect(port, secret, rcvbuf=4096)) as sock:
            runs = [(0, 0, 32 << 20), (1, 0, 32 << 20)]
            frame = dataport.read_request(cache_id, runs, 300_000)
            if op == "write":
                frame = b"KVWR" + frame[4:]
            sock.sendall(frame)
            magic, status, size = tcp.REPLY.unpack(sock.recv(tcp.REPLY.size, socket.MSG_WAITALL))
            assert (magic, status, size) == (b"KVRS", 0, 64 << 20)  # the request runs: the cache is pinned
            trickler = threading.Thread(target=_trickle, args=(sock, op, stop), daemon=True)
            trickler.start()
            try:
                def released() -> bool:
                    if release == "deallocate":
                        try:
                            s.deallocate_cache(cache_id, timeout=2)
                        except LlmError as e:
                            assert e.status == LlmStatus.LLM_LINK_BUSY, e
                            return False
                    return all(c.cache_id != cache_id for c in s.list_caches())

                wait_until(released, what=f"the cache released although a peer trickles its {op}")
            finally:
                stop.set()
                trickler.join(timeout=10)
