"""Device-direct GPU engines against a daemon stand-in, for the remap tests: the connector's DeviceDirect registers an
engine's runs and its unit cache through a real registry and `nixl` backend (tests/fakenixl.py: a recording
stand-in for NIXL), with fake CUDA whose IPC handles name the test's own CPU tensors, so the daemon's imports address
the engine's memory. BOOKKEEPING for CUDA and NIXL: nothing here shows what either would accept."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvbroker import CacheDesc, DeviceMemory, Placement, TensorLocation
from kvbroker.integrations.vllm.cuda_remap import units_desc
from kvbroker.integrations.vllm.gpu import DeviceDirect, GpuKv
from kvbroker.types import CUDA_REREGISTER
from kvbrokerd.backends.common.cudaipc import CudaIpcImporter
from tests.cudaremapkit import Rank
from tests.fakecuda import FakeRuntime
from tests.fakenixl import Rig, nixl_rig


class DaemonClient:
    """What DeviceDirect asks of kvbroker.Client, answered by a nixl backend on a real registry (tests/fakenixl.py:
    a recording stand-in for NIXL, fake CUDA whose IPC handles name the test's own CPU buffers)."""

    def __init__(self, rig: Rig, features: tuple[str, ...] = (CUDA_REREGISTER,)) -> None:
        self.rig = rig
        self.features = features
        self.calls: list[str] = []

    def get_cluster_info(self) -> Any:
        return SimpleNamespace(features=self.features)

    def register_kv_cache(self, desc: CacheDesc, locations: list[TensorLocation]) -> Any:
        self.calls.append("register")
        entry = self.rig.backend.import_device_cache(desc, locations, "engine")
        return SimpleNamespace(cache_id=entry.cache_id, desc=desc)

    def unregister_kv_cache(self, cache_id: int, timeout: float) -> None:
        self.calls.append("unregister")
        self.rig.remove(cache_id)


class ExportedMemory(FakeRuntime):
    """Fake CUDA whose IPC handle is the hex address of a CPU allocation (`export`): opening it maps that very
    memory."""

    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.events = events
        self.exported: dict[int, int] = {}
        """Exported allocations: base address -> bytes."""

    def export(self, tensors: Sequence[torch.Tensor]) -> list[TensorLocation]:
        """torch_locations' answer for CPU tensors: each tensor's allocation (storage), named by its address."""
        out = []
        for t in tensors:
            storage = t.untyped_storage()
            self.exported[storage.data_ptr()] = storage.nbytes()
            handle = f"{storage.data_ptr():x}".encode().ljust(64, b".")
            out.append(TensorLocation("", t.data_ptr() - storage.data_ptr(),
                                      DeviceMemory("cuda", "0", handle, storage.nbytes())))
        return out

    def cuMemGetAddressRange(self, base: int) -> tuple[Any, int, int]:
        return self.CUresult.CUDA_SUCCESS, base, self.exported[base]

    def cudaIpcOpenMemHandle(self, h: Any, flags: int) -> tuple[Any, int]:
        handle = ctypes.string_at(h.getPtr(), 64)
        self.events.append(("open", handle[:12]))
        base = int(handle.rstrip(b".").decode(), 16)
        self.mapped[base] = handle
        return self.cudaError_t.cudaSuccess, base

    def cudaIpcCloseMemHandle(self, base: int) -> tuple[Any]:
        self.events.append(("close", self.mapped.pop(base)[:12]))
        return (self.cudaError_t.cudaSuccess,)


@contextlib.contextmanager
def device_direct_daemon(tmp_path: Path) -> Iterator[tuple[Rig, ExportedMemory, list[GpuKv]]]:
    """The daemon stand-in; the engines opened on it are closed (units first) before it goes."""
    with nixl_rig(tmp_path) as rig:
        runtime = ExportedMemory(rig.events)
        rig.backend._cuda = CudaIpcImporter(runtime, runtime)
        engines: list[GpuKv] = []
        try:
            yield rig, runtime, engines
        finally:
            for gpu in engines:
                gpu.close()


def open_device_direct(client: DaemonClient, cuda: ExportedMemory, rank: Rank) -> tuple[DeviceDirect, Any]:
    gpu = DeviceDirect(client, rank.views, rank.runs, rank.layout.tag(), exporter=cuda.export)  # type: ignore[arg-type]
    assert rank.geometry is not None
    units = gpu.open_units(units_desc(rank.runs, rank.geometry, rank.layout, Placement.DEVICE))
    return gpu, units


def served_units(rig: Rig, cache_id: int) -> list[np.ndarray]:
    """The unit cache as the daemon addresses it: its tensors at the addresses the daemon imported."""
    entry = rig.registry.get(cache_id)
    n, unit = entry.desc.tensor_nbytes, entry.desc.block_nbytes
    return [np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(a)).reshape(-1, unit) for a in entry.addresses]


def serve_device_direct(client: DaemonClient, cuda: ExportedMemory, engines: list[GpuKv]
                        ) -> Callable[[list[Rank]], Callable[[Rank], list[np.ndarray]]]:
    """For a remap test's pull: registers each rank device-direct, with its unit cache, and answers where the daemon
    finds a rank's unit cache."""
    units: dict[int, int] = {}

    def serve(ranks: list[Rank]) -> Callable[[Rank], list[np.ndarray]]:
        for rank in ranks:
            gpu, cache = open_device_direct(client, cuda, rank)
            engines.append(gpu)
            units[id(rank)] = cache.cache_id
        return lambda rank: served_units(client.rig, units[id(rank)])

    return serve
