"""A FAKE cuda-python runtime for bookkeeping tests only: it shows what kvbroker does with CUDA's IPC calls (which,
how often, in what order), never that CUDA would accept them. "Device" memory is host memory (ctypes buffers), so
code that reaches a real engine with it gets that engine's refusal of host memory as VRAM.

`install()` (used from a daemon's sitecustomize) makes kvbrokerd's cudaipc module use it; every call is appended to
the JSON-lines file named by KVBROKER_FAKE_CUDA_LOG.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

GPU0, GPU1 = uuid.UUID(int=0xA0), uuid.UUID(int=0xA1)
SIZE = 1 << 20


class Err(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMapBufferObjectFailed = 205


class Result(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1


class Handle:
    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(64)

    def getPtr(self) -> int:
        return ctypes.addressof(self._buf)


@dataclass
class FakeRuntime:
    """Records every call; opening a handle maps a fresh host buffer unless the handle starts with b"bad"."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)
    mapped: dict[int, bytes] = field(default_factory=dict)
    sizes: dict[bytes, int] = field(default_factory=dict)
    log_path: str = ""
    _buffers: dict[int, Any] = field(default_factory=dict)
    cudaError_t = Err
    cudaIpcMemLazyEnablePeerAccess = 1
    cudaIpcMemHandle_t = Handle
    CUresult = Result

    def _record(self, *call: Any) -> None:
        self.calls.append(call)
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(json.dumps([c.decode(errors="replace") if isinstance(c, bytes) else c for c in call]) + "\n")

    def cudaGetDeviceCount(self) -> tuple[Err, int]:
        return Err.cudaSuccess, 2

    def cudaGetDeviceProperties(self, i: int) -> tuple[Err, Any]:
        prop = type("P", (), {"uuid": type("U", (), {"bytes": (GPU0, GPU1)[i].bytes})()})()
        return Err.cudaSuccess, prop

    def cudaGetErrorName(self, err: Err) -> tuple[Err, bytes]:
        return Err.cudaSuccess, err.name.encode()

    def cudaSetDevice(self, ordinal: int) -> tuple[Err]:
        self._record("set", ordinal)
        return (Err.cudaSuccess,)

    def cudaFree(self, pointer: int) -> tuple[Err]:
        return (Err.cudaSuccess,)

    def cudaIpcOpenMemHandle(self, h: Handle, flags: int) -> tuple[Err, int]:
        data = ctypes.string_at(h.getPtr(), 64)
        self._record("open", data[:4], flags)
        if data.startswith(b"bad"):
            return Err.cudaErrorMapBufferObjectFailed, 0
        buf = ctypes.create_string_buffer(self.sizes.get(data, SIZE))
        base = ctypes.addressof(buf)
        self._buffers[base] = buf
        self.mapped[base] = data
        return Err.cudaSuccess, base

    def cudaIpcCloseMemHandle(self, base: int) -> tuple[Err]:
        self._record("close", self.mapped.pop(base)[:4])
        self._buffers.pop(base, None)
        return (Err.cudaSuccess,)

    def cuMemGetAddressRange(self, base: int) -> tuple[Result, int, int]:
        return Result.CUDA_SUCCESS, base, self.sizes.get(self.mapped[base], SIZE)


def install() -> None:
    """Points kvbrokerd's CUDA importer at one FakeRuntime per process (for a daemon started by a test)."""
    from kvbrokerd.backends.common import cudaipc

    runtime = FakeRuntime(log_path=os.environ.get("KVBROKER_FAKE_CUDA_LOG", ""))
    cudaipc.cuda_missing = lambda: None
    cudaipc.CudaIpcImporter = functools.partial(cudaipc.CudaIpcImporter, runtime, runtime)  # type: ignore[misc,assignment]
