"""Cache registry through the public client: allocate, register caller memory, list, release."""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvbroker import CacheDesc, DataType, KvCacheNotExistError, ParamInvalidError, TensorLocation
from kvbroker._local import LocalDaemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    with LocalDaemon(tmp_path_factory.mktemp("caches"), 1) as d:
        yield d


@pytest.fixture
def segment() -> Iterator[str]:
    name = f"kvbroker-test-{uuid.uuid4().hex[:8]}"
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 1 << 16)
    os.close(fd)
    try:
        yield name
    finally:
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)


def test_allocate_maps_shared_memory_and_ids_are_unique(daemon: LocalDaemon) -> None:
    desc = CacheDesc(num_tensors=3, shape=(4, 2, 8), data_type=DataType.FLOAT32)
    with daemon.client() as c:
        a, b = c.allocate_cache(desc), c.allocate_cache(desc)
        try:
            assert a.cache_id != b.cache_id
            assert len(a.tensors) == 3 and a.tensors[0].shape == (4, 2, 8) and a.tensors[0].dtype == np.float32
            a.tensors[1][2] = 7.0
            with daemon.client() as other:
                [rec] = [r for r in other.list_caches() if r.cache_id == a.cache_id]
                assert rec.daemon_owned and rec.desc == desc
                seg = Path(rec.shm_dir) / rec.tensors[1].segment
                with open(seg, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                    view = np.frombuffer(m, np.float32, count=64, offset=rec.tensors[1].offset).reshape(4, 2, 8)
                    assert (view[2] == 7.0).all()
                    del view
        finally:
            c.deallocate_cache(a)
            c.deallocate_cache(b)
        assert all(r.cache_id not in (a.cache_id, b.cache_id) for r in c.list_caches())
        with pytest.raises(KvCacheNotExistError):
            c.deallocate_cache(a.cache_id)


def test_deallocate_removes_the_segment(daemon: LocalDaemon) -> None:
    with daemon.client() as c:
        cache = c.allocate_cache(CacheDesc(num_tensors=1, shape=(2, 4)))
        seg = Path(cache.record.shm_dir) / cache.record.tensors[0].segment
        assert seg.exists()
        c.deallocate_cache(cache)
        assert not seg.exists()


def test_register_caller_memory(daemon: LocalDaemon, segment: str) -> None:
    desc = CacheDesc(num_tensors=2, shape=(4, 16), data_type=DataType.UINT8)
    with daemon.client() as c:
        cache = c.register_kv_cache(desc, [TensorLocation(segment, 0), TensorLocation(segment, 4096)])
        try:
            cache.tensors[1][3] = 9
            with open(f"/dev/shm/{segment}", "rb") as f:
                f.seek(4096 + 3 * 16)
                assert f.read(16) == bytes([9] * 16)
            [rec] = [r for r in c.list_caches() if r.cache_id == cache.cache_id]
            assert not rec.daemon_owned
            with pytest.raises(ParamInvalidError, match="UnregisterKvCache"):
                c.deallocate_cache(cache.cache_id)
        finally:
            c.unregister_kv_cache(cache)
        assert Path(f"/dev/shm/{segment}").exists(), "unregister must leave the caller's memory alone"


def test_daemon_segments_are_private(daemon: LocalDaemon) -> None:
    with daemon.client() as c:
        cache = c.allocate_cache(CacheDesc(num_tensors=1, shape=(2, 4)))
        try:
            seg = Path(cache.record.shm_dir) / cache.record.tensors[0].segment
            assert seg.stat().st_mode & 0o077 == 0
        finally:
            c.deallocate_cache(cache)
    assert daemon.socket_path.stat().st_mode & 0o077 == 0


def test_stale_segments_of_dead_daemons_are_removed(tmp_path: Path) -> None:
    """A SIGKILLed daemon cannot unlink its segments; the next daemon on the host does."""
    import signal

    victim = LocalDaemon(tmp_path, 5).start()
    with victim.client() as c:
        cache = c.allocate_cache(CacheDesc(num_tensors=1, shape=(2, 4)))
        seg = Path(cache.record.shm_dir) / cache.record.tensors[0].segment
        c.close()
    victim.signal(signal.SIGKILL)
    assert victim.proc is not None
    victim.proc.wait()
    assert seg.exists()
    with LocalDaemon(tmp_path, 6):
        assert not seg.exists()


def test_an_allocation_whose_caller_gave_up_is_released(tmp_path: Path) -> None:
    """The caller gives up while the daemon reserves a cache: the caller never learns the id, so the daemon frees the
    cache itself instead of keeping it (without a lease) forever. The daemon is stopped (SIGSTOP) as soon as its
    segment appears and the caller cancels meanwhile, so that the allocation always outlasts the caller, however
    fast the machine reserves memory."""
    import signal

    import grpc

    from kvbroker.convert import desc_to_pb
    from kvbroker.v1 import broker_pb2, broker_pb2_grpc
    from tests.helpers import private_shm_dir, remove_dir, wait_until

    shm = private_shm_dir()
    try:
        with LocalDaemon(tmp_path, 7, extra_args=["--shm-dir", str(shm)]) as d, \
                grpc.insecure_channel(d.target) as ch:
            stub = broker_pb2_grpc.KvBrokerStub(ch)
            desc = desc_to_pb(CacheDesc(num_tensors=1, shape=(1 << 18, 1024), data_type=DataType.FLOAT32))  # 1 GiB
            call = stub.AllocateCache.future(broker_pb2.AllocateCacheRequest(desc=desc), timeout=60)

            def segment() -> list[Path]:
                if call.done():  # the allocation finished before the daemon could be stopped
                    raise AssertionError(f"allocated before the caller could give up: {call.result()}")
                return [p for p in shm.iterdir() if p.name.endswith(tuple("0123456789"))]

            wait_until(segment, poll=0.0005, what="the daemon to start reserving the segment")
            d.signal(signal.SIGSTOP)
            try:
                call.cancel()
            finally:
                d.signal(signal.SIGCONT)

            def freed() -> bool:
                listed = stub.ListCaches(broker_pb2.ListCachesRequest(), timeout=5).caches
                return not listed and not [p for p in shm.iterdir() if p.name.endswith(tuple("0123456789"))]

            wait_until(freed, what="the abandoned allocation to be released (its cache gone, its segment removed)")
    finally:
        remove_dir(shm)
