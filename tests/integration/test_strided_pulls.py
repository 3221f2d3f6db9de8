"""Strided block runs between real daemons, over shm (planned and copied strided) and over tcp (written out for the
wire): a block-size remap's interleaved pairs, a TP gather of two pulls into interleaved units of the same blocks at
once, by grant and in a session, every byte checked; a strided duplicate is refused and writes nothing."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import numpy as np
import pytest

from kvbroker import CacheDesc, DataType, ParamInvalidError, SessionPull, blockruns
from kvbroker import convert as cv
from kvbroker.v1 import broker_pb2
from tests.helpers import LinkedCaches, assert_bytes_equal, expected_pull, linked_caches

UNITS = 80_000
DESC = CacheDesc(num_tensors=2, shape=(UNITS, 64), data_type=DataType.UINT8)  # a unit of 64 bytes: whole lines
ROWS, BLOCKS = 64, 160


def remap() -> tuple[np.ndarray, np.ndarray]:
    """A 32 -> 64 token remap as vLLM's CPU K lays it out (dimension-major): each destination block's rows take two
    units from source block 2b and two from 2b + 1, alternately (strided runs that interleave), then its V part is
    one run per source block."""
    src: list[np.ndarray] = []
    dst: list[np.ndarray] = []
    for b in range(BLOCKS // 2):
        d0 = 1000 + b * ROWS * 8  # per destination block: K rows of 4 units, then V of 4 * ROWS units
        for half in range(2):
            s0 = 30_000 + (2 * b + half) * ROWS * 4
            row = np.arange(ROWS)
            src.append((s0 + row[:, None] * 2 + np.arange(2)).reshape(-1))
            dst.append((d0 + row[:, None] * 4 + half * 2 + np.arange(2)).reshape(-1))
        for half in range(2):
            s0 = 30_000 + (2 * b + half) * ROWS * 4 + ROWS * 2
            src.append(s0 + np.arange(ROWS * 2))
            dst.append(d0 + ROWS * 4 + half * ROWS * 2 + np.arange(ROWS * 2))
    return np.concatenate(src).astype(np.uint64), np.concatenate(dst).astype(np.uint64)


SRC, DST = remap()


def rank_pairs(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """A TP gather's pull from `rank` of 2: units of heads [4 rank, 4 rank + 4) of every destination block (8 heads
    of 8 units): gaps between its repetitions that the other rank's pull fills."""
    blocks = np.arange(1000)
    dst = (5000 + blocks[:, None] * 64 + rank * 32 + np.arange(32)).reshape(-1)
    src = (5000 + blocks[:, None] * 32 + np.arange(32)).reshape(-1) + rank * 70_000 // 2
    return src.astype(np.uint64), dst.astype(np.uint64)


