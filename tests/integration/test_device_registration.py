"""Device caches through RegisterKvCache (issue #12 §2): validated before anything is imported, then served by a
backend that declares the memory kind, or refused with LLM_FEATURE_NOT_ENABLED naming the backend that would."""

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

DESC = CacheDesc(num_tensors=2, shape=(16, 1024), data_type=DataType.FLOAT16, placement=Placement.DEVICE)


def _cuda(offset: int, handle: bytes = b"h" * 64, allocation: int = 1 << 20, kind: str = "cuda") -> TensorLocation:
    return TensorLocation("", offset, DeviceMemory(kind, "GPU-0f3c", handle, allocation))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    with LocalDaemon(tmp_path_factory.mktemp("device"), 1) as d:
        yield d


def test_a_daemon_without_a_device_backend_refuses_clearly(daemon: LocalDaemon) -> None:
    with daemon.client() as c:
        with pytest.raises(FeatureNotEnabledError) as info:
            c.register_kv_cache(DESC, [_cuda(0), _cuda(DESC.tensor_nbytes)])
        assert "cuda" in info.value.message and "nixl" in info.value.message
        with pytest.raises(FeatureNotEnabledError) as info:
            c.register_kv_cache(DESC, [_cuda(0, b"k" * 32, kind="npu"), _cuda(DESC.tensor_nbytes, b"k", kind="npu")])
        assert "hccl" in info.value.message
        assert c.list_caches() == []


@pytest.mark.parametrize(("tensors", "words"), [
    ([_cuda(0, b"short"), _cuda(32768)], "IPC handle"),
    ([_cuda(0), _cuda(1 << 20)], "outside the exported allocation"),
    ([_cuda(0), _cuda(0, kind="npu")], "one memory kind"),
    ([_cuda(0, kind="tpu"), _cuda(32768, kind="tpu")], "unknown device memory kind"),
    ([_cuda(0), TensorLocation("seg", 0)], "device location for every tensor"),
    ([_cuda(0)], "tensor locations"),
    ([TensorLocation("seg", 0, DeviceMemory("cuda", "", b"h" * 64, 1 << 20)), _cuda(32768)], "shm segment"),
])
def test_bad_device_registrations_are_param_invalid(daemon: LocalDaemon, tensors: list[TensorLocation],
                                                    words: str) -> None:
    with daemon.client() as c, pytest.raises(ParamInvalidError) as info:
        c.register_kv_cache(DESC, tensors)
    assert info.value.status == LlmStatus.LLM_PARAM_INVALID and words in info.value.message


def test_device_locations_survive_the_wire(tmp_path: Path) -> None:
    from kvbroker.convert import tensor_location_from_pb, tensor_location_to_pb

    loc = _cuda(4096)
    assert tensor_location_from_pb(tensor_location_to_pb(loc)) == loc
    assert tensor_location_from_pb(tensor_location_to_pb(TensorLocation("s", 8))) == TensorLocation("s", 8)


def test_the_daemon_says_a_device_cache_may_be_registered_again(daemon: LocalDaemon) -> None:
    """The vLLM connector offers device-direct remap units only where the daemon shares the second registration of the
    same VRAM (an older daemon would register it with NIXL twice): GetClusterInfo's features say so."""
    from kvbroker.types import CUDA_REREGISTER

    with daemon.client() as c:
        assert CUDA_REREGISTER in c.get_cluster_info().features
