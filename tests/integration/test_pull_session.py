"""PullKvBlocksSession between real daemons: a step of pulls as one message, each pull with its own outcome (the one
PullKvBlocks would give), one job per peer and cache (over shm, per peer and destination cache), failures that stay
with their pull, and every bound."""

from __future__ import annotations

import concurrent.futures
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker import (
    CacheDesc,
    CacheIndex,
    DataType,
    Grant,
    KvCacheNotExistError,
    LinkState,
    LlmError,
    LlmStatus,
    ParamInvalidError,
    SessionPull,
    TransferResult,
)
from kvbroker._client import _CALL_METADATA
from kvbroker._local import LocalDaemon
from kvbroker._session import outcome_of
from kvbroker.shm import Cache
from kvbroker.v1 import broker_pb2, broker_pb2_grpc, types_pb2
from kvbrokerd.service.pullsession import (
    MAX_PULL_SESSIONS,
    MAX_SESSION_PULLS_IN_FLIGHT,
    MAX_SESSION_PULLS_PER_MESSAGE,
)
from tests.conftest import cluster_of
from tests.helpers import assert_bytes_equal, expected_pull, fill, snapshot, wait_until

Pair = tuple[LocalDaemon, LocalDaemon]
DESC = CacheDesc(num_tensors=4, shape=(64, 2, 128))
FAKE_GRANT = Grant(b"\x01" * 16, b"\x02" * 32)


def _outcomes(futures: list[concurrent.futures.Future[TransferResult]], timeout: float = 30.0
              ) -> list[TransferResult | LlmError]:
    out: list[TransferResult | LlmError] = []
    for f in futures:
        try:
            out.append(f.result(timeout))
        except LlmError as e:
            out.append(e)
    return out


# -- a step lands, on every backend -----------------------------------------------------------------------------------

def test_a_step_of_pulls_lands_with_verified_bytes(linked_pair: Pair) -> None:
    """Eight pulls in one message, scattered blocks of one remote cache: every pull succeeds with its own result,
    and the destination holds exactly the source's bytes."""
    src_d, dst_d = linked_pair
    with src_d.client() as s, dst_d.client() as d:
        src, dst = s.allocate_cache(DESC), d.allocate_cache(DESC)
        try:
            fill(src, 11)
            fill(dst, 12)
            before = snapshot(dst)
            rng = np.random.default_rng(5)
            dst_all = rng.permutation(64)[:40].tolist()
            src_all = rng.integers(0, 64, 40).tolist()
            pulls = [SessionPull(CacheIndex(src_d.cluster_id, src.cache_id), dst.cache_id,
                                 tuple(dst_all[i * 5:(i + 1) * 5]), tuple(src_all[i * 5:(i + 1) * 5]))
                     for i in range(8)]
            with d.open_pull_session() as session:
                results = _outcomes(session.submit(pulls))
            assert all(isinstance(r, TransferResult) for r in results), results
            assert [r.bytes_moved for r in results if isinstance(r, TransferResult)] == \
                [5 * DESC.block_nbytes * 4] * 8
            assert len({r.transfer_id for r in results if isinstance(r, TransferResult)}) == 8
            assert_bytes_equal(dst.tensors, expected_pull(src, before, src_all, dst_all, range(4), range(4)))
        finally:
            s.deallocate_cache(src)
            d.deallocate_cache(dst)


# -- daemons of our own for the rest ---------------------------------------------------------------------------------

class Trio:
    """Decode daemon `d` linked to two prefill daemons `p` and `q`, with a cache on each."""

    def __init__(self, p: LocalDaemon, q: LocalDaemon, d: LocalDaemon) -> None:
        self.p, self.q, self.d = p, q, d
        self.pc, self.qc, self.dc = p.client(), q.client(), d.client()
        self.src: Cache = self.pc.allocate_cache(DESC)
        self.qsrc: Cache = self.qc.allocate_cache(DESC)
        self.dst: Cache = self.dc.allocate_cache(DESC)
        fill(self.src, 1)
        fill(self.qsrc, 3)

    def pull(self, dst: list[int], src: list[int] | None = None, **kw: object) -> SessionPull:
        return SessionPull(CacheIndex(self.p.cluster_id, self.src.cache_id), self.dst.cache_id, tuple(dst),
                           tuple(dst if src is None else src), **kw)  # type: ignore[arg-type]

    def stub(self) -> tuple[grpc.Channel, broker_pb2_grpc.KvBrokerStub]:
        channel = grpc.insecure_channel(self.d.target)
        return channel, broker_pb2_grpc.KvBrokerStub(channel)


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    root: Path = tmp_path_factory.mktemp("session")
    with LocalDaemon(root, 81) as p, LocalDaemon(root, 82) as q, LocalDaemon(root, 83) as d:
        with d.client() as c:
            assert all(r.ok for r in c.link_clusters([cluster_of(p), cluster_of(q)]))
        trio = Trio(p, q, d)
        try:
            yield trio
        finally:
            for c in (trio.pc, trio.qc, trio.dc):
                c.close()


