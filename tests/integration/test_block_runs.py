"""Block lists as runs (`block_runs`) between real daemons: the same bytes as the plain lists, plain, by grant, in a
pull session and in a push; every malformed form refused with LLM_PARAM_INVALID before any byte moves."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from kvbroker import (
    CacheDesc,
    Grant,
    KvCacheExtParam,
    LlmStatus,
    ParamInvalidError,
    PullBlocks,
    SessionPull,
    blockruns,
)
from kvbroker import convert as cv
from kvbroker._client import _batch_request
from kvbroker._errors import error_from_rpc
from kvbroker.integrations.vllm.loads import LoadOutcome, PullItem, StepLoads
from kvbroker.v1 import broker_pb2, broker_pb2_grpc, types_pb2
from tests.helpers import LinkedCaches, assert_bytes_equal, expected_pull, fill, linked_caches, snapshot, wait_until

BLOCKS = 6000
DESC = CacheDesc(num_tensors=2, shape=(BLOCKS, 8))
# A remap's shape: runs of two blocks from two interleaved sources at a stride, then one long run, 4096 pairs.
_D = np.arange(2048, dtype=np.int64)
SRC = np.concatenate([np.where(_D % 4 < 2, 100 + (_D // 4) * 2 + _D % 2, 2000 + (_D // 4) * 2 + _D % 4 - 2),
                      np.arange(3100, 5148)]).astype(np.uint64)
DST = np.concatenate([_D + 10, np.arange(2100, 4148)]).astype(np.uint64)


class Env(LinkedCaches):
    def expected(self, before: list[np.ndarray], src: np.ndarray = SRC, dst: np.ndarray = DST) -> list[np.ndarray]:
        return expected_pull(self.src, before, src.tolist(), dst.tolist(), range(2), range(2))


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with linked_caches(tmp_path_factory.mktemp("runs"), 71, DESC, 21, Env) as env:
        yield env


def test_the_lists_used_here_go_as_a_few_runs() -> None:
    req = broker_pb2.PullKvBlocksRequest()
    cv.set_block_pairs(req, SRC, DST)
    assert req.HasField("block_runs") and not req.src_blocks
    assert len(req.block_runs.src_first) <= 8


def test_a_pull_as_runs_lands_the_bytes_of_the_plain_lists(env: Env) -> None:
    before = env.fresh()
    result = env.dc.pull_kv_blocks(env.index(), env.dst, SRC, DST)
    assert result.bytes_moved == len(SRC) * DESC.block_nbytes * 2
    as_runs = snapshot(env.dst)
    assert_bytes_equal(as_runs, env.expected(before))
    fill(env.dst, 22)
    plain = broker_pb2.PullKvBlocksRequest(  # the same pairs, as plain lists, by hand: the client would use runs
        src_cache_index=types_pb2.CacheIndex(cluster_id=env.p.cluster_id, cache_id=env.src.cache_id),
        dst_cache_id=env.dst.cache_id, src_blocks=SRC.tolist(), dst_blocks=DST.tolist())
    with grpc.insecure_channel(env.d.target) as channel:
        broker_pb2_grpc.KvBrokerStub(channel).PullKvBlocks(plain, timeout=30)
    assert_bytes_equal(env.dst.tensors, as_runs)


def test_a_pull_by_grant_as_runs_lands_the_same_bytes_and_is_refused_outside_the_grant(env: Env) -> None:
    grant = env.pc.create_grant([env.src.cache_id], sorted(set(SRC.tolist())), 30.0)
    try:
        before = env.fresh()
        env.dc.pull_granted_kv_blocks(env.p.cluster_id, grant, env.dst, DST, src_blocks=SRC)
        assert_bytes_equal(env.dst.tensors, env.expected(before))
        before = env.fresh()
        outside = SRC + np.uint64(1)  # 5148 is not granted
        with pytest.raises(ParamInvalidError, match="does not cover src blocks"):
            env.dc.pull_granted_kv_blocks(env.p.cluster_id, grant, env.dst, DST, src_blocks=outside)
        runs = blockruns.find(SRC, DST)
        assert runs is not None
        with pytest.raises(ParamInvalidError, match="block_runs name their source blocks: leave it 0"):
            env.dc.pull_granted_kv_blocks(env.p.cluster_id, grant, env.dst, (), first_block=1, block_runs=runs)
        assert_bytes_equal(env.dst.tensors, before)
    finally:
        env.pc.release_grant(grant)


def test_a_session_pull_as_runs_lands_the_same_bytes(env: Env) -> None:
    before = env.fresh()
    with env.dc.open_pull_session() as session:
        [done] = session.submit([SessionPull(env.index(), env.dst.cache_id, DST, SRC)])
        assert done.result(30).bytes_moved == len(SRC) * DESC.block_nbytes * 2
    assert_bytes_equal(env.dst.tensors, env.expected(before))


def test_a_push_as_runs_lands_the_same_bytes(env: Env) -> None:
    fill(env.dst, 23)
    before = snapshot(env.src)
    env.dc.push_kv_blocks(env.dst, env.index(), DST, SRC)
    assert_bytes_equal(env.src.tensors, expected_pull(env.dst, before, DST.tolist(), SRC.tolist(), range(2),
                                                       range(2)))
    fill(env.src, 21)


def _runs(src_first: list[int], dst_first: list[int], length: list[int], count: list[int] | None = None,
          src_stride: list[int] | None = None, dst_stride: list[int] | None = None) -> broker_pb2.BlockRuns:
    return broker_pb2.BlockRuns(src_first=src_first, dst_first=dst_first, length=length, count=count or [],
                                src_stride=src_stride or [], dst_stride=dst_stride or [])


REFUSED = [
    pytest.param({"block_runs": _runs([1], [1], [4]), "src_blocks": [1], "dst_blocks": [1]}, "not both",
                 id="both-forms"),
    pytest.param({"block_runs": _runs([1], [1, 2], [4])}, "must be equal", id="lengths-mismatch"),
    pytest.param({"block_runs": _runs([1], [1], [4], [2])}, "all must be empty", id="count-without-strides"),
    pytest.param({"block_runs": _runs([1], [1], [0])}, "every length", id="zero-length"),
    pytest.param({"block_runs": _runs([1], [1], [1], [0], [1], [1])}, "every count", id="zero-count"),
    pytest.param({"block_runs": _runs([0], [0], [1 << 20], [1 << 20], [0], [1 << 20])}, "expand to",
                 id="over-the-limit"),
    pytest.param({"block_runs": _runs([0, 0], [0, 1 << 20], [1 << 20, 1])}, "expand to", id="over-by-one"),
    pytest.param({"block_runs": _runs([(1 << 64) - 1], [0], [1])}, "past block", id="first-overflows"),
    pytest.param({"block_runs": _runs([0], [0], [2], [3], [(1 << 63) - 1], [1])}, "past block",
                 id="stride-overflows"),
    pytest.param({"block_runs": _runs([0], [BLOCKS - 2], [4])}, "out of range", id="past-the-cache"),
    pytest.param({"block_runs": _runs([0, 10], [5, 7], [4, 4])}, "duplicates", id="dst-twice"),
    pytest.param({"block_runs": _runs([0], [0], [2], [2], [4], [1])}, "duplicates", id="strided-dst-twice"),
    pytest.param({"block_runs": broker_pb2.BlockRuns()}, "no runs", id="empty"),
]


@pytest.mark.parametrize(("fields", "match"), REFUSED)
def test_malformed_runs_are_refused_and_nothing_is_written(env: Env, fields: dict[str, object], match: str) -> None:
    before = env.fresh()
    for grant in (False, True):
        req = broker_pb2.PullKvBlocksRequest(
            src_cache_index=types_pb2.CacheIndex(cluster_id=env.p.cluster_id, cache_id=env.src.cache_id),
            dst_cache_id=env.dst.cache_id, **fields)  # type: ignore[arg-type]
        made = None
        if grant:
            made = env.pc.create_grant([env.src.cache_id], list(range(BLOCKS)), 30.0)
            req.src_cache_index.cache_id = 0
            req.grant.grant.grant_id, req.grant.grant.secret = made.grant_id, made.secret
        try:
            with grpc.insecure_channel(env.d.target) as channel, pytest.raises(grpc.RpcError) as info:
                broker_pb2_grpc.KvBrokerStub(channel).PullKvBlocks(req, timeout=30)
        finally:
            if made is not None:
                env.pc.release_grant(made)
        err = error_from_rpc(info.value)
        assert err.status == LlmStatus.LLM_PARAM_INVALID, err
        assert match in str(err)
        assert_bytes_equal(env.dst.tensors, before)


def test_malformed_runs_in_a_session_fail_that_pull_only(env: Env) -> None:
    before = env.fresh()
    with grpc.insecure_channel(env.d.target) as channel:
        stub = broker_pb2_grpc.KvBrokerStub(channel)
        msg = broker_pb2.PullSessionRequest()
        bad = msg.pulls.add(id=1)
        bad.pull.src_cache_index.cluster_id = env.p.cluster_id
        bad.pull.src_cache_index.cache_id = env.src.cache_id
        bad.pull.dst_cache_id = env.dst.cache_id
        bad.pull.block_runs.CopyFrom(_runs([0], [0], [1 << 20], [1 << 20], [0], [1 << 20]))
        replies = stub.PullKvBlocksSession(iter([msg]), timeout=30)
        first = next(iter(replies))
        [done] = first.completions
        assert done.id == 1 and done.status == "LLM_PARAM_INVALID" and "expand to" in done.message, done
        replies.cancel()
    assert_bytes_equal(env.dst.tensors, before)


class _Linked:
    """The env's daemons are linked already."""

    def ensure(self, cluster_id: int) -> None:
        pass

    def forget(self, cluster_id: int) -> None:
        pass


