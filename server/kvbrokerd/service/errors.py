"""The one place where domain errors become gRPC statuses: code from API.md's table, message prefixed with the LLM
status name (readable in grpcurl), and google.rpc.ErrorInfo (+ TransferReport) in the details.

The details travel in trailing metadata, which a gRPC client refuses beyond its limit (8 KiB by default): the status
is then lost (RESOURCE_EXHAUSTED). So block lists go as runs when that is shorter, and are left out (flagged) when
the details would exceed what the caller accepts (`ACCEPT_DETAILS_HEADER`; kvbroker's client announces 64 MiB)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio
import numpy as np
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvbroker.convert import blocks_to_runs
from kvbroker.status import ACCEPT_DETAILS_HEADER, ERROR_DOMAIN, MAX_TIMEOUT_MS, TIMEOUT_HEADER, grpc_code_for
from kvbroker.v1 import errors_pb2
from kvbrokerd.errors import LlmError, LlmStatus
from kvbrokerd.transfers.reports import TransferReport

log = logging.getLogger(__name__)

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
Handler = Callable[[Any, _Req, grpc.aio.ServicerContext], Awaitable[_Resp]]


# What a caller that does not say gets: with the other trailers, under gRPC's default 8 KiB receive limit.
DEFAULT_DETAILS_BUDGET = 6 << 10
# No report can be larger than the request that caused it (at most 64 MiB, daemon.MAX_MESSAGE_BYTES).
MAX_DETAILS_BUDGET = 64 << 20


def _set_blocks(msg: errors_pb2.TransferReport | errors_pb2.GroupReport, blocks: np.ndarray) -> None:
    runs = blocks_to_runs(blocks)
    if len(runs) < len(blocks):
        msg.failed_dst_runs.extend(runs.tolist())
    else:
        msg.failed_dst_blocks.extend(blocks.tolist())


def report_to_pb(report: TransferReport, *, with_blocks: bool = True) -> errors_pb2.TransferReport:
    """The wire form of `report`; without its block lists (flagged) when `with_blocks` is false."""
    msg = errors_pb2.TransferReport(transfer_id=report.transfer_id, backend=report.backend, stage=report.stage,
                                    bytes_moved=report.bytes_moved, completed_layers=report.completed_layers,
                                    block_lists_omitted=not with_blocks)
    if with_blocks:
        _set_blocks(msg, report.failed_dst_blocks)
    for group in report.groups:
        group_msg = msg.groups.add(index=group.index, done=group.done)
        if with_blocks:
            _set_blocks(group_msg, group.failed_dst_blocks)
    return msg


def details_budget(context: grpc.aio.ServicerContext) -> int:
    """Bytes of error details the caller accepts: what it announced, within [default, max]."""
    for key, value in context.invocation_metadata() or ():
        if key == ACCEPT_DETAILS_HEADER and isinstance(value, str) and value.isdigit():
            return min(max(int(value), DEFAULT_DETAILS_BUDGET), MAX_DETAILS_BUDGET)
    return DEFAULT_DETAILS_BUDGET


def to_rpc_status(err: LlmError, budget: int = DEFAULT_DETAILS_BUDGET) -> grpc.Status:
    code = grpc_code_for(err.status)
    metadata = {k: str(v) for k, v in err.details.items() if isinstance(v, str | int | float)}
    info = error_details_pb2.ErrorInfo(
        reason=err.status.name, domain=ERROR_DOMAIN, metadata={"status_code": str(int(err.status)), **metadata}
    )
    message = f"{err.status.name}: {err.message}"
    report = err.details.get("transfer_report")
    if not isinstance(report, TransferReport):
        return rpc_status.to_status(_status(code, message, info))
    status = _status(code, message, info, report_to_pb(report))
    if status.ByteSize() + len(message.encode()) > budget:  # + grpc-message, which repeats the message
        log.warning("transfer %s: its report (%d bytes) exceeds what the caller accepts (%d bytes); block lists "
                    "left out", report.transfer_id, status.ByteSize(), budget)
        status = _status(code, message, info, report_to_pb(report, with_blocks=False))
    return rpc_status.to_status(status)


def _status(code: grpc.StatusCode, message: str, *details: Message) -> status_pb2.Status:
    packed = []
    for detail in details:
        packed.append(any_pb2.Any())
        packed[-1].Pack(detail)
    return status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=packed)


def status_of(exc: Exception, rpc: str, context: grpc.aio.ServicerContext) -> grpc.Status:
    """The status an RPC ends with: an LlmError's own; anything else is a bug of ours, LLM_FAILED (INTERNAL) with its
    type and message, and logged with its traceback. Never gRPC's bare UNKNOWN."""
    if isinstance(exc, LlmError):
        return to_rpc_status(exc, details_budget(context))
    log.error("%s failed", rpc, exc_info=exc)
    return to_rpc_status(LlmError(LlmStatus.LLM_FAILED, f"internal error: {type(exc).__name__}: {exc}"))


def llm_errors(handler: Handler[_Req, _Resp]) -> Handler[_Req, _Resp]:
    """Ends the RPC with the rich status of an LlmError; unexpected exceptions become LLM_FAILED (logged)."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: _Req, context: grpc.aio.ServicerContext) -> _Resp:
        try:
            return await handler(self, request, context)
        except Exception as exc:
            await context.abort_with_status(status_of(exc, handler.__name__, context))
        raise AssertionError("unreachable")  # abort_with_status raises

    return wrapper


def time_remaining(context: grpc.aio.ServicerContext) -> float | None:
    """The call's budget: the sooner of its gRPC deadline and the budget the caller stated (`TIMEOUT_HEADER`)."""
    remaining = context.time_remaining()
    for key, value in context.invocation_metadata() or ():
        if key == TIMEOUT_HEADER and isinstance(value, str) and value.isdigit() and 0 < int(value) <= MAX_TIMEOUT_MS:
            stated = int(value) / 1000
            remaining = stated if remaining is None else min(remaining, stated)
            break
    return None if remaining is None else max(0.0, remaining)
