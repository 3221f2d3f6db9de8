"""The homogeneous pull of bench/vllm_hetero.py (TP 1, blocks of 32 -> TP 1, blocks of 32: 32 MiB at the defaults),
an older tree's daemons against this tree's, in one process: both pairs of daemons up, pulls alternating
old/new/new/old, so that both see the same moments of a noisy machine. Prints the medians and new/old.

    git archive <commit> | (mkdir -p /tmp/kvb-old && tar -x -C /tmp/kvb-old)   # plus its _safecopy build
    PYTHONPATH=client:server python bench/homogeneous_ab.py --before /tmp/kvb-old [--rounds 60]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vllm_hetero import layout  # (bench/ is the script's own directory: first on sys.path)

from kvbroker import ClusterInfo, Grant, KvCacheExtParam
from kvbroker._local import LocalDaemon
from kvbroker._session import PullSession
from kvbroker.integrations.vllm.remap import UnitPull, plan_pull
from kvbroker.types import CacheIndex, SessionPull

HERE = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the older tree (its client/ and server/ are used)")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args()
    tokens = args.tokens
    same = layout(1, 32, tokens // 32 + 2, args.layers, args.heads)
    ext = KvCacheExtParam(tensor_num_per_layer=1)
    blocks = list(range(1, tokens // 32 + 1))
    plan = plan_pull(same, 0, same, blocks, blocks, 0, tokens)
    pulls: dict[str, Callable[[], float]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        for n, (name, tree) in enumerate((("old", Path(args.before).resolve()), ("new", HERE))):
            os.environ["PYTHONPATH"] = f"{tree}/client:{tree}/server"  # the daemons run that tree's sources
            p_daemon = stack.enter_context(LocalDaemon(Path(tmp) / name, 71 + 2 * n, backends=("shm",)))
            d_daemon = stack.enter_context(LocalDaemon(Path(tmp) / name, 72 + 2 * n, backends=("shm",)))
            p, d = stack.enter_context(p_daemon.client()), stack.enter_context(d_daemon.client(timeout=60))
            d.link_clusters([ClusterInfo(p_daemon.cluster_id, p_daemon.peer_address)], timeout=10)
            src, dst = p.allocate_cache(same.desc()), d.allocate_cache(same.desc())
            grant = p.create_grant([src.cache_id], blocks, 600.0, units_per_block=same.grant_units)
            d.renew_grant(grant, 600.0, cluster_id=p_daemon.cluster_id)
            pulls[name] = _puller(d.open_pull_session(), p_daemon.cluster_id, dst.cache_id, grant, plan, ext)
        times: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(args.rounds + 2):
            for name in ("old", "new", "new", "old") if i % 2 else ("new", "old", "old", "new"):
                took = pulls[name]()
                if i >= 2:  # two warm-up rounds
                    times[name].append(took)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"load {os.getloadavg()[0]:.1f}: homogeneous pull ms, median of {len(times['new'])}: old "
              f"{med['old']:.2f}, new {med['new']:.2f}, new/old {med['new'] / med['old']:.3f}")


def _puller(session: PullSession, cluster: int, target: int, grant: Grant, plan: list[UnitPull],
            ext: KvCacheExtParam) -> Callable[[], float]:
    """One pull as the connector's worker makes it (its runs, by the renewed grant, in one session message)."""
    def pull() -> float:
        started = time.perf_counter()
        for f in session.submit([SessionPull(CacheIndex(cluster, 0), target, (), (), ext, grant, one.remote_rank,
                                             block_runs=one.runs) for one in plan]):
            f.result(timeout=60)
        return time.perf_counter() - started

    return pull


if __name__ == "__main__":
    main()
