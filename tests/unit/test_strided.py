"""Strided plans (dataplane/pairs.py checks the runs, planner.py plans them: Plan with counts): a few strided block
runs are checked and planned per run, and land exactly the bytes that the same pairs written out land, with the same
refusals."""

from __future__ import annotations

import concurrent.futures
import functools
import time
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker import blockruns
from kvbroker.types import CacheDesc, DataType
from kvbrokerd.backends.common import memcopy
from kvbrokerd.dataplane import blocklocks, pairs
from kvbrokerd.dataplane.pairs import BlockPairs
from kvbrokerd.dataplane.plan import Pieces, Plan, Progress
from kvbrokerd.errors import LlmError
from kvbrokerd.registry.endpoint import Endpoint
from kvbrokerd.transfers.planner import LayerSelection, concatenated, layer_plans, plan_blocks, plan_pairs

BLOCKS = 96
DESC = CacheDesc(num_tensors=3, shape=(BLOCKS, 24), data_type=DataType.UINT8)
# (src first, dst first, length, count, src stride, dst stride), small enough to collide often
RUN = st.tuples(st.integers(0, 90), st.integers(0, 90), st.integers(1, 6), st.integers(1, 12), st.integers(0, 12),
                st.integers(0, 12))


def _runs(rows: list[tuple[int, int, int, int, int, int]]) -> blockruns.Runs:
    return blockruns.check(*(list(column) for column in zip(*rows, strict=True)))


def _refusal(plan: Callable[[], Plan]) -> str | Plan:
    """The plan, or its refusal as the caller sees it (status and message)."""
    try:
        return plan()
    except LlmError as e:
        return f"{e.status.name}: {e.message}"


def _endpoint(buf: np.ndarray, desc: CacheDesc, label: str) -> Endpoint:
    base = buf.ctypes.data
    return Endpoint(label, [base + i * desc.tensor_nbytes for i in range(desc.num_tensors)], [], [], True,
                    lambda: None)


def _copy(plan: Plan, src: np.ndarray, threads: int) -> tuple[np.ndarray, Progress]:
    dst = np.zeros_like(src)
    progress = Progress(plan)
    old = memcopy.CHUNK_BYTES, memcopy.CHUNK_RUNS, memcopy.PARALLEL_MIN_BYTES
    memcopy.CHUNK_BYTES, memcopy.CHUNK_RUNS, memcopy.PARALLEL_MIN_BYTES = 200, 3, 1  # chunks and parts even here
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            memcopy.copy_plan(_endpoint(src, DESC, "src"), _endpoint(dst, DESC, "dst"), plan, progress,
                              time.monotonic() + 30, pool, threads=threads)
    finally:
        memcopy.CHUNK_BYTES, memcopy.CHUNK_RUNS, memcopy.PARALLEL_MIN_BYTES = old
    return dst, progress


@settings(max_examples=300, deadline=None)
@given(st.lists(RUN, min_size=1, max_size=6), st.sampled_from([LayerSelection(), LayerSelection((1, 2), (0, 1), 1)]),
       st.integers(1, 3))
def test_a_strided_plan_lands_the_bytes_of_its_pairs_written_out_and_refuses_alike(
        rows: list[tuple[int, int, int, int, int, int]], layers: LayerSelection, threads: int) -> None:
    try:
        runs = _runs(rows)
    except blockruns.RunsError:
        return
    if not BlockPairs.of_runs(runs).strided:
        return
    src_blocks, dst_blocks = blockruns.expand(runs)
    expected = _refusal(lambda: plan_blocks(DESC, DESC, src_blocks, dst_blocks, layers))
    got = _refusal(lambda: plan_pairs(DESC, DESC, BlockPairs.of_runs(runs), layers))
    if not isinstance(expected, Plan) or not isinstance(got, Plan):
        assert got == expected  # the same refusal, message and all (LLM_PARAM_INVALID)
        return
    tensors = 3 if layers == LayerSelection() else 2
    assert got.strided and got.num_runs == len(rows) * tensors  # one entry per run and tensor
    assert got.total_bytes == expected.total_bytes and got.num_copies == int(runs.count.sum()) * tensors
    source = np.random.default_rng(len(rows)).integers(1, 256, DESC.num_tensors * DESC.tensor_nbytes, dtype=np.uint8)
    want, _ = _copy(expected, source, 1)
    landed, progress = _copy(got, source, threads)
    assert np.array_equal(landed, want)
    assert progress.bytes_moved == got.total_bytes and not len(progress.failed_dst_blocks())
    # nothing landed: every destination block is reported, as for the written-out plan
    assert Progress(got).failed_dst_blocks().tolist() == Progress(expected).failed_dst_blocks().tolist()
    assert got.plain().total_bytes == got.total_bytes
    spans = _spans(got)  # a claim of ranges holds exactly the cells written, or the cells are claimed themselves
    if spans is not None:
        plain = got.plain()
        cells = blocklocks.run_cells(plain.dst_tensor, plain.dst_offset, plain.length, got.block_nbytes, BLOCKS)
        assert [c for lo, hi in zip(spans.lo, spans.hi, strict=True) for c in range(lo, hi)] == sorted(cells.tolist())


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 5), st.integers(1, 8), st.sampled_from([0, 2, 3, 4, 7])),
                min_size=1, max_size=6))
