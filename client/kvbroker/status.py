"""LLM-DataDist status codes, their gRPC codes, and the exception tree raised by the client.

Shared with the daemon (`kvbrokerd`), whose domain errors are these exceptions, so that both ends agree on every
status and its gRPC code by construction.

Exception tree::

    LlmError                      any non-success status (.status, .message, .details)
    ├── ParamInvalidError         LLM_PARAM_INVALID
    ├── KvCacheNotExistError      LLM_KV_CACHE_NOT_EXIST
    ├── NotYetLinkError           LLM_NOT_YET_LINK
    ├── AlreadyLinkError          LLM_ALREADY_LINK
    ├── LinkFailedError           LLM_LINK_FAILED, LLM_UNLINK_FAILED
    ├── LlmTimeoutError           LLM_TIMEOUT, LLM_WAIT_PROC_TIMEOUT
    ├── ClusterNumExceedLimitError LLM_CLUSTER_NUM_EXCEED_LIMIT
    ├── OutOfMemoryError          LLM_OUT_OF_MEMORY, LLM_DEVICE_OUT_OF_MEMORY
    └── FeatureNotEnabledError    LLM_FEATURE_NOT_ENABLED
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from kvbroker.v1 import errors_pb2


class LlmStatus(enum.IntEnum):
    """LLM-DataDist's status codes with their exact numeric values (0x5010B000 + n)."""

    LLM_SUCCESS = 0x0
    LLM_WAIT_PROC_TIMEOUT = 0x5010B001
    LLM_KV_CACHE_NOT_EXIST = 0x5010B002
    LLM_REPEAT_REQUEST = 0x5010B003
    LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004
    LLM_PARAM_INVALID = 0x5010B005
    LLM_ENGINE_FINALIZED = 0x5010B006
    LLM_NOT_YET_LINK = 0x5010B007
    LLM_ALREADY_LINK = 0x5010B008
    LLM_LINK_FAILED = 0x5010B009
    LLM_UNLINK_FAILED = 0x5010B00A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    LLM_PROCESSING_LINK = 0x5010B00D
    LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00E
    LLM_PREFIX_ALREADY_EXIST = 0x5010B00F
    LLM_PREFIX_NOT_EXIST = 0x5010B010
    LLM_SEQ_LEN_OVER_LIMIT = 0x5010B011
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    LLM_FAILED = 0xFFFFFFFF


_GRPC_CODES: Mapping[LlmStatus, grpc.StatusCode] = {
    LlmStatus.LLM_SUCCESS: grpc.StatusCode.OK,
    LlmStatus.LLM_PARAM_INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    LlmStatus.LLM_KV_CACHE_NOT_EXIST: grpc.StatusCode.NOT_FOUND,
    LlmStatus.LLM_NOT_YET_LINK: grpc.StatusCode.FAILED_PRECONDITION,
    LlmStatus.LLM_EXIST_LINK: grpc.StatusCode.FAILED_PRECONDITION,
    LlmStatus.LLM_ALREADY_LINK: grpc.StatusCode.ALREADY_EXISTS,
    LlmStatus.LLM_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    LlmStatus.LLM_WAIT_PROC_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    LlmStatus.LLM_LINK_FAILED: grpc.StatusCode.UNAVAILABLE,
    LlmStatus.LLM_UNLINK_FAILED: grpc.StatusCode.UNAVAILABLE,
    LlmStatus.LLM_LINK_BUSY: grpc.StatusCode.ABORTED,
    LlmStatus.LLM_PROCESSING_LINK: grpc.StatusCode.ABORTED,
    LlmStatus.LLM_OUT_OF_MEMORY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    LlmStatus.LLM_DEVICE_OUT_OF_MEMORY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    LlmStatus.LLM_CLUSTER_NUM_EXCEED_LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    LlmStatus.LLM_FEATURE_NOT_ENABLED: grpc.StatusCode.UNIMPLEMENTED,
    LlmStatus.LLM_FAILED: grpc.StatusCode.INTERNAL,
}

