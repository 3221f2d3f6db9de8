"""kvbroker's data-plane benchmark: kvbroker and its baselines and peers, side by side, in one run.

    .venv/bin/python bench/kvbench.py                       # everything, >= 1 GiB per point (a few minutes)
    .venv/bin/python bench/kvbench.py --quick               # tiny sizes, no peers: < 60 s (smoke test)
    .venv/bin/python bench/kvbench.py --json                # one JSON object on stdout
    .venv/bin/python bench/kvbench.py --only memcpy,kvbroker-shm --sizes 256K --total-bytes 2G

Subjects (all moving the same scattered blocks: every block of a cache of --tensors tensors, source block order and
destination block order two random permutations, repeated until --total-bytes moved; warm-up pull untimed; the
median of --trials timed trials):
  memcpy        numpy copies between two /dev/shm segments, 1 and 2 threads (the same-host limit)
  socket        sendall(memoryview) / recv_into between two processes over loopback, 1 and 2 connections
  kvbroker-shm  PullKvBlocks through the public client between two local daemons with --backends shm
  kvbroker-tcp  the same with --backends tcp
  kvbroker-nixl the same with --backends nixl (NIXL in this venv: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)
  concurrency   the same total bytes split into 1, 4, 16, 64 concurrent pulls (AsyncClient + asyncio.gather), and
                the same pulls as one pull-session message (the vLLM connector's way) and as one batch call
  nixl          NIXL 1.5.1 UCX READs, default UCX (same host; anonymous and /dev/shm memory) and UCX_TLS=tcp
  mooncake      Mooncake Transfer Engine tcp READs, batches of <= 2048 (bench/.venvs/mooncake)
  latency       one 64 KiB block pull (a call, and one message of a pull session), p50/p99, beside a bare gRPC Ping
  floor         CPU per operation of each daemon and the client: ping, 64 KiB pull, session pull (floor.py)
  planning      kvbrokerd.transfers.planner.plan_blocks for 80 layers x 2 tensors x 1024/4096/16384 scattered blocks
  scale-blocks  one pull of 1 .. 1,048,576 small blocks, contiguous and scattered, with where its time goes (scale.py)
  scale-peers   the same bytes pulled from 1, 2, 4, 8, 16 linked peers at once, and the cost of a link (scale.py)
Peers not installed are skipped with a message: `bash bench/setup_peers.sh` installs them.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import math
import mmap
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
PEERS_DIR = BENCH_DIR / "peers"
sys.path.insert(0, str(PEERS_DIR))

import floor  # noqa: E402
import scale  # noqa: E402
from kvbench_common import (  # noqa: E402
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
from peer_common import (  # noqa: E402
    RESULT_MARK,
    check_pattern,
    fill_pattern,
    fmt_size,
    median,
    parse_size,
    timed_trials,
)

ALL_ITEMS = ("memcpy", "socket", "kvbroker-shm", "kvbroker-tcp", "kvbroker-nixl", "concurrency", "nixl", "mooncake",
             "latency", "floor", "planning", "scale-blocks", "scale-peers")
PEER_ITEMS = ("nixl", "mooncake", "kvbroker-nixl")
"""Items that need an optional install (left out of --quick)."""
CONCURRENCY = (1, 4, 16, 64)
PLAN_BLOCKS = (1024, 4096, 16384)
PLAN_LAYERS = 80
SCALE_BLOCKS = "1,10,100,1000,10000,100000,1048576"
"""Blocks per pull of scale-blocks, up to the daemon's MAX_BLOCKS_PER_REQUEST (2^20)."""
SCALE_BLOCKS_QUICK = "1,10,100,1000,10000,100000"
SCALE_PEERS = "1,2,4,8,16"
SCALE_PEERS_QUICK = "1,2,4"
MAX_SCALE_PEERS = 64
PEER_PYTHON = {
    "nixl": ("KVBENCH_NIXL_PYTHON", BENCH_DIR / ".venvs" / "nixl" / "bin" / "python"),
    "mooncake": ("KVBENCH_MOONCAKE_PYTHON", BENCH_DIR / ".venvs" / "mooncake" / "bin" / "python"),
}
PULL_TIMEOUT_S = 60.0
"""Default deadline of one pull (a whole 256 MiB cache takes well under a second even at 1 GB/s): a pull that hangs
fails its point, not the run."""


# --------------------------------------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
                break
    return {"nproc": os.cpu_count(), "cpu": cpu, "mem_gib": round(mem / 2**30, 1),
            "python": platform.python_version(), "kernel": platform.release(), "numpy": np.__version__,
            "loadavg_at_start": list(os.getloadavg())}


# ---------------------------------------------------------------------------------------------------------- memcpy


@contextlib.contextmanager
def shm_array(name: str, nbytes: int) -> Iterator[np.ndarray]:
    """A numpy uint8 array over a new /dev/shm file (unlinked on exit)."""
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        fd = -1
        arr = np.frombuffer(mm, dtype=np.uint8)
        try:
            yield arr
        finally:
            del arr
            with contextlib.suppress(BufferError):
                mm.close()
    finally:
        if fd >= 0:
            os.close(fd)
        path.unlink(missing_ok=True)


