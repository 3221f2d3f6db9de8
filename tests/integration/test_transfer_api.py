"""The rest of the transfer surface on every backend: PullKvCache, PushKvBlocks/PushKvCache, CopyKvBlocks,
layer-wise progress, layout-tag compatibility and batched transfers. Every byte is compared against numpy."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvbroker import (
    AsyncClient,
    Cache,
    CacheDesc,
    CacheIndex,
    Client,
    DataType,
    KvCacheExtParam,
    LayerLanded,
    LlmStatus,
    ParamInvalidError,
    PullBlocks,
    PushBlocks,
    TransferResult,
)
from kvbroker._local import LocalDaemon
from tests.helpers import assert_bytes_equal, expected_pull, fill, snapshot

Pair = tuple[LocalDaemon, LocalDaemon]
DESC = CacheDesc(num_tensors=8, shape=(16, 4, 32), data_type=DataType.FLOAT16)  # 4 layers of K,V; 256 B/block


def layer_tensors(r: tuple[int, int], per_layer: int = 2, num_tensors: int = 8) -> range:
    return range(num_tensors) if r == (-1, -1) else range(r[0] * per_layer, (r[1] + 1) * per_layer)


Caches = tuple[Client, Client, Cache, Cache]


@pytest.fixture
def caches(linked_pair: Pair) -> Iterator[Caches]:
    src_d, dst_d = linked_pair
    with src_d.client() as s, dst_d.client() as d:
        src, dst = s.allocate_cache(DESC), d.allocate_cache(DESC)
        fill(src, 1)
        fill(dst, 2)
        yield s, d, src, dst
        s.deallocate_cache(src)
        d.deallocate_cache(dst)


@pytest.mark.parametrize(("src_batch", "dst_batch", "size", "ext"), [
    (3, 5, -1, None),
    (0, 15, 100, None),
    (7, 7, 1, KvCacheExtParam((1, 2), (2, 3))),
    (15, 0, 256, KvCacheExtParam((0, 0), (3, 3), 2)),
])
def test_pull_kv_cache(linked_pair: Pair, caches: Caches, src_batch: int, dst_batch: int, size: int,
                       ext: KvCacheExtParam | None) -> None:
    _s, d, src, dst = caches
    before = snapshot(dst)
    result = d.pull_kv_cache(CacheIndex(linked_pair[0].cluster_id, src.cache_id, batch_index=src_batch), dst,
                             batch_index=dst_batch, size=size, ext_param=ext)
    n = DESC.block_nbytes if size == -1 else size
    ext = ext or KvCacheExtParam()
    src_t, dst_t = layer_tensors(ext.src_layer_range), layer_tensors(ext.dst_layer_range)
    assert result.bytes_moved == n * len(src_t)
    expected = [b.copy() for b in before]
    for st, dt in zip(src_t, dst_t, strict=True):
        expected[dt].reshape(16, -1).view(np.uint8)[dst_batch, :n] = src.tensors[st].reshape(16, -1).view(
            np.uint8)[src_batch, :n]
    assert_bytes_equal(dst.tensors, expected)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"batch_index": 16}, "batch index 16"),
    ({"size": 257}, "size must be"),
    ({"src_batch": 16}, "batch index 16"),
    ({"size": -7}, "size must be"),
])
def test_pull_kv_cache_refusals_write_nothing(linked_pair: Pair, caches: Caches, kwargs: dict[str, int],
                                              match: str) -> None:
    _s, d, src, dst = caches
    before = snapshot(dst)
    kwargs = dict(kwargs)  # parametrised dicts are shared between backends
    src_batch = kwargs.pop("src_batch", 0)
    with pytest.raises(ParamInvalidError, match=match):
        d.pull_kv_cache(CacheIndex(linked_pair[0].cluster_id, src.cache_id, batch_index=src_batch), dst,
                        batch_index=kwargs.get("batch_index", 0), size=kwargs.get("size", -1))
    assert_bytes_equal(dst.tensors, before)


@pytest.mark.parametrize("ext", [None, KvCacheExtParam((0, 1), (2, 3)), KvCacheExtParam((3, 3), (0, 0), 2)])
def test_push_kv_blocks(linked_pair: Pair, caches: Caches, ext: KvCacheExtParam | None) -> None:
    """The destination daemon pushes its cache into the source daemon's cache (the link works both ways)."""
    _s, d, remote_cache, local_cache = caches
    before = snapshot(remote_cache)
    src_blocks, dst_blocks = [0, 1, 2, 9, 4], [15, 3, 4, 5, 0]
    result = d.push_kv_blocks(local_cache, CacheIndex(linked_pair[0].cluster_id, remote_cache.cache_id),
                              src_blocks, dst_blocks, ext)
    e = ext or KvCacheExtParam()
    src_t, dst_t = layer_tensors(e.src_layer_range), layer_tensors(e.dst_layer_range)
    assert result.bytes_moved == len(src_blocks) * DESC.block_nbytes * len(src_t)
    assert_bytes_equal(remote_cache.tensors, expected_pull(local_cache, before, src_blocks, dst_blocks, src_t, dst_t))


