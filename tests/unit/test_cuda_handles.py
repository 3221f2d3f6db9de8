"""kvbroker.device.cuda_ipc_handle: every format torch's `storage._share_cuda_()` has written, torch 2.4 to 2.13, as
recorded byte strings laid out the way c10/cuda/CUDACachingAllocator.cpp (`shareIpcHandle`,
`ExpandableSegment::share`) writes them; and `torch_locations` on a stand-in tensor whose storage returns each.
No GPU here: what a real `_share_cuda_` returns is checked by tests/device/cuda_check.py (`handle_format`)."""

from __future__ import annotations

import inspect
import re
import struct
from dataclasses import dataclass

import pytest

from kvbroker import DeviceMemory, TensorLocation
from kvbroker.device import CUDA_HANDLE_BYTES, cuda_ipc_handle, torch_locations

IPC = bytes(range(0x40, 0x40 + CUDA_HANDLE_BYTES))  # a cudaIpcMemHandle_t (its contents are opaque)


def _versioned(version: int, kind: bytes, payload: bytes) -> bytes:
    return bytes([version]) + kind + payload


def _expandable_payload(version: int, fds: tuple[int, ...] = (7, 8)) -> bytes:
    # ShareHeader {pid_t pid; (4 bytes of padding); size_t segment_size; size_t num_handles} then one int fd per
    # 20 MiB page; version 3's header also names the handle type (POSIX fd or fabric).
    header = struct.pack("<iiQQ", 4242, 0, 20 << 20, len(fds))
    if version >= 3:
        header += struct.pack("<Q", 1)
    return header + b"".join(struct.pack("<i", fd) for fd in fds)


RECORDED = {  # torch version -> what its _share_cuda_ returns for a cudaMalloc block
    "2.4": IPC,
    "2.5": _versioned(1, b"c", IPC),
    "2.8": _versioned(2, b"c", IPC),
    "2.12": _versioned(2, b"c", IPC),
    "2.13": _versioned(3, b"c", IPC),
}


@pytest.mark.parametrize("torch_version", sorted(RECORDED))
def test_every_torch_format_of_a_cudamalloc_block_yields_the_64_byte_handle(torch_version: str) -> None:
    assert cuda_ipc_handle(RECORDED[torch_version]) == IPC


def test_64_bytes_are_the_legacy_format_whatever_they_start_with() -> None:
    # torch tells the formats apart by length alone: a raw handle may begin with bytes that look like a header.
    looks_versioned = b"\x02c" + IPC[2:]
    assert cuda_ipc_handle(looks_versioned) == looks_versioned


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_expandable_segment_is_refused_with_the_reason(version: int) -> None:
    with pytest.raises(ValueError, match="expandable segment") as info:
        cuda_ipc_handle(_versioned(version, b"e", _expandable_payload(version)))
    assert "cudaIpcMemHandle_t" in str(info.value) and "expandable_segments:False" in str(info.value)


@pytest.mark.parametrize(("handle", "words"), [
    (_versioned(4, b"c", IPC), "format version 4"),
    (_versioned(4, b"e", _expandable_payload(4)), "format version 4"),
    (_versioned(2, b"x", IPC), "unknown type byte 0x78"),
    (_versioned(3, b"c", IPC[:-1]), "carries 63 bytes"),
    (_versioned(2, b"c", IPC + b"\0"), "carries 65 bytes"),
    (b"", "0 bytes are not"),
    (b"\x02", "1 bytes are not"),
])
def test_what_is_no_known_format_is_refused_by_name(handle: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        cuda_ipc_handle(handle)


@dataclass
class _Device:
    type: str = "cuda"
    index: int = 0


class _Storage:
    def __init__(self, handle: bytes | None, nbytes: int, offset: int) -> None:
        self.shared = (0, handle, nbytes, offset, b"/torch_ref", 0, b"\0" * 64, False)

    def _share_cuda_(self) -> tuple[object, ...]:
        return self.shared


class _CudaTensor:
    """What torch_locations reads of a CUDA tensor: its storage's share tuple, its offset in the storage."""

    device = _Device()

    def __init__(self, storage: _Storage, storage_offset: int = 0, element_size: int = 2) -> None:
        self._storage, self._offset, self._element = storage, storage_offset, element_size

    def is_contiguous(self) -> bool:
        return True

    def untyped_storage(self) -> _Storage:
        return self._storage

    def storage_offset(self) -> int:
        return self._offset

    def element_size(self) -> int:
        return self._element


@pytest.mark.parametrize("torch_version", sorted(RECORDED))
def test_torch_locations_registers_the_64_byte_handle_whatever_torch_wrote(
        torch_version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvbroker.device._torch_device_name", lambda t: "GPU-a")
    # The storage lies 4096 bytes into its allocation; the tensor 100 elements (200 bytes) into its storage.
    tensor = _CudaTensor(_Storage(RECORDED[torch_version], 1 << 20, 4096), storage_offset=100)
    assert torch_locations([tensor]) == [TensorLocation("", 4096 + 200, DeviceMemory("cuda", "GPU-a", IPC,
                                                                                       4096 + (1 << 20)))]


def test_torch_locations_refuses_an_expandable_segment_enabled_at_run_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PYTORCH_CUDA_ALLOC_CONF to warn first (torch.cuda.memory._set_allocator_settings turned them on): the
    handle's type byte tells."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    tensor = _CudaTensor(_Storage(_versioned(2, b"e", _expandable_payload(2)), 1 << 20, 0))
    with pytest.raises(ValueError, match=r"tensor 0: the tensor lies in a torch expandable segment"):
        torch_locations([tensor])


def test_an_empty_storage_is_refused_not_crashed_on() -> None:
    with pytest.raises(ValueError, match="tensor 0 has no device memory"):
        torch_locations([_CudaTensor(_Storage(None, 0, 0))])


def test_the_installed_torch_unpacks_share_cuda_in_the_order_torch_locations_reads() -> None:
    """torch's own pickling of CUDA tensors (torch.multiprocessing.reductions.reduce_tensor) names the fields of
    `_share_cuda_()`: the handle second, the storage's bytes third, its offset in the allocation fourth."""
    reductions = pytest.importorskip("torch.multiprocessing.reductions",
                                     reason="torch is not installed (pip install -e '.[examples]')")
    source = inspect.getsource(reductions.reduce_tensor)
    unpacked = re.search(r"\(([^()]*)\)\s*=\s*storage\._share_cuda_\(\)", source)
    assert unpacked is not None, "reduce_tensor no longer unpacks storage._share_cuda_()"
    names = [n.strip() for n in unpacked.group(1).split(",") if n.strip()]
    assert names[:4] == ["device", "handle", "storage_size_bytes", "storage_offset_bytes"], names
