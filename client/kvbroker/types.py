"""Public value types, named like LLM-DataDist's (CacheDesc, CacheIndex, KvCacheExtParam, ClusterInfo).

Shared with the daemon (`kvbrokerd`), which describes caches, links and results with the same types; the common
names are re-exported by `kvbroker` itself.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbroker.blockruns import Runs
from kvbroker.status import LlmStatus
from kvbroker.tracecontext import TraceContext

Blocks = Sequence[int] | np.ndarray
"""Block indices: a sequence of ints, or a numpy array of them (long lists then cost no Python int each)."""


class DataType(enum.IntEnum):
    """Element type of a cache's tensors. Values equal the wire enum `kvbroker.v1.DataType`."""

    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT32 = 3
    FLOAT64 = 4
    INT8 = 5
    UINT8 = 6
    INT16 = 7
    UINT16 = 8
    INT32 = 9
    UINT32 = 10
    INT64 = 11
    UINT64 = 12
    BOOL = 13
    FLOAT8_E4M3FN = 14
    FLOAT8_E5M2 = 15

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _NUMPY_DTYPES[self].itemsize

    @property
    def numpy_dtype(self) -> np.dtype[np.generic]:
        """The numpy dtype that views this type; types numpy lacks (bf16, fp8) are viewed as same-size integers."""
        return _NUMPY_DTYPES[self]


_NUMPY_DTYPES: dict[DataType, np.dtype[np.generic]] = {
    DataType.FLOAT16: np.dtype(np.float16),
    DataType.BFLOAT16: np.dtype(np.uint16),
    DataType.FLOAT32: np.dtype(np.float32),
    DataType.FLOAT64: np.dtype(np.float64),
    DataType.INT8: np.dtype(np.int8),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.INT16: np.dtype(np.int16),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.INT32: np.dtype(np.int32),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.INT64: np.dtype(np.int64),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.BOOL: np.dtype(np.bool_),
    DataType.FLOAT8_E4M3FN: np.dtype(np.uint8),
    DataType.FLOAT8_E5M2: np.dtype(np.uint8),
}


class Placement(enum.IntEnum):
    """Where a cache's memory lives. Values equal the wire enum `kvbroker.v1.Placement`."""

    HOST = 1
    DEVICE = 2


@dataclass(frozen=True, slots=True)
class CacheDesc:
    """`num_tensors` tensors of one `shape` and `data_type`; `shape[0]` is the number of blocks."""

    num_tensors: int
    shape: tuple[int, ...]
    data_type: DataType = DataType.FLOAT16
    placement: Placement = Placement.HOST
    layout_tag: str = ""
    # Sizes asked at every stage of every transfer: computed once, plain attributes after.
    num_blocks: int = field(init=False, repr=False, compare=False)
    """Blocks per tensor (`shape[0]`)."""
    block_nbytes: int = field(init=False, repr=False, compare=False)
    """Bytes of one block of one tensor."""
    tensor_nbytes: int = field(init=False, repr=False, compare=False)
    """Bytes of one tensor."""

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        data_type = DataType(self.data_type)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "data_type", data_type)
        object.__setattr__(self, "placement", Placement(self.placement))
        object.__setattr__(self, "num_blocks", shape[0] if shape else 0)
        object.__setattr__(self, "block_nbytes", math.prod(shape[1:]) * data_type.itemsize)
        object.__setattr__(self, "tensor_nbytes", math.prod(shape) * data_type.itemsize)


@dataclass(frozen=True, slots=True)
class CacheIndex:
    """Names a cache on a remote cluster."""

    cluster_id: int
    cache_id: int
    batch_index: int = 0


@dataclass(frozen=True, slots=True)
class KvCacheExtParam:
    """Layer selection: inclusive (first, second) ranges, (-1, -1) = all layers; `tensor_num_per_layer` tensors per
    layer (K and V by default)."""

    src_layer_range: tuple[int, int] = (-1, -1)
    dst_layer_range: tuple[int, int] = (-1, -1)
    tensor_num_per_layer: int = 2


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """A remote cluster to link to: its id and its daemon's peer address ("host:port")."""

    remote_cluster_id: int
    remote_address: str


@dataclass(frozen=True, slots=True)
class ClusterResult:
    """Outcome of (un)linking one cluster."""

    remote_cluster_id: int
    status: LlmStatus
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == LlmStatus.LLM_SUCCESS


class LinkState(enum.IntEnum):
    """State of a link. Values equal the wire enum `kvbroker.v1.LinkState`."""

    LINKING = 1
    READY = 2
    BROKEN = 3


@dataclass(frozen=True, slots=True)
class Notification:
    """A message a linked peer's client sent to this daemon (`send_notification` there, `fetch_notifications`
    here); `cluster_id` is the sender's, as its authenticated link says."""

    cluster_id: int
    topic: str
    payload: bytes
    received_unix: float