def _relink(trio: Trio) -> None:
    """The link to `q` READY again after it was frozen (relinked if heartbeats found it broken meanwhile)."""
    def ready() -> bool:
        link = next((x for x in trio.dc.list_links() if x.remote_cluster_id == trio.q.cluster_id), None)
        if link is not None and link.state == LinkState.READY:
            return True
        if link is not None and link.state == LinkState.BROKEN:
            trio.dc.unlink_clusters([cluster_of(trio.q)], force=True)
        trio.dc.link_clusters([cluster_of(trio.q)])
        return False

    wait_until(ready, what="the link to q READY again")


def _raw_session(trio: Trio, messages: list[broker_pb2.PullSessionRequest], expected: int
                 ) -> list[broker_pb2.PullCompletion]:
    """Sends `messages` on a raw stream, half-closes, and returns every completion (at least `expected`)."""
    channel, stub = trio.stub()
    with channel:
        completions = [c for resp in stub.PullKvBlocksSession(iter(messages), metadata=_CALL_METADATA, timeout=60)
                       for c in resp.completions]
    assert len(completions) >= expected
    return completions


def test_the_pulls_of_one_message_run_as_one_job(trio: Trio) -> None:
    """One plan, one pin, one data-plane job per peer and cache: every pull of the message names the same job."""
    msg = broker_pb2.PullSessionRequest(pulls=[
        broker_pb2.SessionPull(id=i + 1, timeout_ms=20_000, pull=broker_pb2.PullKvBlocksRequest(
            src_cache_index=types_pb2.CacheIndex(cluster_id=trio.p.cluster_id, cache_id=trio.src.cache_id),
            dst_cache_id=trio.dst.cache_id, src_blocks=[i, 10 + i], dst_blocks=[20 + i, 40 + i]))
        for i in range(6)])
    completions = _raw_session(trio, [msg], 6)
    assert sorted(c.id for c in completions) == [1, 2, 3, 4, 5, 6]
    assert {c.status for c in completions} == {"LLM_SUCCESS"}
    assert len({c.metadata["job"] for c in completions}) == 1
    assert len({c.result.transfer_id for c in completions}) == 6


def test_a_bad_pull_fails_alone_with_the_status_pull_kv_blocks_gives(trio: Trio) -> None:
    """A released grant, an unknown destination cache, a block out of range and an unlinked cluster each fail with
    PullKvBlocks' own status and message; nothing lands for them, and the good pulls of the same message land."""
    released = trio.pc.create_grant([trio.src.cache_id], [1, 2], 30.0)
    trio.pc.release_grant(released)
    fill(trio.dst, 7)
    before = snapshot(trio.dst)
    src_ix = CacheIndex(trio.p.cluster_id, 0)
    bad = [
        SessionPull(src_ix, trio.dst.cache_id, (50, 51), grant=released),
        SessionPull(CacheIndex(trio.p.cluster_id, trio.src.cache_id), 987654, (52,), (1,)),
        trio.pull([53], [64]),
        SessionPull(CacheIndex(4242, 1), trio.dst.cache_id, (54,), (1,)),
    ]
    good = [trio.pull([0, 1]), trio.pull([2, 3], [9, 8])]
    with trio.dc.open_pull_session() as session:
        outcomes = _outcomes(session.submit([bad[0], good[0], bad[1], bad[2], good[1], bad[3]]))
    got_bad = [outcomes[i] for i in (0, 2, 3, 5)]
    for pull, got in zip(bad, got_bad, strict=True):
        assert isinstance(got, LlmError), got
        with pytest.raises(LlmError) as unary:
            if pull.grant is not None:
                trio.dc.pull_granted_kv_blocks(pull.src_cache_index.cluster_id, pull.grant, pull.dst_cache,
                                               pull.dst_blocks)
            else:
                trio.dc.pull_kv_blocks(pull.src_cache_index, pull.dst_cache, pull.src_blocks, pull.dst_blocks)
        assert (type(got), got.status, got.message) == (type(unary.value), unary.value.status, unary.value.message)
        assert got.failed_dst_blocks is None  # refused before any byte moved
    assert isinstance(got_bad[0], KvCacheNotExistError)
    assert isinstance(got_bad[2], ParamInvalidError)
    assert all(isinstance(outcomes[i], TransferResult) for i in (1, 4))
    expected = expected_pull(trio.src, before, [0, 1, 9, 8], [0, 1, 2, 3], range(4), range(4))
    assert_bytes_equal(trio.dst.tensors, expected)


