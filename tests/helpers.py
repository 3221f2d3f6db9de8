"""Test helpers: expected results of pulls computed independently of the daemon (plain numpy indexing)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvbroker import Cache, CacheDesc, Client


class Allocations:
    """Caches a fixture allocates (and fills), released together when it ends."""

    def __init__(self) -> None:
        self._made: list[tuple[Client, Cache]] = []

    def alloc(self, client: Client, desc: CacheDesc, seed: int) -> Cache:
        cache = client.allocate_cache(desc)
        self._made.append((client, cache))
        fill(cache, seed)
        return cache

    def release(self) -> None:
        for client, cache in self._made:
            client.deallocate_cache(cache)


def fill(cache: Cache, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in cache.tensors:
        flat = t.reshape(-1).view(np.uint8)
        flat[:] = rng.integers(0, 256, size=flat.size, dtype=np.uint8)


def snapshot(cache: Cache) -> list[np.ndarray]:
    return [t.copy() for t in cache.tensors]


def expected_pull(src: Cache, before: list[np.ndarray], src_blocks: Sequence[int], dst_blocks: Sequence[int],
                  src_tensors: range, dst_tensors: range) -> list[np.ndarray]:
    """What the destination must hold after pulling `src_blocks` of `src_tensors` into `dst_blocks` of
    `dst_tensors`; every other byte is unchanged."""
    out = [b.copy() for b in before]
    for s, d in zip(src_tensors, dst_tensors, strict=True):
        out[d].reshape(out[d].shape[0], -1).view(np.uint8)[list(dst_blocks)] = (
            src.tensors[s].reshape(src.tensors[s].shape[0], -1).view(np.uint8)[list(src_blocks)])
    return out


def assert_bytes_equal(actual: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert np.array_equal(a.view(np.uint8), e.view(np.uint8)), f"tensor {i} differs"


def private_shm_dir() -> Path:
    """A fresh directory on /dev/shm's tmpfs, private to this user: a test's own shm dir (`--shm-dir`)."""
    path = Path("/dev/shm") / f"kvtest-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o700)
    return path


def remove_dir(path: Path) -> None:
    for entry in path.iterdir():
        entry.unlink()
    path.rmdir()
