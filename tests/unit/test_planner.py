"""The planner: block-run coalescing, layer selection, and its refusals (LLM_PARAM_INVALID)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker import CacheDesc, DataType, LlmStatus, ParamInvalidError, blockruns
from kvbrokerd.dataplane.pairs import BlockPairs, block_array, coalesce
from kvbrokerd.dataplane.plan import Progress
from kvbrokerd.transfers.planner import LayerSelection, plan_blocks, plan_pairs, side_by_side

DESC = CacheDesc(num_tensors=4, shape=(16, 8), data_type=DataType.FLOAT16)  # 16 bytes per block


def arr(xs: list[int]) -> np.ndarray:
    return np.asarray(xs, dtype=np.uint64)


def test_coalesce_merges_runs_that_advance_together() -> None:
    s, d, n = coalesce(arr([0, 1, 2, 7, 8, 3]), arr([5, 6, 7, 1, 2, 9]))
    assert s.tolist() == [0, 7, 3] and d.tolist() == [5, 1, 9] and n.tolist() == [3, 2, 1]


def test_coalesce_splits_when_only_one_side_is_contiguous() -> None:
    s, d, n = coalesce(arr([0, 1, 2]), arr([4, 6, 7]))
    assert s.tolist() == [0, 1] and d.tolist() == [4, 6] and n.tolist() == [1, 2]


def test_plan_bytes_and_tensor_pairs() -> None:
    plan = plan_blocks(DESC, DESC, arr([2, 3]), arr([10, 11]), LayerSelection((1, 1), (0, 0), 2))
    assert plan.src_tensor.tolist() == [2, 3] and plan.dst_tensor.tolist() == [0, 1]
    assert plan.src_offset.tolist() == [32, 32] and plan.dst_offset.tolist() == [160, 160]
    assert plan.length.tolist() == [32, 32] and plan.total_bytes == 64


@pytest.mark.parametrize(("src", "dst", "layers", "match"), [
    ([], [], LayerSelection(), "empty"),
    ([1], [1, 2], LayerSelection(), "entries"),
    ([16], [0], LayerSelection(), "out of range"),
    ([0], [16], LayerSelection(), "out of range"),
    ([0, 1], [3, 3], LayerSelection(), "duplicates"),
    ([0], [0], LayerSelection((0, -1), (0, 0), 2), "-1"),
    ([0], [0], LayerSelection((1, 0), (1, 0), 2), "first must be <= second"),
    ([0], [0], LayerSelection((0, 2), (0, 2), 2), "exceeds"),
    ([0], [0], LayerSelection((0, 0), (0, 0), 3), "does not divide"),
    ([0], [0], LayerSelection((0, 0), (0, 0), 5), "tensor_num_per_layer"),
    ([0], [0], LayerSelection((0, 0), (0, 1), 2), "spans must be equal"),
])
def test_refusals(src: list[int], dst: list[int], layers: LayerSelection, match: str) -> None:
    with pytest.raises(ParamInvalidError, match=match) as info:
        plan_blocks(DESC, DESC, arr(src), arr(dst), layers)
    assert info.value.status == LlmStatus.LLM_PARAM_INVALID


def test_bytes_per_block_and_tensor_count_must_match() -> None:
    other = CacheDesc(num_tensors=4, shape=(16, 4), data_type=DataType.FLOAT32)
    assert plan_blocks(DESC, other, arr([0]), arr([0]), LayerSelection()).total_bytes == 64  # same bytes per block
    with pytest.raises(ParamInvalidError, match="bytes per block"):
        plan_blocks(DESC, CacheDesc(4, (16, 9)), arr([0]), arr([0]), LayerSelection())
    with pytest.raises(ParamInvalidError, match="tensors"):
        plan_blocks(DESC, CacheDesc(2, (16, 8)), arr([0]), arr([0]), LayerSelection())


def test_block_array_refuses_negative_and_overflowing() -> None:
    with pytest.raises(ParamInvalidError):
        block_array([-1], "src_blocks")
    with pytest.raises(ParamInvalidError):
        block_array([2**64], "src_blocks")
    assert block_array([2**64 - 1], "src_blocks").tolist() == [2**64 - 1]


def test_progress_reports_blocks_of_incomplete_runs() -> None:
    plan = plan_blocks(DESC, DESC, arr([0, 1, 2, 9]), arr([4, 5, 6, 1]), LayerSelection((0, 0), (1, 1), 2))
    # runs: tensor pair (0->2): blocks 4-6, block 1; tensor pair (1->3): blocks 4-6, block 1
    progress = Progress(plan)
    assert progress.failed_dst_blocks().tolist() == [1, 4, 5, 6]
    progress.mark(0, 48)  # first run whole (3 blocks x 16 bytes)
    progress.mark(1, 16)
    progress.mark(2, 16)  # third run only a third
    assert progress.failed_dst_blocks().tolist() == [1, 4, 5, 6]
    progress.mark(2, 32)
    progress.mark(3, 16)
    assert progress.failed_dst_blocks().tolist() == []
    assert progress.bytes_moved == plan.total_bytes == 128


def test_plan_for_80_layers_4096_scattered_blocks() -> None:
    """Runs are tensor pairs x coalesced block runs (its speed is measured in bench/, not here)."""
    desc = CacheDesc(num_tensors=160, shape=(8192, 16, 8, 128), data_type=DataType.FLOAT16)
    rng = np.random.default_rng(0)
    src = rng.permutation(8192)[:4096].astype(np.uint64)
    dst = rng.permutation(8192)[:4096].astype(np.uint64)
    plan = plan_blocks(desc, desc, src, dst, LayerSelection())
    assert plan.num_runs == 160 * len(coalesce(src, dst)[2])


def test_only_small_plans_with_few_runs_run_on_the_event_loop() -> None:
    from kvbrokerd.backends.common.memcopy import small_enough_for_the_loop

    tiny = CacheDesc(num_tensors=2, shape=(200_000, 1), data_type=DataType.UINT8)
    many = np.random.default_rng(0).permutation(200_000).astype(np.uint64)
    assert not small_enough_for_the_loop(plan_blocks(tiny, tiny, many, many[::-1].copy(), LayerSelection()))
    assert small_enough_for_the_loop(plan_blocks(DESC, DESC, arr([0, 1]), arr([2, 3]), LayerSelection()))


def test_cancel_wakes_what_waits_and_only_while_it_waits() -> None:
    desc = CacheDesc(num_tensors=1, shape=(4, 8))
    progress = Progress(plan_blocks(desc, desc, block_array([0], "s"), block_array([1], "d"), LayerSelection()))
    woken: list[str] = []
    with progress.on_cancel(lambda: woken.append("a")):
        pass
    with progress.on_cancel(lambda: woken.append("b")):
        progress.cancel()
        assert progress.cancelled and woken == ["b"]  # "a" had stopped waiting
        with progress.on_cancel(lambda: woken.append("c")):  # already cancelled: woken at once
            assert woken == ["b", "c"]


@pytest.mark.parametrize("num_blocks", [200, 1 << 16])  # counted (a list covering much of the cache) or sorted
def test_a_duplicate_in_a_long_destination_list_is_refused(num_blocks: int) -> None:
    desc = CacheDesc(num_tensors=1, shape=(num_blocks, 8))
    dst = [*range(100), 57]
    with pytest.raises(ParamInvalidError, match="duplicates"):
        plan_blocks(desc, desc, arr(list(range(101))), arr(dst), LayerSelection())
    assert plan_blocks(desc, desc, arr(list(range(101))), arr(list(range(101))), LayerSelection()).num_runs == 1


_stretch = st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 12))


@given(st.lists(_stretch, min_size=1, max_size=6), st.integers(40, 60))
def test_a_plan_from_stretches_is_the_plan_of_their_blocks(stretches: list[tuple[int, int, int]],
                                                            num_blocks: int) -> None:
    """Pairs that came as runs are checked and planned per stretch: the same plan, or the same refusal, as their
    blocks listed one by one."""
    desc = CacheDesc(num_tensors=2, shape=(num_blocks, 8))
    first_s, first_d, length = (np.asarray(c, dtype=np.int64) for c in zip(*stretches, strict=True))
    runs = blockruns.check(first_s, first_d, length)
    src = arr([s + j for s, _, n in stretches for j in range(n)])
    dst = arr([d + j for _, d, n in stretches for j in range(n)])
    try:
        want = plan_blocks(desc, desc, src, dst, LayerSelection())
    except ParamInvalidError as e:
        with pytest.raises(ParamInvalidError) as info:
            plan_pairs(desc, desc, BlockPairs.of_runs(runs), LayerSelection())
        assert info.value.message == e.message
        return
    got = plan_pairs(desc, desc, BlockPairs.of_runs(runs), LayerSelection())
    for column in ("src_tensor", "src_offset", "dst_tensor", "dst_offset", "length"):
        assert np.array_equal(getattr(got, column), getattr(want, column)), column
    assert np.array_equal(got.destination_blocks(), want.destination_blocks())


def test_plans_side_by_side_shift_each_sources_tensors_and_keep_strides() -> None:
    """Two sources' strided plans as one (a pull from two caches of one peer): the second's source tensors follow
    the first cache's, counts and strides stay, and the destination blocks are both plans' (unwritten until asked)."""
    desc = CacheDesc(num_tensors=2, shape=(64, 16), data_type=DataType.UINT8)
    first = BlockPairs.of_runs(blockruns.check([0], [0], [2], [4], [4], [4]))  # src 0-1, 4-5...; dst 0-1, 4-5...
    second = BlockPairs.of_runs(blockruns.check([0], [2], [2], [4], [4], [4]))  # dst 2-3, 6-7...
    plans = [plan_pairs(desc, desc, p, LayerSelection()) for p in (first, second)]
    assert all(p.strided for p in plans)
    one = side_by_side(plans, [0, desc.num_tensors])
    assert one.strided and one.src_tensor.tolist() == [0, 1, 2, 3]
    assert one.dst_tensor.tolist() == [0, 1, 0, 1]
    assert one.count is not None and one.count.tolist() == [4, 4, 4, 4]
    assert one.total_bytes == sum(p.total_bytes for p in plans)
    assert sorted(one.destination_blocks().tolist()) == sorted(range(16))