@pytest.mark.parametrize(("index_kw", "src", "dst", "ext", "match"), [
    ({"batch_index": 1}, [0], [0], None, "batch_index must be 0"),
    ({}, [0], [16], None, "out of range"),
    ({}, [0, 1], [2, 2], None, "duplicates"),
    ({}, [0], [0], KvCacheExtParam((0, 1), (0, 0)), "spans must be equal"),
    ({}, [], [], None, "empty"),
])
def test_push_refusals_write_nothing(linked_pair: Pair, caches: Caches, index_kw: dict[str, int], src: list[int],
                                     dst: list[int], ext: KvCacheExtParam | None, match: str) -> None:
    _s, d, remote_cache, local_cache = caches
    before = snapshot(remote_cache)
    with pytest.raises(ParamInvalidError, match=match):
        d.push_kv_blocks(local_cache, CacheIndex(linked_pair[0].cluster_id, remote_cache.cache_id, **index_kw),
                         src, dst, ext)
    assert_bytes_equal(remote_cache.tensors, before)


def test_push_kv_cache(linked_pair: Pair, caches: Caches) -> None:
    _s, d, remote_cache, local_cache = caches
    before = snapshot(remote_cache)
    d.push_kv_cache(local_cache, CacheIndex(linked_pair[0].cluster_id, remote_cache.cache_id, batch_index=9),
                    src_batch_index=2, size=64)
    expected = [b.copy() for b in before]
    for t in range(8):
        expected[t].reshape(16, -1).view(np.uint8)[9, :64] = local_cache.tensors[t].reshape(16, -1).view(
            np.uint8)[2, :64]
    assert_bytes_equal(remote_cache.tensors, expected)


def test_copy_kv_blocks_one_source_to_several_lists(linked_pair: Pair, caches: Caches) -> None:
    _s, d, _, cache = caches
    other = d.allocate_cache(DESC)
    try:
        before_self, before_other = snapshot(cache), snapshot(other)
        # Within one cache: fork blocks 0-1 into 8-9 and 12-13 (prefix sharing).
        result = d.copy_kv_blocks(cache, cache, [0, 1], [[8, 9], [12, 13]])
        assert result.backend == "local" and result.bytes_moved == 2 * 2 * 8 * DESC.block_nbytes
        expected = expected_pull(cache, before_self, [0, 1], [8, 9], range(8), range(8))
        expected = expected_pull(cache, expected, [0, 1], [12, 13], range(8), range(8))
        assert_bytes_equal(cache.tensors, expected)
        # Across caches.
        d.copy_kv_blocks(cache, other, [3, 5, 7], [[0, 1, 2]])
        assert_bytes_equal(other.tensors, expected_pull(cache, before_other, [3, 5, 7], [0, 1, 2], range(8),
                                                        range(8)))
    finally:
        d.deallocate_cache(other)


@pytest.mark.parametrize(("src", "dst_lists", "match"), [
    ([0, 1], [[1, 2]], "also a source block"),
    ([0], [[5], [5]], "more than one"),
    ([0, 1], [[5]], "entries"),
    ([0], [], "empty"),
    ([0], [[16]], "out of range"),
])
def test_copy_refusals_write_nothing(caches: Caches, src: list[int], dst_lists: list[list[int]], match: str) -> None:
    _s, d, _, cache = caches
    before = snapshot(cache)
    with pytest.raises(ParamInvalidError, match=match):
        d.copy_kv_blocks(cache, cache, src, dst_lists)
    assert_bytes_equal(cache.tensors, before)


def test_layout_tags_must_match(linked_pair: Pair) -> None:
    src_d, dst_d = linked_pair
    tagged = CacheDesc(num_tensors=2, shape=(4, 8), layout_tag="llama-8b/bf16/tp0")
    other = CacheDesc(num_tensors=2, shape=(4, 8), layout_tag="llama-8b/bf16/tp1")
    with src_d.client() as s, dst_d.client() as d:
        src, dst, same = s.allocate_cache(tagged), d.allocate_cache(other), d.allocate_cache(tagged)
        try:
            before = snapshot(dst)
            with pytest.raises(ParamInvalidError) as info:
                d.pull_kv_blocks(CacheIndex(src_d.cluster_id, src.cache_id), dst, [0], [0])
            assert "llama-8b/bf16/tp0" in info.value.message and "llama-8b/bf16/tp1" in info.value.message
            assert_bytes_equal(dst.tensors, before)
            with pytest.raises(ParamInvalidError):
                d.push_kv_blocks(dst, CacheIndex(src_d.cluster_id, src.cache_id), [0], [0])
            d.pull_kv_blocks(CacheIndex(src_d.cluster_id, src.cache_id), same, [0], [0])
        finally:
            s.deallocate_cache(src)
            d.deallocate_cache(dst)
            d.deallocate_cache(same)


