"""Block pairs as runs (`kvbroker.blockruns`): what the client finds expands to exactly its pairs, and the daemon's
bounds refuse every malformed form before anything of its size is allocated."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker import blockruns
from kvbroker import convert as cv
from kvbroker.v1 import broker_pb2
from kvbrokerd.dataplane.pairs import MAX_BLOCKS_PER_REQUEST, BlockPairs
from kvbrokerd.dataplane.plan import Pieces

TOP = blockruns.MAX_INDEX


def _pairs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int]]:
    return sorted(zip(np.asarray(src).tolist(), np.asarray(dst).tolist(), strict=True))


def test_the_bound_is_the_daemons() -> None:
    assert blockruns.MAX_PAIRS == MAX_BLOCKS_PER_REQUEST


# A list built of pieces that are consecutive, strided or scattered, in any order: the shapes remap plans have.
_piece = st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(1, 9), st.integers(1, 12),
                   st.integers(0, 64), st.integers(0, 64))


@given(st.lists(_piece, min_size=1, max_size=12), st.booleans(), st.randoms(use_true_random=False))
def test_found_runs_expand_to_exactly_the_pairs(pieces: list[tuple[int, ...]], shuffle: bool, rnd: object) -> None:
    src: list[int] = []
    dst: list[int] = []
    for s0, d0, length, count, s_step, d_step in pieces:
        for k in range(count):
            src.extend(range(s0 + k * s_step, s0 + k * s_step + length))
            dst.extend(range(d0 + k * d_step, d0 + k * d_step + length))
    if shuffle:
        order = list(range(len(src)))
        rnd.shuffle(order)  # type: ignore[attr-defined]
        src, dst = [src[i] for i in order], [dst[i] for i in order]
    for given_as in (src, np.asarray(src, dtype=np.uint64)):
        runs = blockruns.find(given_as, dst, min_pairs=1)
        if runs is None:  # not worth it: the plain lists go
            continue
        checked = blockruns.check(runs.src_first, runs.dst_first, runs.length, runs.count, runs.src_stride,
                                  runs.dst_stride)
        got_src, got_dst = blockruns.expand(checked)
        assert _pairs(got_src, got_dst) == _pairs(np.asarray(src), np.asarray(dst))
        assert checked.num_pairs == len(src)


@given(st.lists(st.tuples(st.integers(0, 1 << 62), st.integers(0, 1 << 62)), min_size=1, max_size=300))
def test_a_request_carries_the_same_pairs_in_either_form(pairs: list[tuple[int, int]]) -> None:
    src = np.array([p[0] for p in pairs] * 4 + list(range(2000)), dtype=np.uint64)
    dst = np.array([p[1] for p in pairs] * 4 + list(range(5000, 7000)), dtype=np.uint64)
    req = broker_pb2.PullKvBlocksRequest()
    cv.set_block_pairs(req, src, dst)
    wire = broker_pb2.PullKvBlocksRequest.FromString(req.SerializeToString())
    got_src, got_dst = cv.block_pairs_from_pb(wire)
    assert _pairs(np.asarray(got_src), np.asarray(got_dst)) == _pairs(src, dst)


def test_long_consecutive_lists_go_as_a_few_numbers_and_short_ones_as_lists() -> None:
    long = broker_pb2.PullKvBlocksRequest()
    cv.set_block_pairs(long, np.arange(100, 131172), np.arange(4096, 135168))
    assert long.HasField("block_runs") and not long.src_blocks and len(long.block_runs.length) == 1
    assert long.ByteSize() < 64
    short = broker_pb2.PullKvBlocksRequest()
    cv.set_block_pairs(short, [1, 2, 3], (4, 5, 6))
    assert not short.HasField("block_runs") and list(short.src_blocks) == [1, 2, 3]


def test_strided_repetitions_are_found_in_either_order() -> None:
    """A head's K moved between block sizes: pairs of units at one stride on one side, another on the other,
    interleaved from two source blocks (destination order) or not (source order)."""
    d = np.arange(4096, dtype=np.int64)
    src = np.where((d % 4) < 2, 10_000 + (d // 4) * 2 + d % 2, 20_000 + (d // 4) * 2 + d % 4 - 2)
    runs = blockruns.find(src, d)
    assert runs is not None and len(runs.length) <= 4
    assert _pairs(*blockruns.expand(runs)) == _pairs(src, d)


_U64 = st.integers(0, (1 << 64) - 1)


@pytest.mark.parametrize(("fields", "match"), [
    ({"src_first": [], "dst_first": [], "length": []}, "no runs"),
    ({"src_first": [1], "dst_first": [1, 2], "length": [1]}, "must be equal"),
    ({"src_first": [1], "dst_first": [1], "length": [1], "count": [2]}, "all must be empty"),
    ({"src_first": [1], "dst_first": [1], "length": [0]}, "length"),
    ({"src_first": [1], "dst_first": [1], "length": [1], "count": [0], "src_stride": [1], "dst_stride": [1]},
     "count"),
    ({"src_first": [1], "dst_first": [1], "length": [1 << 20], "count": [1 << 20], "src_stride": [1 << 20],
      "dst_stride": [1 << 20]}, "expand to"),
    ({"src_first": [0, 0], "dst_first": [0, 1 << 20], "length": [1 << 20, 1]}, "expand to"),
    ({"src_first": [TOP], "dst_first": [0], "length": [2]}, "past block"),
    ({"src_first": [1 << 64 - 1], "dst_first": [0], "length": [1]}, "past block"),
    ({"src_first": [0], "dst_first": [0], "length": [1], "count": [3], "src_stride": [1 << 62],
      "dst_stride": [1]}, "past block"),
    ({"src_first": [0], "dst_first": [TOP - 4], "length": [2], "count": [2], "src_stride": [4],
      "dst_stride": [4]}, "past block"),
])
def test_malformed_runs_are_refused(fields: dict[str, list[int]], match: str) -> None:
    with pytest.raises(blockruns.RunsError, match=match):
        blockruns.check(**fields)


@given(st.lists(st.tuples(_U64, _U64, _U64, _U64, _U64, _U64), min_size=1, max_size=8))
def test_checked_runs_never_expand_past_the_bound_nor_wrap(runs: list[tuple[int, ...]]) -> None:
    """Anything the check lets through expands to at most MAX_PAIRS pairs, every index the arithmetic says."""
    cols = [list(c) for c in zip(*runs, strict=True)]
    try:
        checked = blockruns.check(*cols)
    except blockruns.RunsError:
        return
    src, dst = blockruns.expand(checked)
    assert len(src) == len(dst) == checked.num_pairs <= blockruns.MAX_PAIRS
    want = [(f + k * s + j, g + k * t + j) for f, g, n, c, s, t in runs for k in range(c) for j in range(n)]
    assert sorted(zip(src.tolist(), dst.tolist(), strict=True)) == sorted(want)


def test_both_forms_in_one_request_are_refused() -> None:
    req = broker_pb2.PullKvBlocksRequest(src_blocks=[1], dst_blocks=[2])
    req.block_runs.src_first.append(1)
    req.block_runs.dst_first.append(2)
    req.block_runs.length.append(1)
    with pytest.raises(blockruns.RunsError, match="not both"):
        cv.block_pairs_from_pb(req)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 9))
def test_split_parts_are_the_runs_bytes_in_order(lengths: list[int], parts: int) -> None:
    n = len(lengths)
    pieces = Pieces(np.arange(n), np.zeros(n, dtype=np.uint32), np.arange(n, dtype=np.uint64) * np.uint64(1000),
                    np.zeros(n, dtype=np.uint32), np.arange(n, dtype=np.uint64) * np.uint64(500),
                    np.asarray(lengths, dtype=np.uint64))
    out = pieces.split(parts)
    assert len(out) <= parts and all(len(p) and bool((p.length > 0).all()) for p in out)
    got = [(int(r), int(so) + i, int(do) + i) for p in out for r, so, do, ln in
           zip(p.run, p.src_offset, p.dst_offset, p.length, strict=True) for i in range(int(ln))]
    want = [(r, r * 1000 + i, r * 500 + i) for r, ln in enumerate(lengths) for i in range(ln)]
    assert got == want
    sizes = [int(p.length.sum()) for p in out]
    assert max(sizes) - min(sizes) <= 1 or len(out) < parts


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 9)), min_size=1, max_size=5),
       st.sets(st.integers(0, 20), max_size=20), st.integers(1, 4))
def test_a_grant_covers_stretches_exactly_when_it_covers_their_blocks(stretches: list[tuple[int, int]],
                                                                     granted: set[int], units: int) -> None:
    starts = np.asarray([s for s, _ in stretches], dtype=np.int64)
    lengths = np.asarray([n for _, n in stretches], dtype=np.int64)
    blocks = np.asarray(sorted(granted), dtype=np.uint64)
    src = np.asarray([s + j for s, n in stretches for j in range(n)], dtype=np.uint64)
    as_runs = BlockPairs.of_runs(blockruns.check(starts, starts, lengths)).outside_grant(blocks, units)
    by_block = BlockPairs.listed(src, src).outside_grant(blocks, units)
    assert np.array_equal(as_runs, by_block)
    assert np.array_equal(by_block, src[~np.isin(src // np.uint64(units), blocks)])



def _greedy(s: np.ndarray, d: np.ndarray, lengths: np.ndarray) -> blockruns.Runs | None:
    """The grouping `_strided` makes without a loop, as a plain loop (its first form)."""
    n = len(s)
    if n < 3:
        return None
    ds, dd = np.diff(s), np.diff(d)
    ok = (lengths[1:] == lengths[:-1]) & (ds >= 0) & (dd >= 0)  # wire strides are unsigned
    # links i and i-1 belong to one group when both are ok and step alike
    same = ok[1:] & ok[:-1] & (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1])
    seg_starts = np.flatnonzero(np.concatenate(([True], ~same)))
    if len(seg_starts) > blockruns._MAX_STRIDE_GROUPS:
        return None
    seg_ends = np.append(seg_starts[1:], len(ok))  # links [a, b) of each segment
    pieces: list[tuple[int, int, int]] = []  # (first run, runs, stride link) per emitted group
    pos = 0
    ok_list = ok.tolist()
    for a, b in zip(seg_starts.tolist(), seg_ends.tolist(), strict=True):
        a = max(a, pos)
        if a >= b or not ok_list[a]:
            continue
        if pos < a:
            pieces.append((pos, a - pos, -1))
        pieces.append((a, b - a + 1, a))
        pos = b + 1
    if pos < n:
        pieces.append((pos, n - pos, -1))
    first: list[int] = []
    reps: list[int] = []
    link: list[int] = []
    for start, many, at in pieces:
        if at < 0:  # not repeated: each run once
            first.extend(range(start, start + many))
            reps.extend([1] * many)
            link.extend([-1] * many)
        else:
            first.append(start)
            reps.append(many)
            link.append(at)
    idx = np.asarray(first, dtype=np.int64)
    at_link = np.asarray(link, dtype=np.int64)
    has = at_link >= 0
    safe = np.where(has, at_link, 0)
    return blockruns.Runs(s[idx].astype(np.uint64), d[idx].astype(np.uint64), lengths[idx].astype(np.uint64),
                np.asarray(reps, dtype=np.uint64), np.where(has, ds[safe], 0).astype(np.uint64),
                np.where(has, dd[safe], 0).astype(np.uint64))


@given(st.lists(st.tuples(st.integers(-3, 6), st.sampled_from([4, 4, 4, 1, 3, -1]), st.sampled_from([1, 2, 2, 2, 3])),
                max_size=60), st.booleans())
def test_strided_groups_runs_as_the_greedy_loop_does(steps: list[tuple[int, int, int]], regular: bool) -> None:
    if regular:  # mostly one step: long groups, one-link segments between them
        steps = [(2 if i % 7 else s, d, 2 if i % 11 else n) for i, (s, d, n) in enumerate(steps)]
    s = np.cumsum([100] + [a for a, _, _ in steps]).astype(np.int64)
    d = np.cumsum([100] + [b for _, b, _ in steps]).astype(np.int64)
    lengths = np.asarray([2] + [n for _, _, n in steps], dtype=np.int64)
    got, want = blockruns._strided(s, d, lengths), _greedy(s, d, lengths)
    assert (got is None) == (want is None)
    if got is not None and want is not None:
        for name in ("src_first", "dst_first", "length", "count", "src_stride", "dst_stride"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), name


def test_pairs_named_counts_from_the_sizes_alone() -> None:
    """A session message's budget is checked with it before `check`: exact for runs `check` takes, over
    MAX_PAIRS for runs it refuses (however large the numbers)."""
    runs = blockruns.check([0, 100], [0, 100], [3, 5], [2, 4], [10, 20], [10, 20])
    assert blockruns.pairs_named([3, 5], [2, 4]) == runs.num_pairs == 26
    assert blockruns.pairs_named([7, 1]) == 8
    assert blockruns.pairs_named([1 << 20], [1 << 20]) > blockruns.MAX_PAIRS
    assert blockruns.pairs_named([2**64 - 1] * 3, [2**64 - 1] * 3) > blockruns.MAX_PAIRS