def test_connector_loads_of_arrays_or_runs_land_and_a_failed_one_names_its_blocks(env: Env) -> None:
    """The vLLM worker hands its plan's runs (or arrays) to its step loads as they are: a good item lands its bytes,
    a failed one reports every destination unit it named (which the worker maps to the blocks to recompute)."""
    grant = env.pc.create_grant([env.src.cache_id], sorted(set(SRC.tolist())), 30.0)
    before = env.fresh()
    outcomes: dict[str, LoadOutcome] = {}
    loads = StepLoads(env.dc, _Linked(), lambda o: outcomes.__setitem__(o.request_id, o))
    try:
        ext = KvCacheExtParam(tensor_num_per_layer=2)
        runs = blockruns.find(SRC, DST)
        shifted = blockruns.find(SRC, DST + np.uint64(1))
        assert runs is not None and shifted is not None
        loads.submit([
            PullItem("good", env.p.cluster_id, grant, 0, env.dst.cache_id, (), runs=runs, ext_param=ext, timeout=30),
            PullItem("forged", env.p.cluster_id, Grant(grant.grant_id, bytes(32)), 0, env.dst.cache_id,
                     DST + np.uint64(1), SRC, ext_param=ext, timeout=30),
            PullItem("forged-runs", env.p.cluster_id, Grant(grant.grant_id, bytes(32)), 0, env.dst.cache_id, (),
                     runs=shifted, ext_param=ext, timeout=30)])
        wait_until(lambda: len(outcomes) == 3, timeout=30, what="the outcomes")
    finally:
        loads.close()
        env.pc.release_grant(grant)
    good = outcomes["good"]
    assert not good.failed_blocks and good.bytes_moved == len(SRC) * DESC.block_nbytes * 2
    for forged in (outcomes["forged"], outcomes["forged-runs"]):
        assert forged.failed_blocks == frozenset((DST + np.uint64(1)).tolist())
        assert forged.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST
    assert_bytes_equal(env.dst.tensors, env.expected(before))


def test_a_batch_group_of_long_lists_goes_as_runs_and_lands_the_same_bytes(env: Env) -> None:
    group = PullBlocks(env.index(), env.dst.cache_id, tuple(SRC.tolist()), tuple(DST.tolist()))
    before = env.fresh()
    env.dc.transfer_kv_blocks_batch([group])
    assert_bytes_equal(env.dst.tensors, env.expected(before))
    assert _batch_request([group]).groups[0].pull.HasField("block_runs")