# Statuses a client may meet without a kvbroker daemon having produced them (transport failures).
_FROM_GRPC_CODE: Mapping[grpc.StatusCode, LlmStatus] = {
    grpc.StatusCode.DEADLINE_EXCEEDED: LlmStatus.LLM_TIMEOUT,
    grpc.StatusCode.INVALID_ARGUMENT: LlmStatus.LLM_PARAM_INVALID,
    grpc.StatusCode.NOT_FOUND: LlmStatus.LLM_KV_CACHE_NOT_EXIST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LlmStatus.LLM_OUT_OF_MEMORY,
    grpc.StatusCode.UNIMPLEMENTED: LlmStatus.LLM_FEATURE_NOT_ENABLED,
}

ERROR_DOMAIN = "kvbroker"
# Request header: how many bytes of error details (google.rpc.Status in trailing metadata) the caller accepts. gRPC
# refuses trailing metadata over its receive limit (8 KiB by default) and the caller then gets RESOURCE_EXHAUSTED
# instead of the LLM status, so the daemon leaves out block lists that would not fit.
ACCEPT_DETAILS_HEADER = "kvbroker-accept-details-bytes"
# Request header: the call's own budget in milliseconds. The daemon answers within it (or the gRPC deadline, if
# sooner); kvbroker's client sets its gRPC deadline `reply_grace` later, so that a reply sent at the budget's end on
# a busy host still arrives. Callers that do not send it (grpcurl, other clients) keep the gRPC deadline's meaning.
TIMEOUT_HEADER = "kvbroker-timeout-ms"
MAX_TIMEOUT_MS = 1 << 31


def reply_grace(budget_s: float) -> float:
    """How much longer than its budget a call waits for the daemon's answer: a starved daemon (a loaded host) sends
    its report late, never its bytes (every copy stops writing at the budget's end)."""
    return min(5.0, max(1.0, budget_s * 0.5))


_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True, slots=True)
class RpcFailure:
    """A failed gRPC call as a kvbroker daemon describes it: code, message and google.rpc.Status details."""

    code: grpc.StatusCode
    text: str
    """The status message as sent (a daemon's starts with the LLM status name)."""
    status: LlmStatus | None = None
    """The LLM status of the ErrorInfo detail; None when the answer carries none (e.g. the daemon was down)."""
    metadata: Mapping[str, str] = field(default_factory=dict)
    """The ErrorInfo's metadata."""
    report: errors_pb2.TransferReport | None = None
    """A failed transfer's report, as sent."""

    @property
    def message(self) -> str:
        """The message without its LLM status prefix."""
        prefix = f"{self.status.name}: " if self.status is not None else ""
        return self.text[len(prefix):] if prefix and self.text.startswith(prefix) else self.text


def read_failure(err: grpc.RpcError) -> RpcFailure:
    """Decodes what a failed call carries. Details that do not decode count as absent, so that a garbled answer can
    never hide the failure it came with."""
    status: LlmStatus | None = None
    metadata: dict[str, str] = {}
    report: errors_pb2.TransferReport | None = None
    for key, value in err.trailing_metadata() or ():
        if key != _DETAILS_KEY:
            continue
        try:
            rich = status_pb2.Status.FromString(value)
            for any_msg in rich.details:
                info = error_details_pb2.ErrorInfo()
                if any_msg.Is(info.DESCRIPTOR) and any_msg.Unpack(info) and info.domain == ERROR_DOMAIN:
                    metadata.update(info.metadata)
                    status = LlmStatus.__members__.get(info.reason, LlmStatus.LLM_FAILED)
                elif any_msg.Is(errors_pb2.TransferReport.DESCRIPTOR):
                    report = errors_pb2.TransferReport()
                    any_msg.Unpack(report)
        except DecodeError:
            continue
    return RpcFailure(err.code(), err.details() or "", status, metadata, report)


def grpc_code_for(status: LlmStatus) -> grpc.StatusCode:
    """The gRPC code that carries `status` on the wire (API.md's table; unlisted statuses are INTERNAL)."""
    return _GRPC_CODES.get(status, grpc.StatusCode.INTERNAL)


