"""Memory that vanishes, fills up, or belongs to someone else never kills a daemon, and a peer never makes one
touch a file outside its shm directory (issue 10, findings 2, 3, 7 and 8).

Real daemons share a private shm directory (`--shm-dir`), so the tests see only the files they made. The test
process plays the model server: it registers its own segments and then truncates them, as a careless one would.
It never touches a truncated cache's arrays itself (that would be its own SIGBUS).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbroker import (
    Cache,
    CacheDesc,
    CacheIndex,
    Client,
    ClusterInfo,
    DataType,
    KvCacheNotExistError,
    LlmError,
    LlmStatus,
    OutOfMemoryError,
    TensorLocation,
)
from kvbroker._local import LocalDaemon
from kvbroker.convert import desc_to_pb, tensor_location_to_pb
from kvbroker.v1 import peer_pb2
from tests import peerkit
from tests.conftest import cluster_of
from tests.helpers import fill, wait_until

DESC = CacheDesc(num_tensors=2, shape=(8, 4096), data_type=DataType.UINT8)
BLOCKS = list(range(8))
PID_NAMESPACE = ["unshare", "--pid", "--fork", "--kill-child"]


def _daemon(workdir: Path, cluster_id: int, shm_dir: Path, wrapper: list[str] | None = None) -> LocalDaemon:
    return LocalDaemon(workdir, cluster_id, backends=("shm",), extra_args=["--shm-dir", str(shm_dir)],
                       wrapper=wrapper or [])


class Pair:
    def __init__(self, src: LocalDaemon, dst: LocalDaemon, s: Client, d: Client, shm_dir: Path) -> None:
        self.src, self.dst, self.s, self.d, self.shm_dir = src, dst, s, d, shm_dir

    def register(self, client: Client, seed: int) -> tuple[Cache, Path]:
        """A model server's own segment, registered as a cache of DESC and filled."""
        path = self.shm_dir / f"model-{uuid.uuid4().hex[:8]}"
        with open(path, "wb") as f:
            f.truncate(DESC.num_tensors * DESC.tensor_nbytes)
        cache = client.register_kv_cache(DESC, [TensorLocation(path.name, i * DESC.tensor_nbytes)
                                                for i in range(DESC.num_tensors)])
        fill(cache, seed)
        return cache, path

    def alive(self) -> None:
        for d in (self.src, self.dst):
            assert d.proc is not None and d.proc.poll() is None, f"daemon {d.cluster_id} died:\n{d.log_tail()}"


@pytest.fixture
def pair(tmp_path: Path, shm_dir: Path) -> Iterator[Pair]:
    with _daemon(tmp_path, 1, shm_dir) as src, _daemon(tmp_path, 2, shm_dir) as dst, \
            src.client() as s, dst.client() as d:
        [result] = d.link_clusters([cluster_of(src)])
        assert result.ok, result
        yield Pair(src, dst, s, d, shm_dir)
        for daemon in (src, dst):
            if daemon.proc is not None and daemon.proc.poll() is None:  # one test kills the source
                assert daemon.stop() == 0, daemon.log_tail()


def _expect_gone(call: object, *words: str) -> LlmError:
    assert callable(call)
    with pytest.raises(KvCacheNotExistError) as err:
        call()
    assert err.value.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST
    for word in words:
        assert word in err.value.message, err.value.message
    return err.value


