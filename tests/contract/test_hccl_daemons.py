"""The `hccl` backend through the whole daemon seam: handshake advertisement, backend choice, GetCacheInfo
descriptions and transfers, in two real `Daemon`s sharing one process so that both engines live in
`hixl_contract_standin` (NOT HIXL; see that module). Two `kvbrokerd` processes on two NPUs are
`tests/device/ascend_check.py`'s job."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from kvbroker import AsyncClient, CacheDesc, CacheIndex, ClusterInfo
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
            # Settings come from the environment, read at start: each daemon gets its own NPU and engine port.
            monkeypatch.setenv("KVBROKER_HCCL_DEVICE", str(n))
            config, _ = load(["--cluster-id", str(n), "--listen", f"unix://{tmp_path}/d{n}.sock",
                              "--peer-listen", "127.0.0.1:0", "--backends", "hccl,tcp", "--insecure-peers",
                              "--shm-dir", str(tmp_path / f"shm{n}")], environ={})
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
