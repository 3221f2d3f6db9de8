"""The `hccl` backend through the whole daemon seam: handshake advertisement, backend choice, GetCacheInfo
descriptions and transfers, in two real `Daemon`s sharing one process so that both engines live in
`hixl_contract_standin` (NOT HIXL; see that module). Two `kvbrokerd` processes on two NPUs are
`tests/device/ascend_check.py`'s job."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbroker import AsyncClient, CacheDesc, CacheIndex, ClusterInfo, LlmError
from kvbrokerd.backends.hccl.engine import HcclSettings
from kvbrokerd.config import load
from kvbrokerd.daemon import Daemon
from tests.contract import hixl_contract_standin as standin
from tests.helpers import wait_until_async

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
            assert config.settings_of("hccl") == HcclSettings(device=n, connect_timeout_ms=2000)
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


async def _answers_while_held(client: AsyncClient, method: str, task: asyncio.Task[Any]) -> None:
    """While an engine's thread is held inside `method` (a `Faults.*_held` event), `client`'s daemon answers, and
    `task` (what made the engine call it) waits for it. The daemons run on this test's event loop: had the call
    blocked the loop, this coroutine would not run again before the call ended, and would see it over."""

    def held() -> bool:
        return any(method in standin.engine(name).held for name in standin.live_engines())

    await wait_until_async(held, what=f"an engine thread inside {method}")
    for _ in range(10):
        await client.get_cluster_info(timeout=10)
    assert held(), f"the daemon answered only once {method} had ended"
    assert not task.done()


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
        standin.FAULTS.registrations_held = registered = threading.Event()
        pull = asyncio.create_task(d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [2], [3], timeout=20))
        try:
            await _answers_while_held(s, "register_mem", pull)
        finally:
            registered.set()
        assert (await pull).backend == "hccl"
        for ta, tb in zip(a.tensors, b.tensors, strict=True):
            assert np.array_equal(tb[3], ta[2])


async def test_a_slow_deregistration_never_blocks_the_event_loop(daemons: tuple[Daemon, Daemon]) -> None:
    """Releasing a cache makes the engine deregister it (forget_cache), which may take long; the daemon goes on
    answering meanwhile, and the release returns once the memory is really gone."""
    src, dst = daemons
    async with AsyncClient(src.local_address) as s, AsyncClient(dst.local_address) as d:
        [linked] = await d.link_clusters([ClusterInfo(1, src.peer_address)])
        assert linked.ok, linked
        a, b = await s.allocate_cache(DESC), await d.allocate_cache(DESC)
        await d.pull_kv_blocks(CacheIndex(1, a.cache_id), b, [0], [0], timeout=10)  # both sides registered
        standin.FAULTS.deregistrations_held = deregistered = threading.Event()
        release = asyncio.create_task(s.deallocate_cache(a))
        try:  # (and the release does not return before the deregistration ends)
            await _answers_while_held(s, "deregister_mem", release)
        finally:
            deregistered.set()
        await release
        assert await s.list_caches() == []


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


async def test_npu_registration_is_refused_where_pyacl_cannot_import_ipc_memory(daemons: tuple[Daemon, Daemon]) -> None:
    """The stand-in models no Ascend IPC (pyACL's ipc_mem_* signatures are not verified yet, docs/ascend.md), so
    the hccl backend must refuse, name the missing call, and list nothing."""
    from kvbroker import DeviceMemory, FeatureNotEnabledError, Placement, TensorLocation

    src, _ = daemons
    desc = CacheDesc(num_tensors=2, shape=(16, 1024), placement=Placement.DEVICE)
    npu = [TensorLocation("", i * desc.tensor_nbytes, DeviceMemory("npu", "1", b"k" * 65, 1 << 20)) for i in (0, 1)]
    async with AsyncClient(src.local_address) as s:
        with pytest.raises(FeatureNotEnabledError) as info:
            await s.register_kv_cache(desc, npu)
        assert "hccl backend cannot import npu memory" in info.value.message
        assert "acl.rt.ipc_mem_import_by_key" in info.value.message
        assert await s.list_caches() == []


class _FakeAscendIpc:
    """BOOKKEEPING ONLY: pyACL's IPC calls with the signatures Mooncake's C++ and the pyACL docs suggest (unverified);
    "exported" memory is the stand-in's host buffers. Records what the hccl backend does with them: on which thread,
    how often, and whether a key is closed while HIXL still has memory of it registered."""

    def __init__(self, exported: dict[str, tuple[int, int]]) -> None:
        self.exported = exported
        self.calls: list[tuple[str, str]] = []
        self.problems: list[str] = []

    def ipc_mem_import_by_key(self, key: str, flags: int) -> tuple[int, int]:
        self.calls.append(("import", key))
        if standin.acl._context_of_thread() is None:
            self.problems.append(f"import of {key} on a thread without the ACL context")
        return (self.exported[key][0], 0) if key in self.exported else (0, 507899)

    def ipc_mem_close(self, key: str) -> int:
        self.calls.append(("close", key))
        base, size = self.exported[key]
        for name in standin.live_engines():
            if any(r.addr < base + size and base < r.addr + r.length for r in standin.engine(name)._regions.values()):
                self.problems.append(f"{key} closed while engine {name} still has its memory registered")
        return 0


async def test_bookkeeping_npu_caches_import_each_key_once_and_close_after_deregistration(
        daemons: tuple[Daemon, Daemon], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbroker import DeviceMemory, ParamInvalidError, Placement, TensorLocation

    src, dst = daemons
    base, _ = standin.acl.rt.malloc(1 << 20, 0)
    raw = np.random.default_rng(5).integers(0, 256, 1 << 20, np.uint8).tobytes()
    ctypes.memmove(base, raw, len(raw))
    ipc = _FakeAscendIpc({"key-a": (base, 1 << 20)})
    monkeypatch.setattr(standin.acl.rt, "ipc_mem_import_by_key", ipc.ipc_mem_import_by_key, raising=False)
    monkeypatch.setattr(standin.acl.rt, "ipc_mem_close", ipc.ipc_mem_close, raising=False)
    desc = CacheDesc(num_tensors=2, shape=(16, 1024), placement=Placement.DEVICE)
    n = desc.tensor_nbytes

    def npu(offsets: tuple[int, int], key: bytes = b"key-a\0", device: str = "1") -> list[TensorLocation]:
        return [TensorLocation("", o, DeviceMemory("npu", device, key, 1 << 20)) for o in offsets]

    async with AsyncClient(src.local_address) as s, AsyncClient(dst.local_address) as d:
        with pytest.raises(ParamInvalidError, match="engine is on NPU 1"):
            await s.register_kv_cache(desc, npu((0, n), device="0"))
        with pytest.raises(ParamInvalidError, match="ipc_mem_import_by_key failed"):
            await s.register_kv_cache(desc, npu((0, n), key=b"key-unknown"))
        first = await s.register_kv_cache(desc, npu((4096, 4096 + n)))
        second = await s.register_kv_cache(desc, npu((4096 + 2 * n, 4096 + 3 * n)))
        assert ipc.calls == [("import", "key-unknown"), ("import", "key-a")]  # one mapping for both caches

        [linked] = await d.link_clusters([ClusterInfo(1, src.peer_address)])
        assert linked.ok, linked
        local = await d.allocate_cache(CacheDesc(num_tensors=2, shape=(16, 1024)))
        result = await d.pull_kv_blocks(CacheIndex(1, first.cache_id), local, [0, 3], [1, 2])
        assert result.backend == "hccl"
        block = desc.block_nbytes
        for i, t in enumerate(local.tensors):
            start = 4096 + i * n
            assert t[1].tobytes() == raw[start: start + block]
            assert t[2].tobytes() == raw[start + 3 * block: start + 4 * block]

        await s.unregister_kv_cache(first)
        assert ("close", "key-a") not in ipc.calls  # the second cache still uses the mapping
        await s.unregister_kv_cache(second)
        assert ipc.calls[-1] == ("close", "key-a")
        assert await s.list_caches() == []
    assert ipc.problems == []