def test_truncated_model_server_memory_fails_every_copy_and_no_daemon_dies(pair: Pair) -> None:
    s, d = pair.s, pair.d
    src_reg, src_path = pair.register(s, seed=1)
    src_alloc = s.allocate_cache(DESC)
    fill(src_alloc, 2)
    expected = [t.copy() for t in src_alloc.tensors]
    dst_alloc = d.allocate_cache(DESC)
    dst_reg, dst_path = pair.register(d, seed=3)
    d.pull_kv_blocks(CacheIndex(1, src_reg.cache_id), dst_alloc, BLOCKS, BLOCKS)  # maps the peer's segment

    os.truncate(src_path, 0)  # the source model server frees its memory while registered
    os.truncate(dst_path, 4096)  # and so does the destination's
    _expect_gone(lambda: d.pull_kv_blocks(CacheIndex(1, src_reg.cache_id), dst_alloc, BLOCKS, BLOCKS),
                 f"remote cache {src_reg.cache_id}", "shrank")
    _expect_gone(lambda: d.push_kv_blocks(dst_alloc, CacheIndex(1, src_reg.cache_id), BLOCKS, BLOCKS),
                 f"remote cache {src_reg.cache_id}", "0 bytes")
    _expect_gone(lambda: s.copy_kv_blocks(src_reg, src_alloc, BLOCKS, [BLOCKS]), f"cache {src_reg.cache_id}")
    _expect_gone(lambda: s.copy_kv_blocks(src_alloc, src_reg, BLOCKS, [BLOCKS]), f"cache {src_reg.cache_id}")
    _expect_gone(lambda: d.pull_kv_blocks(CacheIndex(1, src_alloc.cache_id), dst_reg, BLOCKS, BLOCKS),
                 f"cache {dst_reg.cache_id}")
    _expect_gone(lambda: d.push_kv_blocks(dst_reg, CacheIndex(1, src_alloc.cache_id), [0], [0]),
                 f"cache {dst_reg.cache_id}")
    pair.alive()

    assert [np.array_equal(a, b) for a, b in zip(src_alloc.tensors, expected, strict=True)] == [True, True]
    d.pull_kv_blocks(CacheIndex(1, src_alloc.cache_id), dst_alloc, BLOCKS, BLOCKS[::-1])
    for got, want in zip(dst_alloc.tensors, expected, strict=True):
        assert np.array_equal(got, want[::-1])
    s.unregister_kv_cache(src_reg)
    d.unregister_kv_cache(dst_reg)
    pair.alive()


def test_a_copy_into_memory_that_cannot_be_backed_fails_instead_of_killing(tmp_path: Path) -> None:
    """A registered segment is sparse: on a full tmpfs, its first write finds no page. The copy is refused with a
    status; a plain memmove would have died of SIGBUS."""
    mount = _small_tmpfs(tmp_path / "shm", "8m")
    try:
        with _daemon(tmp_path, 1, mount) as daemon, daemon.client() as c:
            sparse = mount / "model-sparse"
            with open(sparse, "wb") as f:
                f.truncate(DESC.num_tensors * DESC.tensor_nbytes)
            dst = c.register_kv_cache(DESC, [TensorLocation(sparse.name, i * DESC.tensor_nbytes)
                                             for i in range(DESC.num_tensors)])
            src = c.allocate_cache(DESC)
            fill(src, 4)
            filler = c.allocate_cache(CacheDesc(num_tensors=1, shape=(1, _free(mount) - 8192),
                                                data_type=DataType.UINT8))
            err = _expect_gone(lambda: c.copy_kv_blocks(src, dst, BLOCKS, [BLOCKS]), f"cache {dst.cache_id}",
                               "vanished")
            assert err.failed_dst_blocks
            assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_tail()
            c.deallocate_cache(filler)
            c.copy_kv_blocks(src, dst, BLOCKS, [BLOCKS])
            for got, want in zip(dst.tensors, src.tensors, strict=True):
                assert np.array_equal(got, want)
            c.unregister_kv_cache(dst)
            c.deallocate_cache(src)
            assert daemon.stop() == 0, daemon.log_tail()
    finally:
        _unmount(mount)


# -- AllocateCache reserves its memory -------------------------------------------------------------------------------

