"""Scale curves of kvbench: how the cost of a pull grows with the work it is given.

  scale-blocks  one pull of 1, 10, ... 1,048,576 blocks (the daemon's MAX_BLOCKS_PER_REQUEST) of --scale-block bytes
                from a 2-tensor cache, as one contiguous run and scattered (both block lists random); ms per pull,
                us per block, and where the time goes: the same request refused by validation (request path and
                every check, nothing planned or moved), the planner's runs (timed in this process) and the rest
                (the transfer: data plane, bookkeeping, reply)
  scale-peers   the same bytes (a --tensors x --tensor-bytes cache of --concurrency-block blocks per round) pulled
                from 1, 2, 4, 8, 16 linked source daemons at once, one pull per peer (AsyncClient + asyncio.gather);
                and the time to link each peer

Both run on shm and tcp, through kvbench.py (`--only scale-blocks,scale-peers`), which owns the options and the
JSON report (`scale`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from kvbench_common import (
    Config,
    KvPair,
    Report,
    cache_desc,
    check_cache,
    event_loop,
    fill_cache,
    log,
    timed_rounds,
)
from peer_common import fmt_size, median

BACKENDS = ("shm", "tcp")
SCALE_TENSORS = 2
"""One layer (K and V): a scattered pull of n blocks is 2n runs."""
PATTERNS = ("contiguous", "scattered")
REP_BLOCKS = 100_000
"""Each point repeats its pull until about this many blocks have moved (at most MAX_REPS, at least once)."""
MAX_REPS = 20
BIG_PULL_TIMEOUT_S = 300.0
"""A scattered pull of 2^20 blocks takes seconds to tens of seconds on a loaded 2-core machine."""
PULLER_ID = 1000
"""Cluster id of the pulling daemon of scale-peers; its sources are clusters 1..N."""


def _median_s(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


# ---------------------------------------------------------------------------------------------------- scale-blocks


def _refused_lists(dst: list[int], num_blocks: int) -> list[int]:
    """The destination list made invalid at its very end, so that the daemon converts and checks all of it: a repeated
    block (the duplicate check is the last and costliest check), or for one block a block out of range."""
    return [*dst[:-1], dst[0]] if len(dst) > 1 else [num_blocks]


def _planning(block: int, num_blocks: int, s: np.ndarray, d: np.ndarray, reps: int) -> dict[str, float]:
    """The planner alone, in this process: a valid plan, and the same lists refused by the duplicate check; their
    difference is the cost of the runs (coalescing and crossing with the tensors)."""
    from kvbroker import LlmError
    from kvbrokerd.dataplane import pairs
    from kvbrokerd.transfers import planner

    desc = cache_desc(SCALE_TENSORS, num_blocks, block)
    sa = pairs.block_array(s.tolist(), "src_blocks")
    da = pairs.block_array(d.tolist(), "dst_blocks")
    bad = pairs.block_array(_refused_lists(d.tolist(), num_blocks), "dst_blocks")
    layers = planner.LayerSelection()

    def refused() -> None:
        try:
            planner.plan_blocks(desc, desc, sa, bad, layers)
        except LlmError:
            return
        raise RuntimeError("the planner accepted a repeated destination block")

    ok_s = _median_s(lambda: planner.plan_blocks(desc, desc, sa, da, layers), reps)
    refused_s = _median_s(refused, reps)
    return {"plan_ms": ok_s * 1e3, "checks_ms": refused_s * 1e3, "runs_ms": max(0.0, ok_s - refused_s) * 1e3}


def _pull_point(pair: KvPair, src: Any, dst: Any, index: Any, s: np.ndarray, d: np.ndarray, block: int,
                num_blocks: int, reps: int) -> dict[str, Any]:
    from kvbroker import LlmError

    sl, dl = s.tolist(), d.tolist()
    for t in dst.tensors:
        t[d] = 0  # a block the pull misses is caught by the check below
    last: list[Any] = []

    def pull() -> None:
        last[:] = [pair.dst.pull_kv_blocks(index, dst, sl, dl, timeout=pair.timeout)]

    pull_s = _median_s(pull, reps)
    res = last[0]
    if res.backend != pair.backend or res.bytes_moved != SCALE_TENSORS * len(sl) * block:
        raise RuntimeError(f"a pull of {len(sl)} blocks moved {res.bytes_moved} bytes over {res.backend!r}")
    check_cache(src.tensors, dst.tensors, s, d)
    bad = _refused_lists(dl, num_blocks)

    def refused() -> None:
        try:
            pair.dst.pull_kv_blocks(index, dst, sl, bad, timeout=pair.timeout)
        except LlmError:
            return
        raise RuntimeError("an invalid destination list was not refused")

    refused_s = _median_s(refused, reps)
    return {"blocks": len(sl), "runs": res.num_runs, "reps": reps, "pull_ms": pull_s * 1e3,
            "us_per_block": pull_s * 1e6 / len(sl), "refused_ms": refused_s * 1e3}


def _blocks_series(cfg: Config, pair: KvPair, planning: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from kvbroker import CacheIndex

    block, num_blocks = cfg.scale_block, max(cfg.scale_blocks)
    with pair.caches(cache_desc(SCALE_TENSORS, num_blocks, block)) as (src, dst):
        fill_cache(src.tensors)
        index = CacheIndex(cluster_id=1, cache_id=src.cache_id)
        everything = list(range(num_blocks))
        pair.dst.pull_kv_blocks(index, dst, everything, everything, timeout=pair.timeout)  # warm-up: first touch
        rng = np.random.default_rng(cfg.seed)
        sperm, dperm = rng.permutation(num_blocks), rng.permutation(num_blocks)
        out: dict[str, Any] = {}
        for pattern in PATTERNS:
            for n in cfg.scale_blocks:
                s, d = (np.arange(n), np.arange(n)) if pattern == "contiguous" else (sperm[:n], dperm[:n])
                reps = max(1, min(MAX_REPS, REP_BLOCKS // n))
                plan = planning.setdefault(pattern, {}).get(str(n))
                if plan is None:
                    plan = planning[pattern][str(n)] = _planning(block, num_blocks, s, d, min(reps, 5))
                pt = _pull_point(pair, src, dst, index, s, d, block, num_blocks, reps)
                pt["transfer_ms"] = max(0.0, pt["pull_ms"] - pt["refused_ms"] - plan["runs_ms"])
                out.setdefault(pattern, {})[str(n)] = pt
                log(f"scale-blocks {pair.backend} {pattern:10s} {n:8d} blocks: {pt['pull_ms']:9.2f} ms "
                    f"({pt['us_per_block']:.2f} us/block; refused {pt['refused_ms']:.2f} ms, runs "
                    f"{plan['runs_ms']:.2f} ms)")
        return out


def bench_blocks(cfg: Config, rep: Report) -> None:
    scale = rep.scale.setdefault("blocks", {"block": cfg.scale_block, "tensors": SCALE_TENSORS,
                                            "planning": {}, "backends": {}})
    with tempfile.TemporaryDirectory(prefix="kvbench-scale-") as tmp:
        for backend in BACKENDS:
            try:
                with KvPair(Path(tmp) / "blocks", backend, max(cfg.pull_timeout, BIG_PULL_TIMEOUT_S)) as pair:
                    scale["backends"][backend] = _blocks_series(cfg, pair, scale["planning"])
            except Exception as e:
                rep.errors[f"scale-blocks-{backend}"] = f"{type(e).__name__}: {e}"
                log(f"scale-blocks {backend} FAILED: {type(e).__name__}: {e}")


# ----------------------------------------------------------------------------------------------------- scale-peers


class PeerFan:
    """One pulling daemon linked to `peers` source daemons, all forced to one backend; started in parallel."""

    def __init__(self, workdir: Path, backend: str, peers: int, timeout: float) -> None:
        from kvbroker._local import LocalDaemon

        self.backend = backend
        self.timeout = timeout
        self.puller = LocalDaemon(workdir, PULLER_ID, backends=(backend,))
        self.sources = [LocalDaemon(workdir, i + 1, backends=(backend,)) for i in range(peers)]
        self.link_ms: list[float] = []
        self._stack = ExitStack()

    def __enter__(self) -> PeerFan:
        from kvbroker import ClusterInfo

        daemons = [self.puller, *self.sources]
        try:
            with concurrent.futures.ThreadPoolExecutor(len(daemons)) as pool:
                starts = [pool.submit(d.start) for d in daemons]
            for d, started in zip(daemons, starts, strict=True):
                if started.exception() is None:
                    self._stack.callback(d.stop)
            for started in starts:
                started.result()
            self.client = self._stack.enter_context(self.puller.client(timeout=self.timeout))
            self.source_clients = [self._stack.enter_context(d.client(timeout=self.timeout)) for d in self.sources]
            for d in self.sources:  # one at a time: the cost of setting up one link
                t0 = time.perf_counter()
                link = self.client.link_clusters(
                    [ClusterInfo(remote_cluster_id=d.cluster_id, remote_address=d.peer_address)], timeout=30.0)[0]
                self.link_ms.append((time.perf_counter() - t0) * 1e3)
                if not link.ok:
                    raise RuntimeError(f"link to cluster {d.cluster_id} failed: {link.status.name}: {link.message}")
            used = {lk.backend for lk in self.client.list_links()}
            if used != {self.backend}:
                raise RuntimeError(f"links use {sorted(used)}, expected {self.backend!r}")
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()  # clients first (they unmap their caches), then the daemons


def _share_blocks(blocks: int, levels: list[int], peer: int) -> int:
    """Blocks the source cache of peer `peer` (0-based) needs: its share at the smallest level it takes part in."""
    return -(-blocks // min(k for k in levels if k > peer))


async def _fan_trials(target: str, pulls: list[tuple[Any, list[int], list[int]]], dst_id: int, reps: int,
                      trials: int, round_bytes: int, timeout: float) -> list[float]:
    from kvbroker import AsyncClient

    async with AsyncClient(target, timeout=timeout) as c:

        async def round_() -> None:
            results = await asyncio.gather(*(c.pull_kv_blocks(index, dst_id, s, d) for index, s, d in pulls))
            moved = sum(r.bytes_moved for r in results)
            if moved != round_bytes:
                raise RuntimeError(f"{len(pulls)} pulls moved {moved} bytes, expected {round_bytes}")

        return await timed_rounds(round_, reps, trials, round_bytes)


@contextmanager
def _allocated(client: Any, desc: Any) -> Iterator[Any]:
    cache = client.allocate_cache(desc)
    try:
        yield cache
    finally:
        client.deallocate_cache(cache, timeout=10.0)


@contextmanager
def _source_caches(fan: PeerFan, lay: Any, levels: list[int]) -> Iterator[list[Any]]:
    caches = []
    try:
        for j, client in enumerate(fan.source_clients):
            cache = client.allocate_cache(cache_desc(lay.tensors, _share_blocks(lay.blocks_per_tensor, levels, j),
                                                     lay.block))
            caches.append((client, cache))
            fill_cache(cache.tensors, salt=j)  # a block pulled from the wrong peer is caught
        yield [cache for _, cache in caches]
    finally:
        for client, cache in caches:
            client.deallocate_cache(cache, timeout=10.0)


def _peers_series(cfg: Config, fan: PeerFan, levels: list[int]) -> dict[str, Any]:
    from kvbroker import CacheIndex

    lay = cfg.layout(cfg.concurrency_block)
    series: dict[str, Any] = {}
    with _source_caches(fan, lay, levels) as sources, \
            _allocated(fan.client, cache_desc(lay.tensors, lay.blocks_per_tensor, lay.block)) as dst:
        _, dperm = lay.perms()
        rng = np.random.default_rng(cfg.seed)
        for k in levels:
            pulls, checks = [], []
            for j, d in enumerate(np.array_split(dperm, k)):
                s = rng.permutation(sources[j].tensors[0].shape[0])[: len(d)]
                pulls.append((CacheIndex(cluster_id=j + 1, cache_id=sources[j].cache_id), s.tolist(), d.tolist()))
                checks.append((sources[j], s, d))
            for t in dst.tensors:
                t[:] = 0
            trials = _fan_trials(fan.puller.target, pulls, dst.cache_id, lay.reps(cfg.total_bytes), cfg.trials,
                                 lay.pull_bytes, fan.timeout)
            rate = median(event_loop().run_until_complete(trials))
            for src, s, d in checks:
                check_cache(src.tensors, dst.tensors, s, d)
            series[str(k)] = {"gbps": rate, "ms_per_round": lay.pull_bytes / rate / 1e6}
            log(f"scale-peers {fan.backend} {k:2d} peers: {rate:.2f} GB/s "
                f"({series[str(k)]['ms_per_round']:.1f} ms per {fmt_size(lay.pull_bytes)})")
    return series


def bench_peers(cfg: Config, rep: Report) -> None:
    lay = cfg.layout(cfg.concurrency_block)
    levels = sorted(k for k in set(cfg.scale_peers) if k <= lay.blocks_per_tensor)
    scale = rep.scale.setdefault("peers", {"block": lay.block, "round_bytes": lay.pull_bytes, "backends": {}})
    with tempfile.TemporaryDirectory(prefix="kvbench-scale-") as tmp:
        for backend in BACKENDS:
            try:
                with PeerFan(Path(tmp) / f"peers-{backend}", backend, max(levels), cfg.pull_timeout) as fan:
                    log(f"scale-peers {backend}: linked {len(fan.sources)} peers, median "
                        f"{median(fan.link_ms):.1f} ms per link")
                    scale["backends"][backend] = {"link_ms": fan.link_ms, "levels": _peers_series(cfg, fan, levels)}
            except Exception as e:
                rep.errors[f"scale-peers-{backend}"] = f"{type(e).__name__}: {e}"
                log(f"scale-peers {backend} FAILED: {type(e).__name__}: {e}")


# ---------------------------------------------------------------------------------------------------------- report


def merge(reports: list[Report]) -> dict[str, Any]:
    """Best of the rounds, point by point: the lowest pull time of each blocks point (with its breakdown), the
    highest GB/s of each peers level; link times from the first round."""
    merged: dict[str, Any] = {}
    for r in reports:
        blocks = r.scale.get("blocks")
        if blocks:
            into = merged.setdefault("blocks", {**blocks, "backends": {}})
            for backend, patterns in blocks["backends"].items():
                for pattern, points in patterns.items():
                    have = into["backends"].setdefault(backend, {}).setdefault(pattern, {})
                    for n, pt in points.items():
                        if n not in have or pt["pull_ms"] < have[n]["pull_ms"]:
                            have[n] = pt
        peers = r.scale.get("peers")
        if peers:
            into = merged.setdefault("peers", {**peers, "backends": {}})
            for backend, data in peers["backends"].items():
                have = into["backends"].setdefault(backend, {"link_ms": data["link_ms"], "levels": {}})["levels"]
                for k, pt in data["levels"].items():
                    if k not in have or pt["gbps"] > have[k]["gbps"]:
                        have[k] = pt
    return merged


def growth_exponent(points: dict[str, Any]) -> float | None:
    """k in t ~ n^k between the two largest block counts: 1 = linear in blocks, 0 = flat."""
    ns = sorted(int(n) for n in points)
    if len(ns) < 2 or ns[-2] < 1000:
        return None
    lo, hi = points[str(ns[-2])]["pull_ms"], points[str(ns[-1])]["pull_ms"]
    return math.log(hi / lo) / math.log(ns[-1] / ns[-2]) if lo > 0 and hi > 0 else None


def render_lines(rep: Report) -> list[str]:
    lines: list[str] = []
    blocks = rep.scale.get("blocks")
    if blocks and blocks["backends"]:
        lines += ["", f"one pull of n blocks ({fmt_size(blocks['block'])} x {blocks['tensors']} tensors); refused = "
                      "the same request refused by validation, runs = planning them (in-process), transfer = the rest",
                  f"{'':<16s}{'blocks':>9s}{'runs':>9s}{'pull ms':>11s}{'us/block':>10s}{'refused ms':>12s}"
                  f"{'runs ms':>9s}{'transfer ms':>13s}"]
        for backend, patterns in blocks["backends"].items():
            for pattern, points in patterns.items():
                for n, pt in sorted(points.items(), key=lambda x: int(x[0])):
                    runs_ms = blocks["planning"][pattern][n]["runs_ms"]
                    lines.append(f"{backend + ' ' + pattern:<16s}{int(n):9d}{pt['runs']:9d}{pt['pull_ms']:11.2f}"
                                 f"{pt['us_per_block']:10.2f}{pt['refused_ms']:12.2f}{runs_ms:9.2f}"
                                 f"{pt['transfer_ms']:13.2f}")
                k = growth_exponent(points)
                if k is not None:
                    lines.append(f"{'':<16s}time ~ blocks^k between the two largest points: k = {k:.2f}")
    peers = rep.scale.get("peers")
    if peers and peers["backends"]:
        levels = sorted({int(k) for b in peers["backends"].values() for k in b["levels"]})
        lines += ["", f"{fmt_size(peers['round_bytes'])} in {fmt_size(peers['block'])} blocks from n linked peers at "
                      "once (one pull per peer)",
                  f"{'peers':<20s}" + "".join(f"{k:>8d}" for k in levels) + "   min/max   link ms (median, max)"]
        for backend, data in peers["backends"].items():
            series = data["levels"]
            rates = [series[str(k)]["gbps"] for k in levels if str(k) in series]
            ratio = min(rates) / max(rates) if rates and max(rates) > 0 else 0.0
            lines.append(f"{'kvbroker-' + backend + ' GB/s':<20s}"
                         + "".join(f"{series[str(k)]['gbps']:8.2f}" if str(k) in series else f"{'-':>8s}"
                                   for k in levels)
                         + f"   {ratio:7.2f}   {median(data['link_ms']):7.1f} {max(data['link_ms']):7.1f}")
            lines.append(f"{'kvbroker-' + backend + ' ms':<20s}"
                         + "".join(f"{series[str(k)]['ms_per_round']:8.1f}" if str(k) in series else f"{'-':>8s}"
                                   for k in levels))
    return lines
