"""Device registrations on real `--backends nixl` daemons of this CPU-only machine: the nixl backend refuses CUDA memory
with LLM_FEATURE_NOT_ENABLED naming what is missing (cuda-python, a CUDA device, NIXL's VRAM support), bad handles
and offsets are LLM_PARAM_INVALID, and nothing is listed after a refusal. The import itself needs a GPU:
tests/device/cuda_check.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbroker import (
    CacheDesc,
    DataType,
    DeviceMemory,
    FeatureNotEnabledError,
    LlmStatus,
    ParamInvalidError,
    Placement,
    TensorLocation,
)
from kvbroker._local import LocalDaemon
from kvbrokerd.backends import unavailable
from kvbrokerd.backends.common.cudaipc import cuda_missing

pytestmark = pytest.mark.skipif(unavailable("nixl") is not None, reason=str(unavailable("nixl")))

DESC = CacheDesc(num_tensors=2, shape=(16, 1024), data_type=DataType.FLOAT16, placement=Placement.DEVICE)


def _cuda(offset: int, handle: bytes = b"h" * 64, allocation: int = 1 << 20) -> TensorLocation:
    return TensorLocation("", offset, DeviceMemory("cuda", "0", handle, allocation))


GOOD = [_cuda(0), _cuda(DESC.tensor_nbytes)]


@pytest.fixture(scope="module")
def nixl_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    with LocalDaemon(tmp_path_factory.mktemp("devnixl"), 41, backends=("nixl",)) as d:
        yield d


@pytest.fixture(scope="module")
def daemon_without_cuda_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    """A nixl daemon whose `import cuda` fails, whatever this machine has installed."""
    work = tmp_path_factory.mktemp("nocudapy")
    hide = work / "hide" / "cuda"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('cuda-python hidden by the test')\n")
    with LocalDaemon(work, 42, backends=("nixl",), env={"PYTHONPATH": str(hide.parent)}) as d:
        yield d


@pytest.mark.skipif(cuda_missing() is None, reason="this machine can import CUDA memory")
def test_a_nixl_daemon_without_a_gpu_refuses_cuda_memory_saying_why(nixl_daemon: LocalDaemon) -> None:
    with nixl_daemon.client() as c:
        with pytest.raises(FeatureNotEnabledError) as info:
            c.register_kv_cache(DESC, GOOD)
        message = info.value.message
        assert info.value.status == LlmStatus.LLM_FEATURE_NOT_ENABLED
        assert "nixl backend cannot import cuda memory" in message
        assert "no CUDA device" in message or "cuda-python is not installed" in message, message
        assert c.list_caches() == []
        # The daemon stays healthy: host caches still register and list.
        host = c.allocate_cache(CacheDesc(num_tensors=1, shape=(4, 64)))
        assert [r.cache_id for r in c.list_caches()] == [host.cache_id]
        c.deallocate_cache(host)


def test_without_cuda_python_the_refusal_names_it(daemon_without_cuda_python: LocalDaemon) -> None:
    with daemon_without_cuda_python.client() as c:
        with pytest.raises(FeatureNotEnabledError) as info:
            c.register_kv_cache(DESC, GOOD)
        assert "cuda-python is not installed" in info.value.message
        assert "pip install cuda-python" in info.value.message
        assert c.list_caches() == []


def test_npu_memory_on_a_nixl_daemon_points_at_hccl(nixl_daemon: LocalDaemon) -> None:
    npu = [TensorLocation("", i * DESC.tensor_nbytes, DeviceMemory("npu", "0", b"k" * 65, 1 << 20)) for i in (0, 1)]
    with nixl_daemon.client() as c:
        with pytest.raises(FeatureNotEnabledError) as info:
            c.register_kv_cache(DESC, npu)
        assert "hccl" in info.value.message
        assert c.list_caches() == []


@pytest.mark.parametrize(("tensors", "words"), [
    ([_cuda(0, b"h" * 63), _cuda(32768)], "IPC handle is 64..64 bytes, got 63"),
    ([_cuda(0, b"h" * 65), _cuda(32768)], "got 65"),
    ([_cuda(0), _cuda((1 << 20) - 100)], "outside the exported allocation"),
    ([_cuda(0, allocation=1000), _cuda(32768)], "outside the exported allocation"),
    ([_cuda((1 << 64) - 16), _cuda(32768)], "outside the exported allocation"),
    ([_cuda(0), _cuda(DESC.tensor_nbytes - 2)], "tensors overlap"),
    ([TensorLocation("", 0, DeviceMemory("cuda", "x" * 65, b"h" * 64, 1 << 20)), _cuda(32768)], "device must be"),
    ([TensorLocation("", 0, DeviceMemory("cuda", "GPU-\n", b"h" * 64, 1 << 20)), _cuda(32768)], "non-printable"),
])
def test_bad_handles_and_offsets_are_param_invalid_before_any_import(nixl_daemon: LocalDaemon,
                                                                     tensors: list[TensorLocation],
                                                                     words: str) -> None:
    with nixl_daemon.client() as c:
        with pytest.raises(ParamInvalidError) as info:
            c.register_kv_cache(DESC, tensors)
        assert words in info.value.message
        assert c.list_caches() == []


def test_the_refusal_is_logged_nowhere_as_a_crash(nixl_daemon: LocalDaemon, tmp_path: Path) -> None:
    with nixl_daemon.client() as c:
        for _ in range(3):
            with pytest.raises((FeatureNotEnabledError, ParamInvalidError)):
                c.register_kv_cache(DESC, GOOD)
    assert nixl_daemon.proc is not None and nixl_daemon.proc.poll() is None
    assert "Traceback" not in nixl_daemon.log_path.read_text()


def test_listed_device_caches_keep_no_ipc_handle(tmp_path: Path) -> None:
    """Whoever holds a handle can map the model server's memory: the registry drops it once the backend imported it,
    so neither ListCaches nor a peer's GetCacheInfo can hand it on; a failed preparation lists nothing."""
    from kvbrokerd.registry.caches import Registry
    from kvbrokerd.service.local import cache_info

    registry = Registry(tmp_path)
    registry.open()
    try:
        with pytest.raises(RuntimeError):
            registry.add_device(DESC, GOOD, [0x1000, 0x9000], "", lambda entry: (_ for _ in ()).throw(RuntimeError()))
        assert registry.list() == []
        entry = registry.add_device(DESC, GOOD, [0x1000, 0x9000], "s", lambda entry: None)
        assert [e.cache_id for e in registry.list()] == [entry.cache_id] and entry.addresses == [0x1000, 0x9000]
        assert all(t.device is not None and t.device.ipc_handle == b"" and t.device.kind == "cuda"
                   for t in entry.tensors)
        assert all(not t.device.ipc_handle for t in cache_info(entry, str(tmp_path)).tensors)
    finally:
        registry.close()