def bench_memcpy(cfg: Config, rep: Report) -> None:
    cache = cfg.tensors * cfg.tensor_bytes
    tag = f"kvbench-{os.getpid()}"
    with shm_array(f"{tag}-src", cache) as src, shm_array(f"{tag}-dst", cache) as dst, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        for block in cfg.sizes:
            lay = cfg.layout(block)
            fill_pattern(src, block)
            dst[:] = 255
            src_off, dst_off = lay.offsets()
            pairs = [(dst[d : d + block], src[s : s + block])
                     for s, d in zip(src_off.tolist(), dst_off.tolist(), strict=True)]
            halves = [pairs[0::2], pairs[1::2]]

            def copy(chunk: list[tuple[np.ndarray, np.ndarray]]) -> None:
                for a, b in chunk:
                    np.copyto(a, b)

            def copy2(halves: list[list[tuple[np.ndarray, np.ndarray]]] = halves) -> None:
                fut = pool.submit(copy, halves[1])
                copy(halves[0])
                fut.result()

            for subject, fn in (("memcpy-1t", lambda pairs=pairs: copy(pairs)), ("memcpy-2t", copy2)):
                r = timed_trials(lay, cfg.total_bytes, cfg.trials, fn)
                check_pattern(dst, src_off, dst_off, block)
                rep.put(subject, block, r)
                log(f"{subject:14s} {fmt_size(block):>5s}: {r['gbps']:.2f} GB/s")
                dst[:] = 255
            del pairs, halves


# ---------------------------------------------------------------------------------------------------------- peers


def run_peer_script(script: str, python: str, args: list[str], timeout: float) -> dict[str, Any]:
    """Runs a peer script; returns its KVBENCH_RESULT object or raises RuntimeError with the end of its output."""
    cmd = [python, str(PEERS_DIR / script), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=BENCH_DIR)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{script} timed out after {timeout:.0f} s") from e
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            result: dict[str, Any] = json.loads(line[len(RESULT_MARK) :])
            return result
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    raise RuntimeError(f"{script} exited with {proc.returncode} and no result:\n{tail}")


def record_peer(rep: Report, result: dict[str, Any]) -> None:
    subject = result["subject"]
    for block, r in result["results"].items():
        rep.put(subject, int(block), r)
        log(f"{subject:14s} {fmt_size(int(block)):>5s}: {r['gbps']:.2f} GB/s")
    rep.details.setdefault(subject, {})["info"] = result.get("info", {})


def bench_socket(cfg: Config, rep: Report) -> None:
    for conns in (1, 2):
        try:
            record_peer(rep, run_peer_script("socket_peer.py", sys.executable,
                                             [*cfg.peer_args(), "--conns", str(conns)], 900))
        except RuntimeError as e:
            rep.skipped[f"socket-{conns}c"] = str(e)
            log(f"socket-{conns}c failed: {e}")


def peer_python(name: str) -> str | None:
    env, default = PEER_PYTHON[name]
    path = os.environ.get(env) or str(default)
    return path if os.access(path, os.X_OK) else None


def bench_nixl(cfg: Config, rep: Report) -> None:
    python = peer_python("nixl")
    # The -shm subject reads /dev/shm mappings like kvbroker's caches: the like-for-like baseline of kvbroker-nixl.
    for mode, memory, subject in (("default", "anon", "nixl-samehost"), ("default", "shm", "nixl-samehost-shm"),
                                  ("tcp", "anon", "nixl-tcp")):
        if python is None:
            rep.skipped[subject] = "not installed: run `bash bench/setup_peers.sh nixl` (bench/.venvs/nixl)"
            log(f"{subject}: skipped ({rep.skipped[subject]})")
            continue
        try:
            record_peer(rep, run_peer_script("nixl_bench.py", python,
                                             [*cfg.peer_args(), "--ucx", mode, "--memory", memory], 900))
        except RuntimeError as e:
            rep.skipped[subject] = str(e)
            log(f"{subject} failed: {e}")


def bench_mooncake(cfg: Config, rep: Report) -> None:
    python = peer_python("mooncake")
    subject = "mooncake-tcp"
    if python is None:
        rep.skipped[subject] = "not installed: run `bash bench/setup_peers.sh mooncake` (bench/.venvs/mooncake)"
        log(f"{subject}: skipped ({rep.skipped[subject]})")
        return
    try:
        record_peer(rep, run_peer_script("mooncake_bench.py", python, cfg.peer_args(), 900))
    except RuntimeError as e:
        rep.skipped[subject] = str(e)
        log(f"{subject} failed: {e}")


# -------------------------------------------------------------------------------------------------------- kvbroker


def bench_kv_throughput(cfg: Config, rep: Report, pair: KvPair) -> None:
    from kvbroker import CacheIndex

    subject = f"kvbroker-{pair.backend}"
    for block in cfg.sizes:
        lay = cfg.layout(block)
        with pair.caches(cache_desc(cfg.tensors, lay.blocks_per_tensor, block)) as (src, dst):
            fill_cache(src.tensors)
            sperm, dperm = lay.perms()
            sl, dl = sperm.tolist(), dperm.tolist()
            index = CacheIndex(cluster_id=1, cache_id=src.cache_id)
            last: list[Any] = []

            def pull(index: Any = index, dst: Any = dst, sl: list[int] = sl, dl: list[int] = dl,
                     last: list[Any] = last) -> None:
                last[:] = [pair.dst.pull_kv_blocks(index, dst, sl, dl, timeout=pair.timeout)]

            r = timed_trials(lay, cfg.total_bytes, cfg.trials, pull)
            res = last[0]
            if res.backend != pair.backend or res.bytes_moved != lay.pull_bytes:
                raise RuntimeError(f"{subject}: pull used {res.backend!r} and moved {res.bytes_moved} bytes "
                                   f"(expected {pair.backend!r}, {lay.pull_bytes})")
            check_cache(src.tensors, dst.tensors, sperm, dperm)
            r["num_runs"] = res.num_runs
            rep.put(subject, block, r)
            log(f"{subject:14s} {fmt_size(block):>5s}: {r['gbps']:.2f} GB/s ({res.num_runs} runs per pull)")


