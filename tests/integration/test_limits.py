"""Every string the local API accepts has a documented maximum (docs/LIMITS.md, kvbrokerd.limits): over it, or with a
control character, a request is refused with LLM_PARAM_INVALID before anything is created, and no caller can make a
reply too large to deliver (AllocateCache) or a listing too large for everyone (ListCaches)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker import CacheDesc, ClusterInfo, DataType, LlmError, LlmStatus
from kvbroker import convert as cv
from kvbroker._local import LocalDaemon
from kvbroker.types import TensorLocation
from kvbroker.v1 import broker_pb2, broker_pb2_grpc
from kvbrokerd import limits

SMALL = CacheDesc(num_tensors=1, shape=(2, 16))
_CHARS = ["a", "é", "€", "😀", " ", "\x07", "\n"]  # 1, 2, 3 and 4 UTF-8 bytes; printable or not


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    tmp = tmp_path_factory.mktemp("limits")
    (tmp / "shm").mkdir()
    with LocalDaemon(tmp, 1, extra_args=["--shm-dir", str(tmp / "shm")]) as d:
        yield d


@pytest.fixture(scope="module")
def stub(daemon: LocalDaemon) -> Iterator[broker_pb2_grpc.KvBrokerStub]:
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(daemon.target, options=options) as channel:
        yield broker_pb2_grpc.KvBrokerStub(channel)


def _near(limit: int) -> st.SearchStrategy[str]:
    """Strings whose UTF-8 size lies around `limit`, from characters of every UTF-8 width."""
    return st.lists(st.sampled_from(_CHARS), min_size=limit // 4 - 2, max_size=limit + 4).map("".join)


def _allowed(value: str, limit: int) -> bool:
    return len(value.encode()) <= limit and value.isprintable()


def _refusal(err: grpc.RpcError) -> str:
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    details = err.details() or ""
    assert details.startswith("LLM_PARAM_INVALID: "), details
    return details


def _num_caches(stub: broker_pb2_grpc.KvBrokerStub) -> int:
    return int(stub.GetClusterInfo(broker_pb2.GetClusterInfoRequest(), timeout=10).num_caches)


_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(tag=_near(limits.MAX_LAYOUT_TAG_BYTES))
def test_layout_tag_bound(stub: broker_pb2_grpc.KvBrokerStub, tag: str) -> None:
    desc = cv.desc_to_pb(CacheDesc(num_tensors=1, shape=(2, 16), layout_tag=tag))
    before = _num_caches(stub)
    try:
        reply = stub.AllocateCache(broker_pb2.AllocateCacheRequest(desc=desc), timeout=10)
    except grpc.RpcError as err:
        assert not _allowed(tag, limits.MAX_LAYOUT_TAG_BYTES)
        assert "layout_tag" in _refusal(err)
        assert _num_caches(stub) == before  # refused before anything was created
        return
    assert _allowed(tag, limits.MAX_LAYOUT_TAG_BYTES)
    assert reply.cache.desc.layout_tag == tag
    stub.DeallocateCache(broker_pb2.DeallocateCacheRequest(cache_id=reply.cache.cache_id), timeout=10)


@_SETTINGS
@given(session=_near(limits.MAX_SESSION_ID_BYTES))
def test_session_id_bound(stub: broker_pb2_grpc.KvBrokerStub, session: str) -> None:
    try:
        stub.KeepAlive(broker_pb2.KeepAliveRequest(session_id=session, ttl_ms=60_000), timeout=10)
    except grpc.RpcError as err:
        assert not _allowed(session, limits.MAX_SESSION_ID_BYTES) or session == ""
        assert "session_id" in _refusal(err)
        return
    assert _allowed(session, limits.MAX_SESSION_ID_BYTES) and session != ""


@_SETTINGS
@given(address=_near(limits.MAX_ADDRESS_BYTES))
def test_remote_address_bound(stub: broker_pb2_grpc.KvBrokerStub, address: str) -> None:
    # Unlink of a cluster that is not linked: the address is checked first, then the link is looked up.
    reply = stub.UnlinkClusters(broker_pb2.UnlinkClustersRequest(
        clusters=[broker_pb2.ClusterInfo(remote_cluster_id=77, remote_address=address)]), timeout=10)
    [result] = reply.results
    if _allowed(address, limits.MAX_ADDRESS_BYTES):
        assert result.status == "LLM_NOT_YET_LINK"
    else:
        assert result.status == "LLM_PARAM_INVALID" and "remote_address" in result.message


def test_an_over_long_address_fails_only_its_own_cluster(daemon: LocalDaemon) -> None:
    with daemon.client() as c:
        bad, absent = c.link_clusters([ClusterInfo(5, "h" * 600 + ":7100"), ClusterInfo(6, "127.0.0.1:1")],
                                      timeout=2.0)
    assert bad.status == LlmStatus.LLM_PARAM_INVALID and "remote_address is 605 bytes long; at most 512" in bad.message
    assert absent.status == LlmStatus.LLM_LINK_FAILED


def test_huge_layout_tags_cannot_break_listing_or_orphan_a_cache(stub: broker_pb2_grpc.KvBrokerStub) -> None:
    """The report: three 30 MB tags made ListCaches fail for everyone, and a tag over 4 MB gave a cache whose reply
    a default gRPC client (4 MiB limit) could not receive."""
    before = _num_caches(stub)
    for size in (5 << 20, 30 << 20, 30 << 20, 30 << 20):
        desc = cv.desc_to_pb(CacheDesc(num_tensors=1, shape=(2, 16), layout_tag="x" * size))
        with pytest.raises(grpc.RpcError) as refused:
            stub.AllocateCache(broker_pb2.AllocateCacheRequest(desc=desc), timeout=30)
        assert f"desc.layout_tag is {size} bytes long; at most 256" in _refusal(refused.value)
    assert _num_caches(stub) == before
    assert len(stub.ListCaches(broker_pb2.ListCachesRequest(), timeout=10).caches) == before


def test_lease_ttl_bound(stub: broker_pb2_grpc.KvBrokerStub) -> None:
    too_long = int(limits.MAX_LEASE_TTL_S * 1000) + 1
    with pytest.raises(grpc.RpcError) as refused:
        stub.KeepAlive(broker_pb2.KeepAliveRequest(session_id="ttl", ttl_ms=too_long), timeout=10)
    assert "lease ttl" in _refusal(refused.value)
    stub.KeepAlive(broker_pb2.KeepAliveRequest(session_id="ttl", ttl_ms=too_long - 1), timeout=10)


def test_the_cache_listing_stays_deliverable(daemon: LocalDaemon, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Caches of 4,096 one-byte tensors in a segment with a 200-character name take ~0.9 MB each in ListCaches:
    past MAX_CACHE_LISTING_BYTES the next one is refused (LLM_OUT_OF_MEMORY), and ListCaches keeps working."""
    shm = Path(daemon.args[daemon.args.index("--shm-dir") + 1])
    segment = "s" * 200
    (shm / segment).write_bytes(bytes(4096))
    desc = CacheDesc(num_tensors=4096, shape=(1,), data_type=DataType.UINT8)
    request = broker_pb2.RegisterKvCacheRequest(
        desc=cv.desc_to_pb(desc),
        tensors=[cv.tensor_location_to_pb(TensorLocation(segment, i)) for i in range(4096)])
    per_cache = request.ByteSize()
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    registered: list[int] = []
    with grpc.insecure_channel(daemon.target, options=options) as channel:
        stub = broker_pb2_grpc.KvBrokerStub(channel)
        try:
            with pytest.raises(grpc.RpcError) as full:
                for _ in range(limits.MAX_CACHE_LISTING_BYTES // per_cache + 2):
                    registered.append(stub.RegisterKvCache(request, timeout=30).cache.cache_id)
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert re.search(r"LLM_OUT_OF_MEMORY: the descriptions of all caches would exceed \d+ bytes",
                             full.value.details() or "")
            assert len(registered) >= limits.MAX_CACHE_LISTING_BYTES // per_cache - 1
            listing = stub.ListCaches(broker_pb2.ListCachesRequest(), timeout=60)
            assert {c.cache_id for c in listing.caches} >= set(registered)
            assert listing.ByteSize() <= limits.MAX_CACHE_LISTING_BYTES
        finally:
            for cache_id in registered:
                stub.UnregisterKvCache(broker_pb2.UnregisterKvCacheRequest(cache_id=cache_id), timeout=30)
    with daemon.client() as c:  # room again: the limit counts only caches that exist
        c.deallocate_cache(c.allocate_cache(SMALL))


def test_limits_are_documented() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "LIMITS.md").read_text()
    for name in ("MAX_LAYOUT_TAG_BYTES", "MAX_SESSION_ID_BYTES", "MAX_ADDRESS_BYTES", "MAX_CACHE_LISTING_BYTES"):
        value = getattr(limits, name)
        assert f"| {value:,} " in doc or f"| {value} " in doc, f"{name} = {value} is not in docs/LIMITS.md"


def test_refusals_are_llm_param_invalid_for_the_client(daemon: LocalDaemon) -> None:
    with daemon.client() as c, pytest.raises(LlmError) as refused:
        c.allocate_cache(CacheDesc(num_tensors=1, shape=(2, 16), layout_tag="t" * 257))
    assert refused.value.status == LlmStatus.LLM_PARAM_INVALID
