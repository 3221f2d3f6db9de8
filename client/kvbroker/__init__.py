"""kvbroker: the Python client of the kvbrokerd KV-cache transfer daemon (LLM-DataDist semantics over gRPC)."""

from kvbroker._client import AsyncClient, Client
from kvbroker._shm import Cache
from kvbroker._status import (
    AlreadyLinkError,
    ClusterNumExceedLimitError,
    FeatureNotEnabledError,
    KvCacheNotExistError,
    LinkFailedError,
    LlmError,
    LlmStatus,
    LlmTimeoutError,
    NotYetLinkError,
    OutOfMemoryError,
    ParamInvalidError,
)
from kvbroker._types import (
    CacheDesc,
    CacheIndex,
    CacheRecord,
    ClusterInfo,
    ClusterResult,
    ClusterStatus,
    DataType,
    KvCacheExtParam,
    LinkInfo,
    LinkState,
    Placement,
    TensorLocation,
    TransferResult,
)

__version__ = "0.1.0"

__all__ = [
    "AlreadyLinkError",
    "AsyncClient",
    "Cache",
    "CacheDesc",
    "CacheIndex",
    "CacheRecord",
    "Client",
    "ClusterInfo",
    "ClusterNumExceedLimitError",
    "ClusterResult",
    "ClusterStatus",
    "DataType",
    "FeatureNotEnabledError",
    "KvCacheExtParam",
    "KvCacheNotExistError",
    "LinkFailedError",
    "LinkInfo",
    "LinkState",
    "LlmError",
    "LlmStatus",
    "LlmTimeoutError",
    "NotYetLinkError",
    "OutOfMemoryError",
    "ParamInvalidError",
    "Placement",
    "TensorLocation",
    "TransferResult",
]