def status_for_grpc_code(code: grpc.StatusCode) -> LlmStatus:
    """Best LLM status for a gRPC failure that carries no kvbroker ErrorInfo (e.g. the daemon is down)."""
    return _FROM_GRPC_CODE.get(code, LlmStatus.LLM_FAILED)


class LlmError(Exception):
    """A call failed with an LLM-DataDist status. `.details` holds ErrorInfo metadata and decoded detail messages."""

    def __init__(self, status: LlmStatus, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message
        self.details: dict[str, Any] = dict(details or {})

    @property
    def failed_dst_blocks(self) -> list[int] | None:
        """For a failed transfer: destination blocks that did not (completely) land; every other requested block
        holds the source's bytes. None when the error says nothing about blocks: a refused request, for which no
        byte was written at all, or a report whose lists the daemon left out because they exceeded what the caller
        accepts (`details["transfer_report"].block_lists_omitted`; then no requested block can be trusted).
        kvbroker's client accepts the largest report a request can cause."""
        report = self.details.get("transfer_report")
        if report is None or report.block_lists_omitted:
            return None
        return [int(b) for b in report.failed_dst_blocks]


class ParamInvalidError(LlmError):
    """LLM_PARAM_INVALID: the request broke a validation rule; nothing was written."""


class KvCacheNotExistError(LlmError):
    """LLM_KV_CACHE_NOT_EXIST: a local or remote cache id is unknown."""


class NotYetLinkError(LlmError):
    """LLM_NOT_YET_LINK: no READY link to the remote cluster."""


class AlreadyLinkError(LlmError):
    """LLM_ALREADY_LINK: the cluster is linked already."""


class LinkFailedError(LlmError):
    """LLM_LINK_FAILED / LLM_UNLINK_FAILED: the peer was unreachable or refused."""


class LlmTimeoutError(LlmError):
    """LLM_TIMEOUT / LLM_WAIT_PROC_TIMEOUT: the deadline passed."""


class ClusterNumExceedLimitError(LlmError):
    """LLM_CLUSTER_NUM_EXCEED_LIMIT: more than 16 clusters in one (un)link call."""


class OutOfMemoryError(LlmError):
    """LLM_OUT_OF_MEMORY / LLM_DEVICE_OUT_OF_MEMORY: memory or a resource limit is exhausted."""


class FeatureNotEnabledError(LlmError):
    """LLM_FEATURE_NOT_ENABLED: the daemon does not offer this operation or backend."""


_ERROR_CLASSES: Mapping[LlmStatus, type[LlmError]] = {
    LlmStatus.LLM_PARAM_INVALID: ParamInvalidError,
    LlmStatus.LLM_KV_CACHE_NOT_EXIST: KvCacheNotExistError,
    LlmStatus.LLM_NOT_YET_LINK: NotYetLinkError,
    LlmStatus.LLM_ALREADY_LINK: AlreadyLinkError,
    LlmStatus.LLM_LINK_FAILED: LinkFailedError,
    LlmStatus.LLM_UNLINK_FAILED: LinkFailedError,
    LlmStatus.LLM_TIMEOUT: LlmTimeoutError,
    LlmStatus.LLM_WAIT_PROC_TIMEOUT: LlmTimeoutError,
    LlmStatus.LLM_CLUSTER_NUM_EXCEED_LIMIT: ClusterNumExceedLimitError,
    LlmStatus.LLM_OUT_OF_MEMORY: OutOfMemoryError,
    LlmStatus.LLM_DEVICE_OUT_OF_MEMORY: OutOfMemoryError,
    LlmStatus.LLM_FEATURE_NOT_ENABLED: FeatureNotEnabledError,
}


def make_error(status: LlmStatus, message: str, details: Mapping[str, Any] | None = None) -> LlmError:
    """The most specific exception for `status`."""
    return _ERROR_CLASSES.get(status, LlmError)(status, message, details)