def test_layer_wise_progress_sync_callback(linked_pair: Pair, caches: Caches) -> None:
    _s, d, src, dst = caches
    before = snapshot(dst)
    landed: list[LayerLanded] = []
    ext = KvCacheExtParam((0, 2), (1, 3))
    result = d.pull_kv_blocks(CacheIndex(linked_pair[0].cluster_id, src.cache_id), dst, [0, 5, 6], [1, 2, 3], ext,
                              on_layer=landed.append)
    assert [x.layer for x in landed] == [1, 2, 3]
    assert all(x.layer_bytes == 3 * DESC.block_nbytes * 2 for x in landed)
    assert result.bytes_moved == sum(x.layer_bytes for x in landed)
    assert_bytes_equal(dst.tensors, expected_pull(src, before, [0, 5, 6], [1, 2, 3], range(0, 6), range(2, 8)))


async def test_layer_wise_progress_async_iterator(linked_pair: Pair, caches: Caches) -> None:
    _s, _, src, dst = caches
    before = snapshot(dst)
    items: list[LayerLanded | TransferResult] = []
    async with AsyncClient(linked_pair[1].target) as d:
        async for item in d.pull_kv_blocks_stream(CacheIndex(linked_pair[0].cluster_id, src.cache_id), dst.cache_id,
                                                  list(range(16)), list(range(15, -1, -1))):
            # Each reported layer's bytes are already in place when it is reported.
            if isinstance(item, LayerLanded):
                for t in (2 * item.layer, 2 * item.layer + 1):
                    assert np.array_equal(dst.tensors[t][::-1].view(np.uint8), src.tensors[t].view(np.uint8))
            items.append(item)
    assert [i.layer for i in items[:-1] if isinstance(i, LayerLanded)] == [0, 1, 2, 3]
    assert isinstance(items[-1], TransferResult)
    assert_bytes_equal(dst.tensors, expected_pull(src, before, list(range(16)), list(range(15, -1, -1)), range(8),
                                                  range(8)))


def test_stream_refusal_is_an_error_before_any_layer(linked_pair: Pair, caches: Caches) -> None:
    _s, d, src, dst = caches
    before = snapshot(dst)
    landed: list[LayerLanded] = []
    with pytest.raises(ParamInvalidError):
        d.pull_kv_blocks(CacheIndex(linked_pair[0].cluster_id, src.cache_id), dst, [0], [99], on_layer=landed.append)
    assert landed == []
    assert_bytes_equal(dst.tensors, before)


def test_batched_k_and_v_caches(linked_pair: Pair) -> None:
    """K and V registered as two caches each side, pulled (and pushed) in one transfer."""
    src_d, dst_d = linked_pair
    desc = CacheDesc(num_tensors=4, shape=(8, 64), data_type=DataType.BFLOAT16)
    with src_d.client() as s, dst_d.client() as d:
        k_src, v_src, k_dst, v_dst = s.allocate_cache(desc), s.allocate_cache(desc), d.allocate_cache(desc), \
            d.allocate_cache(desc)
        try:
            for i, c in enumerate((k_src, v_src, k_dst, v_dst)):
                fill(c, 10 + i)
            k_before, v_before, remote_before = snapshot(k_dst), snapshot(v_dst), snapshot(v_src)
            cid = src_d.cluster_id
            result = d.transfer_kv_blocks_batch([
                PullBlocks(CacheIndex(cid, k_src.cache_id), k_dst.cache_id, (0, 1, 2), (5, 6, 7)),
                PullBlocks(CacheIndex(cid, v_src.cache_id), v_dst.cache_id, (0, 1, 2), (5, 6, 7)),
                PushBlocks(k_dst.cache_id, CacheIndex(cid, v_src.cache_id), (0,), (7,)),
            ])
            assert result.bytes_moved == (3 + 3 + 1) * 4 * desc.block_nbytes
            assert_bytes_equal(k_dst.tensors, expected_pull(k_src, k_before, [0, 1, 2], [5, 6, 7], range(4), range(4)))
            assert_bytes_equal(v_dst.tensors, expected_pull(v_src, v_before, [0, 1, 2], [5, 6, 7], range(4), range(4)))
            pushed = expected_pull(k_dst, remote_before, [0], [7], range(4), range(4))
            assert_bytes_equal(v_src.tensors, pushed)
            # One bad group refuses the whole batch before any byte moves.
            k_now, v_now = snapshot(k_dst), snapshot(v_dst)
            with pytest.raises(ParamInvalidError) as info:
                d.transfer_kv_blocks_batch([
                    PullBlocks(CacheIndex(cid, k_src.cache_id), k_dst.cache_id, (0,), (1,)),
                    PullBlocks(CacheIndex(cid, v_src.cache_id), v_dst.cache_id, (0,), (8,)),
                ])
            assert info.value.details["group"] == "1" and info.value.status == LlmStatus.LLM_PARAM_INVALID
            assert_bytes_equal(k_dst.tensors, k_now)
            assert_bytes_equal(v_dst.tensors, v_now)
        finally:
            for c in (k_src, v_src):
                s.deallocate_cache(c)
            for c in (k_dst, v_dst):
                d.deallocate_cache(c)