def test_a_frozen_peer_fails_its_pulls_by_their_deadline_and_delays_no_one(trio: Trio) -> None:
    """Pulls to a peer that stopped answering end with LLM_TIMEOUT (or LLM_LINK_FAILED once the link is found
    broken) by their own deadline, and the pulls of the same message to a live peer land while they still wait."""
    fill(trio.dst, 8)
    before = snapshot(trio.dst)
    stuck = SessionPull(CacheIndex(trio.q.cluster_id, 0), trio.dst.cache_id, (60, 61), grant=FAKE_GRANT,
                        timeout=3.0)
    trio.q.signal(signal.SIGSTOP)
    try:
        with trio.dc.open_pull_session() as session:
            futures = session.submit([stuck, trio.pull([4, 5]), trio.pull([6], [30])])
            live = _outcomes(futures[1:])
            assert all(isinstance(r, TransferResult) for r in live), live
            assert not futures[0].done()  # the live pulls did not wait for it
            dead = _outcomes(futures[:1])[0]
        assert isinstance(dead, LlmError)
        assert dead.status in (LlmStatus.LLM_TIMEOUT, LlmStatus.LLM_LINK_FAILED), dead
    finally:
        trio.q.signal(signal.SIGCONT)
    assert_bytes_equal(trio.dst.tensors, expected_pull(trio.src, before, [4, 5, 30], [4, 5, 6], range(4), range(4)))
    _relink(trio)


