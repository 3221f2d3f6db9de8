"""The pull benchmark behind `kvbroker bench`: two local daemons per backend, verified scattered-block pulls, timed.

`DaemonPair` (two daemons allowed one backend, the puller linked to the source) is also what `bench/kvbench.py`
measures kvbroker with. The CLI (`kvbroker._cli`) only parses the flags and prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO, TypeVar

import numpy as np

from kvbroker._client import Client
from kvbroker._format import fmt_gbps, fmt_size, table
from kvbroker._local import DaemonStartError, LocalDaemon
from kvbroker.status import LlmError
from kvbroker.types import CacheDesc, CacheIndex, ClusterInfo, DataType


class BenchError(Exception):
    """A failure outside the daemons' answers (a bench daemon that would not start, bytes that differ)."""


_Pair = TypeVar("_Pair", bound="DaemonPair")


class DaemonPair:
    """Two local daemons allowed only `backend`: `src_daemon` (the source) and `dst_daemon`, which links to it and
    pulls. Entered, both run, `src` and `dst` are their clients, and the link is up over `backend`; on the way out
    (or a failure on the way in, Ctrl-C included) the clients close and the daemons stop.

    `cluster_ids`: (source, puller). `link_timeout`: the link handshake's timeout (default `timeout`).
    `puller_args`: more `kvbrokerd` flags for the pulling daemon (e.g. `--metrics-listen`)."""

    def __init__(self, workdir: Path, backend: str, timeout: float | None, *, cluster_ids: tuple[int, int] = (1, 2),
                 link_timeout: float | None = None, puller_args: Sequence[str] = ()) -> None:
        self.backend = backend
        self.timeout = timeout
        self.link_timeout = timeout if link_timeout is None else link_timeout
        self.src_daemon = LocalDaemon(workdir, cluster_ids[0], backends=(backend,))
        self.dst_daemon = LocalDaemon(workdir, cluster_ids[1], backends=(backend,), extra_args=list(puller_args))
        self._stack = contextlib.ExitStack()

    def __enter__(self: _Pair) -> _Pair:
        try:
            for d in (self.src_daemon, self.dst_daemon):
                self._stack.callback(d.stop)  # before start(): Ctrl-C while it starts still stops it
                d.start()
            self.src: Client = self._stack.enter_context(self.src_daemon.client(self.timeout))
            self.dst: Client = self._stack.enter_context(self.dst_daemon.client(self.timeout))
            source = ClusterInfo(self.src_daemon.cluster_id, self.src_daemon.peer_address)
            link = self.dst.link_clusters([source], timeout=self.link_timeout)[0]
            if not link.ok:
                raise LlmError(link.status, f"linking the bench daemons: {link.message}")
            used = next(lk.backend for lk in self.dst.list_links() if lk.remote_cluster_id == source.remote_cluster_id)
            if used != self.backend:
                raise BenchError(f"the link uses backend {used!r}, expected {self.backend!r}")
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()  # the clients first (they unmap their caches), then the daemons


class Progress:
    """A plain-text progress bar on a stream: redrawn in place on a terminal, one line per 10 % otherwise."""

    WIDTH = 30

    def __init__(self, stream: TextIO, total: int, enabled: bool = True) -> None:
        self.stream = stream
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.tty = stream.isatty()
        self._last_draw = 0.0
        self._last_decile = -1
        self._bar = ""
        """The bar now drawn in place on the terminal ("" = none)."""

    def advance(self, n: int, label: str) -> None:
        self.done = min(self.total, self.done + n)
        if not self.enabled:
            return
        frac = self.done / self.total
        filled = int(frac * self.WIDTH)
        line = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {frac * 100:5.1f}%  {label}"
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw >= 0.1 or self.done == self.total:
                self.stream.write("\r" + line + "\x1b[K")
                self.stream.flush()
                self._last_draw = now
                self._bar = line
        elif int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(line + "\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own: on a terminal it replaces the bar, which is redrawn below it."""
        if not self.enabled:
            return
        if self._bar:
            self.stream.write("\r\x1b[K" + text + "\n" + self._bar)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._bar:
            self.stream.write("\n")
            self.stream.flush()
            self._bar = ""


@dataclasses.dataclass
class BenchPoint:
    backend: str
    block_size: int
    tensors: int
    blocks_per_pull: int
    pulls: int
    bytes: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = dataclasses.field(default_factory=list)
    verified: bool = False

    @property
    def bytes_per_pull(self) -> int:
        return self.tensors * self.blocks_per_pull * self.block_size

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)

        def pct(p: float) -> float:
            return lat[min(len(lat) - 1, max(0, math.ceil(p / 100 * len(lat)) - 1))] if lat else 0.0

        return {"backend": self.backend, "block_size": self.block_size, "tensors": self.tensors,
                "blocks_per_pull": self.blocks_per_pull, "bytes_per_pull": self.bytes_per_pull, "pulls": self.pulls,
                "bytes": self.bytes, "seconds": self.seconds,
                "gbps": self.bytes / self.seconds / 1e9 if self.seconds else 0.0,
                "latency_ms": {"p50": pct(50), "p99": pct(99), "max": lat[-1] if lat else 0.0},
                "verified": self.verified}


