"""What a pull by grant costs over a plain pull, and what a renewed grant wins back (links/grantcache.py).

    PYTHONPATH=$PWD/client:$PWD/server .venv/bin/python bench/grant_pull.py [--backends shm,tcp] [--pulls 60] [--json]

Two local daemons per backend (prefill and decode, linked); the same scattered blocks (--blocks blocks of --block-kib
KiB, every other block of the prefill cache: one run each; default 64 x 64 KiB = 4 MiB in 64 runs) pulled --pulls
times, after one untimed warm-up, in three ways, alternating pull by pull so that load drifts hit all three alike:
  plain     PullKvBlocks naming the prefill cache and blocks
  grant     pull_granted_kv_blocks of a grant never renewed through the decode daemon: it redeems every time
            (Peer.RedeemGrant, one more peer round trip)
  renewed   the same, after a renewal through the decode daemon (as the vLLM connector's GrantKeeper does while the
            request waits): the decode daemon pulls on the renewal's answer, without the round trip
Prints the median and p90 of each, in ms, and how many RedeemGrant calls the prefill daemon answered per way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvbroker import CacheDesc, CacheIndex, ClusterInfo, DataType
from kvbroker._client import Client
from kvbroker._local import LocalDaemon

PULL_TIMEOUT_S = 10.0
LEASE_S = 120.0


def _redeemed(client: Client) -> float:
    with urllib.request.urlopen(f"http://{client.get_cluster_info().metrics_address}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("kvbroker_grants_redeemed_total "):
                return float(line.split()[1])
    return 0.0


def run(backend: str, blocks: int, block_kib: int, pulls: int, workdir: Path) -> dict[str, object]:
    desc = CacheDesc(num_tensors=1, shape=(2 * blocks, block_kib * 1024), data_type=DataType.UINT8)
    src_blocks = list(range(0, 2 * blocks, 2))  # every other block: one run each
    dst_blocks = list(range(blocks))
    metrics = ["--metrics-listen", "127.0.0.1:0"]
    with LocalDaemon(workdir, 1, backends=(backend,), extra_args=metrics) as p, \
            LocalDaemon(workdir, 2, backends=(backend,), extra_args=metrics) as d, \
            p.client() as pc, d.client(timeout=PULL_TIMEOUT_S) as dc:
        assert dc.link_clusters([ClusterInfo(remote_cluster_id=1, remote_address=p.peer_address)])[0].ok
        src, dst = pc.allocate_cache(desc), dc.allocate_cache(desc)
        plain_grant = pc.create_grant([src.cache_id], src_blocks, LEASE_S)
        renewed_grant = pc.create_grant([src.cache_id], src_blocks, LEASE_S)
        dc.renew_grant(renewed_grant, cluster_id=1)

        ways = {
            "plain": lambda: dc.pull_kv_blocks(CacheIndex(1, src.cache_id), dst, src_blocks, dst_blocks),
            "grant": lambda: dc.pull_granted_kv_blocks(1, plain_grant, dst, dst_blocks),
            "renewed": lambda: dc.pull_granted_kv_blocks(1, renewed_grant, dst, dst_blocks),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        redeems: dict[str, float] = dict.fromkeys(ways, 0.0)
        for pull in ways.values():
            pull()  # warm-up: link lookups, mappings, connections
        for _ in range(pulls):
            for name, pull in ways.items():
                before = _redeemed(pc)
                start = time.perf_counter()
                result = pull()
                times[name].append((time.perf_counter() - start) * 1000)
                redeems[name] += _redeemed(pc) - before
                assert result.bytes_moved == blocks * block_kib * 1024
        out: dict[str, object] = {"backend": backend, "bytes": blocks * block_kib * 1024, "runs": blocks,
                                  "pulls": pulls}
        for name, ms in times.items():
            out[name] = {"p50_ms": round(statistics.median(ms), 3),
                         "p90_ms": round(statistics.quantiles(ms, n=10)[-1], 3), "redeems": int(redeems[name])}
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="shm,tcp")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--pulls", type=int, default=60)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="grant-pull-") as tmp:
        for backend in args.backends.split(","):
            results.append(run(backend, args.blocks, args.block_kib, args.pulls, Path(tmp) / backend))
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
        return 0
    for r in results:
        print(f"{r['backend']}: {r['bytes']} bytes in {r['runs']} runs, {r['pulls']} pulls each")
        for name in ("plain", "grant", "renewed"):
            w = r[name]
            assert isinstance(w, dict)
            print(f"  {name:8s} p50 {w['p50_ms']:7.3f} ms  p90 {w['p90_ms']:7.3f} ms  RedeemGrant calls {w['redeems']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