async def _concurrent_trials(target: str, index: Any, dst_id: int, chunks: list[tuple[list[int], list[int]]],
                             reps: int, trials: int, pull_bytes: int, timeout: float,
                             mode: str = "calls") -> list[float]:
    """`mode`: "calls", k concurrent PullKvBlocks calls per round; "batch", the same pulls as the groups of one
    TransferKvBlocksBatch call (one RPC, not k); "session", the same pulls as one message of a pull session (the
    vLLM connector's way: one long-lived stream, each pull its own outcome)."""
    from kvbroker import AsyncClient, PullBlocks, SessionPull

    async with AsyncClient(target, timeout=timeout) as c:
        session = await c.open_pull_session() if mode == "session" else None

        async def round_() -> None:
            if mode == "batch":
                results = [await c.transfer_kv_blocks_batch(
                    [PullBlocks(index, dst_id, tuple(s), tuple(d)) for s, d in chunks])]
            elif session is not None:
                futures = await session.submit([SessionPull(index, dst_id, tuple(d), tuple(s)) for s, d in chunks])
                results = await asyncio.gather(*futures)
            else:
                results = await asyncio.gather(*(c.pull_kv_blocks(index, dst_id, s, d) for s, d in chunks))
            moved = sum(r.bytes_moved for r in results)
            if moved != pull_bytes:
                raise RuntimeError(f"{len(chunks)} concurrent pulls moved {moved} bytes, expected {pull_bytes}")

        try:
            return await timed_rounds(round_, reps, trials, pull_bytes)
        finally:
            if session is not None:
                await session.close()


def bench_kv_concurrency(cfg: Config, rep: Report, pair: KvPair) -> None:
    from kvbroker import CacheIndex

    subject = f"kvbroker-{pair.backend}"
    block = cfg.concurrency_block
    lay = cfg.layout(block)
    levels = [k for k in CONCURRENCY if k <= lay.blocks_per_tensor]
    series: dict[str, float] = {}
    batched: dict[str, float] = {}
    sessions: dict[str, float] = {}
    with pair.caches(cache_desc(cfg.tensors, lay.blocks_per_tensor, block)) as (src, dst):
        fill_cache(src.tensors)
        sperm, dperm = lay.perms()
        index = CacheIndex(cluster_id=1, cache_id=src.cache_id)
        try:
            for k in levels:
                chunks = [(s.tolist(), d.tolist())
                          for s, d in zip(np.array_split(sperm, k), np.array_split(dperm, k), strict=True)]
                for t in dst.tensors:
                    t[:] = 0  # every level must land every block itself
                try:
                    trials = _concurrent_trials(pair.dst_daemon.target, index, dst.cache_id, chunks,
                                                lay.reps(cfg.total_bytes), cfg.trials, lay.pull_bytes, pair.timeout)
                    results = event_loop().run_until_complete(trials)
                except Exception as e:
                    # A level that fails counts as 0 GB/s (so the flatness target is a MISS, not a SKIP).
                    series[str(k)] = 0.0
                    rep.errors[f"{subject}-concurrency-{k}"] = f"{type(e).__name__}: {e}"
                    log(f"{subject:14s} {fmt_size(block):>5s} x {k:2d} concurrent pulls FAILED: "
                        f"{type(e).__name__}: {e}")
                    raise
                check_cache(src.tensors, dst.tensors, sperm, dperm)
                series[str(k)] = median(results)
                log(f"{subject:14s} {fmt_size(block):>5s} x {k:2d} concurrent pulls: {series[str(k)]:.2f} GB/s")
                # The same pulls as one pull-session message per round (every level, the connector's way), and
                # as one batch call (what the per-call cost of k calls takes away).
                for mode, out in (("session", sessions), ("batch", batched)):
                    if mode == "batch" and k == 1:
                        continue
                    for t in dst.tensors:
                        t[:] = 0
                    trials = _concurrent_trials(pair.dst_daemon.target, index, dst.cache_id, chunks,
                                                lay.reps(cfg.total_bytes), cfg.trials, lay.pull_bytes, pair.timeout,
                                                mode=mode)
                    out[str(k)] = median(event_loop().run_until_complete(trials))
                    check_cache(src.tensors, dst.tensors, sperm, dperm)
                    log(f"{subject:14s} {fmt_size(block):>5s} x {k:2d} pulls as one {mode} message: "
                        f"{out[str(k)]:.2f} GB/s")
        finally:
            rep.concurrency[subject] = series
            if sessions:
                rep.concurrency[f"{subject}-session"] = sessions
            if batched:
                rep.concurrency[f"{subject}-batch"] = batched
            rep.details.setdefault(f"{subject}-concurrency", {})["block"] = block


def percentiles(ns: list[int]) -> dict[str, float]:
    a = np.asarray(ns, dtype=np.float64) / 1e3
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "mean_us": float(a.mean()), "samples": len(ns)}


