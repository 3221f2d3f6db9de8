"""Register KV caches that live in accelerator memory: torch CUDA/NPU tensors, or raw device pointers, turned into
`Client.register_kv_cache` arguments.

    from kvbroker.device import torch_cache
    client.register_kv_cache(*torch_cache(kv_tensors))      # every tensor: same shape and dtype, contiguous

The daemon maps the memory through IPC, so the tensors must stay allocated until `unregister_kv_cache` returns (the
daemon closes its mapping before that call returns; freeing first leaves it reading and writing memory that may
belong to something else by then). An IPC handle covers a whole allocation: each tensor is named by its allocation's
handle plus its offset in it. Legacy CUDA IPC handles do not exist for virtual-memory (VMM) allocations, which torch's
`expandable_segments` and vLLM's cumem allocator make: those are refused here, with the reason.

torch's `_share_cuda_` has written three handle formats (c10/cuda/CUDACachingAllocator.cpp, `shareIpcHandle`; torch
reads them back by length: exactly 64 bytes is the old format, anything else starts with a version byte):
- torch <= 2.4: the raw 64-byte `cudaIpcMemHandle_t` of the allocation;
- torch >= 2.5: one version byte (1 from 2.5, 2 once expandable segments could use fabric handles, 3 in torch 2.13),
  one type byte, then the payload: `c` (a cudaMalloc block) is followed by the same 64-byte `cudaIpcMemHandle_t` in
  every version; `e` (an expandable segment) by a header and POSIX file descriptors or fabric handles of cuMemCreate
  memory, which no `cudaIpcMemHandle_t` can name (its layout changed in version 3).
`cuda_ipc_handle` reads all of them; the daemon only ever sees the 64-byte handle.

Nothing here imports torch or cuda-python until a function that needs them is called (importing kvbroker stays
light). docs/device.md has the whole story.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import re
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbroker.types import CacheDesc, DataType, DeviceMemory, Placement, TensorLocation

__all__ = ["ExportedAllocation", "cuda_allocation", "cuda_ipc_handle", "raw_locations", "torch_cache",
           "torch_locations"]

CUDA_HANDLE_BYTES = 64
TORCH_HANDLE_VERSIONS = (1, 2, 3)
"""Versions of torch's storage handle format read here: the `c` payload is the same 64 bytes in each."""
_CUDA_MALLOC, _EXPANDABLE_SEGMENT = ord("c"), ord("e")

_TORCH_DTYPES = {
    "float16": DataType.FLOAT16, "bfloat16": DataType.BFLOAT16, "float32": DataType.FLOAT32,
    "float64": DataType.FLOAT64, "int8": DataType.INT8, "uint8": DataType.UINT8, "int16": DataType.INT16,
    "uint16": DataType.UINT16, "int32": DataType.INT32, "uint32": DataType.UINT32, "int64": DataType.INT64,
    "uint64": DataType.UINT64, "bool": DataType.BOOL, "float8_e4m3fn": DataType.FLOAT8_E4M3FN,
    "float8_e5m2": DataType.FLOAT8_E5M2,
}


@dataclass(frozen=True, slots=True)
class ExportedAllocation:
    """One device allocation as its IPC handle exports it: `base` and `size` in the exporting process."""

    kind: str
    """"cuda" or "npu"."""
    device: str
    """A GPU UUID ("GPU-…", robust against different CUDA_VISIBLE_DEVICES orders) or an ordinal ("0")."""
    ipc_handle: bytes
    """cudaIpcMemHandle_t of the allocation (64 bytes), or the Ascend IPC export key."""
    base: int
    size: int

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "npu"):
            raise ValueError(f"kind must be 'cuda' or 'npu', got {self.kind!r}")
        if self.kind == "cuda" and len(self.ipc_handle) != CUDA_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle is {CUDA_HANDLE_BYTES} bytes, got {len(self.ipc_handle)}")
        if not self.ipc_handle or self.base <= 0 or self.size <= 0:
            raise ValueError("an exported allocation needs a handle, a base address and a size")