def _small_tmpfs(path: Path, size: str) -> Path:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    return path


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "--lazy", str(path)], check=True)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_allocate_reserves_tmpfs_space_and_refuses_what_does_not_fit(tmp_path: Path) -> None:
    mount = _small_tmpfs(tmp_path / "shm", "8m")
    try:
        with _daemon(tmp_path, 1, mount) as daemon, daemon.client() as c:
            files_before = sorted(p.name for p in mount.iterdir())
            six_mib = CacheDesc(num_tensors=2, shape=(3, 1 << 20), data_type=DataType.UINT8)
            first = c.allocate_cache(six_mib)
            assert _free(mount) < 3 << 20, "the first cache's memory must be taken from the tmpfs now"
            with pytest.raises(OutOfMemoryError) as err:
                c.allocate_cache(six_mib)
            assert err.value.status == LlmStatus.LLM_OUT_OF_MEMORY
            assert sorted(p.name for p in mount.iterdir()) == sorted(
                [*files_before, first.record.tensors[0].segment]), "a refused cache must leave nothing behind"
            for t in first.tensors:  # every page of the first cache is really there
                t[...] = 7
            assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_tail()
            c.deallocate_cache(first)
            assert sorted(p.name for p in mount.iterdir()) == files_before
            assert daemon.stop() == 0, daemon.log_tail()
    finally:
        _unmount(mount)


def test_the_daemon_keeps_answering_while_allocate_reserves_memory(tmp_path: Path, shm_dir: Path) -> None:
    """Reserving 1 GiB takes from a third of a second to seconds: it must not stall the event loop meanwhile."""
    desc = CacheDesc(num_tensors=4, shape=(1024, 256 << 10), data_type=DataType.UINT8)
    with _daemon(tmp_path, 1, shm_dir) as daemon, daemon.client() as c, daemon.client() as pinger:
        allocated = threading.Event()
        before = set(shm_dir.iterdir())

        def allocate() -> None:
            cache = c.allocate_cache(desc)
            allocated.set()
            c.deallocate_cache(cache)

        def reserved() -> int:
            """Bytes of the new cache's segments backed by memory so far (tmpfs counts them as it reserves)."""
            total = 0
            for path in set(shm_dir.iterdir()) - before:
                with contextlib.suppress(FileNotFoundError):
                    total += path.stat().st_blocks * 512
            return total

        thread = threading.Thread(target=allocate)
        thread.start()
        answered, mid_reservation = 0, 0
        while not allocated.is_set() and thread.is_alive():
            started_at = reserved()
            pinger.ping()
            answered += 1
            # Counted, not timed (the host may be loaded): a ping sent once the reservation had begun and answered
            # before it ended. A stalled loop answers no such ping: the one it holds is answered after the end.
            if started_at > 0 and reserved() < desc.tensor_nbytes * desc.num_tensors and not allocated.is_set():
                mid_reservation += 1
        thread.join()
        assert allocated.is_set(), "the allocation failed"
        assert mid_reservation >= 3, f"{mid_reservation} of {answered} pings answered while the memory was reserved"


def test_control_page_is_private(tmp_path: Path, shm_dir: Path) -> None:
    with _daemon(tmp_path, 1, shm_dir):
        [page] = [p for p in shm_dir.iterdir() if p.name.endswith("-ctl")]
        assert page.stat().st_mode & 0o077 == 0, oct(page.stat().st_mode)


# -- stale segments: by instance lock, not by PID ------------------------------------------------------------------

def _can_unshare_pid() -> bool:
    return subprocess.run([*PID_NAMESPACE, "true"], capture_output=True).returncode == 0


def _stop_in_namespace(daemon: LocalDaemon) -> int:
    """SIGTERM to the daemon itself (unshare(1) ignores it), then its exit code as unshare passes it on."""
    assert daemon.proc is not None
    [child] = Path(f"/proc/{daemon.proc.pid}/task/{daemon.proc.pid}/children").read_text().split()
    os.kill(int(child), signal.SIGTERM)
    return daemon.proc.wait(10)


def _allocate_in(daemon: LocalDaemon) -> Path:
    with daemon.client(lease_ttl=None) as c:
        cache = c.allocate_cache(DESC)
        cache.close()
        return Path(cache.record.shm_dir) / cache.record.tensors[0].segment


