"""The `nixl` backend between two real daemons on this host (NIXL over UCX, host memory): verified blocks both ways,
a removed remote cache, a transport error, a peer killed mid-pull. Skipped, with the install line, where NIXL is not
installed. The shared suites (test_pull, test_transfer_api, test_validation, test_fuzz) also run on nixl."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvbroker import CacheDesc, CacheIndex, Client, DataType, LinkState, LlmError, LlmStatus, TensorLocation
from kvbroker._local import LocalDaemon
from kvbrokerd.backends import unavailable
from tests.conftest import cluster_of
from tests.helpers import assert_bytes_equal, expected_pull, fill, snapshot, wait_until

pytestmark = pytest.mark.skipif(unavailable("nixl") is not None, reason=str(unavailable("nixl")))

Pair = tuple[LocalDaemon, LocalDaemon]
on_the_nixl_pair = pytest.mark.parametrize("linked_pair", ["nixl"], indirect=True)
"""The session's linked pair of nixl daemons (conftest.py), shared with the other suites: no daemon start here."""


def _wait_ready(d: Client, cluster_id: int) -> None:
    """A failed transfer marks the link BROKEN until the next good heartbeat (about a second)."""
    wait_until(lambda: all(link.state == LinkState.READY for link in d.list_links()
                           if link.remote_cluster_id == cluster_id),
               timeout=10, what=f"the link to cluster {cluster_id} READY again")


@on_the_nixl_pair
def test_kvbrokerd_backends_nixl_moves_verified_blocks_both_ways(linked_pair: Pair) -> None:
    src_d, dst_d = linked_pair
    desc = CacheDesc(num_tensors=4, shape=(64, 8, 128), data_type=DataType.FLOAT16)  # 2 KiB blocks, 128 KiB tensors
    with src_d.client() as s, dst_d.client() as d:
        src, dst = s.allocate_cache(desc), d.allocate_cache(desc)
        try:
            fill(src, 1)
            fill(dst, 2)
            before = snapshot(dst)
            rng = np.random.default_rng(7)
            src_blocks = rng.choice(64, 40, replace=True).tolist()
            dst_blocks = rng.choice(64, 40, replace=False).tolist()
            result = d.pull_kv_blocks(CacheIndex(src_d.cluster_id, src.cache_id), dst, src_blocks, dst_blocks)
            assert result.backend == "nixl" and result.bytes_moved == 40 * desc.block_nbytes * 4
            assert_bytes_equal(dst.tensors, expected_pull(src, before, src_blocks, dst_blocks, range(4), range(4)))

            # Push (one-sided WRITE) back into the peer's cache.
            src_before = snapshot(src)
            d.push_kv_blocks(dst, CacheIndex(src_d.cluster_id, src.cache_id), [0, 1, 2], [61, 62, 63])
            assert_bytes_equal(src.tensors, expected_pull(dst, src_before, [0, 1, 2], [61, 62, 63], range(4),
                                                          range(4)))

            # A partial row (not whole blocks): one descriptor per run instead of the prepared block lists.
            d.pull_kv_cache(CacheIndex(src_d.cluster_id, src.cache_id, batch_index=5), dst, size=100, batch_index=9)
            for t in range(4):
                got = dst.tensors[t].reshape(64, -1).view(np.uint8)[9, :100]
                assert np.array_equal(got, src.tensors[t].reshape(64, -1).view(np.uint8)[5, :100])
        finally:
            s.deallocate_cache(src)
            d.deallocate_cache(dst)


@on_the_nixl_pair
def test_a_removed_remote_cache_is_never_read_as_live(linked_pair: Pair) -> None:
    """NIXL itself goes on reading a deregistered (even reused) address: the control-page check must refuse it."""
    src_d, dst_d = linked_pair
    desc = CacheDesc(num_tensors=2, shape=(16, 4096), data_type=DataType.UINT8)
    with src_d.client() as s, dst_d.client() as d:
        gone, dst = s.allocate_cache(desc), d.allocate_cache(desc)
        fill(gone, 3)
        d.pull_kv_blocks(CacheIndex(src_d.cluster_id, gone.cache_id), dst, [0], [0])  # described, registered
        s.deallocate_cache(gone)
        reused = s.allocate_cache(desc)  # may well be mapped at the same address
        try:
            fill(reused, 4)
            with pytest.raises(LlmError) as info:
                d.pull_kv_blocks(CacheIndex(src_d.cluster_id, gone.cache_id), dst, [1, 2], [1, 2])
            assert info.value.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST
            result = d.pull_kv_blocks(CacheIndex(src_d.cluster_id, reused.cache_id), dst, [1, 2], [1, 2])
            assert result.backend == "nixl"
            assert np.array_equal(dst.tensors[1][1:3], reused.tensors[1][1:3])
        finally:
            s.deallocate_cache(reused)
            d.deallocate_cache(dst)


