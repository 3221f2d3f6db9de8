"""Test helpers: expected results of pulls computed independently of the daemon (plain numpy indexing), and the
one way tests wait for something to happen (`wait_until`, `wait_until_async`; `comes_true` where either answer
is fine)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar, cast

import numpy as np

from kvbroker import Cache, CacheDesc, CacheIndex, Client
from kvbroker._local import LocalDaemon

T = TypeVar("T")

POLL_S = 0.05
"""How often `wait_until` asks again."""


def wait_until(predicate: Callable[[], T], *, timeout: float = 15.0, what: str, poll: float = POLL_S,
               tolerate: tuple[type[Exception], ...] = ()) -> T:
    """Asks `predicate` every `poll` seconds until it returns a truthy value, and returns that value. Past `timeout`
    seconds raises AssertionError naming `what` and the last value seen.

    The timeout is only how long to wait for a condition that should come true, not a measurement: a test asserts on
    what it waited for, never on how long that took. An exception of a type in `tolerate` counts as "not yet" (a
    daemon still starting refuses connections); any other propagates at once."""
    came, last = _ask_until(predicate, timeout, poll, tolerate)
    if not came:
        raise AssertionError(f"waited {timeout:g} s for {what}; last saw {last!r}")
    return cast(T, last)  # (a truthy answer is the predicate's, never a tolerated exception)


def comes_true(predicate: Callable[[], object], *, within: float, poll: float = POLL_S) -> bool:
    """Whether `predicate` comes true within `within` seconds (asked as `wait_until` asks): for code that acts on
    either answer, such as a stand-in server that behaves one way if its client left and another if not."""
    return _ask_until(predicate, within, poll, ())[0]


def _ask_until(predicate: Callable[[], T], timeout: float, poll: float, tolerate: tuple[type[Exception], ...]
               ) -> tuple[bool, T | Exception]:
    deadline = time.monotonic() + timeout
    while True:
        last: T | Exception
        try:
            last = predicate()
        except tolerate as e:
            last = e
        else:
            if last:
                return True, last
        if time.monotonic() >= deadline:
            return False, last
        time.sleep(poll)


async def wait_until_async(predicate: Callable[[], T | Awaitable[T]], *, timeout: float = 15.0, what: str,
                           poll: float = POLL_S) -> T:
    """`wait_until` for a test on an event loop: `predicate` may be a plain or an async function, and the loop keeps
    running between the asks."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        last: T = await got if inspect.isawaitable(got) else got
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}; last saw {last!r}")
        await asyncio.sleep(poll)


def transfers_in_flight(metrics_address: str) -> float:
    """A daemon's count of transfers running now (the `kvbroker_transfers_in_flight` gauge of `--metrics-listen`):
    what a test waits on to know that a transfer has started, or has ended."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return float(next(x for x in lines if x.startswith("kvbroker_transfers_in_flight ")).split()[1])


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


class LinkedCaches:
    """A source cache on daemon `p`, filled from `seed`, and a destination cache on daemon `d`, which linked `p`."""

    def __init__(self, p: LocalDaemon, d: LocalDaemon, desc: CacheDesc, seed: int) -> None:
        self.p, self.d, self.seed = p, d, seed
        self.pc: Client = p.client()
        self.dc: Client = d.client()
        self.src: Cache = self.pc.allocate_cache(desc)
        self.dst: Cache = self.dc.allocate_cache(desc)
        fill(self.src, seed)

    def index(self) -> CacheIndex:
        return CacheIndex(self.p.cluster_id, self.src.cache_id)

    def fresh(self) -> list[np.ndarray]:
        """The destination refilled (from `seed + 1`), as it is now."""
        fill(self.dst, self.seed + 1)
        return snapshot(self.dst)

    def close(self) -> None:
        self.pc.close()
        self.dc.close()


L = TypeVar("L", bound=LinkedCaches)


@contextlib.contextmanager
def linked_caches(root: Path, first_cluster: int, desc: CacheDesc, seed: int, kind: type[L],
                  backends: Sequence[str] | None = None) -> Iterator[L]:
    """Two daemons (clusters `first_cluster` and the next), the second linked to the first, and their caches."""
    from tests.conftest import cluster_of

    with LocalDaemon(root, first_cluster, backends=backends) as p, \
            LocalDaemon(root, first_cluster + 1, backends=backends) as d:
        with d.client() as c:
            assert c.link_clusters([cluster_of(p)])[0].ok
        caches = kind(p, d, desc, seed)
        try:
            yield caches
        finally:
            caches.close()