@pytest.mark.skipif(not _can_unshare_pid(), reason="needs root and unshare(1) for a PID namespace")
def test_a_daemon_in_another_pid_namespace_keeps_its_segments(tmp_path: Path, shm_dir: Path) -> None:
    """The second daemon cannot see the first one's PID: by PID it would have taken it for dead."""
    with _daemon(tmp_path, 1, shm_dir) as first:
        segment = _allocate_in(first)
        with _daemon(tmp_path, 2, shm_dir, wrapper=PID_NAMESPACE) as second:
            assert segment.exists(), "a live daemon's segment was removed"
            with first.client() as c:
                assert segment.name in {r.tensors[0].segment for r in c.list_caches()}
                c.allocate_cache(DESC)  # and it still serves
            assert _stop_in_namespace(second) == 0, second.log_tail()


@pytest.mark.skipif(not _can_unshare_pid(), reason="needs root and unshare(1) for a PID namespace")
def test_a_killed_daemons_segments_are_freed_by_a_daemon_with_its_pid(tmp_path: Path, shm_dir: Path) -> None:
    """Both daemons run as PID 1 of their own namespace (as in containers): the dead one's PID is the live one's."""
    victim = _daemon(tmp_path, 1, shm_dir, wrapper=PID_NAMESPACE).start()
    segment = _allocate_in(victim)
    victim.signal(signal.SIGKILL)
    assert victim.proc is not None
    victim.proc.wait()
    assert segment.exists()
    with _daemon(tmp_path, 2, shm_dir, wrapper=PID_NAMESPACE) as successor:
        assert not segment.exists(), "a dead daemon's segment was left behind"
        owners = {p.name.split("-")[1].split(".")[0] for p in shm_dir.iterdir()}
        assert len(owners) == 1, f"only the live daemon's files remain: {sorted(owners)}"
        assert _stop_in_namespace(successor) == 0, successor.log_tail()
    assert not list(shm_dir.iterdir()), "a daemon that stops removes its files, lock included"


# -- shm push into a destination that goes away ----------------------------------------------------------------------

def test_shm_push_into_a_killed_daemon_reports_every_block_failed(pair: Pair) -> None:
    remote = pair.s.allocate_cache(DESC)
    local = pair.d.allocate_cache(DESC)
    fill(local, 5)
    pair.d.push_kv_blocks(local, CacheIndex(1, remote.cache_id), BLOCKS, BLOCKS)  # the link knows the cache now
    pair.src.signal(signal.SIGKILL)
    assert pair.src.proc is not None
    pair.src.proc.wait()
    with pytest.raises(LlmError) as err:
        pair.d.push_kv_blocks(local, CacheIndex(1, remote.cache_id), BLOCKS, BLOCKS)
    assert err.value.status == LlmStatus.LLM_LINK_FAILED, err.value
    assert "gone" in err.value.message
    assert sorted(err.value.failed_dst_blocks or []) == BLOCKS
    assert pair.dst.proc is not None and pair.dst.proc.poll() is None, pair.dst.log_tail()


@pytest.mark.parametrize("how", ["killed", "deallocated"])
def test_shm_push_while_the_destination_goes_away(pair: Pair, how: str) -> None:
    """The destination goes away while a long push (many small scattered runs) copies: whatever the timing, the
    push fails and reports every block, never a success into memory that nobody holds any more."""
    desc = CacheDesc(num_tensors=128, shape=(1024, 2048), data_type=DataType.UINT8)  # 256 MiB, 131,072 runs
    src_blocks = list(range(1024))
    dst_blocks = src_blocks[::-1]
    local = pair.d.allocate_cache(desc)
    remote = pair.s.allocate_cache(desc)
    pair.d.push_kv_blocks(local, CacheIndex(1, remote.cache_id), [0], [0])  # the link knows the cache now

    def go_away() -> None:
        time.sleep(0.05)  # the scenario, not a wait: the destination goes away early in the push (any moment will do)
        if how == "killed":
            pair.src.signal(signal.SIGKILL)
        else:
            pair.s.deallocate_cache(remote)

    thread = threading.Thread(target=go_away)
    thread.start()
    try:
        with pytest.raises(LlmError) as err:
            pair.d.push_kv_blocks(local, CacheIndex(1, remote.cache_id), src_blocks, dst_blocks)
    finally:
        thread.join()
    want = LlmStatus.LLM_LINK_FAILED if how == "killed" else LlmStatus.LLM_KV_CACHE_NOT_EXIST
    assert err.value.status == want, err.value
    assert sorted(err.value.failed_dst_blocks or []) == src_blocks
    assert pair.dst.proc is not None and pair.dst.proc.poll() is None, pair.dst.log_tail()


