"""kvbench's `floor` item: what one operation costs, per operation, on each side (BENCHMARKS.md, "The per-operation
floor").

Per backend: a bare gRPC Ping, a 64 KiB block pull as one call, the same pull as one message of a pull session, and
a refused pull (a destination block out of range: the request path and its checks, nothing moves), each --floor-ops
times after 100 warm-ups, in blocks of 100 that take turns (so that every kind sees the same load). For each: the
mean wall time, and the CPU time per operation of the pulling daemon, the source daemon (both from
/proc/<pid>/task/*/schedstat: every thread, in nanoseconds) and this client (process_time).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbench_common import KvPair, Report, cache_desc, fill_cache, log

KINDS = ("ping", "pull", "session", "refused")
_BLOCK = 100
_WARM_UPS = 100
_TIMEOUT_S = 30.0


def process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` so far, in ns (threads that ended are not counted: gRPC's and ours live
    as long as the daemon)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):  # the thread ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total


def bench_floor(ops: int, rep: Report, pair: KvPair) -> None:
    from kvbroker import CacheIndex, LlmError, SessionPull

    block, nb = 64 * 1024, 16
    assert pair.src_daemon.proc is not None and pair.dst_daemon.proc is not None
    puller, source = pair.dst_daemon.proc.pid, pair.src_daemon.proc.pid
    with pair.caches(cache_desc(1, nb, block)) as (src, dst):
        fill_cache(src.tensors)
        index = CacheIndex(cluster_id=1, cache_id=src.cache_id)
        c = pair.dst
        session = c.open_pull_session()

        def refused(i: int) -> None:
            with contextlib.suppress(LlmError):
                c.pull_kv_blocks(index, dst, [i % nb], [nb])
                raise RuntimeError("a pull into a block out of range was not refused")

        calls: dict[str, Callable[[int], object]] = {
            "ping": lambda i: c.ping(),
            "pull": lambda i: c.pull_kv_blocks(index, dst, [i % nb], [(i * 7 + 3) % nb]),
            "session": lambda i: session.submit([SessionPull(index, dst.cache_id, ((i * 7 + 3) % nb,),
                                                             (i % nb,))])[0].result(_TIMEOUT_S),
            "refused": refused,
        }
        sums = {k: [0, 0, 0, 0] for k in KINDS}  # wall, puller, source, client (ns)
        for kind in KINDS:
            for i in range(_WARM_UPS):
                calls[kind](i)
        for start in range(0, ops, _BLOCK):
            for kind in KINDS:
                call = calls[kind]
                before = (time.perf_counter_ns(), process_cpu_ns(puller), process_cpu_ns(source),
                          time.process_time_ns())
                for i in range(start, min(ops, start + _BLOCK)):
                    call(i)
                after = (time.perf_counter_ns(), process_cpu_ns(puller), process_cpu_ns(source),
                         time.process_time_ns())
                for j in range(4):
                    sums[kind][j] += after[j] - before[j]
        session.close()
    rows = {k: {"wall_us": s[0] / ops / 1e3, "puller_cpu_us": s[1] / ops / 1e3, "source_cpu_us": s[2] / ops / 1e3,
                "client_cpu_us": s[3] / ops / 1e3} for k, s in sums.items()}
    rep.details.setdefault("floor", {})[pair.backend] = {"ops": ops, **rows}
    for kind, row in rows.items():
        log(f"floor {pair.backend} {kind}: wall {row['wall_us']:.0f} us, CPU per op: pulling daemon "
            f"{row['puller_cpu_us']:.0f} us, source daemon {row['source_cpu_us']:.0f} us, client "
            f"{row['client_cpu_us']:.0f} us")


def render_lines(rep: Report) -> list[str]:
    floor: dict[str, Any] = rep.details.get("floor", {})
    if not floor:
        return []
    lines = ["", f"{'per operation (us)':<28s}{'wall':>8s}{'puller CPU':>12s}{'source CPU':>12s}{'client CPU':>12s}"]
    for backend, table in floor.items():
        for kind in KINDS:
            row = table[kind]
            lines.append(f"{backend + ' ' + kind:<28s}{row['wall_us']:8.0f}{row['puller_cpu_us']:12.0f}"
                         f"{row['source_cpu_us']:12.0f}{row['client_cpu_us']:12.0f}")
    lines.append(f"({next(iter(floor.values()))['ops']} operations of each kind after {_WARM_UPS} warm-ups, in turns "
                 f"of {_BLOCK}; CPU from /proc/<pid>/task/*/schedstat and the client's process_time)")
    return lines
