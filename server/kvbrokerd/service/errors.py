"""The one place where domain errors become gRPC statuses: code from API.md's table, message prefixed with the LLM
status name (readable in grpcurl), and google.rpc.ErrorInfo (+ TransferReport) in the details."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvbroker.status import ERROR_DOMAIN, grpc_code_for
from kvbrokerd.errors import LlmError, LlmStatus

log = logging.getLogger(__name__)

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
Handler = Callable[[Any, _Req, grpc.aio.ServicerContext], Awaitable[_Resp]]


def to_rpc_status(err: LlmError) -> grpc.Status:
    code = grpc_code_for(err.status)
    metadata = {k: str(v) for k, v in err.details.items() if isinstance(v, str | int | float)}
    info = error_details_pb2.ErrorInfo(
        reason=err.status.name, domain=ERROR_DOMAIN, metadata={"status_code": str(int(err.status)), **metadata}
    )
    details = []
    for message in (info, err.details.get("transfer_report")):
        if message is not None:
            packed = any_pb2.Any()
            packed.Pack(message)
            details.append(packed)
    status = status_pb2.Status(
        code=getattr(code_pb2, code.name), message=f"{err.status.name}: {err.message}", details=details
    )
    return rpc_status.to_status(status)


def status_of(exc: Exception, rpc: str) -> grpc.Status:
    """The status an RPC ends with: an LlmError's own; anything else is a bug of ours, LLM_FAILED (INTERNAL) with its
    type and message, and logged with its traceback. Never gRPC's bare UNKNOWN."""
    if isinstance(exc, LlmError):
        return to_rpc_status(exc)
    log.error("%s failed", rpc, exc_info=exc)
    return to_rpc_status(LlmError(LlmStatus.LLM_FAILED, f"internal error: {type(exc).__name__}: {exc}"))


def llm_errors(handler: Handler[_Req, _Resp]) -> Handler[_Req, _Resp]:
    """Ends the RPC with the rich status of an LlmError; unexpected exceptions become LLM_FAILED (logged)."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: _Req, context: grpc.aio.ServicerContext) -> _Resp:
        try:
            return await handler(self, request, context)
        except Exception as exc:
            await context.abort_with_status(status_of(exc, handler.__name__))
        raise AssertionError("unreachable")  # abort_with_status raises

    return wrapper


def time_remaining(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, remaining)
