"""A failed transfer's report on the wire: block lists as runs when shorter, bounded by what the caller accepts,
and decoded by the client back to the list the daemon meant."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker._errors import error_from_rpc
from kvbroker.convert import blocks_to_runs, runs_to_blocks
from kvbroker.status import ACCEPT_DETAILS_HEADER, LlmStatus
from kvbrokerd.errors import LlmError
from kvbrokerd.service.errors import DEFAULT_DETAILS_BUDGET, details_budget, report_to_pb, to_rpc_status
from kvbrokerd.transfers.reports import GroupReport, TransferReport

blocks_st = st.lists(st.integers(0, 2**63), max_size=200)


@given(blocks_st)
def test_runs_round_trip_in_order(blocks: list[int]) -> None:
    runs = blocks_to_runs(blocks)
    assert runs_to_blocks(runs).tolist() == blocks
    assert len(runs) % 2 == 0 and all(runs[1::2] >= 1)


def test_runs_are_maximal_ascending_runs() -> None:
    assert blocks_to_runs([5, 6, 7, 2, 9, 10, 4]).tolist() == [5, 3, 2, 1, 9, 2, 4, 1]
    assert blocks_to_runs([2**64 - 1, 0]).tolist() == [2**64 - 1, 1, 0, 1]  # no wrap-around run
    with pytest.raises(ValueError, match="pairs"):
        runs_to_blocks([1, 2, 3])


class _RpcError(grpc.RpcError):  # type: ignore[misc]
    """A failed call as the client sees it, built from the status the daemon ends the call with."""

    def __init__(self, status: grpc.Status) -> None:
        self._status = status

    def code(self) -> grpc.StatusCode:
        return self._status.code

    def details(self) -> str:
        return self._status.details  # type: ignore[no-any-return]

    def trailing_metadata(self) -> Any:
        return self._status.trailing_metadata


def _report(blocks: list[int], groups: tuple[GroupReport, ...] = ()) -> TransferReport:
    return TransferReport(transfer_id="t1", backend="tcp", failed_dst_blocks=np.array(blocks, dtype=np.uint64),
                          bytes_moved=7, completed_layers=(0, 1), groups=groups)


@given(blocks_st, blocks_st)
def test_the_client_sees_the_lists_the_daemon_reported(blocks: list[int], group_blocks: list[int]) -> None:
    report = _report(blocks, (GroupReport(0, done=False, failed_dst_blocks=np.array(group_blocks, np.uint64)),
                              GroupReport(1, done=True)))
    err = error_from_rpc(_RpcError(to_rpc_status(LlmError(LlmStatus.LLM_TIMEOUT, "late",
                                                          {"transfer_report": report}), 1 << 20)))
    assert err.status == LlmStatus.LLM_TIMEOUT and err.failed_dst_blocks == blocks
    got = err.details["transfer_report"]
    assert list(got.completed_layers) == [0, 1] and got.bytes_moved == 7 and not got.block_lists_omitted
    assert [list(g.failed_dst_blocks) for g in got.groups] == [group_blocks, []]
    assert [g.done for g in got.groups] == [False, True]


def test_contiguous_blocks_travel_as_runs() -> None:
    msg = report_to_pb(_report(list(range(100_000))))
    assert list(msg.failed_dst_runs) == [0, 100_000] and not msg.failed_dst_blocks
    scattered = report_to_pb(_report(list(range(0, 200, 2))))
    assert list(scattered.failed_dst_blocks) == list(range(0, 200, 2)) and not scattered.failed_dst_runs


def test_a_report_over_the_budget_keeps_the_status_and_leaves_the_lists_out() -> None:
    blocks = list(range(0, 20_000, 2))
    status = to_rpc_status(LlmError(LlmStatus.LLM_LINK_FAILED, "gone", {"transfer_report": _report(blocks)}))
    assert sum(len(v) for _, v in status.trailing_metadata) < DEFAULT_DETAILS_BUDGET
    err = error_from_rpc(_RpcError(status))
    assert err.status == LlmStatus.LLM_LINK_FAILED and err.message == "gone"
    assert err.details["transfer_report"].block_lists_omitted and err.failed_dst_blocks is None
    assert err.details["transfer_report"].bytes_moved == 7


class _Context:
    def __init__(self, *metadata: tuple[str, str]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


@pytest.mark.parametrize(("announced", "budget"), [
    (None, DEFAULT_DETAILS_BUDGET), ("100", DEFAULT_DETAILS_BUDGET), ("1000000", 1_000_000),
    (str(1 << 40), 64 << 20), ("-5", DEFAULT_DETAILS_BUDGET), ("lots", DEFAULT_DETAILS_BUDGET),
])
def test_the_budget_is_what_the_caller_announced_within_bounds(announced: str | None, budget: int) -> None:
    metadata = () if announced is None else ((ACCEPT_DETAILS_HEADER, announced),)
    assert details_budget(_Context(*metadata)) == budget