@pytest.fixture(scope="module", params=["shm", "tcp"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LinkedCaches]:
    with linked_caches(tmp_path_factory.mktemp("strided"), 81, DESC, 31, LinkedCaches,
                       backends=(request.param,)) as env:
        yield env


def test_the_pairs_go_as_a_few_strided_runs() -> None:
    for src, dst in (remap(), rank_pairs(1)):
        req = broker_pb2.PullKvBlocksRequest()
        cv.set_block_pairs(req, src, dst)
        runs = req.block_runs
        assert len(runs.src_first) <= 4 * BLOCKS and max(runs.count) > 1, runs


def test_a_strided_remap_lands_every_byte(env: LinkedCaches) -> None:
    before = env.fresh()
    result = env.dc.pull_kv_blocks(env.index(), env.dst, SRC, DST)
    assert result.bytes_moved == len(SRC) * DESC.block_nbytes * 2
    assert_bytes_equal(env.dst.tensors, expected_pull(env.src, before, SRC.tolist(), DST.tolist(), range(2),
                                                      range(2)))


def test_a_strided_remap_by_grant_and_in_a_session_lands_every_byte(env: LinkedCaches) -> None:
    expected = expected_pull(env.src, env.fresh(), SRC.tolist(), DST.tolist(), range(2), range(2))
    grant = env.pc.create_grant([env.src.cache_id], sorted(set((SRC // np.uint64(4)).tolist())), 30.0,
                                units_per_block=4)
    try:
        env.dc.pull_granted_kv_blocks(env.p.cluster_id, grant, env.dst, DST, src_blocks=SRC)
        assert_bytes_equal(env.dst.tensors, expected)
        before = env.fresh()
        with pytest.raises(ParamInvalidError, match="does not cover src blocks"):  # one unit past the grant
            env.dc.pull_granted_kv_blocks(env.p.cluster_id, grant, env.dst, DST, src_blocks=SRC + np.uint64(4))
        assert_bytes_equal(env.dst.tensors, before)
    finally:
        env.pc.release_grant(grant)
    env.fresh()
    with env.dc.open_pull_session() as session:
        [done] = session.submit([SessionPull(env.index(), env.dst.cache_id, DST, SRC)])
        assert done.result(30).bytes_moved == len(SRC) * DESC.block_nbytes * 2
    assert_bytes_equal(env.dst.tensors, expected)


def test_two_ranks_pull_into_interleaved_units_of_the_same_blocks_at_once(env: LinkedCaches) -> None:
    expected = env.fresh()
    for rank in range(2):
        src, dst = rank_pairs(rank)
        expected = expected_pull(env.src, expected, src.tolist(), dst.tolist(), range(2), range(2))
    clients = [env.d.client(), env.d.client()]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            done = [pool.submit(c.pull_kv_blocks, env.index(), env.dst, *rank_pairs(r)) for r, c in enumerate(clients)]
            assert [f.result(60).bytes_moved for f in done] == [1000 * 32 * DESC.block_nbytes * 2] * 2
    finally:
        for c in clients:
            c.close()
    assert_bytes_equal(env.dst.tensors, expected)


def test_a_strided_duplicate_is_refused_and_nothing_is_written(env: LinkedCaches) -> None:
    before = env.fresh()
    dst = DST.copy()
    dst[:2 * ROWS] += np.uint64(1)  # source block 0's K units now land one unit later: onto block 1's, twice
    with pytest.raises(ParamInvalidError, match="duplicates"):
        env.dc.pull_kv_blocks(env.index(), env.dst, SRC, dst)
    assert_bytes_equal(env.dst.tensors, before)


def test_runs_pulls_of_one_session_message_run_as_one_plan_and_a_guilty_one_fails_alone(env: LinkedCaches) -> None:
    """A step's pulls from one cache into one cache, each as runs, are planned together without being written out.
    One that writes a unit twice makes that plan refused and is then refused alone; one that writes units another
    pull writes runs after it (same bytes); the others land."""
    expected = env.fresh()
    halves = [(SRC[:len(SRC) // 2], DST[:len(DST) // 2]), (SRC[len(SRC) // 2:], DST[len(DST) // 2:])]
    for src, dst in halves:
        expected = expected_pull(env.src, expected, src.tolist(), dst.tolist(), range(2), range(2))
    runs = [blockruns.find(src, dst, min_pairs=1) for src, dst in halves]
    overlapping = blockruns.find(SRC[:4096], DST[:4096], min_pairs=1)
    guilty = blockruns.check([0, 1], [70_000, 70_000], [4, 4])  # units 70,000-70,003 written twice
    assert all(r is not None for r in runs) and overlapping is not None
    with env.dc.open_pull_session() as session:
        done = session.submit([SessionPull(env.index(), env.dst.cache_id, (), (), block_runs=r) for r in
                               (*runs, overlapping, guilty)])
        assert [f.result(30).bytes_moved for f in done[:3]] == [
            n * DESC.block_nbytes * 2 for n in (len(halves[0][0]), len(halves[1][0]), 4096)]
        with pytest.raises(ParamInvalidError, match="duplicates"):
            done[3].result(30)
    assert_bytes_equal(env.dst.tensors, expected)