def plan_bench(backends: Sequence[str], block_sizes: Sequence[int], total_bytes: int, tensors: int,
               pull_bytes: int) -> list[BenchPoint]:
    """One point per (backend, block size): pulls of every block of a `tensors`-tensor cache of about `pull_bytes`
    (at most `total_bytes`), repeated until `total_bytes` moved."""
    points = []
    for backend in backends:
        for block in block_sizes:
            blocks = max(1, min(pull_bytes, total_bytes) // (tensors * block))
            pulls = max(1, math.ceil(total_bytes / (tensors * blocks * block)))
            points.append(BenchPoint(backend, block, tensors, blocks, pulls))
    return points


def run_bench(points: list[BenchPoint], progress: Progress, timeout: float, seed: int = 7,
              log: Callable[[str], None] = lambda _: None, metrics_listen: str = "") -> list[BenchPoint]:
    """Runs each point between two fresh local daemons that allow only its backend: a verified warm-up pull of
    scattered blocks (source and destination orders are two random permutations), then the timed pulls.
    `metrics_listen`: the pulling daemon's Prometheus endpoint (one backend after the other on the same address)."""
    rng = np.random.default_rng(seed)
    by_backend: dict[str, list[BenchPoint]] = {}
    for p in points:
        by_backend.setdefault(p.backend, []).append(p)
    with tempfile.TemporaryDirectory(prefix="kvbroker-bench-") as tmp:
        for n, (backend, group) in enumerate(by_backend.items()):
            pair = DaemonPair(Path(tmp) / backend, backend, timeout, cluster_ids=(2 * n + 1, 2 * n + 2),
                              puller_args=["--metrics-listen", metrics_listen] if metrics_listen else [])
            try:
                with pair:
                    log(f"{backend}: daemons {pair.src_daemon.peer_address} -> {pair.dst_daemon.peer_address}, "
                        f"link over {pair.backend!r}")
                    if metrics_listen:
                        log(f"{backend}: metrics of the pulling daemon on http://{metrics_listen}/metrics")
                    for p in group:
                        bench_point(p, pair, rng, progress)
            except DaemonStartError as e:
                raise BenchError(f"a bench daemon did not start: {e}") from None
    return points


def bench_point(p: BenchPoint, pair: DaemonPair, rng: np.random.Generator, progress: Progress) -> None:
    """One point: a verified warm-up pull, then `p.pulls` timed pulls of every block in the same random order."""
    # The caches are released after a point so that the next one has the memory; on a failure or Ctrl-C, stopping
    # the bench's private daemons releases them (a release call to a daemon that is going away would only fail).
    sc, dc = pair.src, pair.dst
    desc = CacheDesc(num_tensors=p.tensors, shape=(p.blocks_per_pull, p.block_size), data_type=DataType.UINT8)
    src = sc.allocate_cache(desc)
    dst = dc.allocate_cache(desc)
    for t in src.tensors:
        t[:] = rng.integers(0, 256, size=t.shape, dtype=np.uint8)
    sperm = rng.permutation(p.blocks_per_pull).tolist()
    dperm = rng.permutation(p.blocks_per_pull).tolist()
    index = CacheIndex(pair.src_daemon.cluster_id, src.cache_id)
    dc.pull_kv_blocks(index, dst, sperm, dperm)  # warm-up, verified
    for s, d in zip(src.tensors, dst.tensors, strict=True):
        if not np.array_equal(d[dperm], s[sperm]):
            raise BenchError(f"{p.backend}: pulled bytes differ from the source (block size {p.block_size})")
    p.verified = True
    label = f"{p.backend} {fmt_size(p.block_size)} blocks"
    start = time.perf_counter()
    for _ in range(p.pulls):
        t0 = time.perf_counter()
        result = dc.pull_kv_blocks(index, dst, sperm, dperm)
        t1 = time.perf_counter()
        p.latencies_ms.append((t1 - t0) * 1e3)
        p.bytes += result.bytes_moved
        progress.advance(result.bytes_moved, f"{label}  {fmt_gbps(p.bytes / max(t1 - start, 1e-9) / 1e9)} GB/s")
    p.seconds = time.perf_counter() - start
    dc.deallocate_cache(dst)
    sc.deallocate_cache(src)


def render_bench(points: Sequence[BenchPoint]) -> str:
    rows = []
    for p in points:
        s = p.summary()
        rows.append([p.backend, fmt_size(p.block_size), str(p.tensors), str(p.blocks_per_pull), str(p.pulls),
                     fmt_size(p.bytes), f"{p.seconds:.3f}", fmt_gbps(s["gbps"]), f"{s['latency_ms']['p50']:.2f}",
                     f"{s['latency_ms']['p99']:.2f}", "yes" if p.verified else "no"])
    return table(rows, ["BACKEND", "BLOCK", "TENSORS", "BLOCKS/PULL", "PULLS", "MOVED", "SECONDS", "GB/S",
                        "P50 MS", "P99 MS", "VERIFIED"])
