"""Hypothesis-generated PullKvBlocks requests and cache descriptors against two live linked daemons.

Every request either succeeds, and then the destination equals an independent model of LLM-DataDist's rules
(plain numpy indexing), or fails with an LlmError whose status is one the rules it breaks allow (all within the
documented set PARAM_INVALID / KV_CACHE_NOT_EXIST / NOT_YET_LINK / TIMEOUT) and with no byte of any cache changed.
The model names every rule a request breaks, so a request that breaks several may be refused by any of them: the
order in which the daemon checks is not part of the contract.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbroker import Cache, CacheDesc, CacheIndex, Client, DataType, KvCacheExtParam, LinkState, LlmError, LlmStatus
from kvbroker._errors import error_from_rpc
from kvbroker._local import LocalDaemon
from kvbroker.status import grpc_code_for
from kvbroker.v1 import broker_pb2, broker_pb2_grpc, types_pb2
from tests.helpers import Allocations, assert_bytes_equal, expected_pull, fill, snapshot

Pair = tuple[LocalDaemon, LocalDaemon]

PI = LlmStatus.LLM_PARAM_INVALID
NOT_EXIST = LlmStatus.LLM_KV_CACHE_NOT_EXIST
NOT_LINKED = LlmStatus.LLM_NOT_YET_LINK
TIMEOUT = LlmStatus.LLM_TIMEOUT
DOCUMENTED = {PI, NOT_EXIST, NOT_LINKED, TIMEOUT}
ALL = (-1, -1)
UNLINKED_CLUSTER = 31_337
UNKNOWN_CACHE_ID = 7_777_777

# Source caches (on the source daemon) and destination caches (on the destination daemon). Most share 16-byte
# blocks so that their pairs can succeed; the 3-byte ones refuse every 16-byte partner.
SRC_DESCS = {
    "s4": CacheDesc(num_tensors=4, shape=(8, 4, 2), data_type=DataType.FLOAT16),
    "s8": CacheDesc(num_tensors=8, shape=(6, 16), data_type=DataType.INT8),
    "s4f": CacheDesc(num_tensors=4, shape=(10, 2, 2), data_type=DataType.FLOAT32),
    "s2": CacheDesc(num_tensors=2, shape=(8, 3), data_type=DataType.UINT8),
}
DST_DESCS = {
    "d4": CacheDesc(num_tensors=4, shape=(8, 4, 2), data_type=DataType.FLOAT16),
    "d8": CacheDesc(num_tensors=8, shape=(12, 8), data_type=DataType.BFLOAT16),
    "d6": CacheDesc(num_tensors=6, shape=(5, 16), data_type=DataType.UINT8),
    "d2": CacheDesc(num_tensors=2, shape=(4, 3), data_type=DataType.INT8),
}
MISSING = ("freed", "unknown", "zero", "negative")


@dataclass
class World:
    src_d: LocalDaemon
    dst_d: LocalDaemon
    s: Client
    d: Client
    src: dict[str, Cache]
    dst: dict[str, Cache]
    freed_src_id: int
    freed_dst_id: int

    def caches(self) -> list[Cache]:
        return [*self.src.values(), *self.dst.values()]

    def snapshot_all(self) -> list[list[np.ndarray]]:
        return [snapshot(c) for c in self.caches()]

    def missing_id(self, ref: str, side: str) -> int:
        return {"freed": self.freed_src_id if side == "src" else self.freed_dst_id, "unknown": UNKNOWN_CACHE_ID,
                "zero": 0, "negative": -3}[ref]


@pytest.fixture(scope="module")
def world(linked_pair: Pair) -> Iterator[World]:
    src_d, dst_d = linked_pair
    with src_d.client() as s, dst_d.client() as d:
        caches = Allocations()
        alloc = caches.alloc
        try:
            src = {name: alloc(s, desc, i) for i, (name, desc) in enumerate(SRC_DESCS.items())}
            dst = {name: alloc(d, desc, 100 + i) for i, (name, desc) in enumerate(DST_DESCS.items())}
            freed_src, freed_dst = s.allocate_cache(SRC_DESCS["s4"]), d.allocate_cache(DST_DESCS["d4"])
            s.deallocate_cache(freed_src)
            d.deallocate_cache(freed_dst)
            yield World(src_d, dst_d, s, d, src, dst, freed_src.cache_id, freed_dst.cache_id)
        finally:
            caches.release()


# -- Strategies ----------------------------------------------------------------------------------------------------

HUGE_BLOCKS = [2**64 - 1, 2**64 - 2, 2**63, 2**63 - 1, 2**32, 2**32 - 1]
_small_block = st.integers(0, 12)
huge_block = st.sampled_from(HUGE_BLOCKS)
block = st.one_of(_small_block, _small_block, _small_block, huge_block)
_layer = st.integers(-3, 10)
layer_range = st.one_of(
    st.just(ALL),
    st.tuples(_layer, _layer),
    st.tuples(st.integers(0, 3), st.integers(0, 3)).map(lambda r: (min(r), max(r))),
)
tensor_num_per_layer = st.one_of(st.sampled_from([0, 1, 2, 4]), st.integers(0, 300), st.just(2**32 - 1))
ext_param = st.one_of(
    st.none(),
    st.builds(KvCacheExtParam, src_layer_range=layer_range, dst_layer_range=layer_range,
              tensor_num_per_layer=tensor_num_per_layer),
)


@dataclass(frozen=True)
class PullReq:
    cluster: str  # "remote" | "own" | "unlinked"
    src_ref: str  # a SRC_DESCS name or one of MISSING
    dst_ref: str  # a DST_DESCS name or one of MISSING
    batch_index: int
    src_blocks: list[int]
    dst_blocks: list[int]
    ext: KvCacheExtParam | None
    tiny_deadline: bool


@st.composite
def wild_requests(draw: st.DrawFn) -> PullReq:
    """Anything: block lists from the whole uint64 range, any cache names, any layer selection."""
    n = draw(st.integers(0, 8))
    src_blocks = draw(st.lists(block, min_size=n, max_size=n))
    dst_len = n if draw(st.integers(0, 4)) else draw(st.integers(0, 8))
    dst_blocks = draw(st.lists(block, min_size=dst_len, max_size=dst_len, unique=draw(st.booleans())))
    return PullReq(
        cluster=draw(st.sampled_from(["remote"] * 6 + ["own", "unlinked"])),
        src_ref=draw(st.sampled_from([*SRC_DESCS] * 3 + list(MISSING))),
        dst_ref=draw(st.sampled_from([*DST_DESCS] * 3 + list(MISSING))),
        batch_index=draw(st.one_of(st.just(0), st.just(0), st.just(0), st.integers(1, 2**32 - 1))),
        src_blocks=src_blocks,
        dst_blocks=dst_blocks,
        ext=draw(ext_param),
        tiny_deadline=draw(st.integers(0, 9)) == 0,
    )


INCOMPATIBLE_PAIRS = [(s, d) for s, sd in SRC_DESCS.items() for d, dd in DST_DESCS.items()
                      if sd.block_nbytes != dd.block_nbytes]
COMPATIBLE_PAIRS = [(s, d) for s, sd in SRC_DESCS.items() for d, dd in DST_DESCS.items()
                    if sd.block_nbytes == dd.block_nbytes]


def _fitting_ext(draw: st.DrawFn, src: CacheDesc, dst: CacheDesc) -> KvCacheExtParam | None:
    """A layer selection that fits both caches when one exists (else the default, which may not)."""
    per = draw(st.sampled_from([0, 1, 2, 4]))
    p = per or 2
    kind = draw(st.integers(0, 3))
    if kind == 0 or src.num_tensors % p or dst.num_tensors % p:
        return None if draw(st.booleans()) else KvCacheExtParam(tensor_num_per_layer=draw(tensor_num_per_layer))
    src_layers, dst_layers = src.num_tensors // p, dst.num_tensors // p
    if kind == 1 and src_layers <= dst_layers:  # every source layer into some destination layers
        first = draw(st.integers(0, dst_layers - src_layers))
        return KvCacheExtParam(ALL, (first, first + src_layers - 1), per)
    if kind == 1 and dst_layers < src_layers:  # some source layers into every destination layer
        first = draw(st.integers(0, src_layers - dst_layers))
        return KvCacheExtParam((first, first + dst_layers - 1), ALL, per)
    k = draw(st.integers(1, min(src_layers, dst_layers)))
    fs, fd = draw(st.integers(0, src_layers - k)), draw(st.integers(0, dst_layers - k))
    return KvCacheExtParam((fs, fs + k - 1), (fd, fd + k - 1), per)


MUTATIONS = [
    "pair-block-bytes-differ", "src-cache-missing", "dst-cache-missing", "src-block-past-end", "dst-block-past-end",
    "src-block-huge", "dst-block-huge", "dst-duplicate", "lengths-differ", "both-empty", "own-cluster",
    "unlinked-cluster", "batch-index", "wild-ext", "wild-tensor-num-per-layer", "range-half-default",
    "range-reversed", "range-past-last-layer", "per-layer-not-dividing", "per-layer-too-big", "spans-differ",
]


def _mutate_range(draw: st.DrawFn, ext: KvCacheExtParam, mutation: str, src: CacheDesc, dst: CacheDesc
                  ) -> KvCacheExtParam:
    """Breaks one layer range of `ext` in the way `mutation` names."""
    side = draw(st.sampled_from(["src", "dst"]))
    desc = src if side == "src" else dst
    p = ext.tensor_num_per_layer or 2
    layers = max(1, desc.num_tensors // p)
    rng = ext.src_layer_range if side == "src" else ext.dst_layer_range
    first, second = rng if rng != ALL else (0, layers - 1)
    if mutation == "range-half-default":
        new = draw(st.sampled_from([(-1, second), (first, -1), (-2, second), (first, -3)]))
    elif mutation == "range-reversed":
        new = (second + 1, second) if first == second else (second, first)
    elif mutation == "range-past-last-layer":
        new = (first + 1, layers) if first < second else (layers, layers)
    else:  # spans-differ
        new = (first, second + 1) if second + 1 < layers else (first + 1, second) if first < second else (0, 0)
    if side == "src":
        return KvCacheExtParam(new, ext.dst_layer_range, ext.tensor_num_per_layer)
    return KvCacheExtParam(ext.src_layer_range, new, ext.tensor_num_per_layer)


@st.composite
def near_valid_requests(draw: st.DrawFn) -> PullReq:
    """A request built to fit a cache pair, then broken in at most one way: most requests are valid or break exactly
    one rule, so each rule is seen alone."""
    mutation = draw(st.sampled_from(["none"] * 6 + MUTATIONS))
    pairs = INCOMPATIBLE_PAIRS if mutation == "pair-block-bytes-differ" else COMPATIBLE_PAIRS
    src_ref, dst_ref = draw(st.sampled_from(pairs))
    src, dst = SRC_DESCS[src_ref], DST_DESCS[dst_ref]
    n = draw(st.integers(1, min(src.num_blocks, dst.num_blocks, 8)))
    src_blocks = draw(st.lists(st.integers(0, src.num_blocks - 1), min_size=n, max_size=n))
    dst_blocks = draw(st.lists(st.integers(0, dst.num_blocks - 1), min_size=n, max_size=n, unique=True))
    ext = _fitting_ext(draw, src, dst)
    cluster, batch_index = "remote", 0
    i = draw(st.integers(0, n - 1))
    if mutation == "src-cache-missing":
        src_ref = draw(st.sampled_from(MISSING))
    elif mutation == "dst-cache-missing":
        dst_ref = draw(st.sampled_from(MISSING))
    elif mutation in ("src-block-past-end", "src-block-huge"):
        bad = src.num_blocks + draw(st.integers(0, 1)) if mutation.endswith("end") else draw(huge_block)
        src_blocks = [bad if k == i else b for k, b in enumerate(src_blocks)]
    elif mutation in ("dst-block-past-end", "dst-block-huge"):
        bad = dst.num_blocks + draw(st.integers(0, 1)) if mutation.endswith("end") else draw(huge_block)
        dst_blocks = [bad if k == i else b for k, b in enumerate(dst_blocks)]
    elif mutation == "dst-duplicate" and n >= 2:
        j = draw(st.integers(0, n - 1).filter(lambda k: k != i))
        dst_blocks = [dst_blocks[i] if k == j else b for k, b in enumerate(dst_blocks)]
    elif mutation == "lengths-differ":
        if draw(st.booleans()):
            src_blocks = src_blocks[:-1] if n > 1 else [*src_blocks, 0]
        else:
            dst_blocks = dst_blocks[:-1] if n > 1 else []
    elif mutation == "both-empty":
        src_blocks, dst_blocks = [], []
    elif mutation == "own-cluster":
        cluster = "own"
    elif mutation == "unlinked-cluster":
        cluster = "unlinked"
    elif mutation == "batch-index":
        batch_index = draw(st.integers(1, 2**32 - 1))
    elif mutation == "wild-ext":
        ext = draw(ext_param)
    elif mutation == "wild-tensor-num-per-layer":
        base = ext or KvCacheExtParam()
        ext = KvCacheExtParam(base.src_layer_range, base.dst_layer_range, draw(tensor_num_per_layer))
    elif mutation in ("per-layer-not-dividing", "per-layer-too-big") and ext is not None:
        n_min = min(src.num_tensors, dst.num_tensors)
        per = (draw(st.integers(1, n_min).filter(lambda v: src.num_tensors % v or dst.num_tensors % v))
               if mutation == "per-layer-not-dividing" and n_min > 2 else
               draw(st.integers(max(src.num_tensors, dst.num_tensors) + 1, 300)))
        ext = KvCacheExtParam(ext.src_layer_range, ext.dst_layer_range, per)
    elif mutation.startswith(("range-", "spans-")):
        ext = _mutate_range(draw, ext or KvCacheExtParam(), mutation, src, dst)
    return PullReq(cluster=cluster, src_ref=src_ref, dst_ref=dst_ref, batch_index=batch_index,
                   src_blocks=src_blocks, dst_blocks=dst_blocks, ext=ext, tiny_deadline=draw(st.integers(0, 9)) == 0)


pull_requests = st.one_of(near_valid_requests(), near_valid_requests(), near_valid_requests(), wild_requests())


# -- The model -----------------------------------------------------------------------------------------------------

def layer_tensors(desc: CacheDesc, rng: tuple[int, int], per_layer: int) -> range | None:
    """Tensors an inclusive layer range selects (reference §4.2), or None when the range is invalid."""
    if rng == ALL:
        return range(desc.num_tensors)
    first, second = rng
    if first < 0 or second < 0 or first > second:
        return None
    if not 1 <= per_layer <= desc.num_tensors or desc.num_tensors % per_layer:
        return None
    if second > desc.num_tensors // per_layer - 1:
        return None
    return range(first * per_layer, (second + 1) * per_layer)


@dataclass(frozen=True)
class Outcome:
    refusals: frozenset[LlmStatus]
    """Statuses of every rule the request breaks; empty when it must succeed."""
    src_tensors: range = range(0)
    dst_tensors: range = range(0)


def predict(req: PullReq, src: CacheDesc | None, dst: CacheDesc | None) -> Outcome:
    bad: set[LlmStatus] = set()
    if req.batch_index != 0:
        bad.add(PI)
    if req.cluster == "own":
        bad.add(PI)
    if not req.src_blocks or len(req.src_blocks) != len(req.dst_blocks):
        bad.add(PI)
    if dst is None:
        bad.add(NOT_EXIST)
    if req.cluster == "unlinked":
        bad.add(NOT_LINKED)
    if req.cluster == "remote" and src is None:
        bad.add(NOT_EXIST)
    if dst is not None and (any(b >= dst.num_blocks for b in req.dst_blocks)
                            or len(set(req.dst_blocks)) != len(req.dst_blocks)):
        bad.add(PI)
    if req.cluster != "remote" or src is None or dst is None:
        return Outcome(frozenset(bad))
    if any(b >= src.num_blocks for b in req.src_blocks):
        bad.add(PI)
    if src.block_nbytes != dst.block_nbytes:
        bad.add(PI)
    ext = req.ext or KvCacheExtParam()
    per_layer = ext.tensor_num_per_layer or 2  # 0 is proto3's "unset": the default, 2.
    s = layer_tensors(src, ext.src_layer_range, per_layer)
    d = layer_tensors(dst, ext.dst_layer_range, per_layer)
    if s is None or d is None or len(s) != len(d):
        bad.add(PI)
        return Outcome(frozenset(bad))
    return Outcome(frozenset(bad), s, d)


def _check_error(err: LlmError) -> None:
    assert err.status in DOCUMENTED, err
    assert err.details.get("grpc_code") == grpc_code_for(err.status).name, err.details


# -- PullKvBlocks ----------------------------------------------------------------------------------------------------

def test_fuzz_pull_kv_blocks(world: World) -> None:
    seen: Counter[str] = Counter()
    links_before = world.d.list_links()
    caches_before = (world.s.get_cluster_info().num_caches, world.d.get_cluster_info().num_caches)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(req=pull_requests)
    def run(req: PullReq) -> None:
        src_cache = world.src.get(req.src_ref)
        dst_cache = world.dst.get(req.dst_ref)
        src_id = src_cache.cache_id if src_cache else world.missing_id(req.src_ref, "src")
        dst_id = dst_cache.cache_id if dst_cache else world.missing_id(req.dst_ref, "dst")
        cluster = {"remote": world.src_d.cluster_id, "own": world.dst_d.cluster_id,
                   "unlinked": UNLINKED_CLUSTER}[req.cluster]
        expected = predict(req, src_cache.desc if src_cache else None, dst_cache.desc if dst_cache else None)
        allowed = set(expected.refusals)
        timeout = None
        if expected.refusals and req.tiny_deadline:
            timeout = 1e-6  # Only for requests that must fail: nothing may be written either way.
            allowed.add(TIMEOUT)
        before = world.snapshot_all()
        try:
            result = world.d.pull_kv_blocks(CacheIndex(cluster, src_id, req.batch_index), dst_id, req.src_blocks,
                                            req.dst_blocks, req.ext, timeout=timeout)
        except LlmError as err:
            _check_error(err)
            assert expected.refusals, f"a valid request was refused: {err}"
            assert err.status in allowed, f"{err.status.name} not in {sorted(s.name for s in allowed)}: {err}"
            for cache, snap in zip(world.caches(), before, strict=True):
                assert_bytes_equal(cache.tensors, snap)
            seen[err.status.name] += 1
            event(err.status.name)
            return
        assert not expected.refusals, f"accepted, but it breaks rules for {sorted(s.name for s in allowed)}"
        assert src_cache is not None and dst_cache is not None
        block_bytes = dst_cache.desc.block_nbytes
        assert result.bytes_moved == len(req.dst_blocks) * block_bytes * len(expected.dst_tensors)
        for cache, snap in zip(world.caches(), before, strict=True):
            if cache is dst_cache:
                assert_bytes_equal(cache.tensors, expected_pull(src_cache, snap, req.src_blocks, req.dst_blocks,
                                                                expected.src_tensors, expected.dst_tensors))
            else:
                assert_bytes_equal(cache.tensors, snap)
        fill(dst_cache, len(req.dst_blocks))  # Fresh bytes, so that the next success is not a no-op by accident.
        seen["SUCCESS"] += 1
        event("SUCCESS")

    run()
    # The daemons are alive and unharmed: they answer, keep the link READY and hold the same caches.
    assert (world.s.get_cluster_info().num_caches, world.d.get_cluster_info().num_caches) == caches_before
    links = world.d.list_links()
    assert [(link.remote_cluster_id, link.state) for link in links] == \
           [(link.remote_cluster_id, link.state) for link in links_before]
    assert all(link.state == LinkState.READY for link in links)
    # The run exercised both sides of the contract (a generator that only made garbage would prove little).
    assert seen["SUCCESS"] >= 5, seen
    assert seen[PI.name] >= 5, seen


# -- AllocateCache descriptors -------------------------------------------------------------------------------------

_dim = st.integers(-2, 4)
shapes = st.one_of(
    st.lists(_dim, min_size=0, max_size=5).map(tuple),
    st.lists(st.integers(1, 3), min_size=1, max_size=4).map(tuple),
    st.sampled_from([(1,) * 32, (2,) + (1,) * 31, (1,) * 33, (3,) * 2 + (1,) * 31]),
)
VALID_DATA_TYPES = [int(t) for t in DataType]


@dataclass(frozen=True)
class DescReq:
    num_tensors: int
    shape: tuple[int, ...]
    data_type: int
    placement: int


desc_requests = st.builds(
    DescReq,
    num_tensors=st.one_of(st.integers(1, 6), st.integers(0, 6)),
    shape=shapes,
    data_type=st.one_of(st.sampled_from(VALID_DATA_TYPES), st.sampled_from([0, 16, 999, -1, 2**31 - 1])),
    placement=st.sampled_from([0, 1, 1, 1, 7, -5]),
)


def desc_refusals(req: DescReq) -> set[LlmStatus]:
    bad: set[LlmStatus] = set()
    if req.num_tensors < 1 or not 1 <= len(req.shape) <= 32 or any(d < 1 for d in req.shape):
        bad.add(PI)
    if req.data_type not in VALID_DATA_TYPES or req.placement not in (0, 1):
        bad.add(PI)
    return bad


def test_fuzz_allocate_cache(world: World) -> None:
    seen: Counter[str] = Counter()
    before_ids = {c.cache_id for c in world.d.list_caches()}
    channel = grpc.insecure_channel(world.dst_d.target)
    stub = broker_pb2_grpc.KvBrokerStub(channel)

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(req=desc_requests)
    def run(req: DescReq) -> None:
        desc = types_pb2.CacheDesc(num_tensors=req.num_tensors, shape=list(req.shape))
        desc.data_type = req.data_type  # type: ignore[assignment]
        desc.placement = req.placement  # type: ignore[assignment]
        refusals = desc_refusals(req)
        try:
            resp = stub.AllocateCache(broker_pb2.AllocateCacheRequest(desc=desc), timeout=10)
        except grpc.RpcError as rpc_err:
            err = error_from_rpc(rpc_err)
            assert rpc_err.details().startswith(f"{err.status.name}: "), rpc_err.details()
            _check_error(err)
            assert refusals, f"a valid descriptor was refused: {err}"
            assert err.status in refusals, err
            assert {c.cache_id for c in world.d.list_caches()} == before_ids, "a refused cache was left behind"
            seen[err.status.name] += 1
            return
        try:
            assert not refusals, f"accepted a descriptor that breaks rules: {req}"
            got = resp.cache.desc
            assert (got.num_tensors, tuple(got.shape), got.data_type) == (req.num_tensors, req.shape, req.data_type)
            assert len(resp.cache.tensors) == req.num_tensors
            assert resp.cache.tensor_nbytes == math.prod(req.shape) * DataType(req.data_type).itemsize
        finally:
            world.d.deallocate_cache(resp.cache.cache_id)
        seen["SUCCESS"] += 1

    try:
        run()
    finally:
        channel.close()
    assert {c.cache_id for c in world.d.list_caches()} == before_ids
    assert world.d.get_cluster_info().cluster_id == world.dst_d.cluster_id
    assert seen["SUCCESS"] >= 5 and seen[PI.name] >= 5, seen
