"""Device caches: RegisterKvCache of tensors in accelerator memory, exported by IPC handle.

The planner and the registry's shm path know nothing of device memory. A device registration is validated here
(one kind per cache, handle sizes, each tensor inside its exported allocation) and then handed to the first of this
daemon's backends that declares the memory kind (`Backend.memory_kinds`); that backend imports the handles
(CUDA: cudaIpcOpenMemHandle; Ascend: the IPC export key) and owns the mapping. A daemon with no such backend
refuses with LLM_FEATURE_NOT_ENABLED and says which backend would serve the kind.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from kvbroker.types import CacheDesc, Placement, TensorLocation
from kvbrokerd.errors import LlmStatus, fail, param_invalid
from kvbrokerd.limits import check_text

if TYPE_CHECKING:
    from kvbrokerd.registry.caches import CacheEntry


class Backend(Protocol):
    """What this module asks of an engine (dataplane/seam.py's `Backend`, which sits a floor up): the memory kinds
    it moves, and how it imports a device cache of one."""

    @property
    def name(self) -> str: ...

    @property
    def memory_kinds(self) -> frozenset[str]: ...

    def import_device_cache(self, desc: CacheDesc, tensors: Sequence[TensorLocation], owner: str) -> CacheEntry: ...

MAX_DEVICE_NAME = 64


def is_device(tensors: Sequence[TensorLocation]) -> bool:
    return any(t.device is not None for t in tensors)


DeviceKinds = Mapping[str, tuple[str, tuple[int, int]]]
"""Device memory kind -> (the backend that imports it, its IPC handle sizes): `kvbrokerd.backends.device_kinds()`."""


def validate(desc: CacheDesc, tensors: Sequence[TensorLocation], known: DeviceKinds) -> str:
    """Checks a device registration before anything is imported; returns its memory kind."""
    if len(tensors) != desc.num_tensors:
        param_invalid(f"{len(tensors)} tensor locations for num_tensors={desc.num_tensors}")
    if desc.placement not in (Placement.DEVICE, Placement.HOST) or any(t.device is None for t in tensors):
        param_invalid("a device cache needs a device location for every tensor")
    kinds = {t.device.kind for t in tensors if t.device is not None}
    if len(kinds) != 1:
        param_invalid(f"one memory kind per cache, got {sorted(kinds)}")
    kind = kinds.pop()
    if kind not in known:
        param_invalid(f"unknown device memory kind {kind!r} (known: {', '.join(known)})")
    _, (smallest, largest) = known[kind]
    for i, t in enumerate(tensors):
        d = t.device
        assert d is not None
        if t.segment:
            param_invalid(f"tensor {i}: a device tensor names no shm segment")
        if not d.device or len(d.device.encode()) > MAX_DEVICE_NAME:
            param_invalid(f"tensor {i}: device must be 1..{MAX_DEVICE_NAME} bytes (a UUID or an ordinal)")
        check_text(f"tensor {i}: device", d.device, MAX_DEVICE_NAME)  # it ends up in messages and logs
        if not smallest <= len(d.ipc_handle) <= largest:
            param_invalid(f"tensor {i}: a {kind} IPC handle is {smallest}..{largest} bytes, got {len(d.ipc_handle)}")
        if t.offset < 0 or t.offset + desc.tensor_nbytes > d.allocation_bytes:
            param_invalid(f"tensor {i}: bytes [{t.offset}, {t.offset + desc.tensor_nbytes}) are outside the exported "
                          f"allocation of {d.allocation_bytes} bytes")
    by_allocation: dict[tuple[str, bytes], list[int]] = {}
    for t in tensors:
        assert t.device is not None
        by_allocation.setdefault((t.device.device, t.device.ipc_handle), []).append(t.offset)
    for offsets in by_allocation.values():
        offsets.sort()
        for a, b in itertools.pairwise(offsets):
            if b - a < desc.tensor_nbytes:
                param_invalid(f"tensors overlap in one exported allocation at offset {b}")
    return kind


def register(desc: CacheDesc, tensors: Sequence[TensorLocation], backends: Mapping[str, Backend],
             owner: str, known: DeviceKinds) -> CacheEntry:
    """Validates, then hands the registration to the backend that serves its memory kind. A daemon that runs the
    backend meant for the kind, which cannot serve it here, lets that backend refuse: it knows what is missing."""
    kind = validate(desc, tensors, known)
    for backend in backends.values():
        if kind in backend.memory_kinds:
            return backend.import_device_cache(desc, tensors, owner)
    serving = known[kind][0]
    if serving in backends:
        return backends[serving].import_device_cache(desc, tensors, owner)
    fail(LlmStatus.LLM_FEATURE_NOT_ENABLED, f"no backend of this daemon moves {kind} memory (it runs "
         f"{', '.join(backends) or 'none'}); start it with --backends {serving},... where the {serving} backend "
         "can run")


def memory_kind(tensors: Sequence[TensorLocation]) -> str:
    """"host" for a cache in shm, else its device kind."""
    return next((t.device.kind for t in tensors if t.device is not None), "host")


def check_moves(backend: Backend | None, *caches: tuple[str, Sequence[TensorLocation]]) -> None:
    """Refuses (LLM_FEATURE_NOT_ENABLED) a transfer whose backend cannot move the memory of one of its caches: a
    device address handed to a host-memory copy would crash the daemon. `backend` None: the daemon's own memcopy."""
    kinds = backend.memory_kinds if backend is not None else frozenset({"host"})
    for what, tensors in caches:
        kind = memory_kind(tensors)
        if kind not in kinds:
            fail(LlmStatus.LLM_FEATURE_NOT_ENABLED, f"{what} is in {kind} memory, which "
                 f"{'the ' + backend.name + ' backend' if backend is not None else 'a local copy'} cannot move "
                 f"(it moves {', '.join(sorted(kinds))}); link over a backend that serves {kind}")
