"""The cache registry: which caches this daemon holds, where their bytes are, and who is using them.

Thread-safety: the registry is mutated on the event loop and by AllocateCache on worker threads (reserving memory
takes time); data-plane threads look caches up and pin them while they copy. `_lock` guards the table, the id counter
and the pin counts, so a cache is never unmapped under a running copy.

Segments: AllocateCache creates `kvbroker-<instance>-c<id>` with its memory reserved (a full tmpfs is refused here,
never discovered by a SIGBUS later). RegisterKvCache takes a model server's own segments by plain name in this
daemon's shm directory: regular files of this daemon's user, never symlinks, never a name that a daemon manages.
Their owner may still truncate them: `CacheEntry.check_intact` says so before a copy, and copies that touch them go
through the kernel (see backends/memcopy.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import itertools
import logging
import math
import os
import resource
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvbroker.types import CacheDesc, DataType, Placement, TensorLocation
from kvbrokerd.errors import LlmStatus, fail, param_invalid
from kvbrokerd.registry import shmseg
from kvbrokerd.registry.endpoint import Endpoint

log = logging.getLogger(__name__)

MAX_DIMS = 32
MAX_TENSORS = 4096
MAX_TENSOR_BYTES = 1 << 44
_ALIGN = 4096


@dataclass(eq=False)
class CacheEntry:
    cache_id: int
    desc: CacheDesc
    tensors: tuple[TensorLocation, ...]
    daemon_owned: bool
    segments: dict[str, shmseg.Segment]
    views: list[memoryview]
    """One flat uint8 memoryview per tensor."""
    pins: int = 0
    closing: bool = False
    created_unix: float = field(default_factory=time.time)
    owner: str = ""
    """Client session whose lease keeps the cache alive ("" = no lease)."""
    addresses: list[int] = field(default_factory=list)
    """Base address of each tensor in this process (for memmove; valid while the entry is pinned)."""
    view_of: int = 0
    """Another view of the memory of this allocated cache (`allocate_view`): its segment is that cache's."""

    def extents(self) -> dict[str, int]:
        """Bytes each segment must hold for the tensors in it."""
        need: dict[str, int] = {}
        for t in self.tensors:
            need[t.segment] = max(need.get(t.segment, 0), t.offset + self.desc.tensor_nbytes)
        return need

    def check_intact(self) -> None:
        """Raises LLM_KV_CACHE_NOT_EXIST when a segment is now smaller than the cache needs (its owner truncated
        it): call under a pin, before a copy or a send from or into this cache. Touching such memory through a
        mapping would kill the daemon with SIGBUS."""
        for name, needed in self.extents().items():
            seg = self.segments.get(name)
            size = seg.current_size() if seg is not None and seg.fd >= 0 else 0
            if size < needed:
                fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"cache {self.cache_id}: segment {name!r} shrank to {size} "
                     f"bytes, the cache needs {needed} (its owner truncated it); unregister the cache",
                     cache_id=self.cache_id)

    def endpoint(self) -> Endpoint:
        """This cache as one side of a memory copy (valid while the entry is pinned)."""
        return Endpoint(label=f"cache {self.cache_id}", addresses=self.addresses,
                        fds=[self.segments[t.segment].fd for t in self.tensors],
                        offsets=[t.offset for t in self.tensors], stable=self.daemon_owned, check=self.check_intact)


