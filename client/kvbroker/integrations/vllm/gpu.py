"""The connector on a GPU engine: vLLM's KV buffer stays where vLLM put it (device memory), and the daemon serves it
in one of two modes, chosen by vLLM's `kv_buffer_device` (as for NixlConnector):

- device-direct (`"cuda"`, vLLM's default on a GPU): every run of the buffer (`cuda_layout.read_runs`) is registered
  with this node's daemon as device memory (`kvbroker.device`: a CUDA IPC handle of vLLM's allocation plus the
  run's offset; no copy). The daemons move blocks VRAM to VRAM through the `nixl` backend, which is the only one
  that moves `cuda` memory: both daemons need `--backends nixl` (docs/device.md). The remap units (cuda_remap) are
  the same locations registered again: the daemon shares the first registration's IPC import and NIXL registration.
- host-staged (`"cpu"`): the daemon allocates a host cache of the same runs (shared memory, like the CPU engine's)
  and transfers only ever touch it, so any backend (shm, tcp) works and no NIXL/UCX is needed. The prefill worker
  copies the blocks each step wrote device-to-host on a side CUDA stream, run by run as soon as every layer of a run
  has been computed (`save_layer`, called after each layer's attention), and waits for those copies at the end of
  the step (`wait_for_save`): a request's KV is on the host before vLLM reports the request finished, hence before
  any decode node can ask for it. The decode worker copies the pulled blocks host-to-device before it reports the
  pull finished (`landed`), so vLLM schedules the request only once its KV is in VRAM.

Everything here works with CPU tensors standing in for device tensors (no streams then: copies are synchronous),
which is how it is tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from kvbroker._client import Client
from kvbroker.device import torch_locations
from kvbroker.integrations.vllm.cuda_layout import (
    KvRuns,
    block_ranges,
    manager_block_views,
    read_runs,
    run_tensors,
)
from kvbroker.integrations.vllm.cuda_remap import NoRemap
from kvbroker.integrations.vllm.cudart import clear_last_error
from kvbroker.integrations.vllm.layout import KvLayout, UnsupportedLayoutError
from kvbroker.shm import Cache
from kvbroker.status import LlmError, LlmStatus
from kvbroker.types import CUDA_REREGISTER, CacheDesc, DataType, Placement, TensorLocation

log = logging.getLogger(f"vllm.{__name__}")

DEVICE_DIRECT, HOST_STAGED = "device", "host"
# kv_buffer_device values -> mode.
MODES = {"cuda": DEVICE_DIRECT, "cpu": HOST_STAGED}

Exporter = Callable[[Sequence[torch.Tensor]], list[TensorLocation]]


def mode_for(kv_buffer_device: str) -> str:
    try:
        return MODES[kv_buffer_device]
    except KeyError:
        raise ValueError(f"KvBrokerConnector on a GPU engine: kv_buffer_device={kv_buffer_device!r} is not supported "
                         "(\"cuda\": device-direct through the nixl backend; \"cpu\": host-staged)") from None


def runs_desc(runs: KvRuns, layout_tag: str, placement: Placement) -> CacheDesc:
    """One kvbroker tensor per run, each `[num_blocks, block_bytes]` bytes: both modes and both sides agree on it."""
    return CacheDesc(num_tensors=len(runs.starts), shape=(runs.num_blocks, runs.block_bytes),
                     data_type=DataType.UINT8, placement=placement, layout_tag=layout_tag)


class GpuKv:
    """The daemon's view of a GPU worker's KV buffer; subclasses are the two modes."""

    mode = ""
    cache: Cache

    def save_layer(self, layer_name: str, blocks: Iterable[int]) -> None:
        """Layer `layer_name` has written `blocks` this step."""

    def wait_for_save(self) -> None:
        """End of a step: what this step wrote is where peers read it."""

    def landed(self, blocks: Sequence[int]) -> None:
        """A pull into `blocks` finished: make them visible to vLLM."""

    def open_units(self, desc: CacheDesc) -> Cache:
        """A second cache over the same memory, addressed in the units of a TP or block-size remap (cuda_remap);
        closed with this one. LlmError where the daemon cannot serve it, NoRemap where this mode offers none."""
        raise NoRemap(f"{self.mode} mode offers no remap units")

    def close(self) -> None:
        raise NotImplementedError


class DeviceDirect(GpuKv):
    mode = DEVICE_DIRECT

    def __init__(self, client: Client, kv_caches: Mapping[str, torch.Tensor], runs: KvRuns, layout_tag: str,
                 exporter: Exporter | None = None) -> None:
        self._client = client
        self.units: Cache | None = None
        tensors = run_tensors(kv_caches, runs)
        try:
            locations = (exporter or torch_locations)(tensors)
        except ValueError as e:  # e.g. VMM memory (expandable segments, cumem): legacy IPC cannot export it
            raise RuntimeError(f"KvBrokerConnector (device-direct): cannot export vLLM's KV buffer: {e}; or set "
                               "kv_buffer_device=\"cpu\" (host-staged)") from e
        try:
            self.cache = client.register_kv_cache(runs_desc(runs, layout_tag, Placement.DEVICE), locations)
            self._locations = locations
        except LlmError as e:
            raise RuntimeError(
                f"KvBrokerConnector (device-direct): the daemon cannot serve the KV buffer in {runs.device} memory: "
                f"{e.status.name}: {e.message}. Run the daemon with --backends nixl on a GPU host (docs/device.md), "
                "or set kv_buffer_device=\"cpu\" (host-staged, any backend)") from e
        log.info("kvbroker connector: device-direct, %d runs x %d blocks x %d bytes of %s registered as cache %d",
                 len(runs.starts), runs.num_blocks, runs.block_bytes, runs.device, self.cache.cache_id)

    def open_units(self, desc: CacheDesc) -> Cache:
        # The same VRAM registered again, at the same locations: a daemon with CUDA_REREGISTER shares the first
        # registration's IPC import and NIXL registration. An older one would register the same descriptors with
        # NIXL twice, which NIXL refuses or frees wrongly on deregistration (ai-dynamo/nixl#1792, #1773).
        if CUDA_REREGISTER not in self._client.get_cluster_info().features:
            raise NoRemap("device-direct remap units need a daemon that shares a device cache's registration "
                          f"({CUDA_REREGISTER}); this one would register the same VRAM with NIXL twice")
        self.units = self._client.register_kv_cache(desc, self._locations)
        return self.units

    def close(self) -> None:
        # Before vLLM frees the memory: the daemon closes its IPC mapping inside the last of these calls
        # (docs/device.md).
        try:
            if self.units is not None:
                self._client.unregister_kv_cache(self.units.cache_id, timeout=10.0)
                self.units = None
        finally:
            self._client.unregister_kv_cache(self.cache.cache_id, timeout=10.0)


class HostStaged(GpuKv):
    mode = HOST_STAGED

    def __init__(self, client: Client, kv_caches: Mapping[str, torch.Tensor], runs: KvRuns, layout_tag: str,
                 saves: bool = True) -> None:
        self._client = client
        self.device = run_tensors(kv_caches, runs)
        try:
            self.cache = client.allocate_cache(runs_desc(runs, layout_tag, Placement.HOST))
        except LlmError as e:
            raise RuntimeError(f"KvBrokerConnector (host-staged): cannot allocate the {len(runs.starts)} x "
                               f"{runs.run_bytes} byte host buffer through kvbrokerd: {e.status.name}: {e.message}"
                               ) from e
        self.host = [torch.from_numpy(a) for a in self.cache.tensors]
        self.units: Cache | None = None
        self.saves = saves
        on_gpu = self.device[0].device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(self.device[0].device) if on_gpu else None  # type: ignore[no-untyped-call]
        self._pinned: list[int] = self._pin() if on_gpu else []
        # Which layers each run holds; a run is copied once all of them have written this step.
        self._run_layers: dict[int, set[str]] = {}
        for name, idx in runs.layer_runs.items():
            for r in idx:
                self._run_layers.setdefault(r, set()).add(name)
        self._layer_runs = {name: tuple(idx) for name, idx in runs.layer_runs.items()}
        self._seen: dict[int, set[str]] = {}
        self._pending: dict[int, set[int]] = {}
        self._copied_blocks = 0
        self._slots: Any = None
        self._slot_blocks: list[int] = []
        self._in_lock = threading.Lock()  # pulls land from several threads; one H2D stream

    def _pin(self) -> list[int]:
        """Page-locks the host buffer so that copies are DMA, asynchronous and at full speed (best effort)."""
        cudart, pinned = torch.cuda.cudart(), []  # type: ignore[no-untyped-call]
        for t in self.host:
            err = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)
            if int(err) != 0:
                # Handled here: read it back, or torch's next kernel-launch check reports it as the kernel's failure.
                cleared = clear_last_error()
                log.warning("kvbroker connector: cannot pin the host KV buffer (cudaHostRegister error %s); copies "
                            "go through pageable memory, slower%s", int(err),
                            "" if cleared is not None else " (CUDA's last error could not be cleared: no libcudart)")
                break
            pinned.append(t.data_ptr())
        return pinned

    # -- prefill: device to host ---------------------------------------------------------------------------------
    def save_from_metadata(self, layer_name: str, attn_metadata: Any, block_size: int) -> None:
        """`save_layer` with the blocks read from vLLM's attention metadata; the slot mapping is read back to the
        host once per step (every layer of a group shares it), not once per layer."""
        if not self.saves:
            return
        meta = attn_metadata.get(layer_name) if isinstance(attn_metadata, Mapping) else attn_metadata
        slots = getattr(meta, "slot_mapping", None)
        if slots is None or slots is not self._slots:
            self._slots, self._slot_blocks = slots, blocks_written(attn_metadata, layer_name, block_size)
        self.save_layer(layer_name, self._slot_blocks)

    def save_layer(self, layer_name: str, blocks: Iterable[int]) -> None:
        if not self.saves:
            return
        blocks = set(blocks)
        for r in self._layer_runs.get(layer_name, ()):
            self._pending.setdefault(r, set()).update(blocks)
            seen = self._seen.setdefault(r, set())
            seen.add(layer_name)
            if seen >= self._run_layers[r]:
                self._copy_out(r)

    def _copy_out(self, r: int) -> None:
        blocks = self._pending.pop(r, set())
        self._seen.pop(r, None)
        if not blocks:
            return
        ranges = block_ranges(blocks)
        if self._stream is None:
            for a, b in ranges:
                self.host[r][a:b].copy_(self.device[r][a:b])
        else:
            # After the layer's kernels (queued on the compute stream), overlapped with the next layers' compute.
            self._stream.wait_stream(torch.cuda.current_stream(self.device[r].device))
            with torch.cuda.stream(self._stream):
                for a, b in ranges:
                    self.host[r][a:b].copy_(self.device[r][a:b], non_blocking=True)
        self._copied_blocks += len(blocks)

    def wait_for_save(self) -> None:
        for r in list(self._pending):  # runs not every layer of which wrote (a layer skipped this step)
            self._copy_out(r)
        if self._stream is not None:
            self._stream.synchronize()
        self._slots, self._slot_blocks = None, []

    # -- decode: host to device ------------------------------------------------------------------------------------
    def landed(self, blocks: Sequence[int]) -> None:
        ranges = block_ranges(blocks)
        with self._in_lock:
            if self._stream is None:
                for dev, host in zip(self.device, self.host, strict=True):
                    for a, b in ranges:
                        dev[a:b].copy_(host[a:b])
                return
            with torch.cuda.stream(self._stream):
                for dev, host in zip(self.device, self.host, strict=True):
                    for a, b in ranges:
                        dev[a:b].copy_(host[a:b], non_blocking=True)
            self._stream.synchronize()

    def open_units(self, desc: CacheDesc) -> Cache:
        self.units = self._client.allocate_cache(desc, view_of=self.cache)
        if self.units.record.tensors != self.cache.record.tensors:  # a daemon that predates views: new memory
            self._client.deallocate_cache(self.units.cache_id, timeout=5.0)
            self.units = None
            raise LlmError(LlmStatus.LLM_FEATURE_NOT_ENABLED, "the daemon does not make views of a cache")
        return self.units

    def close(self) -> None:
        if self.units is not None:
            self._client.deallocate_cache(self.units.cache_id, timeout=5.0)
            self.units = None
        if self._pinned:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            for ptr in self._pinned:
                cudart.cudaHostUnregister(ptr)
            self._pinned = []
        self.host = []
        self._client.deallocate_cache(self.cache.cache_id, timeout=5.0)


def blocks_written(attn_metadata: Any, layer_name: str, block_size: int) -> list[int]:
    """The blocks a step's attention wrote, from vLLM's slot mapping (slot = block * block_size + offset; padding
    slots are negative). Raises when the metadata has no slot mapping: staging cannot then know what to copy, and a
    silently stale host buffer would hand decode nodes wrong KV."""
    meta = attn_metadata.get(layer_name) if isinstance(attn_metadata, Mapping) else attn_metadata
    slots = getattr(meta, "slot_mapping", None)
    if slots is None:
        raise RuntimeError(f"KvBrokerConnector (host-staged): {type(meta).__name__} has no slot_mapping, so the blocks "
                           "this step wrote are unknown; use kv_buffer_device=\"cuda\" with this attention backend")
    slots = slots[slots >= 0]
    return [int(b) for b in torch.unique(torch.div(slots, block_size, rounding_mode="floor")).tolist()]


def on_gpu(kv_caches: Mapping[str, torch.Tensor]) -> bool:
    return any(t.device.type != "cpu" for t in kv_caches.values())


def physical_tag(vllm_layout: str, runs: KvRuns) -> str:
    """vLLM's resolved KVCacheLayout name (the order of the bytes inside a block) and the runs' shape."""
    return f"{vllm_layout}:{runs.signature()}"


def open_gpu_kv(client: Client, kv_caches: Mapping[str, torch.Tensor], layout: KvLayout, mode: str,
                vllm_layout: str | None, *, saves: bool = True, exporter: Exporter | None = None
                ) -> tuple[GpuKv, KvLayout]:
    """Reads the runs of vLLM's KV views, refuses what cannot be served (with the reason), and serves them in `mode`.
    Returns the mode's object and `layout` with the physical part of its tag filled in."""
    if not vllm_layout:
        raise UnsupportedLayoutError("vLLM has not resolved its KV cache layout (cache_config.kv_cache_layout), so "
                                     "peers could not tell whether their blocks' bytes are in the same order")
    kv_caches, kernel = manager_block_views(kv_caches, layout.num_blocks, layout.block_size)
    runs = read_runs(kv_caches)
    # A block split into kernel blocks holds its parts one after the other: another order of bytes than unsplit.
    physical = physical_tag(vllm_layout if kernel == layout.block_size else f"{vllm_layout}.kernel{kernel}", runs)
    layout = dataclasses.replace(layout, physical=physical, num_blocks=runs.num_blocks)
    if mode == DEVICE_DIRECT:
        return DeviceDirect(client, kv_caches, runs, layout.tag(), exporter), layout
    return HostStaged(client, kv_caches, runs, layout.tag(), saves=saves), layout