def raw_locations(pointers: Sequence[tuple[int, int, str]], allocations: Sequence[ExportedAllocation]
                  ) -> list[TensorLocation]:
    """One TensorLocation per (pointer, nbytes, device) triple: the allocation (on that device) that holds all of
    the tensor's bytes, and the tensor's offset in it. ValueError when no allocation holds a tensor."""
    locations = []
    for i, (pointer, nbytes, device) in enumerate(pointers):
        holder = next((a for a in allocations if a.device == device and a.base <= pointer
                       and pointer + nbytes <= a.base + a.size), None)
        if holder is None:
            raise ValueError(f"tensor {i}: no exported allocation on device {device!r} holds bytes "
                             f"[{pointer:#x}, {pointer + nbytes:#x})")
        locations.append(TensorLocation("", pointer - holder.base, DeviceMemory(
            holder.kind, holder.device, holder.ipc_handle, holder.size)))
    return locations


def cuda_allocation(pointer: int) -> ExportedAllocation:
    """The CUDA allocation holding `pointer`, exported with cuda-python (cudaIpcGetMemHandle on the allocation found
    by cuMemGetAddressRange). Refuses memory that legacy IPC cannot export (VMM: expandable segments, cumem)."""
    rt, drv = _cuda_python()
    err, attr = drv.cuPointerGetAttribute(
        drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, pointer)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise ValueError(f"{pointer:#x} is not CUDA device memory of this process ({err})")
    if not attr:
        raise ValueError(_VMM_REFUSAL)
    err, base, size = drv.cuMemGetAddressRange(pointer)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuMemGetAddressRange({pointer:#x}) failed: {err}")
    err, handle = rt.cudaIpcGetMemHandle(int(base))
    if err != rt.cudaError_t.cudaSuccess:
        raise ValueError(f"cudaIpcGetMemHandle failed: {err}")
    err, ordinal = drv.cuPointerGetAttribute(drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, pointer)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cannot tell the device of {pointer:#x}: {err}")
    err, prop = rt.cudaGetDeviceProperties(int(ordinal))
    device = f"GPU-{uuid.UUID(bytes=bytes(prop.uuid.bytes))}" if err == rt.cudaError_t.cudaSuccess else str(ordinal)
    return ExportedAllocation("cuda", device, ctypes.string_at(handle.getPtr(), CUDA_HANDLE_BYTES), int(base),
                              int(size))


_VMM_REFUSAL = ("this memory is a virtual-memory (VMM) allocation, which legacy CUDA IPC handles cannot export (torch "
                "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, vLLM's cumem allocator): allocate the KV cache "
                "without expandable segments (docs/device.md)")


def _cuda_python() -> tuple[Any, Any]:
    """cuda-python's runtime and driver modules (cuda.bindings since 12.6; cuda.cudart / cuda.cuda before)."""
    for runtime, driver in (("cuda.bindings.runtime", "cuda.bindings.driver"), ("cuda.cudart", "cuda.cuda")):
        try:
            return importlib.import_module(runtime), importlib.import_module(driver)
        except ImportError:
            continue
    raise ImportError("exporting raw CUDA pointers needs cuda-python (pip install cuda-python)")


def _expandable_segments() -> bool:
    conf = ",".join(os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return re.search(r"expandable_segments\s*:\s*true", conf, re.IGNORECASE) is not None


def torch_locations(tensors: Sequence[Any]) -> list[TensorLocation]:
    """One TensorLocation per torch tensor on a CUDA or NPU device: its storage's allocation handle (torch's own
    `_share_cuda_` / `_share_npu_`, which export the caching allocator's whole segment), the tensor's offset in that
    segment, and the device (its UUID for CUDA). Contiguous tensors only: the daemon moves a tensor's bytes as one
    range."""
    for i, t in enumerate(tensors):  # every check before anything is exported
        kind = getattr(getattr(t, "device", None), "type", None)
        if kind not in ("cuda", "npu"):
            raise ValueError(f"tensor {i} is on {kind or 'no device'}, not a CUDA or NPU device: register host memory "
                             "as a shm segment (allocate_cache, or register_kv_cache of a shm file)")
        if not t.is_contiguous():
            raise ValueError(f"tensor {i} is not contiguous: register the contiguous KV tensors themselves")
        if kind == "cuda" and _expandable_segments():
            raise ValueError(f"tensor {i}: {_VMM_REFUSAL}")
    locations = []
    for i, t in enumerate(tensors):
        kind = t.device.type
        storage = t.untyped_storage()
        shared = storage._share_cuda_() if kind == "cuda" else storage._share_npu_()
        if shared[1] is None:  # torch shares a storage without data (zero bytes) with no handle
            raise ValueError(f"tensor {i} has no device memory (an empty storage): nothing to register")
        handle, storage_bytes, storage_offset = bytes(shared[1]), int(shared[2]), int(shared[3])
        if kind == "cuda":
            try:
                handle = cuda_ipc_handle(handle)
            except ValueError as e:
                raise ValueError(f"tensor {i}: {e}") from None
        offset = storage_offset + t.storage_offset() * t.element_size()
        locations.append(TensorLocation("", offset, DeviceMemory(
            kind, _torch_device_name(t), handle, storage_offset + storage_bytes)))
    return locations


def cuda_ipc_handle(shared: bytes) -> bytes:
    """The 64-byte `cudaIpcMemHandle_t` in a handle torch's `storage._share_cuda_()` returned, whichever torch wrote
    it (module docstring). ValueError, naming the reason, for an expandable segment, a format version newer than
    this kvbroker knows, or bytes that are no torch CUDA handle."""
    if len(shared) == CUDA_HANDLE_BYTES:  # torch <= 2.4; torch itself tells the formats apart by this length too
        return bytes(shared)
    if len(shared) < 2:
        raise ValueError(f"{len(shared)} bytes are not a torch CUDA storage handle")
    version, kind = shared[0], shared[1]
    if kind == _EXPANDABLE_SEGMENT and version in TORCH_HANDLE_VERSIONS:
        raise ValueError(_EXPANDABLE_REFUSAL)
    if version not in TORCH_HANDLE_VERSIONS:
        raise ValueError(f"torch wrote its CUDA storage handle in format version {version}; this kvbroker reads the "
                         "raw 64-byte handle (torch <= 2.4) and versions "
                         f"{', '.join(map(str, TORCH_HANDLE_VERSIONS))} (torch 2.5 to 2.13): update kvbroker")
    if kind != _CUDA_MALLOC:
        raise ValueError(f"torch CUDA storage handle version {version} has the unknown type byte {kind:#04x} "
                         "(known: 'c' for a cudaMalloc block, 'e' for an expandable segment)")
    payload = bytes(shared[2:])
    if len(payload) != CUDA_HANDLE_BYTES:
        raise ValueError(f"a torch 'c' CUDA storage handle carries a {CUDA_HANDLE_BYTES}-byte cudaIpcMemHandle_t "
                         f"after its 2-byte header; this one carries {len(payload)} bytes")
    return payload


_EXPANDABLE_REFUSAL = (
    "the tensor lies in a torch expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or "
    "torch.cuda.memory._set_allocator_settings): torch exported it as cuMemCreate memory (file descriptors or fabric "
    "handles of this process), not as a cudaIpcMemHandle_t, and kvbrokerd imports legacy CUDA IPC handles only (UCX's "
    "cuda_ipc lane needs memory that legacy IPC can export, too): allocate the KV cache with expandable_segments:False "
    "(docs/device.md)")


def _torch_device_name(t: Any) -> str:
    index = t.device.index if t.device.index is not None else 0
    if t.device.type == "cuda":
        torch = sys.modules["torch"]  # loaded: the tensor is one of its (not imported here: the client stays light)
        try:
            return f"GPU-{uuid.UUID(str(torch.cuda.get_device_properties(index).uuid))}"
        except (AttributeError, ValueError):  # an old torch without the UUID: the ordinal (same visible order!)
            return str(index)
    return str(index)


def torch_cache(tensors: Sequence[Any], layout_tag: str = "") -> tuple[CacheDesc, list[TensorLocation]]:
    """(desc, tensors) for `client.register_kv_cache(...)` from torch KV tensors of one shape and dtype, whose first
    dimension is the block count."""
    if not tensors:
        raise ValueError("no tensors")
    first = tensors[0]
    shapes = {tuple(t.shape) for t in tensors}
    dtypes = {str(t.dtype) for t in tensors}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise ValueError(f"one shape and dtype for every tensor, got shapes {sorted(shapes)} and {sorted(dtypes)}")
    name = str(first.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype {first.dtype} has no kvbroker DataType")
    locations = torch_locations(tensors)
    desc = CacheDesc(num_tensors=len(tensors), shape=tuple(int(d) for d in first.shape),
                     data_type=_TORCH_DTYPES[name], placement=Placement.DEVICE, layout_tag=layout_tag)
    return desc, locations
