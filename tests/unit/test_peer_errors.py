"""`links.peer_error`: the one decoder of a failed call to a peer's daemon, fed with what grpc.aio raises."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest

from kvbroker.status import LlmError, LlmStatus
from kvbrokerd.links.table import PEER_FORGOT_LINK, peer_error
from kvbrokerd.service.errors import to_rpc_status


def _failed_call(code: grpc.StatusCode, text: str, trailing: tuple[tuple[str, str | bytes], ...] = ()
                 ) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=text)


def _answer(status: LlmStatus, message: str) -> grpc.aio.AioRpcError:
    """What a peer daemon's servicer ends a call with."""
    rpc = to_rpc_status(LlmError(status, message))
    return _failed_call(rpc.code, rpc.details, tuple(rpc.trailing_metadata))


@pytest.mark.parametrize(("answer", "status", "text"), [
    (_answer(LlmStatus.LLM_KV_CACHE_NOT_EXIST, "cache 5 does not exist"), LlmStatus.LLM_KV_CACHE_NOT_EXIST,
     "the lookup of cache 5 on cluster 3: cache 5 does not exist"),
    (_answer(LlmStatus.LLM_NOT_YET_LINK, "unknown link"), LlmStatus.LLM_LINK_FAILED,
     "cluster 3 no longer knows this link (the lookup of cache 5); unlink and link again"),
    (_failed_call(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), LlmStatus.LLM_TIMEOUT,
     "cluster 3 did not answer the lookup of cache 5 in time"),
    (_answer(LlmStatus.LLM_OUT_OF_MEMORY, "full"), LlmStatus.LLM_OUT_OF_MEMORY,
     "cluster 3 is full (the lookup of cache 5): full; retry later"),
    (_failed_call(grpc.StatusCode.RESOURCE_EXHAUSTED, "message too large"), LlmStatus.LLM_LINK_FAILED,
     "the lookup of cache 5 on cluster 3 failed: RESOURCE_EXHAUSTED message too large"),
    (_failed_call(grpc.StatusCode.UNAVAILABLE, "failed to connect"), LlmStatus.LLM_LINK_FAILED,
     "the lookup of cache 5 on cluster 3 failed: UNAVAILABLE failed to connect"),
])
def test_a_peer_answer_becomes_our_error(answer: grpc.aio.AioRpcError, status: LlmStatus, text: str) -> None:
    err = peer_error(answer, 3, "the lookup of cache 5")
    assert (err.status, err.message) == (status, text)
    assert err.details["peer_grpc_code"] == answer.code().name and err.details["cluster_id"] == "3"
    assert (PEER_FORGOT_LINK in err.details) == (answer.code() == grpc.StatusCode.FAILED_PRECONDITION)


def test_while_linking_every_failure_is_link_failed() -> None:
    for answer in (_answer(LlmStatus.LLM_OUT_OF_MEMORY, "inbound link limit reached (1)"),
                   _failed_call(grpc.StatusCode.DEADLINE_EXCEEDED, "")):
        err = peer_error(answer, 3, "cluster 3 at 127.0.0.1:1", linking=True)
        assert err.status == LlmStatus.LLM_LINK_FAILED
        assert err.message == f"cluster 3 at 127.0.0.1:1 refused: {answer.details() or answer.code().name}"


def test_the_peer_status_is_kept_as_a_detail_never_as_ours() -> None:
    err = peer_error(_answer(LlmStatus.LLM_PARAM_INVALID, "bad topic"), 3, "the notification")
    assert err.status == LlmStatus.LLM_LINK_FAILED and err.details["peer_status"] == "LLM_PARAM_INVALID"


def test_garbled_details_do_not_hide_the_failure() -> None:
    answer = _failed_call(grpc.StatusCode.NOT_FOUND, "LLM_KV_CACHE_NOT_EXIST: gone",
                          (("grpc-status-details-bin", b"\xff\xff not a status"),))
    err = peer_error(answer, 3, "the lookup of cache 5")
    assert err.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST and "peer_status" not in err.details
