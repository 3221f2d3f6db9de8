"""Domain errors of the daemon: every refusal carries an `LlmStatus` (mapped to gRPC once, in service/errors.py)."""

from __future__ import annotations

from typing import Any, NoReturn

from kvbroker.status import LlmError, LlmStatus, make_error

__all__ = ["LlmError", "LlmStatus", "fail", "param_invalid"]


def fail(status: LlmStatus, message: str, **details: Any) -> NoReturn:
    raise make_error(status, message, {k: str(v) for k, v in details.items()})


def param_invalid(message: str, **details: Any) -> NoReturn:
    fail(LlmStatus.LLM_PARAM_INVALID, message, **details)
