"""kvbroker.device: registration arguments from raw device pointers, clear refusals for what cannot be exported,
and no torch import until a torch function is called. (The torch CUDA path runs in tests/device/cuda_check.py.)"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from kvbroker import DeviceMemory, TensorLocation
from kvbroker.device import ExportedAllocation, raw_locations, torch_locations
from kvbrokerd.dataplane.seam import Capabilities
from kvbrokerd.errors import LlmError, LlmStatus
from kvbrokerd.registry.devicemem import check_moves

H1, H2 = b"1" * 64, b"2" * 64
A1 = ExportedAllocation("cuda", "GPU-a", H1, 0x10000, 1 << 20)
A2 = ExportedAllocation("cuda", "GPU-a", H2, 0x800000, 1 << 16)


def test_raw_pointers_become_handle_plus_offset_in_their_allocation() -> None:
    locations = raw_locations([(0x10000, 4096, "GPU-a"), (0x10000 + 8192, 4096, "GPU-a"), (0x800000 + 512, 4096,
                                                                                            "GPU-a")], [A1, A2])
    assert locations == [
        TensorLocation("", 0, DeviceMemory("cuda", "GPU-a", H1, 1 << 20)),
        TensorLocation("", 8192, DeviceMemory("cuda", "GPU-a", H1, 1 << 20)),
        TensorLocation("", 512, DeviceMemory("cuda", "GPU-a", H2, 1 << 16)),
    ]


@pytest.mark.parametrize("triple", [
    (0x10000 + (1 << 20) - 100, 4096, "GPU-a"),  # runs past the end of its allocation
    (0x8000, 4096, "GPU-a"),  # before any
    (0x10000, 4096, "GPU-b"),  # another device
])
def test_a_pointer_no_allocation_holds_is_refused(triple: tuple[int, int, str]) -> None:
    with pytest.raises(ValueError, match="no exported allocation"):
        raw_locations([triple], [A1, A2])


@pytest.mark.parametrize(("args", "words"), [
    (("tpu", "0", H1, 1, 1), "kind"),
    (("cuda", "0", b"short", 1, 1), "64 bytes"),
    (("npu", "0", b"", 1, 1), "needs a handle"),
    (("cuda", "0", H1, 0x1000, 0), "needs a handle"),
])
def test_exported_allocations_are_checked(args: tuple[str, str, bytes, int, int], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ExportedAllocation(*args)


def test_torch_cpu_tensors_are_refused_clearly() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[examples]')")
    with pytest.raises(ValueError, match="tensor 1 is on cpu, not a CUDA or NPU device"):
        torch_locations([_FakeCuda(), torch.zeros(4)])


@dataclass
class _Device:
    type: str = "cuda"
    index: int = 0


class _FakeCuda:
    """Stands for a CUDA tensor only up to the checks that come before any CUDA call."""

    device = _Device()

    def is_contiguous(self) -> bool:
        return True

    def untyped_storage(self) -> object:
        raise AssertionError("the refusal must come first")


def test_expandable_segments_are_refused_before_anything_is_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True")
    with pytest.raises(ValueError, match=r"virtual-memory \(VMM\) allocation"):
        torch_locations([_FakeCuda()])


def test_importing_kvbroker_device_imports_no_torch_nor_cuda() -> None:
    code = ("import sys, kvbroker, kvbroker.device\n"
            "bad = [m for m in ('torch', 'cuda', 'numpy.cuda') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class _Backend:
    name = "shm"
    memory_kinds = Capabilities().memory_kinds


def test_a_transfer_over_a_backend_that_cannot_move_the_memory_is_refused() -> None:
    host = [TensorLocation("seg", 0)]
    cuda = [TensorLocation("", 0, DeviceMemory("cuda", "0", b"", 0))]
    check_moves(_Backend(), ("local cache 1", host), ("remote cache 2", host))  # type: ignore[arg-type]
    for backend, words in ((_Backend(), "the shm backend cannot move"), (None, "a local copy cannot move")):
        with pytest.raises(LlmError) as info:
            check_moves(backend, ("local cache 1", host), ("remote cache 2", cuda))  # type: ignore[arg-type]
        assert info.value.status == LlmStatus.LLM_FEATURE_NOT_ENABLED
        assert "remote cache 2 is in cuda memory" in info.value.message and words in info.value.message


def test_a_registered_device_cache_maps_nothing_on_the_client() -> None:
    from kvbroker import CacheDesc, CacheRecord, Placement
    from kvbroker.shm import Cache

    desc = CacheDesc(num_tensors=1, shape=(4, 64), placement=Placement.DEVICE)
    record = CacheRecord(7, desc, (TensorLocation("", 0, DeviceMemory("cuda", "0", b"", 1 << 20)),), "/nonexistent",
                         False)
    cache = Cache.map(record)
    assert cache.cache_id == 7 and cache.tensors == []
    cache.close()