def test_destination_overlaps_are_found_exactly(rows: list[tuple[int, int, int, int]]) -> None:
    first, size, times, step = (np.asarray(c, dtype=np.int64) for c in zip(*rows, strict=True))
    step = np.where(times > 1, step, 0)
    blocks = [f + k * s + j for f, n, c, s in zip(first.tolist(), size.tolist(), times.tolist(), step.tolist(),
                                                 strict=True) for k in range(c) for j in range(n)]
    assert _overlaps(first, size, times, step) == (len(set(blocks)) != len(blocks))


def _overlaps(first: np.ndarray, size: np.ndarray, times: np.ndarray, step: np.ndarray) -> bool:
    runs = blockruns.check(first, first, size, times, step, step)
    try:
        BlockPairs.of_runs(runs).checked_runs(1 << 20, 1 << 20)
    except LlmError as e:
        assert "duplicates" in e.message
        return True
    return False


def test_a_remap_interleaving_two_sources_in_one_destination_is_no_duplicate() -> None:
    """A 32 -> 64 token remap's K rows: two source blocks fill alternate halves of one destination row, at one step;
    shifted by one unit, they overlap."""
    first = np.asarray([0, 2], dtype=np.int64)
    size, times, step = (np.asarray([2, 2]), np.asarray([128, 128]), np.asarray([4, 4]))
    assert not _overlaps(first, size, times, step)
    assert _overlaps(np.asarray([0, 1]), size, times, step)


def test_out_of_range_and_bytes_per_block_are_refused_with_the_plain_messages() -> None:
    runs = _runs([(0, 0, 2, 10, 4, 4), (50, 90, 1, 2, 1, 3)])  # dst 90 + 3 + 0 = 93 < 96; src fine
    src, dst = blockruns.expand(runs)
    small = CacheDesc(num_tensors=3, shape=(93, 24), data_type=DataType.UINT8)
    other = CacheDesc(num_tensors=3, shape=(BLOCKS, 12), data_type=DataType.UINT8)
    for a, b in ((DESC, small), (small, small), (DESC, other)):
        got = _refusal(functools.partial(plan_pairs, a, b, BlockPairs.of_runs(runs), LayerSelection()))
        assert isinstance(got, str) and got.startswith("LLM_PARAM_INVALID")
        assert got == _refusal(functools.partial(plan_blocks, a, b, src, dst, LayerSelection()))


def test_only_a_few_runs_that_repeat_are_planned_strided() -> None:
    assert not BlockPairs.listed([0, 1], [2, 3]).strided
    assert not BlockPairs.of_runs(_runs([(0, 0, 5, 1, 0, 0)])).strided  # nothing repeats: the stretches' path
    assert BlockPairs.of_runs(_runs([(0, 0, 1, 3, 2, 2)])).strided
    many = blockruns.Runs(*(np.ones(pairs.MAX_STRIDED_RUNS + 1, dtype=np.uint64) for _ in range(6)))
    many.count[:] = 2
    assert not BlockPairs.of_runs(many).strided


def _strided_plan() -> Plan:
    runs = _runs([(0, 1, 2, 20, 3, 4), (70, 3, 2, 20, 1, 4), (60, 85, 5, 1, 0, 0)])
    return plan_pairs(DESC, DESC, BlockPairs.of_runs(runs), LayerSelection())