# -- a linked peer names local files -------------------------------------------------------------------------------

EPOCH = "0123abcd"


@contextlib.contextmanager
def _fake_peer(workdir: Path, page_name: str, nonce: bytes, segments: list[str]) -> Iterator[str]:
    """A compromised peer (it holds the deployment token) that names `page_name` as its shm probe page and
    describes cache 7 as living in `segments`: nothing real can be made to send these answers."""
    desc = peer_pb2.AuthenticateResponse(cluster_id=9, instance_epoch=EPOCH, backend_info={
        "shm": json.dumps({"segment": page_name, "nonce": nonce.hex()}).encode()})
    with peerkit.FakePeer(9, peerkit.token_of(workdir), desc) as peer:
        peer.caches[7] = peer_pb2.GetCacheInfoResponse(
            cache_id=7, desc=desc_to_pb(DESC), instance_epoch=EPOCH,
            tensors=[tensor_location_to_pb(TensorLocation(s, 0)) for s in segments])
        yield peer.address


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A root-only file outside the shm directory that no peer may read or write through us."""
    path = tmp_path / "secret"
    path.write_bytes(b"S" * DESC.tensor_nbytes * 2)
    path.chmod(0o600)
    return path


def test_a_peer_cannot_point_the_shm_probe_outside_our_directory(tmp_path: Path, shm_dir: Path) -> None:
    nonce = os.urandom(16)
    page = tmp_path / f"kvbroker-{EPOCH}-ctl"  # a valid page name, but outside our shm dir
    page.write_bytes(nonce + bytes(32))
    with _daemon(tmp_path, 2, shm_dir) as d, d.client() as c:
        for name in (page.name, str(page), f"../{tmp_path.name}/{page.name}"):
            with _fake_peer(tmp_path, name, nonce, []) as address:
                [result] = c.link_clusters([ClusterInfo(remote_cluster_id=9, remote_address=address)])
                assert result.status == LlmStatus.LLM_LINK_FAILED and "no usable backend" in result.message, \
                    result


@pytest.mark.parametrize("name", ["absolute", "dotdot", "symlink"])
def test_a_peer_cannot_make_us_read_or_write_files_outside_our_directory(tmp_path: Path, shm_dir: Path,
                                                                         secret: Path, name: str) -> None:
    nonce = os.urandom(16)
    page = shm_dir / f"kvbroker-{EPOCH}-ctl"
    page.write_bytes(nonce + bytes(8 * 7) + (7).to_bytes(8, "little"))  # 8 slots: cache 7 is "live"
    lock = os.open(shm_dir / f"kvbroker-{EPOCH}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # the fake peer's daemon "runs"
    (shm_dir / "innocent").symlink_to(secret)
    segment = {"absolute": str(secret), "dotdot": f"../../..{secret}", "symlink": "innocent"}[name]
    before = secret.read_bytes()
    try:
        with _daemon(tmp_path, 2, shm_dir) as d, \
                _fake_peer(tmp_path, page.name, nonce, [segment, segment]) as address, d.client() as c:
            [result] = c.link_clusters([ClusterInfo(remote_cluster_id=9, remote_address=address)])
            assert result.ok, result
            dst = c.allocate_cache(DESC)
            with pytest.raises(LlmError) as err:
                c.pull_kv_blocks(CacheIndex(9, 7), dst, BLOCKS, BLOCKS)
            assert err.value.status == LlmStatus.LLM_LINK_FAILED, err.value
            assert not any(t.any() for t in dst.tensors), "nothing of the file may land in the cache"
            fill(dst, 8)
            with pytest.raises(LlmError):
                c.push_kv_blocks(dst, CacheIndex(9, 7), BLOCKS, BLOCKS)
            assert secret.read_bytes() == before
            assert d.proc is not None and d.proc.poll() is None, d.log_tail()
    finally:
        os.close(lock)


# -- issue 23, finding 3: nothing a puller maps for a peer outlives the peer's cache --------------------------------
def _held(pid: int, shm_dir: Path, prefix: str) -> set[str]:
    """Names of `shm_dir` files starting with `prefix` that process `pid` has open or mapped."""
    names = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            names.add(os.readlink(fd))
    with contextlib.suppress(OSError):
        names.update(line.split(maxsplit=5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                     if len(line.split(maxsplit=5)) == 6)
    folder = f"{shm_dir}/"
    return {n.removeprefix(folder).removesuffix(" (deleted)") for n in names
            if n.startswith(folder + prefix)}


@pytest.mark.parametrize("ending", ["deallocated", "killed"])
def test_a_puller_lets_go_of_a_peer_cache_that_is_gone(tmp_path: Path, shm_dir: Path, ending: str) -> None:
    """The puller kept every remote cache it had read open and mapped for the life of the link: after the peer
    deallocated it (or died) its tmpfs memory was never freed. Now the link's heartbeat sweep drops it."""
    with _daemon(tmp_path, 1, shm_dir) as src, _daemon(tmp_path, 2, shm_dir) as dst, src.client() as s, \
            dst.client() as d:
        [linked] = d.link_clusters([cluster_of(src)])
        assert linked.ok, linked
        a, b = s.allocate_cache(DESC), d.allocate_cache(DESC)
        segment = a.record.tensors[0].segment
        d.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, [0], [0])
        assert dst.proc is not None
        assert _held(dst.proc.pid, shm_dir, segment) == {segment}  # the premise: the pull opened the peer's memory
        if ending == "deallocated":
            s.deallocate_cache(a)
        else:
            s.close()
            src.signal(signal.SIGKILL)
        wait_until(lambda: not _held(dst.proc.pid, shm_dir, segment),  # type: ignore[union-attr]
                   what=f"the puller to close the peer's {ending} cache")