def bench_kv_latency(cfg: Config, rep: Report, pair: KvPair) -> None:
    """One 64 KiB block pull beside a bare gRPC Ping to the same (pulling) daemon, interleaved so that both see the
    same conditions. Two more interleaved calls split the pull's cost: a pull of one 64-byte block (the fixed cost of
    a pull, next to nothing to move) and a refused pull (destination block out of range: the request path and the
    validation, no transfer)."""
    from kvbroker import CacheIndex, LlmError, SessionPull, TransferResult

    block, nb = 64 * 1024, 16
    with pair.caches(cache_desc(1, nb, block)) as (src, dst), pair.caches(cache_desc(1, nb, 64)) as (tiny_src, tiny):
        fill_cache(src.tensors)
        index = CacheIndex(cluster_id=1, cache_id=src.cache_id)
        tiny_index = CacheIndex(cluster_id=1, cache_id=tiny_src.cache_id)
        c = pair.dst

        def refused(i: int) -> None:
            try:
                c.pull_kv_blocks(index, dst, [i % nb], [nb])
            except LlmError:
                return
            raise RuntimeError("a pull into a block out of range was not refused")

        session = c.open_pull_session()  # the vLLM connector's way: one message on a long-lived stream
        calls: dict[str, Callable[[int], object]] = {
            "ping": lambda i: c.ping(),
            "pull": lambda i: c.pull_kv_blocks(index, dst, [i % nb], [(i * 7 + 3) % nb]),
            "session": lambda i: session.submit([SessionPull(index, dst.cache_id, ((i * 7 + 3) % nb,),
                                                             (i % nb,))])[0].result(PULL_TIMEOUT_S),
            "pull64B": lambda i: c.pull_kv_blocks(tiny_index, tiny, [i % nb], [i % nb]),
            "refused": refused,
        }
        samples: dict[str, list[int]] = {k: [] for k in calls}
        for i in range(50 + cfg.latency_samples):  # 50 warm-up rounds
            for kind, call in calls.items():
                t0 = time.perf_counter_ns()
                call(i)
                if i >= 50:
                    samples[kind].append(time.perf_counter_ns() - t0)
        last = cfg.latency_samples
        for kind in ("pull", "session"):
            res = calls[kind](last)
            assert isinstance(res, TransferResult)
            if res.bytes_moved != block or res.backend != pair.backend:
                raise RuntimeError(f"latency {kind} moved {res.bytes_moved} bytes over {res.backend!r}")
            check_cache(src.tensors, dst.tensors, np.array([last % nb]), np.array([(last * 7 + 3) % nb]))
        session.close()
    for kind, ns in samples.items():
        rep.latency[f"kvbroker-{pair.backend}-{kind}"] = percentiles(ns)
    lat = {k: rep.latency[f"kvbroker-{pair.backend}-{k}"]["p50_us"] for k in calls}
    log(f"latency {pair.backend} p50: 64K pull {lat['pull']:.0f} us, 64K session pull {lat['session']:.0f} us, "
        f"64B pull {lat['pull64B']:.0f} us, refused pull {lat['refused']:.0f} us, ping {lat['ping']:.0f} us")


def bench_kv_floor(cfg: Config, rep: Report, pair: KvPair) -> None:
    floor.bench_floor(cfg.floor_ops, rep, pair)


def py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return found if os.access(found, os.X_OK) else None


