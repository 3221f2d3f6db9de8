"""PullKvBlocks between two real daemons, on every backend: every byte compared against an independent model."""

from __future__ import annotations

import numpy as np
import pytest

from kvbroker import CacheDesc, CacheIndex, DataType, KvCacheExtParam
from kvbroker._local import LocalDaemon
from tests.helpers import assert_bytes_equal, expected_pull, fill, snapshot

Pair = tuple[LocalDaemon, LocalDaemon]

SHAPES = [
    (DataType.FLOAT16, (32, 16, 4, 8)),
    (DataType.BFLOAT16, (16, 8, 2, 64)),
    (DataType.FLOAT32, (24, 3, 5)),
    (DataType.INT8, (8, 1)),
    (DataType.INT64, (40, 2, 2)),
    (DataType.FLOAT8_E4M3FN, (12, 16, 32)),
    (DataType.UINT8, (5,)),
]


@pytest.mark.parametrize(("dtype", "shape"), SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "scattered"])
def test_pull_every_dtype_and_shape(linked_pair: Pair, dtype: DataType, shape: tuple[int, ...], layout: str) -> None:
    src_d, dst_d = linked_pair
    desc = CacheDesc(num_tensors=4, shape=shape, data_type=dtype)
    rng = np.random.default_rng(hash((dtype, shape, layout)) % 2**32)
    with src_d.client() as s, dst_d.client() as d:
        src, dst = s.allocate_cache(desc), d.allocate_cache(desc)
        try:
            fill(src, 1)
            fill(dst, 2)
            before = snapshot(dst)
            n = max(1, shape[0] // 2)
            if layout == "contiguous":
                src_blocks, dst_blocks = list(range(n)), list(range(shape[0] - n, shape[0]))
            else:
                src_blocks = rng.choice(shape[0], n, replace=True).tolist()
                dst_blocks = rng.choice(shape[0], n, replace=False).tolist()
            result = d.pull_kv_blocks(CacheIndex(src_d.cluster_id, src.cache_id), dst, src_blocks, dst_blocks)
            assert result.bytes_moved == n * desc.block_nbytes * 4
            assert result.backend in ("shm", "tcp", "nixl")
            if layout == "contiguous":
                assert result.num_runs == 4
            assert_bytes_equal(dst.tensors, expected_pull(src, before, src_blocks, dst_blocks, range(4), range(4)))
        finally:
            s.deallocate_cache(src)
            d.deallocate_cache(dst)


LAYER_CASES = [
    # (num_tensors, tensor_num_per_layer, src range, dst range)
    (8, 2, (-1, -1), (-1, -1)),
    (8, 2, (0, 0), (3, 3)),
    (8, 2, (1, 2), (0, 1)),
    (8, 1, (5, 7), (0, 2)),
    (8, 4, (1, 1), (0, 0)),
    (8, 4, (0, 1), (0, 1)),
    (6, 1, (0, 5), (0, 5)),
    (6, 2, (2, 2), (2, 2)),
]


@pytest.mark.parametrize(("num_tensors", "per_layer", "src_range", "dst_range"), LAYER_CASES)
def test_pull_layer_ranges(linked_pair: Pair, num_tensors: int, per_layer: int, src_range: tuple[int, int],
                           dst_range: tuple[int, int]) -> None:
    src_d, dst_d = linked_pair
    desc = CacheDesc(num_tensors=num_tensors, shape=(16, 4, 8), data_type=DataType.FLOAT16)
    ext = KvCacheExtParam(src_layer_range=src_range, dst_layer_range=dst_range, tensor_num_per_layer=per_layer)
    with src_d.client() as s, dst_d.client() as d:
        src, dst = s.allocate_cache(desc), d.allocate_cache(desc)
        try:
            fill(src, 3)
            before = snapshot(dst)
            src_blocks, dst_blocks = [3, 4, 5, 9, 0], [1, 2, 3, 15, 7]
            d.pull_kv_blocks(CacheIndex(src_d.cluster_id, src.cache_id), dst, src_blocks, dst_blocks, ext)

            def tensors(r: tuple[int, int]) -> range:
                return range(num_tensors) if r == (-1, -1) else range(r[0] * per_layer, (r[1] + 1) * per_layer)

            expected = expected_pull(src, before, src_blocks, dst_blocks, tensors(src_range), tensors(dst_range))
            assert_bytes_equal(dst.tensors, expected)
        finally:
            s.deallocate_cache(src)
            d.deallocate_cache(dst)


def test_large_scattered_pull_many_runs(linked_pair: Pair) -> None:
    """Enough data (48 MiB) to use several data connections / copy threads, with thousands of runs."""
    src_d, dst_d = linked_pair
    desc = CacheDesc(num_tensors=8, shape=(2048, 16, 2, 64), data_type=DataType.BFLOAT16)
    rng = np.random.default_rng(11)
    with src_d.client() as s, dst_d.client() as d:
        src, dst = s.allocate_cache(desc), d.allocate_cache(desc)
        try:
            fill(src, 4)
            before = snapshot(dst)
            src_blocks = rng.permutation(2048)[:1536].tolist()
            dst_blocks = rng.permutation(2048)[:1536].tolist()
            result = d.pull_kv_blocks(CacheIndex(src_d.cluster_id, src.cache_id), dst, src_blocks, dst_blocks)
            assert result.bytes_moved == 1536 * desc.block_nbytes * 8
            assert_bytes_equal(dst.tensors, expected_pull(src, before, src_blocks, dst_blocks, range(8), range(8)))
        finally:
            s.deallocate_cache(src)
            d.deallocate_cache(dst)


async def test_async_client_concurrent_pulls_into_disjoint_blocks(linked_pair: Pair) -> None:
    import asyncio

    from kvbroker import AsyncClient

    src_d, dst_d = linked_pair
    desc = CacheDesc(num_tensors=2, shape=(256, 32, 64), data_type=DataType.FLOAT16)
    async with AsyncClient(src_d.target) as s, AsyncClient(dst_d.target) as d:
        src, dst = await s.allocate_cache(desc), await d.allocate_cache(desc)
        try:
            fill(src, 5)
            before = snapshot(dst)
            rng = np.random.default_rng(5)
            dst_perm = rng.permutation(256)
            jobs = [(rng.choice(256, 16).tolist(), dst_perm[i * 16 : (i + 1) * 16].tolist()) for i in range(16)]
            results = await asyncio.gather(*(
                d.pull_kv_blocks(CacheIndex(src_d.cluster_id, src.cache_id), dst, sb, db) for sb, db in jobs))
            assert all(r.bytes_moved == 16 * desc.block_nbytes * 2 for r in results)
            expected = before
            for sb, db in jobs:
                expected = expected_pull(src, expected, sb, db, range(2), range(2))
            assert_bytes_equal(dst.tensors, expected)
        finally:
            await s.deallocate_cache(src)
            await d.deallocate_cache(dst)


async def test_many_concurrent_large_pulls_all_finish(linked_pair: Pair) -> None:
    """More concurrent large pulls than worker threads, each split into parts: none may starve (this once timed
    out, each transfer holding a worker while its parts waited behind the others)."""
    import asyncio

    from kvbroker import AsyncClient

    src_d, dst_d = linked_pair
    desc = CacheDesc(num_tensors=2, shape=(512, 256 << 10), data_type=DataType.UINT8)  # 256 MiB per cache
    async with AsyncClient(src_d.target) as s, AsyncClient(dst_d.target, timeout=60) as d:
        src, dst = await s.allocate_cache(desc), await d.allocate_cache(desc)
        try:
            fill(src, 6)
            groups = np.array_split(np.random.default_rng(3).permutation(512), 24)
            results = await asyncio.gather(*(
                d.pull_kv_blocks(CacheIndex(src_d.cluster_id, src.cache_id), dst, g.tolist(), g.tolist())
                for g in groups))
            assert sum(r.bytes_moved for r in results) == 512 * (256 << 10) * 2
            assert_bytes_equal(dst.tensors, [t.copy() for t in src.tensors])
        finally:
            await s.deallocate_cache(src)
            await d.deallocate_cache(dst)
