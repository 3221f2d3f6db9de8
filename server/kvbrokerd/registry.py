"""The cache registry: which caches this daemon holds, where their bytes are, and who is using them.

Thread-safety: the registry is mutated on the event loop, but data-plane threads look caches up and pin them while
they copy; `_lock` guards the table and the pin counts, so a cache is never unmapped under a running copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvbroker._shm import SegmentMap
from kvbroker._types import CacheDesc, DataType, Placement, TensorLocation
from kvbrokerd import shmseg
from kvbrokerd.errors import LlmStatus, fail, param_invalid

MAX_DIMS = 32
MAX_TENSORS = 4096
MAX_TENSOR_BYTES = 1 << 44
_SEGMENT_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_ALIGN = 4096
log = logging.getLogger(__name__)
# Control page: 16-byte nonce, then one uint64 slot per live cache id (slot = id % slots; 0 = empty).
_NONCE_BYTES = 16


@dataclass(eq=False)
class CacheEntry:
    cache_id: int
    desc: CacheDesc
    tensors: tuple[TensorLocation, ...]
    daemon_owned: bool
    maps: dict[str, SegmentMap]
    views: list[memoryview]
    """One flat uint8 memoryview per tensor."""
    pins: int = 0
    closing: bool = False
    created_unix: float = field(default_factory=time.time)
    owner: str = ""
    """Client session whose lease keeps the cache alive ("" = no lease)."""
    addresses: list[int] = field(default_factory=list)
    """Base address of each tensor in this process (for memmove; valid while the entry is pinned)."""


def validate_desc(desc: CacheDesc) -> None:
    if not 1 <= desc.num_tensors <= MAX_TENSORS:
        param_invalid(f"num_tensors must be in [1, {MAX_TENSORS}], got {desc.num_tensors}")
    if not 1 <= len(desc.shape) <= MAX_DIMS:
        param_invalid(f"shape must have 1..{MAX_DIMS} dims, got {len(desc.shape)}")
    if any(d < 1 for d in desc.shape):
        param_invalid(f"every dim must be >= 1 (shape[0] is the block count), got shape {list(desc.shape)}")
    if math.prod(desc.shape) * desc.data_type.itemsize > MAX_TENSOR_BYTES:
        param_invalid(f"a tensor of shape {list(desc.shape)} is larger than {MAX_TENSOR_BYTES} bytes")
    if desc.placement != Placement.HOST:
        fail(LlmStatus.LLM_FEATURE_NOT_ENABLED, "only host placement is served (no device backend is enabled)")


def desc_from_wire(num_tensors: int, data_type: int, shape: Sequence[int], placement: int, tag: str) -> CacheDesc:
    """Builds a CacheDesc from untrusted wire values with LLM_PARAM_INVALID for anything out of range."""
    try:
        dtype = DataType(data_type)
    except ValueError:
        param_invalid(f"unknown data_type {data_type}")
    try:
        place = Placement(placement or Placement.HOST)
    except ValueError:
        param_invalid(f"unknown placement {placement}")
    if not 1 <= len(shape) <= MAX_DIMS:
        param_invalid(f"shape must have 1..{MAX_DIMS} dims, got {len(shape)}")
    desc = CacheDesc(num_tensors=num_tensors, shape=tuple(shape), data_type=dtype, placement=place, layout_tag=tag)
    validate_desc(desc)
    return desc


class Registry:
    def __init__(self, shm_dir: Path, max_caches: int = 4096) -> None:
        self.shm_dir = shm_dir
        self.max_caches = max_caches
        self.instance = secrets.token_hex(4)
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self._lock = threading.Lock()
        self._caches: dict[int, CacheEntry] = {}
        # Ids start at a random point so that an id from a previous incarnation of this daemon (same cluster id,
        # after a restart) almost surely names no cache here instead of silently naming another one.
        self._next_id = (secrets.randbits(30) + 1) << 32
        self._control: SegmentMap | None = None
        self._live: np.ndarray | None = None
        self.control_path: Path | None = None
        self.on_remove: list[Callable[[CacheEntry], None]] = []
        """Called with each entry leaving the registry, after its last pin and before its memory is unmapped (for
        backends that registered the memory with an engine)."""

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def open(self) -> None:
        """Removes segments of dead daemons and publishes the control page (nonce + live cache ids)."""
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        shmseg.remove_stale_segments(self.shm_dir)
        name = shmseg.segment_name(self.instance, "ctl")
        self.control_path = shmseg.create_segment(self.shm_dir, name, _NONCE_BYTES + 8 * self.max_caches)
        os.chmod(self.control_path, 0o644)
        self._control = SegmentMap(self.control_path)
        self._control.mmap[:_NONCE_BYTES] = self.nonce
        self._live = np.frombuffer(self._control.mmap, dtype=np.uint64, offset=_NONCE_BYTES)

    def close(self) -> None:
        with self._lock:
            entries = list(self._caches.values())
            self._caches.clear()
        for entry in entries:
            self._removed(entry)
            self._release(entry)
        self._live = None
        if self._control is not None:
            self._control.close()
            self._control = None
        if self.control_path is not None:
            self.control_path.unlink(missing_ok=True)

    # -- queries ---------------------------------------------------------------------------------------------------
    def get(self, cache_id: int) -> CacheEntry:
        entry = self._caches.get(cache_id)
        if entry is None or entry.closing:
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"cache {cache_id} does not exist", cache_id=cache_id)
        return entry

    def list(self) -> list[CacheEntry]:
        with self._lock:
            return sorted(self._caches.values(), key=lambda e: e.cache_id)

    def __len__(self) -> int:
        return len(self._caches)

    def pin(self, cache_id: int) -> CacheEntry:
        """Keeps the cache's memory mapped until `unpin` (callable from any thread)."""
        with self._lock:
            entry = self.get(cache_id)
            entry.pins += 1
            return entry

    def unpin(self, entry: CacheEntry) -> None:
        with self._lock:
            entry.pins -= 1

    @contextlib.contextmanager
    def pinned(self, cache_id: int) -> Iterator[CacheEntry]:
        entry = self.pin(cache_id)
        try:
            yield entry
        finally:
            self.unpin(entry)

    # -- mutations -------------------------------------------------------------------------------------------------
    def allocate(self, desc: CacheDesc, owner: str = "") -> CacheEntry:
        validate_desc(desc)
        self._check_capacity()
        stride = -(-desc.tensor_nbytes // _ALIGN) * _ALIGN
        total = stride * desc.num_tensors
        if total > shmseg.free_bytes(self.shm_dir):
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"{total} bytes requested, {shmseg.free_bytes(self.shm_dir)} free in "
                 f"{self.shm_dir}", requested=total)
        cache_id = self._reserve_id()
        name = shmseg.segment_name(self.instance, f"c{cache_id}")
        try:
            path = shmseg.create_segment(self.shm_dir, name, total)
        except OSError as e:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"cannot create shm segment {name}: {e.strerror}")
        tensors = tuple(TensorLocation(name, i * stride) for i in range(desc.num_tensors))
        try:
            return self._add(cache_id, desc, tensors, daemon_owned=True, owner=owner)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def register(self, desc: CacheDesc, tensors: Sequence[TensorLocation], owner: str = "") -> CacheEntry:
        validate_desc(desc)
        if len(tensors) != desc.num_tensors:
            param_invalid(f"{len(tensors)} tensor locations for num_tensors={desc.num_tensors}")
        spans: dict[str, list[tuple[int, int]]] = {}
        for i, loc in enumerate(tensors):
            if not _SEGMENT_NAME.match(loc.segment) or loc.segment in (".", ".."):
                param_invalid(f"tensor {i}: bad segment name {loc.segment!r} (want a shm name without '/')")
            try:
                size = (self.shm_dir / loc.segment).stat().st_size
            except OSError:
                param_invalid(f"tensor {i}: shm segment {loc.segment!r} does not exist in {self.shm_dir}")
            if loc.offset < 0 or loc.offset + desc.tensor_nbytes > size:
                param_invalid(f"tensor {i}: bytes [{loc.offset}, {loc.offset + desc.tensor_nbytes}) lie outside "
                              f"segment {loc.segment!r} of {size} bytes")
            spans.setdefault(loc.segment, []).append((loc.offset, loc.offset + desc.tensor_nbytes))
        for seg, ranges in spans.items():
            ranges.sort()
            for (_, end), (start, _) in itertools.pairwise(ranges):
                if start < end:
                    param_invalid(f"tensors overlap in segment {seg!r} at byte {start}")
        self._check_capacity()
        return self._add(self._reserve_id(), desc, tuple(tensors), daemon_owned=False, owner=owner)

    async def remove(self, cache_id: int, *, daemon_owned: bool | None, wait_s: float = 10.0) -> None:
        """Removes a cache once no copy uses it; waits at most `wait_s`, then refuses with LLM_LINK_BUSY.
        `daemon_owned` says which call asked (Deallocate: True, Unregister: False, lease expiry: None = either)."""
        with self._lock:
            entry = self.get(cache_id)
            if daemon_owned is not None and entry.daemon_owned != daemon_owned:
                how = "DeallocateCache" if entry.daemon_owned else "UnregisterKvCache"
                param_invalid(f"cache {cache_id} must be released with {how}")
            entry.closing = True
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                if entry.pins == 0:
                    del self._caches[cache_id]
                    self._set_live(cache_id, 0)
                    break
            if time.monotonic() > deadline:
                entry.closing = False
                fail(LlmStatus.LLM_LINK_BUSY, f"cache {cache_id} is still in use by a transfer")
            await asyncio.sleep(0.005)
        self._removed(entry)
        self._release(entry)

    # -- internals -------------------------------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        if len(self._caches) >= self.max_caches:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"cache limit reached ({self.max_caches})")

    def _reserve_id(self) -> int:
        # Ids are never reused; skipping ids whose control slot is taken keeps the slot -> id map unambiguous.
        with self._lock:
            while self._live is not None and self._live[self._next_id % self.max_caches] != 0:
                self._next_id += 1
            cache_id = self._next_id
            self._next_id += 1
            return cache_id

    def _set_live(self, cache_id: int, value: int) -> None:
        if self._live is not None:
            self._live[cache_id % self.max_caches] = value

    def _add(self, cache_id: int, desc: CacheDesc, tensors: tuple[TensorLocation, ...], daemon_owned: bool,
             owner: str) -> CacheEntry:
        maps: dict[str, SegmentMap] = {}
        try:
            for loc in tensors:
                if loc.segment not in maps:
                    maps[loc.segment] = SegmentMap(self.shm_dir / loc.segment)
        except OSError as e:
            for m in maps.values():
                m.close()
            param_invalid(f"cannot map shm segment: {e}")
        views = [memoryview(maps[t.segment].mmap)[t.offset : t.offset + desc.tensor_nbytes] for t in tensors]
        addresses = [int(np.frombuffer(v, np.uint8).ctypes.data) for v in views]
        entry = CacheEntry(cache_id, desc, tensors, daemon_owned, maps, views, owner=owner, addresses=addresses)
        with self._lock:
            self._caches[cache_id] = entry
            self._set_live(cache_id, cache_id)
        return entry

    def _removed(self, entry: CacheEntry) -> None:
        for callback in self.on_remove:
            try:
                callback(entry)
            except Exception:  # a backend's clean-up must not keep the memory mapped or the cache listed
                log.exception("clean-up of cache %d failed", entry.cache_id)

    def _release(self, entry: CacheEntry) -> None:
        for v in entry.views:
            v.release()
        entry.views = []
        for m in entry.maps.values():
            m.close()
        if entry.daemon_owned:
            for seg in {t.segment for t in entry.tensors}:
                (self.shm_dir / seg).unlink(missing_ok=True)


def is_live(control: np.ndarray, cache_id: int) -> bool:
    """Reads a peer's control page: is `cache_id` still registered there?"""
    return bool(control[cache_id % len(control)] == cache_id)


def control_view(seg: SegmentMap) -> tuple[bytes, np.ndarray]:
    """(nonce, live-id array) of a peer's mapped control page."""
    return bytes(seg.mmap[:_NONCE_BYTES]), np.frombuffer(seg.mmap, dtype=np.uint64, offset=_NONCE_BYTES)
