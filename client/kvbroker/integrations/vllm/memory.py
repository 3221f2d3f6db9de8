"""Puts vLLM's paged KV buffer in memory the daemon allocated, so that transfers read and write it in place.

vLLM allocates a worker's whole KV cache with one `torch.zeros(size, dtype=torch.int8)` inside the allocation context
a connector may provide (`get_mem_pool_context`), then views each layer out of it. On CPU there is no allocator to
swap, so the context is a `TorchFunctionMode` (torch's public interception hook) that answers exactly that call with
a tensor over a daemon-allocated cache (`Client.allocate_cache`: shared memory, zero-filled, owned by this engine's
lease) and lets every other call through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from kvbroker.integrations.vllm.layout import KvLayout
from kvbroker.shm import Cache


class DaemonKvAllocation(TorchFunctionMode):
    """Serves the KV buffer allocation of `layout` from `allocate`; other allocations are untouched."""

    def __init__(self, layout: KvLayout, allocate: Callable[[], Cache]) -> None:
        super().__init__()
        self.layout = layout
        self._allocate = allocate
        self.cache: Cache | None = None
        self.buffer: torch.Tensor | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self.cache is None and self._is_kv_buffer(args, kwargs):
            self.cache = self._allocate()
            self.buffer = torch.from_numpy(whole_cache_bytes(self.cache, self.layout.buffer_bytes))
            return self.buffer
        return func(*args, **kwargs)

    def _is_kv_buffer(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        size = args[0] if args else kwargs.get("size")
        if isinstance(size, tuple | list | torch.Size) and len(size) == 1:
            size = size[0]
        device = torch.device(kwargs.get("device") or "cpu")
        return (isinstance(size, int) and size == self.layout.buffer_bytes and kwargs.get("dtype") == torch.int8
                and device.type == "cpu")


def whole_cache_bytes(cache: Cache, nbytes: int) -> np.ndarray:
    """One int8 array over a daemon-allocated cache's tensors, which lie back to back in one segment."""
    owner: Any = cache.tensors[0]
    while isinstance(owner, np.ndarray):  # the numpy views stand on the segment's mmap
        owner = owner.base
    flat = np.frombuffer(owner, dtype=np.int8, count=nbytes)
    start = flat.__array_interface__["data"][0]
    for i, t in enumerate(cache.tensors):
        if t.__array_interface__["data"][0] != start + i * cache.desc.tensor_nbytes:
            raise RuntimeError(f"kvbroker cache {cache.cache_id}: tensor {i} is not where one contiguous KV buffer "
                               "needs it (the daemon padded its tensors)")
    return flat
