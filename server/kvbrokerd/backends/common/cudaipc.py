"""CUDA IPC imports for device caches: a model server's cudaIpcMemHandle_t opened in this daemon (cuda-python).

A legacy IPC handle names a whole allocation, and CUDA maps it once per context: opening it again in the same process
fails or aliases, and closing one of two users' mappings would pull the memory from under the other. So each
(device, handle) is opened once per process and reference-counted over the caches that use it; the mapping is closed
when the last of them leaves the registry (or at close). Closing must happen before the owner frees the allocation
(docs/device.md): the daemon cannot tell that it did not.

cuda-python is imported only by a daemon that serves cuda memory, and `runtime` is injectable so that the
bookkeeping can be unit-tested without a GPU (tests/unit/test_cudaipc_bookkeeping.py).
"""

from __future__ import annotations

import ctypes
import importlib
import threading
import uuid
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kvbrokerd.errors import LlmStatus, fail, param_invalid

HANDLE_BYTES = 64
INSTALL = "pip install cuda-python"


def load_runtime() -> tuple[ModuleType, ModuleType]:
    """cuda-python's runtime and driver modules (cuda.bindings since 12.6; cuda.cudart / cuda.cuda before)."""
    try:
        return (importlib.import_module("cuda.bindings.runtime"), importlib.import_module("cuda.bindings.driver"))
    except ImportError:
        return importlib.import_module("cuda.cudart"), importlib.import_module("cuda.cuda")


def error_name(rt: Any, err: Any) -> str:
    try:
        ok, name = rt.cudaGetErrorName(err)
        return bytes(name).decode() if ok == rt.cudaError_t.cudaSuccess else str(err)
    except Exception:  # a name is only for the message
        return str(err)


def cuda_missing() -> str | None:
    """Why this process cannot import CUDA memory (cuda-python missing, no usable device), or None."""
    try:
        rt, _ = load_runtime()
    except ImportError as e:
        return f"cuda-python is not installed ({e}); install it with: {INSTALL}"
    try:
        err, count = rt.cudaGetDeviceCount()
    except Exception as e:  # a broken driver install raises instead of returning an error
        return f"no CUDA device: cudaGetDeviceCount raised {type(e).__name__}: {e}"
    if err != rt.cudaError_t.cudaSuccess or not count:
        why = error_name(rt, err) if err != rt.cudaError_t.cudaSuccess else "0 devices"
        return f"no CUDA device (cudaGetDeviceCount: {why})"
    return None


def parse_device(name: str, uuids: list[bytes]) -> int:
    """The CUDA ordinal of `name`: a decimal ordinal, or a GPU UUID ("GPU-…" as nvidia-smi -L prints it; robust
    against a different CUDA_VISIBLE_DEVICES order in the model server)."""
    if name.isdecimal():
        ordinal = int(name)
        if ordinal >= len(uuids):
            param_invalid(f"CUDA device {ordinal} does not exist here ({len(uuids)} visible)")
        return ordinal
    text = name.removeprefix("GPU-")
    try:
        wanted = uuid.UUID(text).bytes
    except ValueError:
        param_invalid(f"device {name[:64]!r} is neither a CUDA ordinal nor a GPU UUID (GPU-xxxxxxxx-…)")
    if wanted not in uuids:
        param_invalid(f"GPU {name[:64]} is not visible to this daemon (check CUDA_VISIBLE_DEVICES)")
    return uuids.index(wanted)


@dataclass
class _Mapping:
    base: int
    size: int
    users: int = 0


@dataclass
class ImportedTensors:
    """One cache's view of its imports: per tensor the device ordinal and its address in this process."""

    device: int
    addresses: list[int]
    keys: list[tuple[int, bytes]] = field(default_factory=list)


