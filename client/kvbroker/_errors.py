"""Turns a failed call to the daemon into the matching `LlmError` (the client's decoder; `read_failure` is shared
with the daemon, which decodes its peers' answers in `kvbrokerd.links.table`)."""

from __future__ import annotations

from typing import Any

import grpc

from kvbroker.convert import runs_to_blocks
from kvbroker.status import LlmError, make_error, read_failure, status_for_grpc_code
from kvbroker.v1 import errors_pb2

TRANSFER_METHODS = frozenset({"PullKvBlocks", "PullKvBlocksStream", "PullKvCache", "PushKvBlocks", "PushKvCache",
                              "CopyKvBlocks", "TransferKvBlocksBatch"})
"""Calls that write into caches: a failure of one that the daemon did not describe may have left any block changed."""


def error_from_rpc(err: grpc.RpcError, method: str = "") -> LlmError:
    """Decodes google.rpc.Status details (ErrorInfo, TransferReport); falls back on the gRPC code alone. A transfer
    (`method`) that failed without the daemon's word (its deadline passed in transit, the daemon froze or died) gets
    a report that trusts no requested block: the daemon may still be finishing the chunk it was copying."""
    failure = read_failure(err)
    details: dict[str, Any] = {"grpc_code": failure.code.name, **failure.metadata}
    if failure.report is not None:
        details["transfer_report"] = with_block_lists(failure.report)
    elif failure.status is None and method in TRANSFER_METHODS:
        details["transfer_report"] = errors_pb2.TransferReport(stage="unknown", block_lists_omitted=True)
    if failure.status is None:
        message = f"{failure.code.name}: {failure.text}" if failure.text else failure.code.name
        return make_error(status_for_grpc_code(failure.code), message, details)
    return make_error(failure.status, failure.message, details)


def with_block_lists(report: errors_pb2.TransferReport) -> errors_pb2.TransferReport:
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
