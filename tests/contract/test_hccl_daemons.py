"""The `hccl` backend through the whole daemon seam: handshake advertisement, backend choice, GetCacheInfo
descriptions and transfers, in two real `Daemon`s sharing one process so that both engines live in
`hixl_contract_standin` (NOT HIXL; see that module). Two `kvbrokerd` processes on two NPUs are
`tests/device/ascend_check.py`'s job."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from kvbroker import AsyncClient, CacheDesc, CacheIndex, ClusterInfo, LlmError
from kvbrokerd.config import load
from kvbrokerd.daemon import Daemon
from tests.contract import hixl_contract_standin as standin

DESC = CacheDesc(num_tensors=4, shape=(16, 1024))


@pytest.fixture
async def daemons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Daemon, Daemon]]:
    standin.reset()
    monkeypatch.setitem(sys.modules, "hixl", standin)
    monkeypatch.setitem(sys.modules, "acl", standin.acl)
    made: list[Daemon] = []
    try:
        for n in (1, 2):
            # Each daemon its own NPU (and so its own default engine port, 26000 + device).
            config, _ = load(["--cluster-id", str(n), "--listen", f"unix://{tmp_path}/d{n}.sock",
                              "--peer-listen", "127.0.0.1:0", "--backends", "hccl,tcp", "--insecure-peers",
                              "--shm-dir", str(tmp_path / f"shm{n}"), "--hccl-device", str(n)],
                             environ={"KVBROKER_HCCL_CONNECT_TIMEOUT_MS": "2000"})
            assert config.hccl_connect_timeout_ms == 2000
            daemon = Daemon(config)
            made.append(daemon)
            await daemon.start()
        yield made[0], made[1]
    finally:
        for daemon in made:
            await daemon.stop(grace=0)
    assert standin.VIOLATIONS == []
    assert standin.live_engines() == []  # each daemon finalised its engine when it stopped


async def test_two_daemons_pull_and_push_over_hccl(daemons: tuple[Daemon, Daemon]) -> None:
    src, dst = daemons
    async with AsyncClient(src.local_address) as s, AsyncClient(dst.local_address) as d:
        [linked] = await d.link_clusters([ClusterInfo(1, src.peer_address)])
        assert linked.ok, linked
        a, b = await s.allocate_cache(DESC), await d.allocate_cache(DESC)  # both registered after the link
        rng = np.random.default_rng(3)
        for t in a.tensors:
            t.reshape(-1).view(np.uint8)[:] = rng.integers(0, 256, t.nbytes, np.uint8)
        result = await d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [0, 1, 2, 9], [4, 5, 6, 0])
        assert result.backend == "hccl"
        for ta, tb in zip(a.tensors, b.tensors, strict=True):
            assert np.array_equal(tb[[4, 5, 6, 0]].view(np.uint8), ta[[0, 1, 2, 9]].view(np.uint8))
            assert not tb[[1, 2, 3, 7]].view(np.uint8).any()
        for t in b.tensors:
            t[3] = 7
        pushed = await d.push_kv_blocks(b, CacheIndex(1, a.cache_id), [3], [15])
        assert pushed.backend == "hccl"
        for ta, tb in zip(a.tensors, b.tensors, strict=True):
            assert np.array_equal(ta[15].view(np.uint8), tb[3].view(np.uint8))
    assert {t for e, _, t in standin.CALLS if e == "127.0.0.1:26002"} == {"kvbroker-hixl-npu2_0"}


async def test_a_slow_registration_never_blocks_the_event_loop(daemons: tuple[Daemon, Daemon]) -> None:
    """A peer's GetCacheInfo registers the cache with the engine (describe_cache); that may take long (a large region
    on an NPU, or an engine thread busy with a link set-up), and the daemon goes on answering meanwhile."""
    src, dst = daemons
    async with AsyncClient(src.local_address) as s, AsyncClient(dst.local_address) as d:
        [linked] = await d.link_clusters([ClusterInfo(1, src.peer_address)])
        assert linked.ok, linked
        a, b = await s.allocate_cache(DESC), await d.allocate_cache(DESC)
        for t in a.tensors:
            t[2] = 9
        standin.FAULTS.register_delay_s = 1.0
        started = time.monotonic()
        pull = asyncio.create_task(d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [2], [3], timeout=20))
        answers, longest_gap, last = 0, 0.0, time.monotonic()
        while not pull.done():
            await s.get_cluster_info(timeout=10)
            answers += 1
            longest_gap, last = max(longest_gap, time.monotonic() - last), time.monotonic()
            await asyncio.sleep(0.02)
        assert (await pull).backend == "hccl"
        assert time.monotonic() - started >= 1.0  # the registration was slow, and the daemon answered meanwhile:
        assert answers >= 10 and longest_gap < 0.5, f"{answers} answers; the event loop stalled {longest_gap:.2f} s"
        for ta, tb in zip(a.tensors, b.tensors, strict=True):
            assert np.array_equal(tb[3], ta[2])


async def test_a_cache_removed_while_it_registers_leaves_no_registration(daemons: tuple[Daemon, Daemon],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache stays pinned while the engine registers it: its removal waits, then deregisters it (never unmaps
    memory the engine is registering, never leaves a registration behind)."""
    src, dst = daemons
    async with AsyncClient(src.local_address) as s, AsyncClient(dst.local_address) as d:
        [linked] = await d.link_clusters([ClusterInfo(1, src.peer_address)])
        assert linked.ok, linked
        a, b = await s.allocate_cache(DESC), await d.allocate_cache(DESC)
        await d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [0], [0], timeout=10)  # dst's side registered
        engine = standin.engine("127.0.0.1:26001")
        before = len(engine._regions)
        c = await s.allocate_cache(DESC)
        standin.FAULTS.register_delay_s = 1.0
        registering = threading.Event()
        register = standin.Hixl.register_mem

        def noted(self: standin.Hixl, desc: standin.MemDesc, kind: standin.MemType, /) -> tuple[int, int]:
            if self is engine:
                registering.set()
            return register(self, desc, kind)

        monkeypatch.setattr(standin.Hixl, "register_mem", noted)
        pull = asyncio.create_task(d.pull_kv_blocks(CacheIndex(1, c.cache_id), b, [0], [0], timeout=20))
        assert await asyncio.to_thread(registering.wait, 10)  # the engine thread is registering c now
        await s.deallocate_cache(c)
        with contextlib.suppress(LlmError):  # it may read the cache before it is gone, or fail
            await pull
        assert len(engine._regions) == before