@on_the_nixl_pair
def test_a_view_and_its_base_are_served_through_one_registration_whichever_goes_first(linked_pair: Pair) -> None:
    """A CPU engine's token view over a nixl link: the view is its base's memory at the same addresses, registered
    with NIXL once for both (tests/unit/test_nixl_registrations.py counts it), and the peer loads that registration
    for each of the two caches it pulls from. The view goes on serving after its base is released (the memory stays
    registered and mapped), and neither is read once both are gone."""
    src_d, dst_d = linked_pair
    desc, quarters = CacheDesc(num_tensors=2, shape=(16, 4096)), CacheDesc(num_tensors=2, shape=(64, 1024))
    with src_d.client() as s, dst_d.client() as d:
        base = s.allocate_cache(desc)
        view = s.allocate_cache(quarters, view_of=base)
        dst, dst_quarters = d.allocate_cache(desc), d.allocate_cache(quarters)
        try:
            fill(base, 5)
            assert d.pull_kv_blocks(CacheIndex(src_d.cluster_id, base.cache_id), dst, [3], [0]).backend == "nixl"
            assert d.pull_kv_blocks(CacheIndex(src_d.cluster_id, view.cache_id), dst_quarters, [13], [9]).backend \
                == "nixl"
            for t in range(2):
                assert dst.tensors[t][0].tobytes() == view.tensors[t][12:16].tobytes()  # base block 3: quarters 12..15
                assert dst_quarters.tensors[t][9].tobytes() == base.tensors[t].reshape(64, -1)[13].tobytes()
            s.deallocate_cache(base)
            fill(view, 6)
            d.pull_kv_blocks(CacheIndex(src_d.cluster_id, view.cache_id), dst_quarters, [40, 2], [1, 2])
            assert all(dst_quarters.tensors[t][1:3].tobytes() == view.tensors[t][[40, 2]].tobytes() for t in range(2))
            with pytest.raises(LlmError) as info:
                d.pull_kv_blocks(CacheIndex(src_d.cluster_id, base.cache_id), dst, [0], [0])
            assert info.value.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST
            s.deallocate_cache(view)
            with pytest.raises(LlmError) as info:
                d.pull_kv_blocks(CacheIndex(src_d.cluster_id, view.cache_id), dst_quarters, [0], [0])
            assert info.value.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST
        finally:
            for cache in (base, view):
                with contextlib.suppress(LlmError):
                    s.deallocate_cache(cache)
            d.deallocate_cache(dst)
            d.deallocate_cache(dst_quarters)
    for daemon in linked_pair:
        assert daemon.proc is not None and daemon.proc.poll() is None


@on_the_nixl_pair
@pytest.mark.skipif("UCX_TLS" in os.environ, reason="needs UCX's same-host CMA path, where the reader's kernel "
                    "reports the fault (over tcp the serving daemon itself would read the vanished pages)")