@contextlib.contextmanager
def profiled(cfg: Config, name: str, pair: KvPair) -> Iterator[None]:
    """With --profile DIR: py-spy samples both daemons while `name` runs (raw collapsed stacks, flamegraph.pl-ready),
    then the top frames of each are logged."""
    tool = py_spy() if cfg.profile else None
    if cfg.profile is None or tool is None:
        if cfg.profile is not None:
            log("--profile: py-spy not found (.venv/bin/pip install py-spy); not profiling")
        yield
        return
    cfg.profile.mkdir(parents=True, exist_ok=True)
    procs = []
    for role, daemon in (("source", pair.src_daemon), ("puller", pair.dst_daemon)):
        assert daemon.proc is not None
        out = cfg.profile / f"{name}-{role}.txt"
        procs.append((out, subprocess.Popen([tool, "record", "-p", str(daemon.proc.pid), "-f", "raw", "-r", "250",
                                             "-o", str(out), "--nonblocking"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    time.sleep(1.0)  # py-spy attaches
    try:
        yield
    finally:
        for _, proc in procs:
            proc.send_signal(signal.SIGINT)
        for out, proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            if out.exists():
                log(f"profile {out}:\n{summarize_stacks(out)}")


def summarize_stacks(path: Path, top: int = 12) -> str:
    """Top frames of a py-spy raw file by inclusive and by self samples (idle threads are not sampled)."""
    self_n: dict[str, int] = {}
    incl_n: dict[str, int] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        self_n[frames[-1]] = self_n.get(frames[-1], 0) + n
        for f in set(frames):
            incl_n[f] = incl_n.get(f, 0) + n
    if not total:
        return "  (no samples)"
    out = [f"  {total} busy samples; self:"]
    out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in sorted(self_n.items(), key=lambda x: -x[1])[:top]]
    out.append("  inclusive:")
    out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in sorted(incl_n.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(out)


def bench_kvbroker(cfg: Config, rep: Report) -> None:
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        for backend in ("shm", "tcp", "nixl"):
            want_tp = f"kvbroker-{backend}" in cfg.items
            want_conc = "concurrency" in cfg.items and backend != "nixl"
            want_lat = "latency" in cfg.items and backend != "nixl"
            want_floor = "floor" in cfg.items and backend != "nixl"
            if not (want_tp or want_conc or want_lat or want_floor):
                continue
            from kvbrokerd.backends import unavailable

            if (missing := unavailable(backend)) is not None:
                rep.skipped[f"kvbroker-{backend}"] = missing
                log(f"kvbroker-{backend}: skipped ({missing})")
                continue
            steps = [(f"kvbroker-{backend}", bench_kv_throughput, want_tp),
                     (f"kvbroker-{backend}-concurrency", bench_kv_concurrency, want_conc),
                     (f"kvbroker-{backend}-latency", bench_kv_latency, want_lat),
                     (f"kvbroker-{backend}-floor", bench_kv_floor, want_floor)]
            pair: KvPair | None = None
            try:
                for name, fn, wanted in steps:
                    if not wanted:
                        continue
                    if pair is None:
                        log(f"starting two daemons with --backends {backend}")
                        pair = KvPair(Path(tmp) / f"run{len(rep.errors)}", backend, cfg.pull_timeout).__enter__()
                    try:
                        with profiled(cfg, name, pair):
                            fn(cfg, rep, pair)
                    except Exception as e:
                        # Record, then start fresh daemons: a failed pull may leave the pair wedged.
                        rep.errors.setdefault(name, f"{type(e).__name__}: {e}")
                        log(f"{name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
                            f"--- pulling daemon's log ---\n{pair.dst_daemon.log_tail(10)}")
                        pair.__exit__(None, None, None)
                        pair = None
            finally:
                if pair is not None:
                    pair.__exit__(None, None, None)


# -------------------------------------------------------------------------------------------------------- planning


def bench_planning(cfg: Config, rep: Report) -> None:
    from kvbroker import CacheDesc, DataType
    from kvbrokerd.dataplane import pairs
    from kvbrokerd.transfers import planner

    tensors = 2 * PLAN_LAYERS
    num_blocks = 2 * max(PLAN_BLOCKS)
    desc = CacheDesc(num_tensors=tensors, shape=(num_blocks, 16, 8, 128), data_type=DataType.FLOAT16)
    rng = np.random.default_rng(cfg.seed)
    out: dict[str, Any] = {}
    for n in PLAN_BLOCKS:
        src = pairs.block_array(rng.choice(num_blocks, n, replace=False).tolist(), "src_blocks")
        dst = pairs.block_array(rng.choice(num_blocks, n, replace=False).tolist(), "dst_blocks")
        times = []
        runs = 0
        for _ in range(3 if cfg.quick else 7):
            t0 = time.perf_counter()
            plan = planner.plan_blocks(desc, desc, src, dst, planner.LayerSelection())
            times.append(time.perf_counter() - t0)
            runs = plan.num_runs
        ms = median(times) * 1e3
        out[str(n)] = {"ms": ms, "runs": runs, "ns_per_run": ms * 1e6 / max(runs, 1)}
        log(f"planning {PLAN_LAYERS} layers x 2 tensors x {n:5d} blocks: {ms:7.2f} ms ({runs} runs)")
    rep.planning = {"layers": PLAN_LAYERS, "tensors": tensors, "points": out}


# --------------------------------------------------------------------------------------------------- ratios/report


def _best(rep: Report, subjects: tuple[str, ...], block: str) -> float | None:
    vals = [rep.throughput[s][block] for s in subjects if block in rep.throughput.get(s, {})]
    return max(vals) if vals else None


RATIOS: list[tuple[str, str, tuple[str, ...]]] = [
    ("kvbroker-shm/memcpy", "kvbroker-shm", ("memcpy-1t", "memcpy-2t")),
    ("kvbroker-shm/memcpy-2t", "kvbroker-shm", ("memcpy-2t",)),
    ("kvbroker-tcp/socket", "kvbroker-tcp", ("socket-1c", "socket-2c")),
    ("kvbroker-shm/nixl-samehost", "kvbroker-shm", ("nixl-samehost",)),
    ("kvbroker-tcp/nixl-tcp", "kvbroker-tcp", ("nixl-tcp",)),
    ("kvbroker-tcp/mooncake", "kvbroker-tcp", ("mooncake-tcp",)),
    ("kvbroker-nixl/nixl-samehost-shm", "kvbroker-nixl", ("nixl-samehost-shm",)),
    ("kvbroker-nixl/nixl-samehost", "kvbroker-nixl", ("nixl-samehost",)),
]
# 64 KiB pull p50 over gRPC ping p50 (tcp adds a data round trip to the peer).
LATENCY_TARGETS = {"shm": 1.3, "tcp": 1.5}
# (ratio name, threshold, smallest block size it applies to, label)
THROUGHPUT_TARGETS: list[tuple[str, float, int, str]] = [
    ("kvbroker-shm/memcpy", 0.8, 256 * 1024, "shm >= 0.8x memcpy (blocks >= 256K)"),
    ("kvbroker-shm/memcpy-2t", 0.85, 256 * 1024, "shm >= 0.85x two-thread memcpy (blocks >= 256K)"),
    ("kvbroker-shm/nixl-samehost", 1.5, 0, "shm >= 1.5x NIXL same-host"),
    ("kvbroker-tcp/socket", 0.8, 256 * 1024, "tcp >= 0.8x socket (blocks >= 256K)"),
    ("kvbroker-tcp/nixl-tcp", 3.0, 0, "tcp >= 3x NIXL UCX_TLS=tcp"),
    ("kvbroker-tcp/mooncake", 1.25, 0, "tcp >= 1.25x Mooncake tcp"),
    ("kvbroker-nixl/nixl-samehost-shm", 0.9, 0, "nixl >= 0.9x raw NIXL same-host, same (shm) memory"),
]


def target(rep: Report, label: str, value: float | None, ok: bool | None, need: str) -> None:
    status = "SKIP" if value is None or ok is None else ("PASS" if ok else "MISS")
    rep.targets.append({"target": label, "value": value, "need": need, "status": status})


def flatness(series: dict[str, float]) -> float:
    """min/max GB/s over the concurrency levels (a failed level counts 0)."""
    top = max(series.values())
    return min(series.values()) / top if top > 0 else 0.0


def compute_ratios_and_targets(cfg: Config, rep: Report) -> None:
    for name, num, dens in RATIOS:
        row: dict[str, float] = {}
        for key in (str(s) for s in cfg.sizes):
            a = rep.throughput.get(num, {}).get(key)
            b = _best(rep, dens, key)
            if a is not None and b:
                row[key] = a / b
        if row:
            rep.ratios[name] = row
    ratio_items = {name: (num, dens[0].split("-")[0]) for name, num, dens in RATIOS}
    for name, threshold, min_block, label in THROUGHPUT_TARGETS:
        if not all(item in cfg.items for item in ratio_items[name]):
            continue  # targets of items this run did not select are left out (a missing peer is a SKIP)
        for block in cfg.sizes:
            if block < min_block:
                continue
            v = rep.ratios.get(name, {}).get(str(block))
            target(rep, f"{label} @ {fmt_size(block)}", v, None if v is None else v >= threshold,
                   f">= {threshold}")
    for backend in ("shm", "tcp") if "latency" in cfg.items else ():
        ping = rep.latency.get(f"kvbroker-{backend}-ping")
        for kind, label in (("pull", "64K pull"), ("session", "64K session pull")):
            pull = rep.latency.get(f"kvbroker-{backend}-{kind}")
            v = pull["p50_us"] / ping["p50_us"] if pull and ping else None
            if v is not None:
                rep.ratios.setdefault(f"latency-p50-{kind}/ping", {})[backend] = v
            limit = LATENCY_TARGETS[backend]
            target(rep, f"{backend} {label} p50 <= {limit}x gRPC ping p50", v, None if v is None else v <= limit,
                   f"<= {limit}")
    for backend in ("shm", "tcp") if "concurrency" in cfg.items else ():
        for suffix, way in (("", "concurrent pulls"), ("-session", "pulls as one session message")):
            series = rep.concurrency.get(f"kvbroker-{backend}{suffix}")
            v = flatness(series) if series else None
            if v is not None:
                rep.ratios.setdefault(f"concurrency{suffix}-min/max", {})[backend] = v
            top = max(k for k in CONCURRENCY if k <= cfg.layout(cfg.concurrency_block).blocks_per_tensor)
            target(rep, f"{backend} flat from 1 to {top} {way} (min/max GB/s)", v,
                   None if v is None else v >= 0.9, ">= 0.9")
    pts = rep.planning.get("points", {})
    if "planning" in cfg.items:
        mid = pts.get("4096", {}).get("ms")
        target(rep, "plan 80 layers x 2 x 4096 blocks takes milliseconds (< 100 ms)", mid,
               None if mid is None else mid < 100, "< 100 ms")
        lo, hi = pts.get("4096", {}).get("ms"), pts.get("16384", {}).get("ms")
        # Growth exponent k in t ~ n^k from 4,096 to 16,384 blocks: 1 = linear, 2 = quadratic. Single ms-scale
        # timings on a shared machine are noisy, and the 16,384-block plan writes ~100 MB of fresh arrays.
        v = math.log(hi / lo) / math.log(16384 / 4096) if lo and hi else None
        target(rep, "plan time linear: exponent k of t ~ n^k, 4096->16384 blocks", v,
               None if v is None else v <= 1.25, "<= 1.25")


def render(cfg: Config, rep: Report) -> str:
    m = rep.machine
    load = "/".join(f"{x:.2f}" for x in m["loadavg_at_start"])
    lines = [f"kvbench: {m['nproc']} CPUs ({m['cpu']}), {m['mem_gib']} GiB RAM, Python {m['python']}, "
             f"kernel {m['kernel']}, load average at start {load}",
             f"every point: {fmt_size(cfg.total_bytes)} moved per trial in scattered blocks of a "
             f"{cfg.tensors} x {fmt_size(cfg.tensor_bytes)} cache, median of {cfg.trials} trial(s) after a warm-up"
             + (f", best of {cfg.rounds} rounds" if cfg.rounds > 1 else ""),
             ""]
    cols = [fmt_size(s) for s in cfg.sizes]
    head = f"{'GB/s':<16s}" + "".join(f"{c:>9s}" for c in cols)
    order = ["memcpy-1t", "memcpy-2t", "socket-1c", "socket-2c", "kvbroker-shm", "kvbroker-tcp", "kvbroker-nixl",
             "nixl-samehost", "nixl-samehost-shm", "nixl-tcp", "mooncake-tcp"]
    if rep.throughput or rep.skipped:
        lines += [head, "-" * len(head)]
    for subject in order + [s for s in rep.throughput if s not in order]:
        row = rep.throughput.get(subject)
        if row is None:
            if subject in rep.skipped:
                lines.append(f"{subject:<16s}   skipped: {rep.skipped[subject].splitlines()[0]}")
            continue
        lines.append(f"{subject:<16s}" + "".join(f"{row[str(s)]:9.2f}" if str(s) in row else f"{'-':>9s}"
                                                 for s in cfg.sizes))
    if any(name in rep.ratios for name, _, _ in RATIOS):
        lines += ["", f"{'ratio':<28s}" + "".join(f"{c:>9s}" for c in cols)]
        for name, _, _ in RATIOS:
            row2 = rep.ratios.get(name)
            if row2:
                lines.append(f"{name:<28s}" + "".join(f"{row2[str(s)]:9.2f}" if str(s) in row2 else f"{'-':>9s}"
                                                      for s in cfg.sizes))
    if rep.concurrency:
        levels = sorted({int(k) for s in rep.concurrency.values() for k in s})
        lines += ["", f"{'concurrent pulls @ ' + fmt_size(cfg.concurrency_block):<24s}"
                  + "".join(f"{k:>8d}" for k in levels) + "   min/max"]
        for subject, series in rep.concurrency.items():
            lines.append(f"{subject:<24s}" + "".join(f"{series[str(k)]:8.2f}" if str(k) in series else f"{'-':>8s}"
                                                     for k in levels)
                         + f"   {flatness(series):7.2f}")
    if rep.latency:
        lines += ["", f"{'latency (us)':<26s}{'p50':>9s}{'p99':>9s}{'mean':>9s}"]
        for name, lat in rep.latency.items():
            label = (name.replace("-pull64B", " 64B pull").replace("-pull", " 64K pull")
                     .replace("-session", " 64K session").replace("-ping", " gRPC ping")
                     .replace("-refused", " refused pull"))
            lines.append(f"{label:<26s}{lat['p50_us']:9.0f}{lat['p99_us']:9.0f}{lat['mean_us']:9.0f}")
        for kind in ("pull", "session"):
            for backend, ratio in rep.ratios.get(f"latency-p50-{kind}/ping", {}).items():
                lines.append(f"{'p50 64K ' + kind + '/ping ' + backend:<26s}{ratio:9.2f}")
    if rep.planning:
        lines += ["", f"planning ({rep.planning['layers']} layers x 2 tensors)   blocks      runs        ms   ns/run"]
        for n, pt in rep.planning["points"].items():
            lines.append(f"{'':<36s}{int(n):6d}{pt['runs']:10d}{pt['ms']:10.2f}{pt['ns_per_run']:9.1f}")
    lines += floor.render_lines(rep)
    lines += scale.render_lines(rep)
    if rep.targets:
        lines += ["", "targets" + (" (--quick: points too small and too few for these to mean anything; a smoke test "
                                   "only)" if cfg.quick else "")]
        for t in rep.targets:
            val = "-" if t["value"] is None else f"{t['value']:.2f}"
            lines.append(f"  {t['status']:<5s}{t['target']:<62s}{val:>8s}  (need {t['need']})")
    extra = {k: v for k, v in rep.skipped.items() if k not in order}
    for name, why in extra.items():
        lines.append(f"skipped {name}: {why}")
    if rep.errors:
        lines += ["", "errors (the run went on)"]
        lines += [f"  {name}: {why.splitlines()[0] if why else ''}" for name, why in rep.errors.items()]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny run for smoke tests: 64M per point, 200 latency samples, 1 trial, no peers")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--save", type=Path, metavar="FILE", help="also write the JSON object to FILE")
    p.add_argument("--sizes", help="block sizes (default 64K,256K,2M)")
    p.add_argument("--total-bytes", help="bytes moved per timed trial and point (default 1G; --quick 64M)")
    p.add_argument("--only", help=f"comma-separated subset of: {','.join(ALL_ITEMS)}")
    p.add_argument("--skip", help="comma-separated items to leave out")
    p.add_argument("--tensors", type=int, default=8, help="tensors per cache (default 8)")
    p.add_argument("--tensor-bytes", help="bytes per tensor (default 32M; --quick 4M)")
    p.add_argument("--trials", type=int, help="timed trials per point, median reported (default 3; --quick 1)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every subject this many times and keep each one's best round (default 1): on a shared "
                        "machine other load only slows subjects down, and not all of them equally")
    p.add_argument("--latency-samples", type=int, help="pulls and pings for the latency series (default 1000)")
    p.add_argument("--floor-ops", type=int,
                   help="operations of each kind for the floor item (default 2000; --quick 300)")
    p.add_argument("--concurrency-block", help="block size of the concurrency series (default 256K; --quick 64K)")
    p.add_argument("--pull-timeout", type=float,
                   help=f"deadline of one kvbroker pull, s (default {PULL_TIMEOUT_S:.0f}; --quick 20)")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="sample both daemons with py-spy during each kvbroker item; raw stacks into DIR")
    p.add_argument("--scale-block", default="64",
                   help="block size of scale-blocks (default 64: 2^20 blocks x 2 tensors fit in 128 MiB per cache)")
    p.add_argument("--scale-blocks",
                   help=f"blocks per pull of scale-blocks (default {SCALE_BLOCKS}; --quick {SCALE_BLOCKS_QUICK})")
    p.add_argument("--scale-peers",
                   help=f"linked peers of scale-peers (default {SCALE_PEERS}; --quick {SCALE_PEERS_QUICK}); its blocks "
                        "and bytes per round are --concurrency-block and the --tensors x --tensor-bytes cache")
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args(argv)
    items = list(ALL_ITEMS)
    if a.only:
        items = [i.strip() for i in a.only.split(",") if i.strip()]
    elif a.quick:
        items = [i for i in ALL_ITEMS if i not in PEER_ITEMS]
    if a.skip:
        items = [i for i in items if i not in {s.strip() for s in a.skip.split(",")}]
    unknown = [i for i in items if i not in ALL_ITEMS]
    if unknown:
        p.error(f"unknown item(s) {unknown}; choose from {', '.join(ALL_ITEMS)}")
    cfg = Config(
        sizes=[parse_size(s) for s in (a.sizes or "64K,256K,2M").split(",") if s.strip()],
        total_bytes=parse_size(a.total_bytes or ("64M" if a.quick else "1G")),
        tensors=a.tensors,
        tensor_bytes=parse_size(a.tensor_bytes or ("4M" if a.quick else "32M")),
        trials=a.trials or (1 if a.quick else 3),
        rounds=max(1, a.rounds),
        seed=a.seed,
        latency_samples=a.latency_samples or (200 if a.quick else 1000),
        floor_ops=a.floor_ops or (300 if a.quick else 2000),
        concurrency_block=parse_size(a.concurrency_block or ("64K" if a.quick else "256K")),
        pull_timeout=a.pull_timeout or (20.0 if a.quick else PULL_TIMEOUT_S),
        items=items,
        quick=a.quick,
        profile=a.profile,
        scale_block=parse_size(a.scale_block),
        scale_blocks=[int(n) for n in (a.scale_blocks or (SCALE_BLOCKS_QUICK if a.quick else SCALE_BLOCKS)).split(",")
                      if n.strip()],
        scale_peers=[int(n) for n in (a.scale_peers or (SCALE_PEERS_QUICK if a.quick else SCALE_PEERS)).split(",")
                     if n.strip()],
    )
    if cfg.scale_block % 2 or not cfg.scale_blocks or min(cfg.scale_blocks) < 1 or not cfg.scale_peers \
            or not 1 <= min(cfg.scale_peers) <= max(cfg.scale_peers) <= MAX_SCALE_PEERS:
        p.error(f"--scale-block must be even, --scale-blocks >= 1 each, --scale-peers between 1 and {MAX_SCALE_PEERS} "
                "(each peer is a daemon process on this machine)")
    for s in [*cfg.sizes, cfg.concurrency_block]:
        if s % 2 or cfg.tensor_bytes % s:
            p.error(f"block size {s} must be even and divide --tensor-bytes {cfg.tensor_bytes}")
    return cfg, a


def run(cfg: Config) -> Report:
    """`cfg.rounds` rounds of every selected subject, merged (see merge_rounds); then the ratios and targets."""
    reports = []
    for n in range(cfg.rounds):
        if cfg.rounds > 1:
            log(f"round {n + 1} of {cfg.rounds}")
        reports.append(run_round(cfg))
    rep = reports[0] if len(reports) == 1 else merge_rounds(cfg, reports)
    compute_ratios_and_targets(cfg, rep)
    return rep


def merge_rounds(cfg: Config, reports: list[Report]) -> Report:
    """Best of the rounds: a busy shared machine only ever slows a subject down, so each subject's throughput (and
    each concurrency level) is the best of its per-round medians; latency is taken, per backend, from the round
    whose bare ping p50 was lowest (pull and ping were interleaved, so their ratio is from one round); planning is
    the fastest round. Skips and errors of every round are kept."""
    rep = Report(config=dict(cfg.__dict__), machine=dict(reports[0].machine))
    rep.machine["loadavg_at_end"] = reports[-1].machine["loadavg_at_end"]
    for r in reports:
        for subject, row in r.throughput.items():
            for key, val in row.items():
                best = rep.throughput.setdefault(subject, {})
                best[key] = max(best.get(key, 0.0), val)
                d = rep.details.setdefault(subject, {}).setdefault(key, {"round_gbps": []})
                d["round_gbps"].append(val)
                d["gbps"] = best[key]
        for subject, series in r.concurrency.items():
            merged = rep.concurrency.setdefault(subject, {})
            for key, val in series.items():
                merged[key] = max(merged.get(key, 0.0), val)
        rep.skipped.update(r.skipped)
        rep.errors.update({f"round {reports.index(r) + 1}: {k}": v for k, v in r.errors.items()})
    for backend in ("shm", "tcp"):
        rounds = [r for r in reports if f"kvbroker-{backend}-ping" in r.latency]
        if rounds:
            quiet = min(rounds, key=lambda r: r.latency[f"kvbroker-{backend}-ping"]["p50_us"])
            rep.latency.update({k: v for k, v in quiet.latency.items() if k.startswith(f"kvbroker-{backend}-")})
    for backend in ("shm", "tcp"):  # the floor of the round whose ping was quickest, as for latency
        floors = [r.details["floor"][backend] for r in reports if backend in r.details.get("floor", {})]
        if floors:
            rep.details.setdefault("floor", {})[backend] = min(floors, key=lambda f: float(f["ping"]["wall_us"]))
    planned = [r for r in reports if r.planning.get("points", {}).get("4096")]
    if planned:
        rep.planning = min(planned, key=lambda r: float(r.planning["points"]["4096"]["ms"])).planning
    rep.scale = scale.merge(reports)
    rep.details["seconds"] = sum(r.details["seconds"] for r in reports)
    rep.details["rounds"] = len(reports)
    return rep


def run_round(cfg: Config) -> Report:
    rep = Report(config=dict(cfg.__dict__), machine=machine_info())
    steps: list[tuple[str, Callable[[Config, Report], None]]] = [
        ("memcpy", bench_memcpy), ("socket", bench_socket), ("kvbroker", bench_kvbroker), ("nixl", bench_nixl),
        ("mooncake", bench_mooncake), ("planning", bench_planning), ("scale-blocks", scale.bench_blocks),
        ("scale-peers", scale.bench_peers)]
    kv_items = {"kvbroker-shm", "kvbroker-tcp", "kvbroker-nixl", "concurrency", "latency", "floor"}
    t0 = time.perf_counter()
    for name, fn in steps:
        wanted = bool(kv_items & set(cfg.items)) if name == "kvbroker" else name in cfg.items
        if wanted:
            try:
                fn(cfg, rep)
            except Exception as e:
                rep.errors.setdefault(name, f"{type(e).__name__}: {e}")
                log(f"{name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
    rep.details["seconds"] = time.perf_counter() - t0
    rep.machine["loadavg_at_end"] = list(os.getloadavg())
    return rep


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    rep = run(cfg)
    doc = json.dumps(rep.__dict__, indent=None, default=str)
    if args.save:
        args.save.write_text(doc + "\n")
    if args.json:
        print(doc)
    else:
        print(render(cfg, rep))
        print(f"\n(total {rep.details['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
