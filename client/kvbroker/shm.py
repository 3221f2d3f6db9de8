"""Maps shared-memory segments as numpy arrays without Python's resource tracker (`SegmentMap` is shared with the
daemon, which maps segments the same way).

`multiprocessing.shared_memory.SharedMemory(name)` registers even an attached segment with the resource tracker on
Python < 3.13, which unlinks it when this process exits and would destroy the daemon's cache; so segments are opened
as files under the shm directory and mapped with `mmap`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from pathlib import Path

import numpy as np

from kvbroker.types import CacheDesc, CacheRecord


class SegmentMap:
    """One read-write mapping of a whole segment file (a regular file, never reached through a symlink)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{self.path} is not a regular file")
            self.size = st.st_size
            self.mmap = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmaps; numpy views still alive keep the mapping until they are dropped (BufferError is then ignored)."""
        with contextlib.suppress(BufferError):
            self.mmap.close()


def tensor_views(desc: CacheDesc, maps: list[SegmentMap], offsets: list[int]) -> list[np.ndarray]:
    """numpy arrays of `desc.shape` over each tensor's bytes."""
    dtype = desc.data_type.numpy_dtype
    count = desc.tensor_nbytes // dtype.itemsize
    return [
        np.frombuffer(m.mmap, dtype=dtype, count=count, offset=off).reshape(desc.shape)
        for m, off in zip(maps, offsets, strict=True)
    ]


class Cache:
    """A cache registered with the daemon, with `.tensors` as numpy arrays over its shared memory.

    Writes into `.tensors` are what linked peers pull. `close()` (or the client's `deallocate_cache`) unmaps.
    """

    def __init__(self, record: CacheRecord) -> None:
        self.cache_id = record.cache_id
        self.desc = record.desc
        self.record = record
        self._maps: dict[str, SegmentMap] = {}
        self.tensors: list[np.ndarray] = []

    @classmethod
    def map(cls, record: CacheRecord) -> Cache:
        """Maps every segment of `record` (each segment once, however many tensors it holds)."""
        cache = cls(record)
        if any(loc.device is not None for loc in record.tensors):
            return cache  # device memory: the caller has it already, nothing here to map (tensors stay empty)
        try:
            for loc in record.tensors:
                if loc.segment not in cache._maps:
                    cache._maps[loc.segment] = SegmentMap(Path(record.shm_dir) / loc.segment)
            cache.tensors = tensor_views(
                record.desc, [cache._maps[t.segment] for t in record.tensors], [t.offset for t in record.tensors]
            )
        except BaseException:
            cache.close()
            raise
        return cache

    def close(self) -> None:
        self.tensors = []
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def __repr__(self) -> str:
        return f"Cache(cache_id={self.cache_id}, desc={self.desc})"