class CudaIpcImporter:
    """Opens, reference-counts and closes CUDA IPC mappings (thread-safe; CUDA calls made on the caller's thread)."""

    def __init__(self, runtime: Any = None, driver: Any = None) -> None:
        if runtime is None:
            runtime, driver = load_runtime()
        self._rt = runtime
        self._drv = driver
        self._lock = threading.Lock()
        self._mappings: dict[tuple[int, bytes], _Mapping] = {}
        self._uuids: list[bytes] | None = None

    def make_current(self, ordinal: int = 0) -> None:
        """Makes device `ordinal`'s primary context current on this thread (NIXL's agent and UCX's progress threads
        must be created with one current: nixl issue #2102)."""
        self._check(self._rt.cudaSetDevice(ordinal)[0], f"cudaSetDevice({ordinal})")
        self._check(self._rt.cudaFree(0)[0], "creating the CUDA context (cudaFree(0))")

    @property
    def open_mappings(self) -> int:
        return len(self._mappings)

    def _check(self, err: Any, what: str, status: LlmStatus = LlmStatus.LLM_FAILED) -> None:
        if err != self._rt.cudaError_t.cudaSuccess:
            fail(status, f"{what} failed: {error_name(self._rt, err)}")

    def device_uuids(self) -> list[bytes]:
        if self._uuids is None:
            err, count = self._rt.cudaGetDeviceCount()
            self._check(err, "cudaGetDeviceCount", LlmStatus.LLM_FEATURE_NOT_ENABLED)
            uuids = []
            for i in range(count):
                err, prop = self._rt.cudaGetDeviceProperties(i)
                self._check(err, f"cudaGetDeviceProperties({i})")
                uuids.append(bytes(prop.uuid.bytes))
            self._uuids = uuids
        return self._uuids

    def import_tensors(self, device: str, handles: list[bytes], offsets: list[int], allocations: list[int],
                       nbytes: int) -> ImportedTensors:
        """Maps every tensor's allocation (each distinct handle once) and returns their addresses here. Checks each
        tensor against the real size of its mapping: a claimed allocation larger than the exporter's would let
        transfers touch memory outside it. All or nothing: on error, what this call opened is closed again."""
        ordinal = parse_device(device, self.device_uuids())
        result = ImportedTensors(ordinal, [])
        try:
            for i, (handle, offset, allocation) in enumerate(zip(handles, offsets, allocations, strict=True)):
                if len(handle) != HANDLE_BYTES:
                    param_invalid(f"tensor {i}: a CUDA IPC handle is {HANDLE_BYTES} bytes, got {len(handle)}")
                key = (ordinal, bytes(handle))
                mapping = self._open(key, i)
                result.keys.append(key)
                if offset + nbytes > mapping.size or allocation > mapping.size:
                    param_invalid(f"tensor {i}: bytes [{offset}, {offset + nbytes}) of a claimed {allocation}-byte "
                                  f"allocation, but the exported allocation is {mapping.size} bytes")
                result.addresses.append(mapping.base + offset)
        except BaseException:
            self.release(result)
            raise
        return result

    def _open(self, key: tuple[int, bytes], index: int) -> _Mapping:
        with self._lock:
            mapping = self._mappings.get(key)
            if mapping is None:
                mapping = self._mappings[key] = self._map(key, index)
            mapping.users += 1
            return mapping

    def _map(self, key: tuple[int, bytes], index: int) -> _Mapping:
        rt = self._rt
        ordinal, handle = key
        self._check(rt.cudaSetDevice(ordinal)[0], f"cudaSetDevice({ordinal})")
        h = rt.cudaIpcMemHandle_t()
        ctypes.memmove(h.getPtr(), handle, HANDLE_BYTES)  # the field's Python name differs across versions
        err, base = rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)
        if err != rt.cudaError_t.cudaSuccess:
            param_invalid(f"tensor {index}: cudaIpcOpenMemHandle failed ({error_name(rt, err)}): the handle must come "
                          "from cudaIpcGetMemHandle (or torch's _share_cuda_) in another live process on this machine, "
                          "of memory from cudaMalloc or torch's caching allocator without expandable segments")
        base = int(base)
        err, start, size = self._drv.cuMemGetAddressRange(base)
        if err != self._drv.CUresult.CUDA_SUCCESS or int(start) != base:
            rt.cudaIpcCloseMemHandle(base)
            fail(LlmStatus.LLM_FAILED, f"tensor {index}: cannot size the imported allocation ({err})")
        return _Mapping(base, int(size))

    def release(self, imported: ImportedTensors) -> list[str]:
        """Drops the cache's uses; closes each mapping nobody else uses. Returns the errors of closes that failed."""
        errors: list[str] = []
        with self._lock:
            for key in imported.keys:
                mapping = self._mappings.get(key)
                if mapping is None:
                    continue
                mapping.users -= 1
                if mapping.users == 0:
                    del self._mappings[key]
                    errors += self._unmap(key, mapping)
            imported.keys.clear()
        return errors

    def _unmap(self, key: tuple[int, bytes], mapping: _Mapping) -> list[str]:
        rt = self._rt
        rt.cudaSetDevice(key[0])
        err = rt.cudaIpcCloseMemHandle(mapping.base)[0]
        return [] if err == rt.cudaError_t.cudaSuccess else [f"cudaIpcCloseMemHandle: {error_name(rt, err)}"]

    def close_all(self) -> list[str]:
        errors: list[str] = []
        with self._lock:
            for key, mapping in list(self._mappings.items()):
                errors += self._unmap(key, mapping)
            self._mappings.clear()
        return errors
