"""Every validation rule of PullKvBlocks (LLM-DataDist V2, reference §4.2 and the PullKvBlocks page) and of cache
descriptors, against two live linked daemons on every backend.

Each refusal is checked three ways: the exception class and `LlmStatus`, the gRPC code it travelled as (API.md's
table), and that not one byte of any cache on either daemon changed. Positive controls next to the refusals (the
boundary that is still valid) show that each refusal is caused by the rule under test and not by something else.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvbroker import (
    Cache,
    CacheDesc,
    CacheIndex,
    Client,
    ClusterInfo,
    ClusterNumExceedLimitError,
    DataType,
    KvCacheExtParam,
    KvCacheNotExistError,
    LinkState,
    LlmError,
    LlmStatus,
    LlmTimeoutError,
    NotYetLinkError,
    ParamInvalidError,
    TensorLocation,
)
from kvbroker._local import LocalDaemon
from kvbroker.v1 import broker_pb2, broker_pb2_grpc, types_pb2
from tests.helpers import (
    Allocations,
    assert_bytes_equal,
    expected_pull,
    fill,
    snapshot,
    transfers_in_flight,
    wait_until,
)

Pair = tuple[LocalDaemon, LocalDaemon]

# 4 layers of (K, V): 8 tensors of 8 blocks, 16 bytes per block.
NUM_TENSORS = 8
NUM_BLOCKS = 8
MAIN = CacheDesc(num_tensors=NUM_TENSORS, shape=(NUM_BLOCKS, 4, 2), data_type=DataType.FLOAT16)
SIX_TENSORS = CacheDesc(num_tensors=6, shape=(NUM_BLOCKS, 4, 2), data_type=DataType.FLOAT16)  # same block bytes
WIDE_BLOCKS = CacheDesc(num_tensors=NUM_TENSORS, shape=(NUM_BLOCKS, 4, 4), data_type=DataType.FLOAT16)  # 32 B/block
UNLINKED_CLUSTER = 999_999
UNKNOWN_CACHE_ID = 987_654_321
SHM_DIR = "/dev/shm"


@dataclass
class Env:
    src_d: LocalDaemon
    dst_d: LocalDaemon
    s: Client
    d: Client
    src: Cache
    dst: Cache
    src_six: Cache
    src_wide: Cache
    others: list[Cache] = field(default_factory=list)

    def caches(self) -> list[Cache]:
        return [self.src, self.dst, self.src_six, self.src_wide, *self.others]

    def snapshot_all(self) -> list[list[np.ndarray]]:
        return [snapshot(c) for c in self.caches()]

    def assert_unchanged(self, before: list[list[np.ndarray]]) -> None:
        for cache, snap in zip(self.caches(), before, strict=True):
            assert_bytes_equal(cache.tensors, snap)

    def remote(self, cache: Cache | int, batch_index: int = 0) -> CacheIndex:
        cache_id = cache.cache_id if isinstance(cache, Cache) else cache
        return CacheIndex(self.src_d.cluster_id, cache_id, batch_index)


@pytest.fixture(scope="module")
def env(linked_pair: Pair) -> Iterator[Env]:
    src_d, dst_d = linked_pair
    with src_d.client() as s, dst_d.client() as d:
        caches = Allocations()
        alloc = caches.alloc
        try:
            yield Env(src_d, dst_d, s, d, src=alloc(s, MAIN, 1), dst=alloc(d, MAIN, 2),
                      src_six=alloc(s, SIX_TENSORS, 3), src_wide=alloc(s, WIDE_BLOCKS, 4),
                      others=[alloc(d, SIX_TENSORS, 5)])
        finally:
            caches.release()


def expect_error(env: Env, call: Callable[[], object], exc: type[LlmError], status: LlmStatus,
                 grpc_code: str) -> LlmError:
    """Runs `call`, which must fail with exactly `exc`/`status`/`grpc_code` and leave every cache untouched."""
    before = env.snapshot_all()
    with pytest.raises(LlmError) as info:
        call()
    err = info.value
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    assert err.status == status, err
    assert err.details.get("grpc_code") == grpc_code, err.details
    assert err.message, "a refusal must say why"
    env.assert_unchanged(before)
    return err


# -- PullKvBlocks: LLM_PARAM_INVALID --------------------------------------------------------------------------------

ALL = (-1, -1)


@dataclass(frozen=True)
class PullCase:
    src_blocks: tuple[int, ...] = (0, 1)
    dst_blocks: tuple[int, ...] = (2, 3)
    ext: KvCacheExtParam | None = None
    batch_index: int = 0
    own_cluster: bool = False
    src_cache: str = "src"  # "src" | "six" | "wide"


def ext(src: tuple[int, int], dst: tuple[int, int], per_layer: int = 2) -> KvCacheExtParam:
    return KvCacheExtParam(src_layer_range=src, dst_layer_range=dst, tensor_num_per_layer=per_layer)


PARAM_INVALID_CASES = [
    # src_cache_index.batch_index must be 0 for block pulls.
    pytest.param(PullCase(batch_index=1), id="batch_index-1"),
    pytest.param(PullCase(batch_index=2**32 - 1), id="batch_index-uint32-max"),
    # Cannot pull from our own cluster id.
    pytest.param(PullCase(own_cluster=True), id="own-cluster"),
    # src_blocks non-empty, len(src_blocks) == len(dst_blocks).
    pytest.param(PullCase(src_blocks=(), dst_blocks=()), id="both-empty"),
    pytest.param(PullCase(src_blocks=(), dst_blocks=(0,)), id="src-empty"),
    pytest.param(PullCase(src_blocks=(0, 1), dst_blocks=(2,)), id="src-longer"),
    pytest.param(PullCase(src_blocks=(0,), dst_blocks=(2, 3)), id="dst-longer"),
    pytest.param(PullCase(src_blocks=(0,), dst_blocks=()), id="dst-empty"),
    # Every src index < remote num_blocks, every dst index < local num_blocks (also values past 2^63).
    pytest.param(PullCase(src_blocks=(NUM_BLOCKS,), dst_blocks=(0,)), id="src-index-eq-num_blocks"),
    pytest.param(PullCase(src_blocks=(0, 1, NUM_BLOCKS + 5), dst_blocks=(0, 1, 2)), id="src-index-last-of-three"),
    pytest.param(PullCase(src_blocks=(2**63 - 1,), dst_blocks=(0,)), id="src-index-2^63-1"),
    pytest.param(PullCase(src_blocks=(2**63,), dst_blocks=(0,)), id="src-index-2^63"),
    pytest.param(PullCase(src_blocks=(2**64 - 1,), dst_blocks=(0,)), id="src-index-2^64-1"),
    pytest.param(PullCase(src_blocks=(0, 2**64 - 1), dst_blocks=(4, 5)), id="src-index-2^64-1-after-valid"),
    pytest.param(PullCase(src_blocks=(0,), dst_blocks=(NUM_BLOCKS,)), id="dst-index-eq-num_blocks"),
    pytest.param(PullCase(src_blocks=(0, 1), dst_blocks=(7, 2**32)), id="dst-index-2^32"),
    pytest.param(PullCase(src_blocks=(0,), dst_blocks=(2**63,)), id="dst-index-2^63"),
    pytest.param(PullCase(src_blocks=(0,), dst_blocks=(2**64 - 1,)), id="dst-index-2^64-1"),
    pytest.param(PullCase(src_blocks=(0, 1, 2), dst_blocks=(2**64 - 1, 2**64 - 2, 2**64 - 3)),
                 id="dst-index-descending-near-2^64"),
    # No duplicate destination blocks (two sources cannot land in one block).
    pytest.param(PullCase(src_blocks=(0, 1), dst_blocks=(3, 3)), id="dst-duplicate-adjacent"),
    pytest.param(PullCase(src_blocks=(0, 1, 2, 3), dst_blocks=(5, 1, 6, 5)), id="dst-duplicate-apart"),
    pytest.param(PullCase(src_blocks=(4, 4), dst_blocks=(6, 6)), id="dst-and-src-duplicate"),
    # Layer ranges: (-1, -1) or two indices >= 0.
    pytest.param(PullCase(ext=ext((-1, 0), (0, 0))), id="src-range-first-minus-1-only"),
    pytest.param(PullCase(ext=ext((0, -1), (0, 0))), id="src-range-second-minus-1-only"),
    pytest.param(PullCase(ext=ext((0, 0), (-1, 0))), id="dst-range-first-minus-1-only"),
    pytest.param(PullCase(ext=ext((0, 0), (0, -1))), id="dst-range-second-minus-1-only"),
    pytest.param(PullCase(ext=ext((-2, -2), (-2, -2))), id="ranges-minus-2"),
    pytest.param(PullCase(ext=ext((-1, -1), (-3, 1))), id="dst-range-minus-3"),
    # first <= second.
    pytest.param(PullCase(ext=ext((2, 1), (1, 2))), id="src-range-first-gt-second"),
    pytest.param(PullCase(ext=ext((0, 1), (3, 2))), id="dst-range-first-gt-second"),
    # second <= last layer = num_tensors / tensor_num_per_layer - 1 (= 3 here).
    pytest.param(PullCase(ext=ext((0, 4), (0, 4))), id="both-ranges-past-last-layer"),
    pytest.param(PullCase(ext=ext((4, 4), (0, 0))), id="src-range-past-last-layer"),
    pytest.param(PullCase(ext=ext((0, 0), (4, 4))), id="dst-range-past-last-layer"),
    pytest.param(PullCase(ext=ext((2, 2), (1, 1), per_layer=4)), id="past-last-layer-4-per-layer"),
    pytest.param(PullCase(ext=ext((0, 1), (0, 1), per_layer=8)), id="past-last-layer-8-per-layer"),
    # tensor_num_per_layer in [1, num_tensors] when a range is given.
    pytest.param(PullCase(ext=ext((0, 0), (0, 0), per_layer=NUM_TENSORS + 1)), id="per-layer-gt-num_tensors"),
    pytest.param(PullCase(ext=ext((0, 0), (0, 0), per_layer=300)), id="per-layer-300"),
    pytest.param(PullCase(ext=ext((0, 0), (0, 0), per_layer=2**32 - 1)), id="per-layer-uint32-max"),
    # ... and must divide num_tensors when a range is given.
    pytest.param(PullCase(ext=ext((0, 0), (0, 0), per_layer=3)), id="per-layer-3-not-dividing-8"),
    pytest.param(PullCase(ext=ext((1, 1), (0, 0), per_layer=5)), id="per-layer-5-not-dividing-8"),
    pytest.param(PullCase(ext=ext((0, 1), (0, 1), per_layer=4), src_cache="six"), id="per-layer-4-not-dividing-6"),
    # src and dst spans must be equal.
    pytest.param(PullCase(ext=ext((0, 1), (0, 0))), id="spans-2-vs-1"),
    pytest.param(PullCase(ext=ext((3, 3), (0, 3))), id="spans-1-vs-4"),
    pytest.param(PullCase(ext=ext(ALL, (0, 2))), id="spans-all-vs-3-layers"),
    pytest.param(PullCase(ext=ext((0, 2), ALL)), id="spans-3-layers-vs-all"),
    pytest.param(PullCase(ext=ext((0, 3), (0, 3)), src_cache="six"), id="six-tensors-past-last-layer"),
    # Bytes per block must be equal.
    pytest.param(PullCase(src_cache="wide"), id="bytes-per-block-32-vs-16"),
    pytest.param(PullCase(src_cache="wide", ext=ext((0, 0), (0, 0))), id="bytes-per-block-with-ranges"),
    # Tensor counts must be equal when every layer is pulled.
    pytest.param(PullCase(src_cache="six"), id="tensor-count-6-vs-8"),
    pytest.param(PullCase(src_cache="six", ext=ext(ALL, ALL, per_layer=1)), id="tensor-count-6-vs-8-explicit-ext"),
]


def _pull(env: Env, case: PullCase, *, timeout: float | None = None) -> object:
    src = {"src": env.src, "six": env.src_six, "wide": env.src_wide}[case.src_cache]
    cluster = env.dst_d.cluster_id if case.own_cluster else env.src_d.cluster_id
    return env.d.pull_kv_blocks(CacheIndex(cluster, src.cache_id, case.batch_index), env.dst, list(case.src_blocks),
                                list(case.dst_blocks), case.ext, timeout=timeout)


@pytest.mark.parametrize("case", PARAM_INVALID_CASES)
def test_pull_param_invalid(env: Env, case: PullCase) -> None:
    expect_error(env, lambda: _pull(env, case), ParamInvalidError, LlmStatus.LLM_PARAM_INVALID, "INVALID_ARGUMENT")


def test_pull_own_cluster_with_own_cache_is_param_invalid(env: Env) -> None:
    """Pulling 'from' our own cluster is refused even when the named cache exists locally."""
    expect_error(env, lambda: env.d.pull_kv_blocks(CacheIndex(env.dst_d.cluster_id, env.dst.cache_id), env.dst,
                                                   [0], [1]),
                 ParamInvalidError, LlmStatus.LLM_PARAM_INVALID, "INVALID_ARGUMENT")


# -- PullKvBlocks: the valid side of each boundary ------------------------------------------------------------------

VALID_CASES = [
    # Duplicate source blocks are allowed (one block fanned out to several destination blocks).
    pytest.param(PullCase(src_blocks=(3, 3, 3), dst_blocks=(0, 5, 7)), id="src-duplicates-allowed"),
    pytest.param(PullCase(src_blocks=(NUM_BLOCKS - 1,), dst_blocks=(NUM_BLOCKS - 1,)), id="last-block"),
    pytest.param(PullCase(src_blocks=tuple(range(NUM_BLOCKS)), dst_blocks=tuple(reversed(range(NUM_BLOCKS)))),
                 id="every-block-reversed"),
    pytest.param(PullCase(ext=ext((3, 3), (3, 3))), id="last-layer"),
    pytest.param(PullCase(ext=ext((0, 3), (0, 3))), id="every-layer-explicit"),
    pytest.param(PullCase(ext=ext((0, 0), (0, 0), per_layer=NUM_TENSORS)), id="per-layer-eq-num_tensors"),
    pytest.param(PullCase(ext=ext((7, 7), (0, 0), per_layer=1)), id="per-layer-1-last"),
    # tensor_num_per_layer 0 is "unset" on the wire (proto3), i.e. the documented default of 2.
    pytest.param(PullCase(ext=ext((3, 3), (0, 0), per_layer=0)), id="per-layer-0-means-2"),
    pytest.param(PullCase(ext=ext((1, 2), (2, 3), per_layer=0)), id="per-layer-0-means-2-two-layers"),
    # With (-1, -1) on both sides tensor_num_per_layer selects nothing and is not checked.
    pytest.param(PullCase(ext=ext(ALL, ALL, per_layer=3)), id="all-layers-ignores-per-layer"),
    # A 6-tensor source's 3 layers fit 3 of the destination's 4 layers.
    pytest.param(PullCase(ext=ext((0, 2), (1, 3)), src_cache="six"), id="six-tensors-into-8-with-ranges"),
]


def _tensors(desc: CacheDesc, case: PullCase, side: str) -> range:
    per = (case.ext.tensor_num_per_layer or 2) if case.ext else 2
    r = (case.ext.src_layer_range if side == "src" else case.ext.dst_layer_range) if case.ext else ALL
    return range(desc.num_tensors) if r == ALL else range(r[0] * per, (r[1] + 1) * per)


@pytest.mark.parametrize("case", VALID_CASES)
def test_pull_valid_boundaries(env: Env, case: PullCase) -> None:
    src = {"src": env.src, "six": env.src_six, "wide": env.src_wide}[case.src_cache]
    before = env.snapshot_all()
    _pull(env, case)
    expected = expected_pull(src, before[env.caches().index(env.dst)], list(case.src_blocks), list(case.dst_blocks),
                             _tensors(src.desc, case, "src"), _tensors(env.dst.desc, case, "dst"))
    assert_bytes_equal(env.dst.tensors, expected)
    # Only the destination changed.
    for i, cache in enumerate(env.caches()):
        if cache is not env.dst:
            assert_bytes_equal(cache.tensors, before[i])
    fill(env.dst, 2)  # Fresh, distinct bytes for the next test.


# -- PullKvBlocks: unknown caches, links, deadlines ----------------------------------------------------------------

@pytest.mark.parametrize("dst_id", [UNKNOWN_CACHE_ID, 0, -1, 2**63 - 1, -(2**63)])
def test_unknown_local_dst_cache(env: Env, dst_id: int) -> None:
    err = expect_error(env, lambda: env.d.pull_kv_blocks(env.remote(env.src), dst_id, [0], [0]),
                       KvCacheNotExistError, LlmStatus.LLM_KV_CACHE_NOT_EXIST, "NOT_FOUND")
    assert str(dst_id) in err.message


def test_dst_cache_id_of_the_other_daemon_is_unknown(env: Env) -> None:
    """A cache id that exists only on the source daemon does not name a destination cache here."""
    local_ids = {c.cache_id for c in env.d.list_caches()}
    foreign = next(c.cache_id for c in env.s.list_caches() if c.cache_id not in local_ids)
    expect_error(env, lambda: env.d.pull_kv_blocks(env.remote(env.src), foreign, [0], [0]),
                 KvCacheNotExistError, LlmStatus.LLM_KV_CACHE_NOT_EXIST, "NOT_FOUND")


def test_deallocated_local_dst_cache(env: Env) -> None:
    gone = env.d.allocate_cache(MAIN)
    env.d.deallocate_cache(gone)
    expect_error(env, lambda: env.d.pull_kv_blocks(env.remote(env.src), gone.cache_id, [0], [0]),
                 KvCacheNotExistError, LlmStatus.LLM_KV_CACHE_NOT_EXIST, "NOT_FOUND")


@pytest.mark.parametrize("cache_id", [UNKNOWN_CACHE_ID, 0, -7, 2**63 - 1])
def test_unknown_remote_cache(env: Env, cache_id: int) -> None:
    expect_error(env, lambda: env.d.pull_kv_blocks(env.remote(cache_id), env.dst, [0], [0]),
                 KvCacheNotExistError, LlmStatus.LLM_KV_CACHE_NOT_EXIST, "NOT_FOUND")


def test_remote_cache_deallocated_before_first_pull(env: Env) -> None:
    gone = env.s.allocate_cache(MAIN)
    env.s.deallocate_cache(gone)
    expect_error(env, lambda: env.d.pull_kv_blocks(env.remote(gone.cache_id), env.dst, [0], [0]),
                 KvCacheNotExistError, LlmStatus.LLM_KV_CACHE_NOT_EXIST, "NOT_FOUND")


def test_remote_cache_deallocated_after_a_pull(env: Env) -> None:
    """The link remembers remote descriptors; a cache freed since must still be refused, not read."""
    stale = env.s.allocate_cache(MAIN)
    try:
        fill(stale, 9)
        env.d.pull_kv_blocks(env.remote(stale), env.dst, [0], [0])
        fill(env.dst, 2)
    finally:
        env.s.deallocate_cache(stale)
    expect_error(env, lambda: env.d.pull_kv_blocks(env.remote(stale.cache_id), env.dst, [1, 2], [3, 4]),
                 KvCacheNotExistError, LlmStatus.LLM_KV_CACHE_NOT_EXIST, "NOT_FOUND")
    # The refusal did not break the link: a live cache is still pulled.
    before = snapshot(env.dst)
    env.d.pull_kv_blocks(env.remote(env.src), env.dst, [5], [6])
    assert_bytes_equal(env.dst.tensors, expected_pull(env.src, before, [5], [6], range(8), range(8)))
    fill(env.dst, 2)


def test_cluster_not_linked(env: Env) -> None:
    expect_error(env, lambda: env.d.pull_kv_blocks(CacheIndex(UNLINKED_CLUSTER, env.src.cache_id), env.dst, [0],
                                                   [0]),
                 NotYetLinkError, LlmStatus.LLM_NOT_YET_LINK, "FAILED_PRECONDITION")


def test_link_is_one_way(env: Env) -> None:
    """dst linked to src; src did not link to dst, so src cannot pull from dst."""
    expect_error(env, lambda: env.s.pull_kv_blocks(CacheIndex(env.dst_d.cluster_id, env.dst.cache_id), env.src,
                                                   [0], [0]),
                 NotYetLinkError, LlmStatus.LLM_NOT_YET_LINK, "FAILED_PRECONDITION")


DEADLINE_BLOCKS = 100_000
DEADLINE_DESC = CacheDesc(num_tensors=2, shape=(DEADLINE_BLOCKS, 1), data_type=DataType.UINT8)


@pytest.mark.parametrize("timeout", [1e-6, 1e-4])
def test_deadline_too_short(env: Env, timeout: float) -> None:
    """A deadline that passes before the daemon can start copying: LLM_TIMEOUT and no byte written.

    gRPC rounds deadlines up to whole milliseconds, so a tiny pull can finish inside a "1 us" deadline (it does, now
    and then, over a unix socket); the pull here names 100,000 scattered blocks, which no daemon can even decode in
    a millisecond. The same pull with room to run succeeds, so the refusal is the deadline's doing.
    """
    rng = np.random.default_rng(17)
    src_blocks = rng.permutation(DEADLINE_BLOCKS).tolist()
    dst_blocks = rng.permutation(DEADLINE_BLOCKS).tolist()
    src, dst = env.s.allocate_cache(DEADLINE_DESC), env.d.allocate_cache(DEADLINE_DESC)
    try:
        fill(src, 21)
        fill(dst, 22)
        env.others += [src, dst]
        before = env.snapshot_all()
        with pytest.raises(LlmError) as info:
            env.d.pull_kv_blocks(env.remote(src), dst, src_blocks, dst_blocks, timeout=timeout)
        err = info.value
        assert type(err) is LlmTimeoutError, err
        assert err.status == LlmStatus.LLM_TIMEOUT
        assert err.details.get("grpc_code") == "DEADLINE_EXCEEDED"
        # The daemon's own deadline passed before ours, so it starts no copy now; one it started keeps its place in
        # transfers_in_flight until it stops. Once none runs, nothing can land later.
        metrics_at = env.d.get_cluster_info().metrics_address
        wait_until(lambda: transfers_in_flight(metrics_at) == 0, what="no transfer running in the destination")
        env.assert_unchanged(before)

        expected = expected_pull(src, snapshot(dst), src_blocks, dst_blocks, range(2), range(2))
        env.d.pull_kv_blocks(env.remote(src), dst, src_blocks, dst_blocks, timeout=60)
        assert_bytes_equal(dst.tensors, expected)
    finally:
        env.others = [c for c in env.others if c is not src and c is not dst]
        env.s.deallocate_cache(src)
        env.d.deallocate_cache(dst)


# -- The wire: status message prefix and rich details --------------------------------------------------------------

def _raw_pull(env: Env, **overrides: object) -> grpc.RpcError:
    fields: dict[str, object] = {
        "src_cache_index": types_pb2.CacheIndex(cluster_id=env.src_d.cluster_id, cache_id=env.src.cache_id),
        "dst_cache_id": env.dst.cache_id, "src_blocks": [0], "dst_blocks": [1],
    }
    fields.update(overrides)
    with grpc.insecure_channel(env.dst_d.target) as channel:
        stub = broker_pb2_grpc.KvBrokerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.PullKvBlocks(broker_pb2.PullKvBlocksRequest(**fields), timeout=10)  # type: ignore[arg-type]
    err: grpc.RpcError = info.value
    return err


def _error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    bins = [v for k, v in (err.trailing_metadata() or ()) if k == "grpc-status-details-bin"]
    assert len(bins) == 1, err.trailing_metadata()
    rich = status_pb2.Status.FromString(bins[0])
    assert rich.code == err.code().value[0]
    assert rich.message == err.details()
    infos = []
    for any_msg in rich.details:
        info = error_details_pb2.ErrorInfo()
        if any_msg.Is(info.DESCRIPTOR):
            any_msg.Unpack(info)
            infos.append(info)
    assert len(infos) == 1, rich
    return infos[0]


RAW_CASES = [
    pytest.param({"src_cache_index": "batch1"}, LlmStatus.LLM_PARAM_INVALID, grpc.StatusCode.INVALID_ARGUMENT,
                 id="param-invalid"),
    pytest.param({"src_blocks": []}, LlmStatus.LLM_PARAM_INVALID, grpc.StatusCode.INVALID_ARGUMENT,
                 id="param-invalid-empty"),
    pytest.param({"dst_cache_id": UNKNOWN_CACHE_ID}, LlmStatus.LLM_KV_CACHE_NOT_EXIST, grpc.StatusCode.NOT_FOUND,
                 id="kv-cache-not-exist"),
    pytest.param({"src_cache_index": "unlinked"}, LlmStatus.LLM_NOT_YET_LINK, grpc.StatusCode.FAILED_PRECONDITION,
                 id="not-yet-link"),
]


@pytest.mark.parametrize(("overrides", "status", "code"), RAW_CASES)
def test_wire_status_message_and_details(env: Env, overrides: dict[str, object], status: LlmStatus,
                                         code: grpc.StatusCode) -> None:
    index = overrides.get("src_cache_index")
    if index == "batch1":
        overrides["src_cache_index"] = types_pb2.CacheIndex(cluster_id=env.src_d.cluster_id,
                                                            cache_id=env.src.cache_id, batch_index=1)
    elif index == "unlinked":
        overrides["src_cache_index"] = types_pb2.CacheIndex(cluster_id=UNLINKED_CLUSTER, cache_id=env.src.cache_id)
    before = env.snapshot_all()
    err = _raw_pull(env, **overrides)
    assert err.code() == code
    assert err.details().startswith(f"{status.name}: "), err.details()
    assert len(err.details()) > len(status.name) + 2, "the message must say more than the status name"
    info = _error_info(err)
    assert info.reason == status.name
    assert info.domain == "kvbroker"
    assert info.metadata["status_code"] == str(int(status))
    env.assert_unchanged(before)


def test_wire_ext_param_without_tensor_num_per_layer_means_2(env: Env) -> None:
    """ext_param present with layer ranges but tensor_num_per_layer unset (0): the default of 2 applies."""
    before = snapshot(env.dst)
    req = broker_pb2.PullKvBlocksRequest(
        src_cache_index=types_pb2.CacheIndex(cluster_id=env.src_d.cluster_id, cache_id=env.src.cache_id),
        dst_cache_id=env.dst.cache_id, src_blocks=[1, 2], dst_blocks=[6, 7],
        ext_param=types_pb2.KvCacheExtParam(src_layer_range=types_pb2.LayerRange(first=2, second=2),
                                            dst_layer_range=types_pb2.LayerRange(first=1, second=1)),
    )
    with grpc.insecure_channel(env.dst_d.target) as channel:
        broker_pb2_grpc.KvBrokerStub(channel).PullKvBlocks(req, timeout=10)
    assert_bytes_equal(env.dst.tensors, expected_pull(env.src, before, [1, 2], [6, 7], range(4, 6), range(2, 4)))
    fill(env.dst, 2)


def test_wire_ext_param_with_only_dst_range(env: Env) -> None:
    """An unset src_layer_range means (-1, -1): all 8 source tensors cannot fit the 2 of one destination layer."""
    before = env.snapshot_all()
    err = _raw_pull(env, ext_param=types_pb2.KvCacheExtParam(
        dst_layer_range=types_pb2.LayerRange(first=0, second=0)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("LLM_PARAM_INVALID: ")
    env.assert_unchanged(before)


# -- Cache descriptors: AllocateCache --------------------------------------------------------------------------------

def _cache_ids(c: Client) -> set[int]:
    return {r.cache_id for r in c.list_caches()}


def _expect_desc_error(env: Env, call: Callable[[], object]) -> LlmError:
    before = _cache_ids(env.d)
    err = expect_error(env, call, ParamInvalidError, LlmStatus.LLM_PARAM_INVALID, "INVALID_ARGUMENT")
    assert _cache_ids(env.d) == before, "a refused descriptor must not leave a cache behind"
    return err


BAD_DESCS = [
    pytest.param(CacheDesc(num_tensors=0, shape=(4, 4)), id="num_tensors-0"),
    pytest.param(CacheDesc(num_tensors=2, shape=()), id="shape-0-dims"),
    pytest.param(CacheDesc(num_tensors=2, shape=(1,) * 33), id="shape-33-dims"),
    pytest.param(CacheDesc(num_tensors=2, shape=(2,) + (1,) * 40), id="shape-41-dims"),
    pytest.param(CacheDesc(num_tensors=2, shape=(0, 4)), id="num_blocks-0"),
    pytest.param(CacheDesc(num_tensors=2, shape=(4, 0, 2)), id="inner-dim-0"),
    pytest.param(CacheDesc(num_tensors=2, shape=(4, -1)), id="dim-minus-1"),
    pytest.param(CacheDesc(num_tensors=2, shape=(-4,)), id="num_blocks-negative"),
    pytest.param(CacheDesc(num_tensors=2, shape=(4, 2, -2**62)), id="dim-very-negative"),
    pytest.param(CacheDesc(num_tensors=2, shape=(-2, -2)), id="two-negatives"),
]


@pytest.mark.parametrize("desc", BAD_DESCS)
def test_allocate_bad_descriptor(env: Env, desc: CacheDesc) -> None:
    _expect_desc_error(env, lambda: env.d.allocate_cache(desc))


@pytest.mark.parametrize("desc", [
    pytest.param(CacheDesc(num_tensors=1, shape=(1,), data_type=DataType.UINT8), id="smallest"),
    pytest.param(CacheDesc(num_tensors=2, shape=(2,) + (1,) * 31, data_type=DataType.INT8), id="32-dims"),
])
def test_allocate_boundary_descriptor_is_accepted(env: Env, desc: CacheDesc) -> None:
    cache = env.d.allocate_cache(desc)
    try:
        assert cache.desc.shape == desc.shape
        assert len(cache.tensors) == desc.num_tensors
    finally:
        env.d.deallocate_cache(cache)


def _raw_allocate(env: Env, desc: types_pb2.CacheDesc) -> grpc.RpcError:
    with grpc.insecure_channel(env.dst_d.target) as channel:
        stub = broker_pb2_grpc.KvBrokerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.AllocateCache(broker_pb2.AllocateCacheRequest(desc=desc), timeout=10)
    err: grpc.RpcError = info.value
    return err


@pytest.mark.parametrize(("data_type", "placement"), [
    pytest.param(999, 1, id="data_type-999"),
    pytest.param(0, 1, id="data_type-unspecified"),
    pytest.param(-1, 1, id="data_type-minus-1"),
    pytest.param(1, 999, id="placement-999"),
])
def test_allocate_unknown_enum_values(env: Env, data_type: int, placement: int) -> None:
    before = _cache_ids(env.d)
    desc = types_pb2.CacheDesc(num_tensors=2, shape=[4, 4])
    desc.data_type = data_type  # type: ignore[assignment]
    desc.placement = placement  # type: ignore[assignment]
    err = _raw_allocate(env, desc)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith("LLM_PARAM_INVALID: "), err.details()
    assert _error_info(err).reason == "LLM_PARAM_INVALID"
    assert _cache_ids(env.d) == before


# -- Cache descriptors: RegisterKvCache ----------------------------------------------------------------------------

REG_DESC = CacheDesc(num_tensors=2, shape=(4, 8), data_type=DataType.UINT8)  # 32 bytes per tensor
SEGMENT_BYTES = 4096


@pytest.fixture
def segment() -> Iterator[str]:
    """A caller-owned shm segment of SEGMENT_BYTES random bytes; yields its name."""
    name = f"kvbroker-test-{uuid.uuid4().hex}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, SEGMENT_BYTES)
        os.write(fd, np.random.default_rng(7).integers(0, 256, SEGMENT_BYTES, dtype=np.uint8).tobytes())
        os.close(fd)
        yield name
    finally:
        os.unlink(path)


def _segment_bytes(name: str) -> bytes:
    with open(os.path.join(SHM_DIR, name), "rb") as f:
        return f.read()


REG_CASES = [
    pytest.param([0], id="one-location-for-two-tensors"),
    pytest.param([0, 32, 64], id="three-locations-for-two-tensors"),
    pytest.param([], id="no-locations"),
    pytest.param([0, "missing"], id="nonexistent-segment"),
    pytest.param([0, SEGMENT_BYTES - 31], id="region-one-byte-past-end"),
    pytest.param([0, SEGMENT_BYTES], id="region-starts-at-end"),
    pytest.param([0, 2**63], id="offset-2^63"),
    pytest.param([0, 2**64 - 32], id="offset-wraps-uint64"),
    pytest.param([0, 31], id="overlap-by-one-byte"),
    pytest.param([64, 64], id="same-offset"),
    pytest.param([100, 80], id="overlap-out-of-order"),
    pytest.param([0, "../x"], id="name-dotdot-slash"),
    pytest.param([0, "a/b"], id="name-with-slash"),
    pytest.param([0, ""], id="name-empty"),
    pytest.param([0, ".."], id="name-dotdot"),
    pytest.param([0, "."], id="name-dot"),
    pytest.param([0, "/dev/shm/x"], id="name-absolute"),
    pytest.param([0, "x" * 300], id="name-too-long"),
]


@pytest.mark.parametrize("locations", REG_CASES)
def test_register_bad_locations(env: Env, segment: str, locations: list[int | str]) -> None:
    tensors = []
    for i, loc in enumerate(locations):
        if isinstance(loc, int):
            tensors.append(TensorLocation(segment, loc))
        elif loc == "missing":
            tensors.append(TensorLocation(f"kvbroker-test-missing-{uuid.uuid4().hex}", 0))
        else:
            tensors.append(TensorLocation(loc, 32 * i))
    before = _segment_bytes(segment)
    _expect_desc_error(env, lambda: env.d.register_kv_cache(REG_DESC, tensors))
    assert _segment_bytes(segment) == before


@pytest.mark.parametrize("desc", BAD_DESCS[:5])
def test_register_bad_descriptor(env: Env, segment: str, desc: CacheDesc) -> None:
    tensors = [TensorLocation(segment, 0)] * max(1, desc.num_tensors)
    _expect_desc_error(env, lambda: env.d.register_kv_cache(desc, tensors))


@pytest.mark.parametrize("offsets", [[0, 32], [SEGMENT_BYTES - 32, 0], [1, 33]], ids=["packed", "swapped", "odd"])
def test_register_valid_locations(env: Env, segment: str, offsets: list[int]) -> None:
    cache = env.d.register_kv_cache(REG_DESC, [TensorLocation(segment, o) for o in offsets])
    try:
        raw = np.frombuffer(_segment_bytes(segment), dtype=np.uint8)
        for t, o in zip(cache.tensors, offsets, strict=True):
            assert np.array_equal(t.reshape(-1).view(np.uint8), raw[o : o + 32])
    finally:
        env.d.unregister_kv_cache(cache)


# -- LinkClusters: at most 16 clusters per call --------------------------------------------------------------------

def _clusters(n: int) -> list[ClusterInfo]:
    return [ClusterInfo(remote_cluster_id=50_000 + i, remote_address=f"127.0.0.1:{1 + i}") for i in range(n)]


@pytest.mark.parametrize("n", [17, 100])
def test_link_too_many_clusters_client(env: Env, n: int) -> None:
    links_before = _link_identities(env)
    with pytest.raises(ClusterNumExceedLimitError) as info:
        env.d.link_clusters(_clusters(n))
    assert info.value.status == LlmStatus.LLM_CLUSTER_NUM_EXCEED_LIMIT
    with pytest.raises(ClusterNumExceedLimitError):
        env.d.unlink_clusters(_clusters(n))
    assert _link_identities(env) == links_before


def _link_identities(env: Env) -> list[tuple[int, str, LinkState, str]]:
    """What a refused (un)link must leave alone; last_seen moves with every heartbeat, so it is left out."""
    return [(x.remote_cluster_id, x.remote_address, x.state, x.remote_epoch) for x in env.d.list_links()]


@pytest.mark.parametrize("method", ["LinkClusters", "UnlinkClusters"])
def test_link_too_many_clusters_daemon(env: Env, method: str) -> None:
    """The daemon enforces the limit itself (a client other than ours need not check)."""
    links_before = _link_identities(env)
    clusters = [broker_pb2.ClusterInfo(remote_cluster_id=c.remote_cluster_id, remote_address=c.remote_address)
                for c in _clusters(17)]
    req = (broker_pb2.LinkClustersRequest(clusters=clusters, timeout_ms=100) if method == "LinkClusters"
           else broker_pb2.UnlinkClustersRequest(clusters=clusters, timeout_ms=100))
    with grpc.insecure_channel(env.dst_d.target) as channel:
        stub = broker_pb2_grpc.KvBrokerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            getattr(stub, method)(req, timeout=10)
    err: grpc.RpcError = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details().startswith("LLM_CLUSTER_NUM_EXCEED_LIMIT: "), err.details()
    assert _error_info(err).reason == "LLM_CLUSTER_NUM_EXCEED_LIMIT"
    assert _link_identities(env) == links_before


def test_sixteen_clusters_are_within_the_limit(env: Env) -> None:
    """16 is allowed: unlinking 16 clusters we never linked answers per cluster (each fails on its own: not linked);
    the call as a whole is not refused."""
    results = env.d.unlink_clusters(_clusters(16))
    assert [r.remote_cluster_id for r in results] == [c.remote_cluster_id for c in _clusters(16)]
    assert all(r.status == LlmStatus.LLM_NOT_YET_LINK for r in results), results
