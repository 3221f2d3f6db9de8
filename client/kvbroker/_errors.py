"""Turns a failed gRPC call into the matching `LlmError`."""

from __future__ import annotations

from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from kvbroker.convert import runs_to_blocks
from kvbroker.status import ERROR_DOMAIN, LlmError, LlmStatus, make_error, status_for_grpc_code
from kvbroker.v1 import errors_pb2

_DETAILS_KEY = "grpc-status-details-bin"


def error_from_rpc(err: grpc.RpcError) -> LlmError:
    """Decodes google.rpc.Status details (ErrorInfo, TransferReport); falls back on the gRPC code alone."""
    code: grpc.StatusCode = err.code()
    text: str = err.details() or ""
    details: dict[str, Any] = {"grpc_code": code.name}
    status: LlmStatus | None = None
    for key, value in err.trailing_metadata() or ():
        if key != _DETAILS_KEY:
            continue
        rich = status_pb2.Status.FromString(value)
        for any_msg in rich.details:
            info = error_details_pb2.ErrorInfo()
            report = errors_pb2.TransferReport()
            if any_msg.Is(info.DESCRIPTOR) and any_msg.Unpack(info) and info.domain == ERROR_DOMAIN:
                details.update(info.metadata)
                status = LlmStatus.__members__.get(info.reason, LlmStatus.LLM_FAILED)
            elif any_msg.Is(report.DESCRIPTOR) and any_msg.Unpack(report):
                details["transfer_report"] = _with_block_lists(report)
    if status is None:
        status = status_for_grpc_code(code)
        message = f"{code.name}: {text}" if text else code.name
    else:
        prefix = f"{status.name}: "
        message = text[len(prefix) :] if text.startswith(prefix) else text
    return make_error(status, message, details)


def _with_block_lists(report: errors_pb2.TransferReport) -> errors_pb2.TransferReport:
    """`report` with every block list as a list (the daemon sends runs when they are shorter)."""
    messages: list[errors_pb2.TransferReport | errors_pb2.GroupReport] = [report, *report.groups]
    for msg in messages:
        if msg.failed_dst_runs:
            try:
                blocks = runs_to_blocks(msg.failed_dst_runs)
            except ValueError:
                continue  # a malformed report must not hide the error it came with
            msg.ClearField("failed_dst_runs")
            msg.failed_dst_blocks.extend(blocks.tolist())
    return report