@dataclass(frozen=True, slots=True)
class Grant:
    """A grant of held blocks (`create_grant`): a public id and a secret, both needed to renew, redeem or release it.
    `token()` is its text form (for a request's parameters); the secret never shows in repr."""

    grant_id: bytes
    secret: bytes = field(repr=False)
    expires_in: float = 0.0
    """Seconds until it lapses unless renewed, as its daemon said when it answered."""

    def token(self) -> str:
        return f"{self.grant_id.hex()}.{self.secret.hex()}"

    @classmethod
    def from_token(cls, token: str) -> Grant:
        """ValueError unless `token` is a `token()` (a 16-byte id and a 32-byte secret in hex)."""
        if not isinstance(token, str) or len(token) != 32 + 1 + 64:
            raise ValueError("not a kvbroker grant")
        grant_id, dot, secret = token.partition(".")
        if dot != ".":
            raise ValueError("not a kvbroker grant")
        return cls(bytes.fromhex(grant_id), bytes.fromhex(secret))


@dataclass(frozen=True, slots=True)
class LinkInfo:
    """A link as `list_links` reports it."""

    remote_cluster_id: int
    remote_address: str
    state: LinkState
    backend: str
    remote_epoch: str
    last_seen_unix: float
    reason: str = ""


CUDA_REREGISTER = "cuda-reregister"
"""A daemon feature (`ClusterStatus.features`): device memory registered again with the same tensor locations as a
listed cache (the same memory in other blocks) shares that cache's IPC import and engine registration."""


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """What `get_cluster_info` reports about the daemon."""

    cluster_id: int
    version: str
    peer_address: str
    backends: tuple[str, ...]
    instance_epoch: str
    num_caches: int
    num_links: int
    protocol_version: int
    metrics_address: str = ""
    features: tuple[str, ...] = ()
    """Behaviours older daemons lack (`CUDA_REREGISTER`)."""


@dataclass(frozen=True, slots=True)
class TransferResult:
    """Outcome of a successful transfer."""

    bytes_moved: int
    backend: str
    transfer_id: str
    num_runs: int


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """Accelerator memory exported by IPC handle: `kind` "cuda" or "npu", the device (UUID or ordinal), the
    exporter's handle (CUDA: the 64-byte cudaIpcMemHandle_t of the allocation; Ascend: its IPC export key) and the
    exported allocation's size."""

    kind: str
    device: str
    ipc_handle: bytes
    allocation_bytes: int


@dataclass(frozen=True, slots=True)
class TensorLocation:
    """A tensor in a shared-memory segment (segment name without slash, byte offset), or, with `device`, in an
    exported device allocation (offset from the allocation's base; segment empty)."""

    segment: str
    offset: int = 0
    device: DeviceMemory | None = None


@dataclass(frozen=True, slots=True)
class CacheRecord:
    """A cache as the daemon reports it (no memory mapped)."""

    cache_id: int
    desc: CacheDesc
    tensors: tuple[TensorLocation, ...]
    shm_dir: str
    daemon_owned: bool
    owner: str = ""
    """Client session whose lease keeps the cache alive ("" = none)."""
    lease_expires_unix: float = 0.0


@dataclass(frozen=True, slots=True)
class LayerLanded:
    """A destination layer of a layer-wise pull has landed completely."""

    layer: int
    layer_bytes: int


@dataclass(frozen=True, slots=True)
class PullBlocks:
    """One group of a batched transfer: pull blocks of a remote cache into a local cache."""

    src_cache_index: CacheIndex
    dst_cache: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    ext_param: KvCacheExtParam | None = None


@dataclass(frozen=True, slots=True)
class PushBlocks:
    """One group of a batched transfer: write blocks of a local cache into a remote cache."""

    src_cache: int
    dst_cache_index: CacheIndex
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    ext_param: KvCacheExtParam | None = None


@dataclass(frozen=True, slots=True)
class SessionPull:
    """One pull of a pull session (`open_pull_session`): `pull_kv_blocks` of `src_cache_index`, or, with `grant`,
    `pull_granted_kv_blocks` of the blocks that `src_cache_index.cluster_id` granted (its cache_id then 0)."""

    src_cache_index: CacheIndex
    dst_cache: int
    dst_blocks: tuple[int, ...] | np.ndarray
    src_blocks: tuple[int, ...] | np.ndarray = ()
    """Source blocks; with a grant, empty means the grant's blocks from `first_block` on. Long lists may be numpy
    arrays (they then go as runs, `kvbroker.blockruns`)."""
    ext_param: KvCacheExtParam | None = None
    grant: Grant | None = None
    cache_slot: int = 0
    """With a grant: which of its caches (e.g. the TP rank)."""
    first_block: int = 0
    """With a grant and no `src_blocks`: index into the grant's blocks of the first one to pull."""
    timeout: float | None = None
    """This pull's own deadline in seconds, from when the daemon reads it (None: the client's `timeout`)."""
    block_runs: Runs | None = None
    """Instead of `src_blocks` and `dst_blocks` (then empty): the pairs as runs, sent as they are."""
    trace_context: TraceContext | None = None
    """The trace of the request this pull serves (`kvbroker.tracecontext`), which the daemon's span of the pull
    continues; None: the submitter's current one (`tracecontext.use`, or OpenTelemetry's current span), if any."""
