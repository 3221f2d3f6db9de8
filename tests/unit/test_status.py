"""Status codes keep LLM-DataDist's numbers, map to API.md's gRPC codes, and decode back into typed errors."""

from __future__ import annotations

import grpc
import pytest

import kvbroker
from kvbroker import LlmStatus
from kvbroker.status import grpc_code_for, make_error

# From LLM-DataDist's llm_error_codes.h (0x5010B000 + n) and the Python LLMStatusCode table.
EXPECTED = {
    "LLM_SUCCESS": 0,
    "LLM_WAIT_PROC_TIMEOUT": 1343270913,
    "LLM_KV_CACHE_NOT_EXIST": 1343270914,
    "LLM_PARAM_INVALID": 1343270917,
    "LLM_NOT_YET_LINK": 1343270919,
    "LLM_ALREADY_LINK": 1343270920,
    "LLM_LINK_FAILED": 1343270921,
    "LLM_UNLINK_FAILED": 1343270922,
    "LLM_CLUSTER_NUM_EXCEED_LIMIT": 1343270924,
    "LLM_PROCESSING_LINK": 1343270925,
    "LLM_DEVICE_OUT_OF_MEMORY": 1343270926,
    "LLM_EXIST_LINK": 1343270936,
    "LLM_FEATURE_NOT_ENABLED": 1343270937,
    "LLM_TIMEOUT": 1343270938,
    "LLM_LINK_BUSY": 1343270939,
    "LLM_OUT_OF_MEMORY": 1343270940,
    "LLM_FAILED": 0xFFFFFFFF,
}


@pytest.mark.parametrize(("name", "value"), sorted(EXPECTED.items()))
def test_numeric_values(name: str, value: int) -> None:
    assert LlmStatus[name] == value


@pytest.mark.parametrize(("status", "code"), [
    (LlmStatus.LLM_PARAM_INVALID, grpc.StatusCode.INVALID_ARGUMENT),
    (LlmStatus.LLM_KV_CACHE_NOT_EXIST, grpc.StatusCode.NOT_FOUND),
    (LlmStatus.LLM_NOT_YET_LINK, grpc.StatusCode.FAILED_PRECONDITION),
    (LlmStatus.LLM_EXIST_LINK, grpc.StatusCode.FAILED_PRECONDITION),
    (LlmStatus.LLM_ALREADY_LINK, grpc.StatusCode.ALREADY_EXISTS),
    (LlmStatus.LLM_TIMEOUT, grpc.StatusCode.DEADLINE_EXCEEDED),
    (LlmStatus.LLM_WAIT_PROC_TIMEOUT, grpc.StatusCode.DEADLINE_EXCEEDED),
    (LlmStatus.LLM_LINK_FAILED, grpc.StatusCode.UNAVAILABLE),
    (LlmStatus.LLM_UNLINK_FAILED, grpc.StatusCode.UNAVAILABLE),
    (LlmStatus.LLM_LINK_BUSY, grpc.StatusCode.ABORTED),
    (LlmStatus.LLM_PROCESSING_LINK, grpc.StatusCode.ABORTED),
    (LlmStatus.LLM_OUT_OF_MEMORY, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LlmStatus.LLM_DEVICE_OUT_OF_MEMORY, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LlmStatus.LLM_CLUSTER_NUM_EXCEED_LIMIT, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LlmStatus.LLM_FEATURE_NOT_ENABLED, grpc.StatusCode.UNIMPLEMENTED),
    (LlmStatus.LLM_FAILED, grpc.StatusCode.INTERNAL),
])
def test_grpc_code_table(status: LlmStatus, code: grpc.StatusCode) -> None:
    assert grpc_code_for(status) == code


@pytest.mark.parametrize(("status", "cls"), [
    (LlmStatus.LLM_PARAM_INVALID, kvbroker.ParamInvalidError),
    (LlmStatus.LLM_NOT_YET_LINK, kvbroker.NotYetLinkError),
    (LlmStatus.LLM_KV_CACHE_NOT_EXIST, kvbroker.KvCacheNotExistError),
    (LlmStatus.LLM_TIMEOUT, kvbroker.LlmTimeoutError),
    (LlmStatus.LLM_ALREADY_LINK, kvbroker.AlreadyLinkError),
    (LlmStatus.LLM_LINK_BUSY, kvbroker.LlmError),
])
def test_typed_errors(status: LlmStatus, cls: type[kvbroker.LlmError]) -> None:
    err = make_error(status, "why", {"k": "v"})
    assert type(err) is cls
    assert isinstance(err, kvbroker.LlmError)
    assert err.status == status and err.message == "why" and err.details == {"k": "v"}
    assert str(err) == f"{status.name}: why"
