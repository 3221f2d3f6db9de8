"""Throughput of `tcp` pulls with and without `--data-tls` (docs/benchmarks-history.md, "Cost of --data-tls").

    .venv/bin/python bench/tls_cost.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.tlsgen (certificates made at run time)

from kvbroker import CacheDesc, CacheIndex, ClusterInfo, DataType
from kvbroker._local import LocalDaemon
from tests.tlsgen import Ca

DESC = CacheDesc(num_tensors=8, shape=(128, 256 << 10), data_type=DataType.UINT8)  # 256 MiB, 256 KiB blocks
TRIALS = 4


def measure(workdir: Path, ca: Ca, data_tls: bool) -> float:
    flags = [ca.flags(f"{workdir.name}-{side}", data_tls) for side in ("a", "b")]
    with LocalDaemon(workdir, 1, backends=("tcp",), extra_args=flags[0]) as a, \
            LocalDaemon(workdir, 2, backends=("tcp",), extra_args=flags[1]) as b, \
            a.client() as src_client, b.client(timeout=120) as dst_client:
        src, dst = src_client.allocate_cache(DESC), dst_client.allocate_cache(DESC)
        for tensor in src.tensors:
            tensor[...] = 1
        assert dst_client.link_clusters([ClusterInfo(1, a.peer_address)])[0].ok
        rng = np.random.default_rng(0)
        src_blocks, dst_blocks = rng.permutation(128).tolist(), rng.permutation(128).tolist()
        index = CacheIndex(1, src.cache_id)
        dst_client.pull_kv_blocks(index, dst, src_blocks, dst_blocks)  # warm-up: connections, page faults
        best = float("inf")
        moved = 0
        for _ in range(TRIALS):
            t0 = time.perf_counter()
            moved = dst_client.pull_kv_blocks(index, dst, src_blocks, dst_blocks).bytes_moved
            best = min(best, time.perf_counter() - t0)
        return moved / best / 1e9


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvbroker-tls-cost-") as tmp:
        root = Path(tmp)
        ca = Ca(root, "bench")
        results = {}
        for name, data_tls in (("tcp", False), ("tcp+data-tls", True)):
            (root / name).mkdir()
            results[name] = measure(root / name, ca, data_tls)
    for name, gbps in results.items():
        print(f"{name:14s} {gbps:6.2f} GB/s")
    print(f"ratio          {results['tcp+data-tls'] / results['tcp']:6.2f}")


if __name__ == "__main__":
    main()