def test_a_peers_description_never_brings_a_handle_in() -> None:
    from kvbroker.convert import desc_to_pb, tensor_location_to_pb
    from kvbroker.v1 import peer_pb2
    from kvbrokerd.links.table import Link

    resp = peer_pb2.GetCacheInfoResponse(cache_id=5, desc=desc_to_pb(DESC),
                                         tensors=[tensor_location_to_pb(t) for t in GOOD])
    remote = Link(remote_cluster_id=9, remote_address="127.0.0.1:1")._parse_cache(5, resp)
    assert [(t.device.kind, t.device.ipc_handle) for t in remote.tensors if t.device] == [("cuda", b"")] * 2


@pytest.fixture(scope="module")
def daemon_with_fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalDaemon, Path]]:
    """A nixl daemon whose CUDA runtime is tests/fakecuda.py (BOOKKEEPING ONLY: "device" memory is host memory)."""
    work = tmp_path_factory.mktemp("fakecuda")
    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("from tests.fakecuda import install\ninstall()\n")
    root = Path(__file__).resolve().parents[2]
    calls = work / "cuda_calls.jsonl"
    env = {"PYTHONPATH": f"{site}:{root}", "KVBROKER_FAKE_CUDA_LOG": str(calls)}
    with LocalDaemon(work, 43, backends=("nixl",), env=env) as d:
        yield d, calls


def test_bookkeeping_a_vram_registration_nixl_refuses_closes_every_mapping(
        daemon_with_fake_cuda: tuple[LocalDaemon, Path]) -> None:
    """Real NIXL, fake CUDA: NIXL refuses to register host memory as VRAM (as on a GPU machine whose UCX lacks CUDA,
    or that does not take IPC-imported memory): the refusal names NIXL, every mapping the registration opened is
    closed again (one open for the two tensors of one allocation), nothing is listed, and the daemon serves on."""
    daemon, calls = daemon_with_fake_cuda
    with daemon.client() as c:
        with pytest.raises(FeatureNotEnabledError) as info:
            c.register_kv_cache(DESC, [_cuda(0, b"AAAA" * 16), _cuda(DESC.tensor_nbytes, b"AAAA" * 16)])
        assert "NIXL cannot register the imported VRAM" in info.value.message
        with pytest.raises(ParamInvalidError) as bad:
            c.register_kv_cache(DESC, [_cuda(0, b"BBBB" * 16), _cuda(0, b"bad!" * 16)])
        assert "cudaIpcOpenMemHandle failed (cudaErrorMapBufferObjectFailed)" in bad.value.message
        assert c.list_caches() == []
        host = c.allocate_cache(CacheDesc(num_tensors=1, shape=(4, 64)))
        c.deallocate_cache(host)
    import json

    log = [json.loads(line) for line in calls.read_text().splitlines()]
    opened = [c[1] for c in log if c[0] == "open"]
    closed = [c[1] for c in log if c[0] == "close"]
    assert opened == ["AAAA", "BBBB", "bad!"] and sorted(closed) == ["AAAA", "BBBB"]