def test_a_link_keeps_a_bounded_number_of_peer_caches_open(tmp_path: Path, shm_dir: Path) -> None:
    """Caches the peer still holds but the puller no longer reads are closed beyond MAX_OPEN_CACHES (least recently
    used first) and opened again when read."""
    from kvbrokerd.backends.shm.backend import MAX_OPEN_CACHES

    small = CacheDesc(num_tensors=1, shape=(1, 64), data_type=DataType.UINT8)
    with _daemon(tmp_path, 1, shm_dir) as src, _daemon(tmp_path, 2, shm_dir) as dst, src.client() as s, \
            dst.client() as d:
        [linked] = d.link_clusters([cluster_of(src)])
        assert linked.ok, linked
        b = d.allocate_cache(small)
        caches = [s.allocate_cache(small) for _ in range(MAX_OPEN_CACHES + 8)]
        for i, a in enumerate(caches):
            fill(a, i)
            d.pull_kv_blocks(CacheIndex(src.cluster_id, a.cache_id), b, [0], [0])
        assert dst.proc is not None
        segments = [a.record.tensors[0].segment for a in caches]
        held = _held(dst.proc.pid, shm_dir, segments[0].rpartition("-")[0]) & set(segments)
        assert held == set(segments[-MAX_OPEN_CACHES:])  # the least recently used went first
        d.pull_kv_blocks(CacheIndex(src.cluster_id, caches[0].cache_id), b, [0], [0])  # and comes back when read
        assert np.array_equal(b.tensors[0][0], caches[0].tensors[0][0])
