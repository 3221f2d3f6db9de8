"""What kvbench.py and scale.py share: the run's options and report, the pair of daemons a kvbroker subject pulls
between, its caches and their check, the async timing loop and the one event loop of the run.

Imported by kvbench.py and scale.py (kvbench.py puts bench/peers on sys.path first, for peer_common)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from peer_common import Layout, gbps

from kvbroker._bench import DaemonPair


def log(msg: str) -> None:
    print(f"[kvbench] {msg}", file=sys.stderr, flush=True)


@dataclass
class Config:
    sizes: list[int]
    total_bytes: int
    tensors: int
    tensor_bytes: int
    trials: int
    rounds: int
    seed: int
    latency_samples: int
    concurrency_block: int
    pull_timeout: float
    items: list[str]
    profile: Path | None
    quick: bool
    floor_ops: int = 2000
    scale_block: int = 64
    scale_blocks: list[int] = field(default_factory=list)
    scale_peers: list[int] = field(default_factory=list)

    def layout(self, block: int) -> Layout:
        return Layout(self.tensors, self.tensor_bytes, block, self.seed)

    def peer_args(self) -> list[str]:
        return ["--sizes", ",".join(str(s) for s in self.sizes), "--total-bytes", str(self.total_bytes),
                "--tensors", str(self.tensors), "--tensor-bytes", str(self.tensor_bytes),
                "--trials", str(self.trials), "--seed", str(self.seed)]


@dataclass
class Report:
    config: dict[str, Any]
    machine: dict[str, Any]
    throughput: dict[str, dict[str, float]] = field(default_factory=dict)
    """subject -> block size (str bytes) -> GB/s (median of trials)."""
    details: dict[str, Any] = field(default_factory=dict)
    concurrency: dict[str, dict[str, float]] = field(default_factory=dict)
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    planning: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    """Subjects that ran and failed (the run goes on): name -> error."""
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)
    scale: dict[str, Any] = field(default_factory=dict)
    """scale-blocks and scale-peers (bench/scale.py)."""

    def put(self, subject: str, block: int, result: dict[str, Any]) -> None:
        self.throughput.setdefault(subject, {})[str(block)] = result["gbps"]
        self.details.setdefault(subject, {})[str(block)] = result


def fill_cache(tensors: list[np.ndarray], salt: int = 0) -> None:
    """Block k of tensor t holds bytes (k + 31 t + salt) % 251 + 1: never 0, so an uncopied (zero) block is caught;
    caches filled with different salts tell their blocks apart."""
    for t, arr in enumerate(tensors):
        flat = arr.view(np.uint8).reshape(arr.shape[0], -1)
        flat[:] = ((np.arange(arr.shape[0]) + 31 * t + salt) % 251 + 1).astype(np.uint8)[:, None]


def check_cache(src: list[np.ndarray], dst: list[np.ndarray], sperm: np.ndarray, dperm: np.ndarray) -> None:
    idx = np.linspace(0, len(sperm) - 1, min(32, len(sperm))).astype(np.int64)
    for t in (0, len(src) - 1):
        s, d = src[t].view(np.uint8), dst[t].view(np.uint8)  # bytes, not fp16 values (the pattern has NaNs)
        for i in idx:
            if not np.array_equal(d[dperm[i]], s[sperm[i]]):
                raise AssertionError(f"tensor {t}: dst block {dperm[i]} differs from src block {sperm[i]}")


class KvPair(DaemonPair):
    """Two LocalDaemons forced to one backend, the pulling one (cluster 2) linked to the source (cluster 1)."""

    def __init__(self, workdir: Path, backend: str, timeout: float) -> None:
        super().__init__(workdir / backend, backend, timeout, link_timeout=10.0)

    @contextlib.contextmanager
    def caches(self, desc: Any) -> Iterator[tuple[Any, Any]]:
        """A source cache on cluster 1 and a destination cache on cluster 2, deallocated on exit (a failure to
        deallocate after a failed pull is logged, so that it does not hide the pull's own error)."""
        src = self.src.allocate_cache(desc)
        failed = False
        try:
            dst = self.dst.allocate_cache(desc)
            try:
                yield src, dst
            except BaseException:
                failed = True
                raise
            finally:
                self._release(self.dst, dst, failed)
        finally:
            self._release(self.src, src, failed)

    @staticmethod
    def _release(client: Any, cache: Any, failed: bool) -> None:
        try:
            client.deallocate_cache(cache, timeout=10.0)
        except Exception as e:
            if not failed:
                raise
            log(f"(could not deallocate cache {cache.cache_id} after the failure: {e})")


def cache_desc(num_tensors: int, num_blocks: int, block: int) -> Any:
    from kvbroker import CacheDesc, DataType

    return CacheDesc(num_tensors=num_tensors, shape=(num_blocks, block // 2), data_type=DataType.FLOAT16)


async def timed_rounds(round_: Callable[[], Awaitable[None]], reps: int, trials: int, round_bytes: int
                       ) -> list[float]:
    """GB/s of `trials` timed trials of `reps` rounds each, after one untimed warm-up round (and channel set-up)."""
    await round_()
    results = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            await round_()
        results.append(gbps(reps * round_bytes, time.perf_counter() - t0))
    return results


_LOOP: list[asyncio.AbstractEventLoop] = []


def event_loop() -> asyncio.AbstractEventLoop:
    """One event loop for the whole run: grpc.aio keeps its poller bound to the first loop it ran on, and
    complains ("Event loop is closed") when asyncio.run() closes a loop under it."""
    if not _LOOP:
        _LOOP.append(asyncio.new_event_loop())
    return _LOOP[0]