def test_bounds_pulls_per_message_duplicate_ids_and_pulls_in_flight(trio: Trio) -> None:
    """A message over the limit ends the stream once (LLM_PARAM_INVALID); an id already in flight is refused; a
    pull past the limit of pulls in flight is refused with LLM_OUT_OF_MEMORY, while the ones in flight are
    untouched."""
    def pull(i: int, dst: int = 0, timeout_ms: int = 20_000, grant: bool = False) -> broker_pb2.SessionPull:
        req = broker_pb2.PullKvBlocksRequest(
            src_cache_index=types_pb2.CacheIndex(cluster_id=trio.p.cluster_id, cache_id=trio.src.cache_id),
            dst_cache_id=trio.dst.cache_id, src_blocks=[dst], dst_blocks=[dst])
        if grant:
            req.src_cache_index.cluster_id = trio.q.cluster_id
            req.src_cache_index.cache_id = 0
            req.ClearField("src_blocks")
            req.grant.grant.grant_id = FAKE_GRANT.grant_id
            req.grant.grant.secret = FAKE_GRANT.secret
        return broker_pb2.SessionPull(id=i, pull=req, timeout_ms=timeout_ms)

    too_many = broker_pb2.PullSessionRequest(pulls=[pull(i + 1, i % 64) for i in range(MAX_SESSION_PULLS_PER_MESSAGE
                                                                                         + 1)])
    channel, stub = trio.stub()
    with channel, pytest.raises(grpc.RpcError) as ended:
        for resp in stub.PullKvBlocksSession(iter([too_many]), metadata=_CALL_METADATA, timeout=60):
            assert not resp.completions  # no pull of it was looked at
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 256" in ended.value.details()

    # The frozen peer keeps granted pulls in flight until their deadline.
    trio.q.signal(signal.SIGSTOP)
    try:
        per = MAX_SESSION_PULLS_PER_MESSAGE
        waves = [broker_pb2.PullSessionRequest(pulls=[pull(1000 + w * per + i, grant=True, timeout_ms=4000)
                                                      for i in range(per)])
                 for w in range(MAX_SESSION_PULLS_IN_FLIGHT // per)]
        extra = broker_pb2.PullSessionRequest(pulls=[pull(1000, grant=True), pull(5000, 1)])
        completions = _raw_session(trio, [*waves, extra], MAX_SESSION_PULLS_IN_FLIGHT + 2)
    finally:
        trio.q.signal(signal.SIGCONT)
    by_id = {c.id: c for c in completions if c.id >= 5000 or c.status != "LLM_TIMEOUT"}
    first = [c for c in completions if c.id == 1000]
    assert any(c.status == "LLM_PARAM_INVALID" and "already in flight" in c.message for c in first), first
    assert by_id[5000].status == "LLM_OUT_OF_MEMORY" and "in flight" in by_id[5000].message
    waited = [c for c in completions if 1000 <= c.id < 5000 and "already in flight" not in c.message]
    assert len(waited) == MAX_SESSION_PULLS_IN_FLIGHT
    assert {c.status for c in waited} <= {"LLM_TIMEOUT", "LLM_LINK_FAILED", "LLM_KV_CACHE_NOT_EXIST"}
    _relink(trio)


def test_sessions_per_daemon_are_bounded(trio: Trio) -> None:
    """The session past MAX_PULL_SESSIONS is refused at its start (LLM_OUT_OF_MEMORY); closing one makes room."""
    sessions = [trio.dc.open_pull_session() for _ in range(MAX_PULL_SESSIONS)]
    try:
        # Each session is open once the daemon has answered a pull on it.
        for s in sessions:
            assert isinstance(s.submit([trio.pull([10])])[0].result(30), TransferResult)
        extra = trio.dc.open_pull_session()
        with pytest.raises(LlmError) as refused:
            extra.submit([trio.pull([11])])[0].result(30)
        assert refused.value.status == LlmStatus.LLM_OUT_OF_MEMORY
        assert "pull sessions are open" in refused.value.message
        with pytest.raises(LlmError):
            extra.submit([trio.pull([11])])
        extra.close()
        sessions.pop().close()
        with trio.dc.open_pull_session() as again:
            assert isinstance(again.submit([trio.pull([11])])[0].result(30), TransferResult)
    finally:
        for s in sessions:
            s.close()


async def test_the_async_session_gives_each_pull_its_outcome(trio: Trio) -> None:
    from kvbroker import AsyncClient

    async with AsyncClient(trio.d.target) as c, await c.open_pull_session() as session:
        futures = await session.submit([trio.pull([12, 13]), trio.pull([14], [64])])
        ok = await futures[0]
        assert ok.bytes_moved == 2 * DESC.block_nbytes * 4
        with pytest.raises(ParamInvalidError, match="src block 64 is out of range"):
            await futures[1]
        more = await session.submit([trio.pull([15])])
        assert (await more[0]).bytes_moved == DESC.block_nbytes * 4


def test_a_client_refuses_a_bad_submit_before_sending(trio: Trio) -> None:
    with trio.dc.open_pull_session() as session:
        with pytest.raises(ParamInvalidError):
            session.submit([])
        with pytest.raises(ParamInvalidError):
            session.submit([trio.pull([1])] * (MAX_SESSION_PULLS_PER_MESSAGE + 1))
        with pytest.raises(ParamInvalidError):
            session.submit([trio.pull([1], timeout=0.0)])
        assert isinstance(session.submit([trio.pull([1])])[0].result(30), TransferResult)


_blocks = st.lists(st.integers(0, 7) | st.integers(min_value=0, max_value=2**64 - 1), max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pulls=st.lists(st.tuples(st.integers(0, 2**64 - 1), _blocks, _blocks, st.sampled_from([0, 1, 2]),
                                st.booleans()), min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_any_message_gets_one_completion_per_pull_and_refused_pulls_write_nothing(
        trio: Trio, pulls: list[tuple[int, list[int], list[int], int, bool]]) -> None:
    """Whatever a message holds, each pull gets exactly one completion with its id, a success or an LLM status
    (never a broken stream), and a pull that is refused moves no byte."""
    caches = [trio.dst.cache_id, 999_999, -5]
    msg = broker_pb2.PullSessionRequest()
    # Pull k's small destination blocks lie in [8k, 8k + 8): two pulls never race for one block.
    pulls = [(i, s, [8 * k + b if b < 8 else b for b in d], c, g) for k, (i, s, d, c, g) in enumerate(pulls)]
    for pull_id, src, dst, cache, with_grant in pulls:
        req = broker_pb2.PullKvBlocksRequest(
            src_cache_index=types_pb2.CacheIndex(cluster_id=trio.p.cluster_id, cache_id=trio.src.cache_id),
            dst_cache_id=caches[cache], src_blocks=src, dst_blocks=dst)
        if with_grant:
            req.grant.grant.grant_id = b"\x00" * (16 if pull_id % 2 else 3)
        msg.pulls.add(id=pull_id, pull=req, timeout_ms=10_000)
    before = snapshot(trio.dst)
    completions = _raw_session(trio, [msg], len(pulls))
    assert sorted(c.id for c in completions) == sorted(p[0] for p in pulls)
    moved: list[tuple[list[int], list[int]]] = []
    for c in completions:
        outcome = outcome_of(c)
        pull = next(p for p in pulls if p[0] == c.id)
        if isinstance(outcome, TransferResult):
            moved.append((pull[1], pull[2]))
        else:
            assert outcome.status != LlmStatus.LLM_FAILED, outcome
    expected = before
    for src, dst in moved:
        expected = expected_pull(trio.src, expected, src, dst, range(4), range(4))
    assert_bytes_equal(trio.dst.tensors, expected)


def test_two_pulls_writing_one_block_both_land_one_after_the_other(trio: Trio) -> None:
    """Pulls of one message that write the same destination block cannot share a plan: each still lands (the
    daemon's block claims order them), and the block holds one of the two sources."""
    with trio.dc.open_pull_session() as session:
        results = _outcomes(session.submit([trio.pull([20, 21], [1, 2]), trio.pull([21, 22], [3, 4])]))
    assert all(isinstance(r, TransferResult) for r in results), results
    src = [t.reshape(t.shape[0], -1).view(np.uint8) for t in trio.src.tensors]
    dst = [t.reshape(t.shape[0], -1).view(np.uint8) for t in trio.dst.tensors]
    for s, d in zip(src, dst, strict=True):
        assert np.array_equal(d[20], s[1]) and np.array_equal(d[22], s[4])
        assert np.array_equal(d[21], s[2]) or np.array_equal(d[21], s[3])


def test_a_failed_job_gives_each_pull_its_own_report(trio: Trio) -> None:
    """Four pulls that run as one job past a 1 ms deadline: each fails with LLM_TIMEOUT, names the shared job, and
    reports only its own destination blocks as not landed."""
    desc = CacheDesc(num_tensors=2, shape=(32, 1 << 20), data_type=DataType.UINT8)
    src, dst = trio.pc.allocate_cache(desc), trio.dc.allocate_cache(desc)
    try:
        fill(src, 4)
        index = CacheIndex(trio.p.cluster_id, src.cache_id)
        trio.dc.pull_kv_blocks(index, dst, [0], [0])  # the daemon knows the remote cache: the deadline hits the job
        pulls = [SessionPull(index, dst.cache_id, tuple(range(8 * i, 8 * i + 8)), tuple(range(8 * i, 8 * i + 8)),
                             timeout=0.001) for i in range(4)]
        with trio.dc.open_pull_session() as session:
            outcomes = _outcomes(session.submit(pulls))
        assert all(isinstance(o, LlmError) and o.status == LlmStatus.LLM_TIMEOUT for o in outcomes), outcomes
        jobs = {o.details.get("job") for o in outcomes if isinstance(o, LlmError)}
        assert len(jobs) == 1 and None not in jobs
        for pull, o in zip(pulls, outcomes, strict=True):
            assert isinstance(o, LlmError)
            failed = o.failed_dst_blocks
            assert failed and set(failed) <= set(pull.dst_blocks), (pull.dst_blocks, failed)
            assert o.details["transfer_report"].transfer_id == o.details["transfer_id"]
    finally:
        trio.pc.deallocate_cache(src)
        trio.dc.deallocate_cache(dst)


# -- pulls from several caches of one peer (a decode rank gathering the prefill's TP ranks) ----------------------------

def _pull_from(trio: Trio, cache: Cache, pull_id: int, src: list[int], dst: list[int]) -> broker_pb2.SessionPull:
    return broker_pb2.SessionPull(id=pull_id, timeout_ms=20_000, pull=broker_pb2.PullKvBlocksRequest(
        src_cache_index=types_pb2.CacheIndex(cluster_id=trio.p.cluster_id, cache_id=cache.cache_id),
        dst_cache_id=trio.dst.cache_id, src_blocks=src, dst_blocks=dst))


def test_pulls_from_two_caches_of_one_peer_into_one_cache_run_as_one_job(trio: Trio) -> None:
    """A step's pulls from two of the peer's caches (a decode rank's from two prefill ranks) that write apart run as
    one data-plane job over both caches (shm), and the destination holds each source's own bytes."""
    second = trio.pc.allocate_cache(DESC)
    try:
        fill(second, 7)
        before = snapshot(trio.dst)
        msg = broker_pb2.PullSessionRequest(pulls=[_pull_from(trio, trio.src, 1, [1, 2, 9], [30, 31, 40]),
                                                   _pull_from(trio, second, 2, [1, 2, 5], [32, 33, 41]),
                                                   _pull_from(trio, trio.src, 3, [3], [42])])
        completions = _raw_session(trio, [msg], 3)
        assert {c.status for c in completions} == {"LLM_SUCCESS"}, completions
        assert len({c.metadata["job"] for c in completions}) == 1
        expected = expected_pull(trio.src, before, [1, 2, 9, 3], [30, 31, 40, 42], range(4), range(4))
        assert_bytes_equal(trio.dst.tensors, expected_pull(second, expected, [1, 2, 5], [32, 33, 41], range(4),
                                                           range(4)))
    finally:
        trio.pc.deallocate_cache(second)


def test_pulls_from_two_caches_writing_one_block_are_two_jobs_that_both_land(trio: Trio) -> None:
    """Pulls from two caches that write one destination block are never one job: each lands (the block claims
    order them) and the block holds one of the two sources."""
    second = trio.pc.allocate_cache(DESC)
    try:
        fill(second, 8)
        msg = broker_pb2.PullSessionRequest(pulls=[_pull_from(trio, trio.src, 1, [1, 2], [50, 51]),
                                                   _pull_from(trio, second, 2, [3, 4], [51, 52])])
        completions = _raw_session(trio, [msg], 2)
        assert {c.status for c in completions} == {"LLM_SUCCESS"}, completions
        assert len({c.metadata["job"] for c in completions}) == 2
        for s, q, d in zip(trio.src.tensors, second.tensors, trio.dst.tensors, strict=True):
            s, q, d = (t.reshape(t.shape[0], -1).view(np.uint8) for t in (s, q, d))
            assert np.array_equal(d[50], s[1]) and np.array_equal(d[52], q[4])
            assert np.array_equal(d[51], s[2]) or np.array_equal(d[51], q[3])
    finally:
        trio.pc.deallocate_cache(second)


def test_a_refused_pull_from_one_of_two_caches_fails_alone(trio: Trio) -> None:
    """A pull from the second cache that names a block out of range is refused with PullKvBlocks' status, and
    writes nothing; the pulls from the first cache land."""
    second = trio.pc.allocate_cache(DESC)
    try:
        fill(second, 9)
        before = snapshot(trio.dst)
        msg = broker_pb2.PullSessionRequest(pulls=[_pull_from(trio, trio.src, 1, [4, 5], [55, 56]),
                                                   _pull_from(trio, second, 2, [6, 64], [57, 58])])
        completions = {c.id: c for c in _raw_session(trio, [msg], 2)}
        assert completions[1].status == "LLM_SUCCESS"
        assert completions[2].status == "LLM_PARAM_INVALID" and "out of range" in completions[2].message
        assert_bytes_equal(trio.dst.tensors, expected_pull(trio.src, before, [4, 5], [55, 56], range(4), range(4)))
    finally:
        trio.pc.deallocate_cache(second)


def test_a_source_gone_fails_the_job_over_both_caches_and_reports_each_pulls_blocks(trio: Trio) -> None:
    """The second cache deallocated once the daemon knows it: the job over both caches fails with
    LLM_KV_CACHE_NOT_EXIST, each pull reports its own blocks, and the next step from the first cache lands."""
    second = trio.pc.allocate_cache(DESC)
    fill(second, 10)
    trio.dc.pull_kv_blocks(CacheIndex(trio.p.cluster_id, second.cache_id), trio.dst, [0], [60])  # known to d
    trio.pc.deallocate_cache(second)
    msg = broker_pb2.PullSessionRequest(pulls=[_pull_from(trio, trio.src, 1, [4, 5], [59, 60]),
                                               _pull_from(trio, second, 2, [6], [61])])
    completions = {c.id: c for c in _raw_session(trio, [msg], 2)}
    assert completions[2].status == "LLM_KV_CACHE_NOT_EXIST", completions[2]
    assert completions[1].status in ("LLM_SUCCESS", "LLM_KV_CACHE_NOT_EXIST"), completions[1]
    if completions[1].status != "LLM_SUCCESS":
        assert set(completions[1].report.failed_dst_blocks) <= {59, 60}
    assert set(completions[2].report.failed_dst_blocks) <= {61}
    again = _raw_session(trio, [broker_pb2.PullSessionRequest(pulls=[_pull_from(trio, trio.src, 3, [4], [59])])], 1)
    assert again[0].status == "LLM_SUCCESS", again[0]