@given(st.integers(1, 7), st.data())
def test_split_cuts_strided_entries_between_repetitions_into_balanced_parts(parts: int, data: st.DataObject) -> None:
    plan = _strided_plan()
    pieces = Pieces.of(plan)
    split = pieces.split(parts)
    longest = int(plan.length.max())
    assert sum(int(p.nbytes.sum()) for p in split) == plan.total_bytes
    for part in split:
        assert int(part.nbytes.sum()) <= -(-plan.total_bytes // parts) + longest
    whole = pieces.plain()

    def merged(parts: list[Pieces]) -> list[tuple[int, int, int, int]]:
        """(run, src offset, dst offset, length), a run once repeated, pieces that continue each other joined."""
        out: list[tuple[int, int, int, int]] = []
        for part in parts:
            p = part.plain()
            for row in zip(p.run.tolist(), p.src_offset.tolist(), p.dst_offset.tolist(), p.length.tolist(),
                           strict=True):
                last = out[-1] if out else None
                if last and last[0] == row[0] and last[1] + last[3] == row[1] and last[2] + last[3] == row[2]:
                    out[-1] = (last[0], last[1], last[2], last[3] + row[3])  # a plain run cut by bytes
                else:
                    out.append(row)
        return out

    # the same repetitions, in the same order, each once (a strided run is cut between two of them, a plain one
    # anywhere)
    assert merged(split) == merged([whole])


@given(st.integers(1, 5), st.data())
def test_failed_blocks_of_a_strided_plan_are_exactly_the_repetitions_that_did_not_land(parts: int,
                                                                                       data: st.DataObject) -> None:
    """Against the plan written out (one run per repetition): pieces land whole, in part (their first repetitions, as
    a fault leaves them) or not at all; a mark that does not say which repetitions it holds (or takes bytes back)
    makes its run count as not landed."""
    plan = _strided_plan()
    progress = Progress(plan)
    landed_bytes: dict[tuple[int, int], int] = {}  # (run, repetition): bytes
    untrusted: set[int] = set()
    for part in Pieces.of(plan).split(parts):
        plain = part.plain()
        assert plain.first_repeat is not None
        how = data.draw(st.sampled_from(["whole", "head", "none", "untold"]))
        keep = data.draw(st.integers(0, len(plain))) if how == "head" else 0 if how == "none" else len(plain)
        if how == "untold":
            progress.mark_runs(part.run, part.nbytes)
            untrusted.update(part.run.tolist())
        else:  # as memcopy records: whole pieces, then the first repetitions of the one that faulted
            progress.mark_runs(plain.run[:keep], plain.length[:keep], plain.first_repeat[:keep])
        for r, k, n in zip(plain.run[:keep].tolist(), plain.first_repeat[:keep].tolist(),
                           plain.length[:keep].tolist(), strict=True):
            landed_bytes[r, k] = landed_bytes.get((r, k), 0) + n
    # a repetition landed when all its bytes did (a plain run may be cut by bytes between parts)
    landed = {rk for rk, n in landed_bytes.items() if n == int(plan.length[rk[0]])}
    assert plan.count is not None and plan.dst_stride is not None
    expected: set[int] = set()
    complete = {r for r in range(plan.num_runs) if all((r, k) in landed for k in range(int(plan.count[r])))}
    for r in range(plan.num_runs):
        for k in range(int(plan.count[r])):
            if r not in complete and ((r, k) not in landed or r in untrusted):
                at = int(plan.dst_offset[r]) + k * int(plan.dst_stride[r])
                expected.update(range(at // plan.block_nbytes, -(-(at + int(plan.length[r])) // plan.block_nbytes)))
    assert progress.failed_dst_blocks().tolist() == sorted(expected)


def test_layer_plans_keep_strided_entries_whole() -> None:
    plan = _strided_plan()
    layers = layer_plans(plan, 1)
    assert [layer for layer, _ in layers] == [0, 1, 2]
    assert all(sub.strided and sub.num_runs == 3 for _, sub in layers)
    assert sum(sub.total_bytes for _, sub in layers) == plan.total_bytes


def _spans(plan: Plan) -> blocklocks.Spans | None:
    assert plan.count is not None and plan.dst_stride is not None
    return blocklocks.strided_spans(plan.dst_tensor, plan.dst_offset, plan.length, plan.count, plan.dst_stride,
                                    plan.block_nbytes, BLOCKS)


def test_strided_claims_are_exactly_the_cells_written_and_two_ranks_heads_stay_apart() -> None:
    runs = _runs([(0, 1, 2, 20, 3, 4), (60, 85, 5, 1, 0, 0)])
    gapped = plan_pairs(DESC, DESC, BlockPairs.of_runs(runs), LayerSelection())
    assert _spans(gapped) is None  # entry 0 leaves two cells between its repetitions that nothing fills
    filled = _strided_plan()
    spans = _spans(filled)  # entries 0 and 1 fill [1, 81) between them: one range per tensor, and 85-89
    assert spans is not None and len(spans.lo) == 6
    plain = filled.plain()
    cells = blocklocks.run_cells(plain.dst_tensor, plain.dst_offset, plain.length, filled.block_nbytes, BLOCKS)
    covered = [c for lo, hi in zip(spans.lo, spans.hi, strict=True) for c in range(lo, hi)]
    assert covered == sorted(cells.tolist())  # exactly the cells written, no more
    # a TP gather: rank 0 writes heads 0-1, rank 1 heads 2-3 of the same destination blocks (4 units per head,
    # 16 per block), each as strided runs: their claims never wait on each other
    class Cache:
        pass

    locks, key = blocklocks.BlockLocks(), Cache()

    def rank(r: int) -> np.ndarray:
        runs = _runs([(0, 16 + 8 * r, 8, 4, 8, 16)])
        p = plan_pairs(DESC, DESC, BlockPairs.of_runs(runs), LayerSelection())
        assert _spans(p) is None  # gaps (the other rank's heads): the cells themselves are claimed
        plain = p.plain()
        return blocklocks.run_cells(plain.dst_tensor, plain.dst_offset, plain.length, p.block_nbytes, BLOCKS)

    first = locks.claim(key, DESC.num_tensors, BLOCKS, rank(0), time.monotonic() + 5, "rank 0")
    second = locks.claim(key, DESC.num_tensors, BLOCKS, rank(1), time.monotonic() + 0.01, "rank 1")
    with pytest.raises(LlmError, match="same destination blocks"):  # and the same rank again does wait
        locks.claim(key, DESC.num_tensors, BLOCKS, rank(0), time.monotonic() + 0.01, "rank 0 again")
    locks.release(first)
    locks.release(second)


@given(st.lists(RUN, min_size=1, max_size=5), st.lists(st.integers(0, 30), max_size=30, unique=True),
       st.integers(1, 4))
def test_a_grant_judged_by_bounding_ranges_never_covers_an_ungranted_block(
        rows: list[tuple[int, int, int, int, int, int]], granted: list[int], units: int) -> None:
    try:
        runs = _runs(rows)
    except blockruns.RunsError:
        return
    blocks = np.asarray(granted, dtype=np.uint64)
    src, _ = blockruns.expand(runs)
    outside = BlockPairs.of_runs(runs).outside_grant(blocks, units)
    assert outside.tolist() == [b for b in src.tolist() if b // units not in granted]


def test_a_plan_of_runs_writes_its_destination_blocks_out_only_when_asked() -> None:
    runs = _runs([(0, 1, 2, 20, 3, 4), (70, 3, 2, 20, 1, 4), (60, 85, 5, 1, 0, 0)])
    _, dst = blockruns.expand(runs)
    lazy = plan_pairs(DESC, DESC, BlockPairs.of_runs(runs), LayerSelection())
    assert lazy.dst_pairs is not None and lazy.dst_pairs.runs is runs
    assert not len(lazy.dst_blocks) and lazy.num_dst_blocks == len(dst)
    assert np.array_equal(lazy.destination_blocks(), dst)
    assert np.array_equal(lazy.plain().destination_blocks(), dst)
    assert all(np.array_equal(sub.destination_blocks(), dst) for _, sub in layer_plans(lazy, 1))
    both = concatenated([lazy, _strided_plan()])  # a merged group: written out
    assert not both.strided and both.dst_pairs is None and np.array_equal(both.dst_blocks, np.concatenate([dst, dst]))
    assert both.total_bytes == 2 * lazy.total_bytes


@pytest.mark.parametrize("shape", [(64, 8), (64, 12)])  # 16-byte blocks, and 24 (not a power of two)
def test_a_remaps_claim_is_its_merged_ranges_whatever_the_block_size(shape: tuple[int, int]) -> None:
    desc = CacheDesc(2, shape)
    runs = blockruns.check([0, 16], [0, 1], [1, 1], [16, 16], [1, 1], [2, 2])  # two sources fill alternate blocks
    plan = plan_pairs(desc, desc, BlockPairs.of_runs(runs), LayerSelection())
    assert plan.count is not None and plan.dst_stride is not None
    spans = blocklocks.strided_spans(plan.dst_tensor, plan.dst_offset, plan.length, plan.count, plan.dst_stride,
                                     plan.block_nbytes, 64)
    assert spans is not None and (list(spans.lo), list(spans.hi)) == ([0, 64], [32, 96])


def test_a_duplicate_check_too_long_for_the_event_loop_says_so_and_is_made_off_it() -> None:
    """4,096 runs that interleave at two steps: their duplicate check writes out 2^20 repetitions, which the daemon's
    event loop does not do (the manager plans them on its executor)."""
    n = 4096
    first = np.arange(n, dtype=np.uint64)
    step = (n * (np.arange(n) % 2 + 1)).astype(np.uint64)
    runs = blockruns.check(first, first, np.ones(n, np.uint64), np.full(n, 256, np.uint64), step, step)
    desc = CacheDesc(2, (1 << 22, 16))
    with pytest.raises(pairs.TooLongForTheLoop):
        plan_pairs(desc, desc, BlockPairs.of_runs(runs), LayerSelection(), loop_budget=1 << 14)
    assert plan_pairs(desc, desc, BlockPairs.of_runs(runs), LayerSelection()).num_copies == 2 * n * 256