def test_a_transport_error_costs_one_pull_not_the_link(linked_pair: Pair) -> None:
    """A read that fails in UCX (here: the model server shrank the segment under its registered cache) makes NIXL
    drop its endpoint for good; the channel reconnects, so once the memory is back, pulls work again."""
    src_d, dst_d = linked_pair
    desc = CacheDesc(num_tensors=2, shape=(8, 4096), data_type=DataType.UINT8)
    path = Path("/dev/shm") / f"kvbroker-test-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 2 * desc.tensor_nbytes)
        with src_d.client() as s, dst_d.client() as d:
            src = s.register_kv_cache(desc, [TensorLocation(path.name, 0), TensorLocation(path.name,
                                                                                          desc.tensor_nbytes)])
            dst = d.allocate_cache(desc)
            try:
                fill(src, 6)
                d.pull_kv_blocks(CacheIndex(src_d.cluster_id, src.cache_id), dst, [0], [0])
                os.ftruncate(fd, 0)  # the registered pages are gone: the peer's reads fail with EFAULT
                with pytest.raises(LlmError) as info:
                    d.pull_kv_blocks(CacheIndex(src_d.cluster_id, src.cache_id), dst, [1, 2], [1, 2])
                assert info.value.status == LlmStatus.LLM_LINK_FAILED, info.value
                os.ftruncate(fd, 2 * desc.tensor_nbytes)  # back (zeros): the cache never left the registry
                src.tensors[0][3] = 77
                _wait_ready(d, src_d.cluster_id)
                assert d.pull_kv_blocks(CacheIndex(src_d.cluster_id, src.cache_id), dst, [3], [4]).backend == "nixl"
                assert (dst.tensors[0][4] == 77).all()
            finally:
                s.unregister_kv_cache(src)
                d.deallocate_cache(dst)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def test_peer_killed_mid_pull_gives_link_failed_and_the_daemon_stays_healthy(tmp_path: Path) -> None:
    """(A frozen peer, by contrast, is still read: one-sided.)"""
    desc = CacheDesc(num_tensors=2, shape=(256, 64 << 10), data_type=DataType.UINT8)  # 32 MiB
    blocks = list(range(256))
    src_d = LocalDaemon(tmp_path, 1, backends=("nixl",)).start()
    dst_d = LocalDaemon(tmp_path, 2, backends=("nixl",))
    try:
        dst_d.start()
        with src_d.client() as s, dst_d.client() as d, concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert d.link_clusters([cluster_of(src_d)])[0].ok
            src, dst = s.allocate_cache(desc), d.allocate_cache(desc)
            assert d.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, blocks, blocks).backend == "nixl"
            # A frozen peer: on one host UCX reads its memory by CMA, one-sided, without its help. Over a transport
            # that needs the peer (UCX_TLS=tcp) the transfer is aborted at the deadline instead.
            src_d.signal(signal.SIGSTOP)
            try:
                if "UCX_TLS" not in os.environ:
                    assert d.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, [0], [1], timeout=5.0).bytes_moved > 0
                else:
                    with pytest.raises(LlmError) as frozen:
                        d.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, blocks, blocks, timeout=1.0)
                    # The daemon's own deadline error (its transfer report names the blocks): an answer that came
                    # later than the call's 1 s gRPC deadline would have reached the caller as a bare
                    # DEADLINE_EXCEEDED, without a report.
                    assert frozen.value.status == LlmStatus.LLM_TIMEOUT
                    assert frozen.value.failed_dst_blocks == blocks
            finally:
                src_d.signal(signal.SIGCONT)
            _wait_ready(d, 1)

            pulled = [0]

            def pull_until_it_fails() -> LlmError:
                while True:
                    try:
                        d.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, blocks, blocks, timeout=20.0)
                        pulled[0] += 1
                    except LlmError as e:
                        return e

            pending = pool.submit(pull_until_it_fails)
            wait_until(lambda: pulled[0] >= 2, what="pulls running back to back")
            src_d.signal(signal.SIGKILL)
            error = pending.result(timeout=60)  # (only a hang detector)
        # A failure seen, not waited out: a pull stuck until its 20 s deadline would end in LLM_TIMEOUT.
        assert error.status == LlmStatus.LLM_LINK_FAILED, error
        assert error.details.get("backend") == "nixl" and error.details.get("transfer_id")
        assert error.failed_dst_blocks == blocks
        with dst_d.client() as d:
            [link] = d.list_links()
            assert link.state == LinkState.BROKEN
        # Healthy: a fresh peer links over nixl and a pull from it succeeds.
        with LocalDaemon(tmp_path, 9, backends=("nixl",)) as other, other.client() as o, dst_d.client() as d:
            assert d.link_clusters([cluster_of(other)])[0].ok
            a = o.allocate_cache(CacheDesc(num_tensors=2, shape=(4, 16)))
            b = d.allocate_cache(CacheDesc(num_tensors=2, shape=(4, 16)))
            fill(a, 5)
            assert d.pull_kv_blocks(CacheIndex(9, a.cache_id), b, [0], [1]).bytes_moved == 2 * 16 * 2
            assert np.array_equal(b.tensors[0][1], a.tensors[0][0])
        assert dst_d.stop() == 0, dst_d.log_tail()  # and it stops cleanly (NIXL torn down before exit)
    finally:
        src_d.stop()
        dst_d.stop()


def test_an_idle_nixl_daemon_does_not_spin(tmp_path: Path) -> None:
    """NIXL's Python wrapper runs its progress thread without a pause: an idle daemon burned a whole core. CPU time,
    not wall time, is measured, so a loaded host does not make this flaky."""
    with LocalDaemon(tmp_path, 1, backends=("nixl",)) as d:
        assert d.proc is not None
        usage = Path(f"/proc/{d.proc.pid}/stat")

        def cpu_s() -> float:
            fields = usage.read_text().rpartition(")")[2].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        # Start-up's own CPU time is over once a tenth of a second passes without a tick of it (a spinning daemon
        # never gets there, and fails here already).
        last = [cpu_s()]

        def idle_a_moment() -> bool:
            seen, last[0] = last[0], cpu_s()
            return last[0] == seen

        wait_until(idle_a_moment, poll=0.1, what="the daemon idle after its start")
        before = cpu_s()
        time.sleep(3.0)  # the scenario, not a wait: the idle window measured
        assert cpu_s() - before < 0.5, "an idle daemon with the nixl backend keeps a core busy"
