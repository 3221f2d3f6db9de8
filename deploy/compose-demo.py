"""The demo client of deploy/compose.yaml: two running brokers, a real pull between them, every byte verified.

    KVBROKER_A=unix:///run/broker-a/kvbroker.sock KVBROKER_B=unix:///run/broker-b/kvbroker.sock python3 compose-demo.py

Allocates a cache on broker A (the "prefill" side) and fills it, allocates one on broker B ("decode"), links B to A,
pulls scattered blocks of a layer range from A into B, checks the bytes, then cleans up. Needs the same /dev/shm as
both brokers (compose: `ipc: service:broker-a`) because it maps the caches to fill and check them.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import kvbroker
from kvbroker import CacheDesc, CacheIndex, ClusterInfo, DataType, KvCacheExtParam


def wait_ready(target: str, deadline_s: float) -> kvbroker.ClusterStatus:
    end = time.monotonic() + deadline_s
    while True:
        try:
            with kvbroker.Client(target, timeout=2.0) as c:
                return c.get_cluster_info()
        except kvbroker.LlmError:
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


def main() -> int:
    a_target = os.environ.get("KVBROKER_A", "unix:///run/broker-a/kvbroker.sock")
    b_target = os.environ.get("KVBROKER_B", "unix:///run/broker-b/kvbroker.sock")
    layers, blocks = int(os.environ.get("DEMO_LAYERS", "8")), int(os.environ.get("DEMO_BLOCKS", "128"))
    a_info, b_info = wait_ready(a_target, 60), wait_ready(b_target, 60)
    print(f"broker A: cluster {a_info.cluster_id} at {a_info.peer_address}; "
          f"broker B: cluster {b_info.cluster_id} at {b_info.peer_address}")
    desc = CacheDesc(num_tensors=2 * layers, shape=(blocks, 16, 8, 128), data_type=DataType.FLOAT16)
    a_link = ClusterInfo(remote_cluster_id=a_info.cluster_id, remote_address=a_info.peer_address)
    with kvbroker.Client(a_target) as a, kvbroker.Client(b_target) as b:
        src = a.allocate_cache(desc)
        dst = b.allocate_cache(desc)
        try:
            rng = np.random.default_rng(1)
            for t in src.tensors:
                t.view(np.uint8)[:] = rng.integers(0, 256, size=t.view(np.uint8).shape, dtype=np.uint8)
            result = b.link_clusters([a_link], timeout=10.0)[0]
            if not result.ok:
                print(f"link failed: {result.status.name}: {result.message}", file=sys.stderr)
                return 1
            backend = next(lk.backend for lk in b.list_links() if lk.remote_cluster_id == a_info.cluster_id)
            src_blocks = rng.choice(blocks, blocks // 2, replace=False).tolist()
            dst_blocks = rng.choice(blocks, blocks // 2, replace=False).tolist()
            half = layers // 2 - 1
            ext = KvCacheExtParam(src_layer_range=(0, half), dst_layer_range=(layers - 1 - half, layers - 1))
            t0 = time.perf_counter()
            moved = b.pull_kv_blocks(CacheIndex(a_info.cluster_id, src.cache_id), dst, src_blocks, dst_blocks, ext,
                                     timeout=60.0)
            elapsed = time.perf_counter() - t0
            first_dst = 2 * (layers - 1 - half)
            for i in range(2 * (half + 1)):
                want = src.tensors[i].view(np.uint8)[src_blocks]
                if not np.array_equal(dst.tensors[first_dst + i].view(np.uint8)[dst_blocks], want):
                    print(f"tensor {first_dst + i}: pulled bytes differ from the source", file=sys.stderr)
                    return 1
            print(f"pulled {len(src_blocks)} blocks of layers 0..{half} into layers {layers - 1 - half}..{layers - 1} "
                  f"over {backend!r}: {moved.bytes_moved} bytes in {elapsed * 1e3:.1f} ms "
                  f"({moved.bytes_moved / elapsed / 1e9:.2f} GB/s); every byte verified")
            b.unlink_clusters([a_link])
        finally:
            b.deallocate_cache(dst)
            a.deallocate_cache(src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
