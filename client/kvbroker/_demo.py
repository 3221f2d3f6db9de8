"""`kvbroker demo`: two local daemons, a real layer-range pull of scattered blocks, every byte verified."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvbroker._local import LocalDaemon
from kvbroker.types import CacheDesc, CacheIndex, ClusterInfo, DataType, KvCacheExtParam


def fill_pattern(tensors: list[np.ndarray], seed: int) -> None:
    """Distinct bytes per tensor and block, so that a misplaced block cannot go unnoticed."""
    rng = np.random.default_rng(seed)
    for t in tensors:
        flat = t.reshape(-1).view(np.uint8)
        flat[:] = rng.integers(0, 256, size=flat.size, dtype=np.uint8)


def run_demo(layers: int = 8, blocks: int = 256, block_tokens: int = 16, kv_heads: int = 8, head_dim: int = 128,
             backends: tuple[str, ...] | None = None, out: Callable[[str], None] = print) -> dict[str, float]:
    desc = CacheDesc(num_tensors=2 * layers, shape=(blocks, block_tokens, kv_heads, head_dim),
                     data_type=DataType.FLOAT16)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvbroker-demo-") as tmp:
        prefill = LocalDaemon(Path(tmp), 1, backends=backends)
        decode = LocalDaemon(Path(tmp), 2, backends=backends)
        with prefill, decode, prefill.client() as p, decode.client() as d:
            out(f"started prefill daemon (cluster 1, {prefill.peer_address}) and decode daemon (cluster 2, "
                f"{decode.peer_address})")
            src = p.allocate_cache(desc)
            dst = d.allocate_cache(desc)
            out(f"allocated two caches: {desc.num_tensors} tensors (K,V x {layers} layers) of "
                f"{list(desc.shape)} fp16, {desc.tensor_nbytes * desc.num_tensors / 2**20:.0f} MiB each")
            fill_pattern(src.tensors, seed=1)
            link = d.link_clusters([ClusterInfo(remote_cluster_id=1, remote_address=prefill.peer_address)])[0]
            if not link.ok:
                raise RuntimeError(f"link failed: {link.status.name}: {link.message}")
            backend = d.list_links()[0].backend
            rng = np.random.default_rng(7)
            n = blocks // 2
            src_blocks = np.sort(rng.choice(blocks, n, replace=False)).tolist()
            dst_blocks = rng.choice(blocks, n, replace=False).tolist()
            half = layers // 2 - 1
            ext = KvCacheExtParam(src_layer_range=(0, half), dst_layer_range=(layers - 1 - half, layers - 1))
            # An untimed first pull of everything maps the fresh memory in both daemons (page faults), as a
            # serving system's would be long before; then new source bytes, so the timed pull is checked for real.
            d.pull_kv_blocks(CacheIndex(cluster_id=1, cache_id=src.cache_id), dst, range(blocks), range(blocks))
            fill_pattern(src.tensors, seed=2)
            before = [t.copy() for t in dst.tensors]
            t0 = time.perf_counter()
            result = d.pull_kv_blocks(CacheIndex(cluster_id=1, cache_id=src.cache_id), dst, src_blocks, dst_blocks,
                                      ext)
            elapsed = time.perf_counter() - t0
            first_dst = 2 * (layers - 1 - half)
            for i in range(2 * (half + 1)):
                expect = before[first_dst + i].copy()
                expect[dst_blocks] = src.tensors[i][src_blocks]
                if not np.array_equal(dst.tensors[first_dst + i].view(np.uint8), expect.view(np.uint8)):
                    raise AssertionError(f"tensor {first_dst + i} differs from the expected bytes")
            for j in range(first_dst):
                if not np.array_equal(dst.tensors[j].view(np.uint8), before[j].view(np.uint8)):
                    raise AssertionError(f"tensor {j} outside the layer range was modified")
            gbps = result.bytes_moved / elapsed / 1e9
            out(f"pulled {n} scattered blocks of layers 0..{half} into layers {layers - 1 - half}..{layers - 1} over "
                f"'{backend}': {result.bytes_moved / 2**20:.1f} MiB in {result.num_runs} runs, "
                f"{elapsed * 1e3:.1f} ms ({gbps:.2f} GB/s)")
            out("verified every byte: pulled blocks equal the source, all other bytes unchanged")
            d.unlink_clusters([ClusterInfo(remote_cluster_id=1, remote_address=prefill.peer_address)])
            p.deallocate_cache(src)
            d.deallocate_cache(dst)
            results = {"bytes": float(result.bytes_moved), "seconds": elapsed, "gbps": gbps}
    out("stopped both daemons; no socket or shared-memory segment left behind")
    return results
