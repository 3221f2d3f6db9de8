"""BOOKKEEPING ONLY: how the `nixl` backend registers memory with its agent when several caches lie over the same
memory (a host cache and its views; a device cache registered again in the units of a remap), against a recording
stand-in for the NIXL agent and tests/fakecuda.py for CUDA. NIXL 1.5 takes the same descriptors twice and frees the
first one twice on deregistration; newer NIXL refuses them (ai-dynamo/nixl#1792, #1773): each range must be
registered once, for as long as any cache over it is listed, and a device cache's IPC mapping closed only after
that. What NIXL and CUDA do with the memory is for tests/integration/test_nixl.py (host memory, real NIXL) and
tests/device/cuda_check.py (a GPU)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvbroker import CacheDesc, DataType, DeviceMemory, ParamInvalidError, Placement, TensorLocation
from tests.fakenixl import Rig, nixl_rig

BASE = CacheDesc(num_tensors=2, shape=(8, 1024), data_type=DataType.UINT8)
UNITS = CacheDesc(num_tensors=2, shape=(64, 128), data_type=DataType.UINT8)  # the same tensors, other blocks


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with nixl_rig(tmp_path) as rig:
        yield rig


@pytest.mark.parametrize("base_goes_first", [True, False])
def test_bookkeeping_a_host_view_shares_its_bases_registration(rig: Rig, base_goes_first: bool) -> None:
    """A CPU engine's token view (AllocateCache view_of) is its base's memory at the same addresses: one
    registration, whose metadata both caches' descriptions carry, deregistered when the last of them goes."""
    registry, backend, agent = rig.registry, rig.backend, rig.agent
    base = registry.allocate(BASE, "s")
    view = registry.allocate_view(UNITS, "s", base.cache_id)
    assert view.addresses == base.addresses
    described = [asyncio.run(backend.describe_cache(e)) for e in (base, view)]
    assert rig.kinds() == ["register"] and described[0].endswith(b"md1") and described[1].endswith(b"md1")
    first, last = (base, view) if base_goes_first else (view, base)
    rig.remove(first.cache_id)
    assert rig.kinds() == ["register"]
    rig.remove(last.cache_id)
    assert rig.kinds() == ["register", "deregister"] and agent.live == {}


def _cuda(handle: bytes, offset: int) -> TensorLocation:
    return TensorLocation("", offset, DeviceMemory("cuda", "0", handle.ljust(64, b"."), 1 << 20))


def test_bookkeeping_a_device_cache_registered_again_in_units_shares_the_import_and_the_registration(
        rig: Rig) -> None:
    """DeviceDirect.open_units registers the same VRAM again, in remap units: one IPC open, one NIXL registration,
    and the mapping closed only after NIXL let go of it, whichever cache goes first."""
    backend, agent, events = rig.backend, rig.agent, rig.events
    tensors = [_cuda(b"KV", 0), _cuda(b"KV", BASE.tensor_nbytes)]
    device = (CacheDesc(num_tensors=2, shape=BASE.shape, data_type=DataType.UINT8, placement=Placement.DEVICE),
              CacheDesc(num_tensors=2, shape=UNITS.shape, data_type=DataType.UINT8, placement=Placement.DEVICE))
    cache = backend.import_device_cache(device[0], tensors, "s")
    units = backend.import_device_cache(device[1], tensors, "s")
    assert units.addresses == cache.addresses
    assert events == [("open", b"KV.."), ("register", 1)]
    rig.remove(cache.cache_id)
    assert events == [("open", b"KV.."), ("register", 1)]  # the units cache still reads and writes that memory
    rig.remove(units.cache_id)
    assert events == [("open", b"KV.."), ("register", 1), ("deregister", 1), ("close", b"KV..")]
    assert agent.live == {} and backend._cuda is not None and backend._cuda.open_mappings == 0


def test_bookkeeping_memory_partly_registered_for_another_cache_is_refused_and_leaves_nothing_behind(
        rig: Rig) -> None:
    """A second cache over one of the first cache's ranges and other memory besides would have NIXL hold that range
    twice: refused (LLM_PARAM_INVALID) before NIXL sees it, its own IPC import closed again."""
    registry, backend, agent, events = rig.registry, rig.backend, rig.agent, rig.events
    gap = 2 * BASE.tensor_nbytes  # two separate ranges in one allocation
    desc = CacheDesc(num_tensors=2, shape=BASE.shape, data_type=DataType.UINT8, placement=Placement.DEVICE)
    first = backend.import_device_cache(desc, [_cuda(b"KV", 0), _cuda(b"KV", gap)], "s")
    with pytest.raises(ParamInvalidError, match="registered with NIXL for another cache"):
        backend.import_device_cache(desc, [_cuda(b"KV", 0), _cuda(b"XY", 0)], "s")
    assert [c.cache_id for c in registry.list()] == [first.cache_id]
    assert events == [("open", b"KV.."), ("register", 1), ("open", b"XY.."), ("close", b"XY..")]
    rig.remove(first.cache_id)
    assert agent.live == {} and rig.kinds()[-2:] == ["deregister", "close"]


def test_bookkeeping_closing_the_backend_deregisters_a_shared_registration_once(rig: Rig) -> None:
    registry, backend, agent = rig.registry, rig.backend, rig.agent
    base = registry.allocate(BASE, "s")
    view = registry.allocate_view(UNITS, "s", base.cache_id)
    for entry in (base, view):
        backend.local_cache(agent, entry)
    teardown: list[Callable[[Any], None]] = []
    backend.agent = cast(Any, SimpleNamespace(close=teardown.append))
    backend._live = cast(Any, SimpleNamespace(stop=lambda: None))
    backend.close()
    teardown[0](SimpleNamespace(deregister_memory=agent.deregister_memory, remove_remote_agent=lambda name: None))
    assert rig.kinds() == ["register", "deregister"]
