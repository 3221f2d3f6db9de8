"""What a local client sends on a PullKvBlocksSession is bounded before it is expanded or queued, measured as the
decode daemon's peak memory: a message over the pull limit ends the stream once (no completion per pull), a client
that does not read its completions is stopped from sending (no unbounded queue), and a message whose pulls name more
block pairs than the budget per message is refused from the runs' sizes, before any pair is written out."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvbroker import CacheDesc, DataType, LlmError, LlmStatus, ParamInvalidError, SessionPull, TransferResult, blockruns
from kvbroker._client import _CALL_METADATA
from kvbroker._errors import error_from_rpc
from kvbroker.v1 import broker_pb2, broker_pb2_grpc
from kvbrokerd.limits import DEFAULT_SESSION_MESSAGE_PAIRS
from kvbrokerd.service.pullsession import MAX_SESSION_PULLS_PER_MESSAGE
from tests.helpers import LinkedCaches, linked_caches, wait_until

BLOCKS = 1 << 21
DESC = CacheDesc(num_tensors=1, shape=(BLOCKS, 1), data_type=DataType.UINT8)
"""Blocks of one byte: a pull of 2^20 pairs costs the daemon its bookkeeping, hardly any copying."""
BOUND_MIB = 100
"""What the daemon may grow by for any of these messages (the unbounded code grew by GiBs)."""
PAIRS_PER_MESSAGE = DEFAULT_SESSION_MESSAGE_PAIRS


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LinkedCaches]:
    with linked_caches(tmp_path_factory.mktemp("session-bounds"), 91, DESC, 5, LinkedCaches, ["shm"]) as env:
        yield env


class PeakMemory:
    """The decode daemon's peak RSS from now on, above its RSS now (MiB); Linux's clear_refs resets the peak."""

    def __init__(self, env: LinkedCaches) -> None:
        assert env.d.proc is not None
        self.status = Path(f"/proc/{env.d.proc.pid}/status")
        Path(f"/proc/{env.d.proc.pid}/clear_refs").write_text("5")
        self.start = self._kib("VmRSS")

    def _kib(self, field: str) -> int:
        return int(re.findall(rf"{field}:\s+(\d+) kB", self.status.read_text())[0])

    def rss_mib(self) -> float:
        return self._kib("VmRSS") / 1024

    def grown_mib(self) -> float:
        return (self._kib("VmHWM") - self.start) / 1024


def _id_only(first_id: int, n: int) -> broker_pb2.PullSessionRequest:
    """`n` pulls that name nothing but their id: each is refused, and costs its sender ~4 bytes."""
    msg = broker_pb2.PullSessionRequest()
    for i in range(first_id, first_id + n):
        msg.pulls.add(id=i)
    return msg


def _run_pull(env: LinkedCaches, pull_id: int, src: int, dst: int, length: int) -> broker_pb2.SessionPull:
    pull = broker_pb2.SessionPull(id=pull_id, timeout_ms=30_000)
    pull.pull.src_cache_index.cluster_id = env.p.cluster_id
    pull.pull.src_cache_index.cache_id = env.src.cache_id
    pull.pull.dst_cache_id = env.dst.cache_id
    pull.pull.block_runs.src_first.append(src)
    pull.pull.block_runs.dst_first.append(dst)
    pull.pull.block_runs.length.append(length)
    return pull


def _session(env: LinkedCaches, messages: Iterator[broker_pb2.PullSessionRequest]
             ) -> tuple[list[broker_pb2.PullCompletion], grpc.RpcError | None]:
    """Every completion of a raw stream that sends `messages` and half-closes, and the error it ended with."""
    with grpc.insecure_channel(env.d.target) as channel:
        call = broker_pb2_grpc.KvBrokerStub(channel).PullKvBlocksSession(messages, metadata=_CALL_METADATA,
                                                                         timeout=60)
        completions: list[broker_pb2.PullCompletion] = []
        try:
            for resp in call:
                completions.extend(resp.completions)
        except grpc.RpcError as err:
            return completions, err
    return completions, None


def _still_serves(env: LinkedCaches) -> None:
    with env.dc.open_pull_session() as session:
        [done] = session.submit([SessionPull(env.index(), env.dst.cache_id, (7,), (8,))])
        assert isinstance(done.result(30), TransferResult)


def test_a_message_over_the_pull_limit_ends_the_stream_once(env: LinkedCaches) -> None:
    """One message of 400,000 id-only pulls (1.6 MB) used to become 400,000 completions queued on the event loop
    (+921 MiB). Now the stream ends at once with one LLM_PARAM_INVALID, and no pull of it is looked at."""
    peak = PeakMemory(env)
    completions, err = _session(env, iter([_id_only(1, 400_000)]))
    assert completions == []
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    refused = error_from_rpc(err)
    assert isinstance(refused, ParamInvalidError)
    assert f"at most {MAX_SESSION_PULLS_PER_MESSAGE}" in refused.message and "400000 pulls" in refused.message
    assert peak.grown_mib() < BOUND_MIB, peak.grown_mib()
    _still_serves(env)


def test_a_client_that_does_not_read_its_completions_is_held_back(env: LinkedCaches) -> None:
    """A client sends message after message of refused pulls and never reads a completion: the daemon stops
    reading its messages once its completions queue is full (the client's sends then wait), instead of queueing
    ~2.3 KiB per refused pull without bound (1,000 messages of 256: +590 MiB before)."""
    sent = [0]
    stop = threading.Event()

    def messages() -> Iterator[broker_pb2.PullSessionRequest]:
        for m in range(1000):
            if stop.is_set():
                return
            sent[0] = m + 1
            yield _id_only(1 + m * MAX_SESSION_PULLS_PER_MESSAGE, MAX_SESSION_PULLS_PER_MESSAGE)

    peak = PeakMemory(env)
    with grpc.insecure_channel(env.d.target) as channel:
        call = broker_pb2_grpc.KvBrokerStub(channel).PullKvBlocksSession(messages(), metadata=_CALL_METADATA,
                                                                         timeout=120)
        try:
            # Until the client's sends and the daemon's memory have both stopped moving: everything sent was read,
            # or the daemon holds the client back.
            seen: list[tuple[int, float]] = []

            def settled() -> bool:
                seen.append((sent[0], peak.rss_mib()))
                recent = seen[-5:]
                return len(recent) == 5 and len({n for n, _ in recent}) == 1 and \
                    max(m for _, m in recent) - min(m for _, m in recent) < 1.0

            wait_until(settled, timeout=60, poll=0.5, what="the client's sends and the daemon's memory settled")
            assert peak.grown_mib() < BOUND_MIB, (peak.grown_mib(), sent[0])
        finally:
            stop.set()
            call.cancel()
    _still_serves(env)


def test_a_message_over_the_pair_budget_is_refused_before_its_pairs_are_written_out(env: LinkedCaches) -> None:
    """24 pulls of one 2^20-pair run each, writing the same destination blocks, used to be written out pair by pair
    into Python sets (+1,962 MiB). Their pairs (24 * 2^20) are over the budget per message: every pull is refused
    (LLM_PARAM_INVALID, naming the budget) from the runs' sizes, and the daemon does not grow."""
    env.dc.pull_kv_blocks(env.index(), env.dst, np.arange(1 << 20), np.arange(1 << 20))  # both caches mapped
    peak = PeakMemory(env)
    msg = broker_pb2.PullSessionRequest(pulls=[_run_pull(env, i + 1, 0, 0, 1 << 20) for i in range(24)])
    completions, err = _session(env, iter([msg]))
    assert err is None, err
    assert sorted(c.id for c in completions) == list(range(1, 25))
    assert {c.status for c in completions} == {"LLM_PARAM_INVALID"}, {c.message for c in completions}
    assert f"at most {PAIRS_PER_MESSAGE}" in completions[0].message
    assert peak.grown_mib() < BOUND_MIB, peak.grown_mib()


def test_pulls_within_the_pair_budget_that_share_destination_blocks_land_in_bounded_memory(
        env: LinkedCaches) -> None:
    """Four pulls of 2^18 pairs writing the same destination blocks (the budget per message in all) cannot share a
    plan: each lands in turn, and telling which of them may run together writes no pair into a Python set."""
    env.dc.pull_kv_blocks(env.index(), env.dst, np.arange(1 << 20), np.arange(1 << 20))
    quarter = PAIRS_PER_MESSAGE // 4
    peak = PeakMemory(env)
    msg = broker_pb2.PullSessionRequest(pulls=[_run_pull(env, i + 1, i * quarter, 0, quarter) for i in range(4)])
    completions, err = _session(env, iter([msg]))
    assert err is None, err
    assert {c.status for c in completions} == {"LLM_SUCCESS"}, {c.message for c in completions}
    assert len(completions) == 4
    assert peak.grown_mib() < BOUND_MIB, peak.grown_mib()
    landed = env.dst.tensors[0].reshape(-1)[:quarter]
    sources = [env.src.tensors[0].reshape(-1)[i * quarter:(i + 1) * quarter] for i in range(4)]
    assert any(np.array_equal(landed, s) for s in sources)


def test_a_client_submit_over_the_pair_budget_goes_as_several_messages(env: LinkedCaches) -> None:
    """The client keeps each message within the daemon's budget: a submit of three pulls of 2^19 pairs (more than
    one message may name) still gives every pull its result."""
    half = 1 << 19
    pulls = [SessionPull(env.index(), env.dst.cache_id, (), block_runs=blockruns.check([i * half], [i * half], [half]))
             for i in range(3)]
    with env.dc.open_pull_session() as session:
        futures = session.submit(pulls)
        results = [f.result(60) for f in futures]
    assert [r.bytes_moved for r in results] == [half] * 3
    for i in range(3):
        assert np.array_equal(env.dst.tensors[0].reshape(-1)[i * half:(i + 1) * half],
                              env.src.tensors[0].reshape(-1)[i * half:(i + 1) * half])


def test_the_client_learns_why_a_session_ended(env: LinkedCaches) -> None:
    """A session the daemon ended (here: a message of too many pulls, sent raw on the client's own stream) fails its
    pending pulls and every later submit with the daemon's status and message."""
    with env.dc.open_pull_session() as session:
        session._requests.put(_id_only(1 << 40, MAX_SESSION_PULLS_PER_MESSAGE + 1))
        with pytest.raises(LlmError) as ended:
            session.submit([SessionPull(env.index(), env.dst.cache_id, (1,), (2,))])[0].result(30)
        assert ended.value.status == LlmStatus.LLM_PARAM_INVALID
        assert f"at most {MAX_SESSION_PULLS_PER_MESSAGE}" in ended.value.message
        with pytest.raises(LlmError, match=f"at most {MAX_SESSION_PULLS_PER_MESSAGE}"):
            session.submit([SessionPull(env.index(), env.dst.cache_id, (1,), (2,))])