def validate_desc(desc: CacheDesc, *, host: bool = True) -> None:
    """`host`: the cache lives in shm (this registry's memory); device caches go through devicemem.py."""
    if not 1 <= desc.num_tensors <= MAX_TENSORS:
        param_invalid(f"num_tensors must be in [1, {MAX_TENSORS}], got {desc.num_tensors}")
    if not 1 <= len(desc.shape) <= MAX_DIMS:
        param_invalid(f"shape must have 1..{MAX_DIMS} dims, got {len(desc.shape)}")
    if any(d < 1 for d in desc.shape):
        param_invalid(f"every dim must be >= 1 (shape[0] is the block count), got shape {list(desc.shape)}")
    if math.prod(desc.shape) * desc.data_type.itemsize > MAX_TENSOR_BYTES:
        param_invalid(f"a tensor of shape {list(desc.shape)} is larger than {MAX_TENSOR_BYTES} bytes")
    if host and desc.placement != Placement.HOST:
        fail(LlmStatus.LLM_FEATURE_NOT_ENABLED, "a device cache is registered with a device location per tensor "
             "(TensorLocation.device); AllocateCache makes host caches only")


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
    validate_desc(desc, host=False)  # the placement is checked by whoever takes the cache (registry or devicemem)
    return desc


class Registry:
    """Live caches' ids are distinct modulo `max_caches`: a backend may keep one slot per live cache at
    `cache_id % max_caches` (backends/liveslots.py)."""

    def __init__(self, shm_dir: Path, max_caches: int = 4096) -> None:
        self.shm_dir = shm_dir
        self.max_caches = max_caches
        self.instance = ""
        """This daemon's instance name (also its epoch), claimed by `open`."""
        self._lock = threading.Lock()
        self._caches: dict[int, CacheEntry] = {}
        self._slots: set[int] = set()
        """cache_id % max_caches of every cache in the table."""
        # Ids start at a random point so that an id from a previous incarnation of this daemon (same cluster id,
        # after a restart) almost surely names no cache here instead of silently naming another one.
        self._next_id = (secrets.randbits(30) + 1) << 32
        self._instance_lock: shmseg.InstanceLock | None = None
        self.on_add: list[Callable[[CacheEntry], None]] = []
        """Called with each entry joining the registry, before its id is handed to anyone. Under the registry's lock
        (on whichever thread adds it), so quick, and never calling back into the registry."""
        self.on_remove: list[Callable[[CacheEntry], None]] = []
        """Called, in order, with each entry leaving the registry, after its last pin and before its memory is
        unmapped (for backends that registered the memory with an engine, or publish which caches live)."""

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def open(self) -> None:
        """Claims an instance name (its lock held until `close`) and removes the files of dead instances."""
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        _raise_fd_limit()
        self._instance_lock = shmseg.InstanceLock.claim(self.shm_dir)
        self.instance = self._instance_lock.instance
        shmseg.remove_stale_segments(self.shm_dir, self.instance)

    def close(self) -> None:
        with self._lock:
            entries = list(self._caches.values())
            self._caches.clear()
            self._slots.clear()
        for entry in entries:
            self._removed(entry)
            self._release(entry)
        if self._instance_lock is not None:
            self._instance_lock.release()  # last: until now a starting daemon must leave our files alone
            self._instance_lock = None

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
        free = shmseg.free_bytes(self.shm_dir)
        if total > free:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"{total} bytes requested, {free} free in {self.shm_dir}",
                 requested=total)
        cache_id = self._reserve_id()
        name = shmseg.segment_name(self.instance, f"c{cache_id}")
        try:
            segment = shmseg.create_segment(self.shm_dir, name, total)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                fail(LlmStatus.LLM_OUT_OF_MEMORY, f"{total} bytes do not fit in {self.shm_dir} "
                     f"({shmseg.free_bytes(self.shm_dir)} free): {e.strerror}", requested=total)
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"cannot create shm segment {name}: {e.strerror}")
        tensors = tuple(TensorLocation(name, i * stride) for i in range(desc.num_tensors))
        try:
            return self._add(cache_id, desc, tensors, {name: segment}, daemon_owned=True, owner=owner)
        except BaseException:
            segment.close()
            (self.shm_dir / name).unlink(missing_ok=True)
            raise

    def allocate_view(self, desc: CacheDesc, owner: str, base_id: int) -> CacheEntry:
        """A second cache over the memory of allocated cache `base_id`, which `owner` (a session) holds: the same
        tensors and bytes, other blocks. It keeps the memory mapped until released, whatever becomes of the base.
        It shares the base's mapping (the same addresses), so an engine that registers memory (nixl) finds both
        caches over the same regions and registers them once."""
        validate_desc(desc)
        self._check_capacity()
        with self._lock:
            base = self.get(base_id)
            if not owner or base.owner != owner or not base.daemon_owned or base.view_of or base.closing:
                param_invalid(f"view_of: cache {base_id} is not a live cache this daemon allocated for this session")
            if (desc.num_tensors, desc.tensor_nbytes) != (base.desc.num_tensors, base.desc.tensor_nbytes):
                param_invalid(f"a view of cache {base_id} has {base.desc.num_tensors} tensors of "
                              f"{base.desc.tensor_nbytes} bytes, not {desc.num_tensors} of {desc.tensor_nbytes}")
            # Its own descriptor of the file: the base may be released (and its descriptor closed) first. The
            # mapping outlives whichever closes first: mmap refuses to unmap while the other's views export it.
            segments = {name: shmseg.Segment(name, os.dup(seg.fd), seg.size, seg.uid, seg.writable, seg.map())
                        for name, seg in base.segments.items()}
        entry = self._add(self._reserve_id(), desc, base.tensors, segments, daemon_owned=True, owner=owner,
                          view_of=base_id)
        return entry

    def register(self, desc: CacheDesc, tensors: Sequence[TensorLocation], owner: str = "") -> CacheEntry:
        validate_desc(desc)
        if len(tensors) != desc.num_tensors:
            param_invalid(f"{len(tensors)} tensor locations for num_tensors={desc.num_tensors}")
        spans: dict[str, list[tuple[int, int]]] = {}
        for i, loc in enumerate(tensors):
            try:
                shmseg.check_name(loc.segment)
            except shmseg.SegmentError as e:
                param_invalid(f"tensor {i}: {e} (a shm name in {self.shm_dir})")
            if shmseg.instance_of(loc.segment) is not None:
                param_invalid(f"tensor {i}: segment {loc.segment!r} belongs to a kvbroker daemon; register "
                              "memory of your own")
            if loc.offset < 0:
                param_invalid(f"tensor {i}: negative offset {loc.offset}")
            spans.setdefault(loc.segment, []).append((loc.offset, loc.offset + desc.tensor_nbytes))
        for seg, ranges in spans.items():
            ranges.sort()
            for (_, end), (start, _) in itertools.pairwise(ranges):
                if start < end:
                    param_invalid(f"tensors overlap in segment {seg!r} at byte {start}")
        self._check_capacity()
        segments: dict[str, shmseg.Segment] = {}
        try:
            for name, ranges in spans.items():
                # The checks hold for the descriptor kept: the name may be replaced later, the file we map may not.
                segments[name] = shmseg.Segment.open(self.shm_dir, name, writable=True, owner=os.geteuid(),
                                                     min_size=max(end for _, end in ranges))
        except shmseg.SegmentError as e:
            for opened in segments.values():
                opened.close()
            param_invalid(f"{e} (a regular file of uid {os.geteuid()} that holds every tensor is needed)")
        try:
            return self._add(self._reserve_id(), desc, tuple(tensors), segments, daemon_owned=False, owner=owner)
        except BaseException:
            for opened in segments.values():
                opened.close()
            raise

    def add_device(self, desc: CacheDesc, tensors: Sequence[TensorLocation], addresses: Sequence[int], owner: str,
                   prepare: Callable[[CacheEntry], None]) -> CacheEntry:
        """Lists a device cache whose memory a backend has imported (devicemem.py): `addresses` are the tensors'
        addresses in this process. prepare(entry) runs before the cache is visible (the backend registers the memory
        with its engine); if it raises, nothing is listed. The IPC handles are not kept: ListCaches and peers'
        GetCacheInfo never see them (whoever holds one can map the model server's memory)."""
        self._check_capacity()
        kept = tuple(dataclasses.replace(t, device=dataclasses.replace(t.device, ipc_handle=b""))
                     if t.device is not None else t for t in tensors)
        entry = CacheEntry(self._reserve_id(), desc, kept, False, {}, [], owner=owner, addresses=list(addresses))
        prepare(entry)
        with self._lock:
            if len(self._caches) >= self.max_caches:
                self._removed(entry)
                fail(LlmStatus.LLM_OUT_OF_MEMORY, f"cache limit reached ({self.max_caches})")
            self._publish(entry)
        return entry

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
                    break
            if time.monotonic() > deadline:
                entry.closing = False
                fail(LlmStatus.LLM_LINK_BUSY, f"cache {cache_id} is still in use by a transfer")
            await asyncio.sleep(0.005)
        try:
            # Off the event loop: an engine (nixl, hccl) deregisters on its own thread and may take a while, and
            # unmapping a large cache takes time too. The slot stays reserved until then, so these hooks never
            # meet a new cache in it.
            await asyncio.get_running_loop().run_in_executor(None, self._tear_down, entry)
        finally:
            with self._lock:
                self._slots.discard(cache_id % self.max_caches)

    def _tear_down(self, entry: CacheEntry) -> None:
        self._removed(entry)
        self._release(entry)

    # -- internals -------------------------------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        if len(self._caches) >= self.max_caches:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"cache limit reached ({self.max_caches})")

    def _reserve_id(self) -> int:
        # Ids are never reused; skipping ids whose slot is taken keeps the slot -> id map unambiguous.
        with self._lock:
            while self._next_id % self.max_caches in self._slots:
                self._next_id += 1
            cache_id = self._next_id
            self._next_id += 1
            return cache_id

    def _add(self, cache_id: int, desc: CacheDesc, tensors: tuple[TensorLocation, ...],
             segments: dict[str, shmseg.Segment], daemon_owned: bool, owner: str, view_of: int = 0) -> CacheEntry:
        try:
            maps = {name: seg.map() for name, seg in segments.items()}
        except (OSError, ValueError) as e:
            param_invalid(f"cannot map shm segment: {e}")
        views = [memoryview(maps[t.segment])[t.offset : t.offset + desc.tensor_nbytes] for t in tensors]
        addresses = [int(np.frombuffer(v, np.uint8).ctypes.data) for v in views]
        entry = CacheEntry(cache_id, desc, tensors, daemon_owned, segments, views, owner=owner, addresses=addresses,
                           view_of=view_of)
        with self._lock:
            if len(self._caches) >= self.max_caches:  # again: AllocateCache runs on worker threads
                for v in views:
                    v.release()
                fail(LlmStatus.LLM_OUT_OF_MEMORY, f"cache limit reached ({self.max_caches})")
            self._publish(entry)
        return entry

    def _publish(self, entry: CacheEntry) -> None:
        """Lists `entry` (under the lock) and tells the on_add hooks."""
        self._caches[entry.cache_id] = entry
        self._slots.add(entry.cache_id % self.max_caches)
        for callback in self.on_add:
            try:
                callback(entry)
            except Exception:  # the cache is added either way; a backend that missed it fails its transfers
                log.exception("a hook on the addition of cache %d failed", entry.cache_id)

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
        for seg in entry.segments.values():
            seg.close()
        if entry.daemon_owned and not entry.view_of:  # (a view's file is its base's: the base unlinks it)
            for name in entry.segments:
                (self.shm_dir / name).unlink(missing_ok=True)


def _raise_fd_limit() -> None:
    """Each mapped segment keeps its descriptor open (size re-checks, kernel copies): allow as many as the hard
    limit lets this process have."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.debug("raised the open-file limit from %d to %d", soft, hard)
