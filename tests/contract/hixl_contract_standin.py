"""A STAND-IN for CANN's `hixl` Python binding (and the two pyACL calls it needs) -- NOT HIXL.

HIXL ships only with the CANN toolkit and needs an Ascend NPU, so the `hccl` backend's contract suite runs against
this module instead. It exposes the binding's surface (`hicann/hixl` src/python/hixl_py: `Hixl`, `MemDesc`,
`MemType`, `TransferOp`, `TransferOpDesc`, `TransferStatus`, status ints, option names; every method returns a status
int or a `(status, value)` tuple and never raises) and ENFORCES the documented contract, so an adapter that breaks a
rule fails here as it would on an NPU:

- `initialize` needs `acl.rt.set_device` on the calling thread first; every later call must come from that thread
  (or one that set the engine's ACL context); otherwise FAILED, and the breach is recorded in `VIOLATIONS`.
- Memory is visible across a link only if it was registered on both engines BEFORE `connect`; with the buffer
  pool off (`"0:0"`) a descriptor on unregistered memory fails, with it on (the default "4:8") the stand-in copies
  anyway and counts the transfer in `Hixl.staged` (HIXL treats such memory as host memory and stages it).
- Unknown remote engines, transfers on no link, and re-querying a finished request fail; at most 4096 registrations
  and 50 GB of device memory per engine; a disconnect ends the link's requests (nothing lands after it).
- `connect_async` links see what was registered when it was called; `get_async_connect_status` reports them.
- Status values are the documented ones (103900...).

Where the documentation names no code (a descriptor on memory registered after the link; a call from the wrong
thread) the stand-in picks one and says so next to it. Bytes move for real: engines live in one process and copy
with `ctypes.memmove` between registered addresses, so data correctness is checked byte for byte. "Device" memory
is host memory here. `FAULTS` injects what only hardware produces (slow transfers, failed requests, dropped links).
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

SUCCESS = 0
PARAM_INVALID = 103900
TIMEOUT = 103901
NOT_CONNECTED = 103902
ALREADY_CONNECTED = 103903
NOTIFY_FAILED = 103904
UNSUPPORTED = 103905
RESOURCE_EXHAUSTED = 203900
FAILED = 503900

OPTION_ENABLE_USE_FABRIC_MEM = "EnableUseFabricMem"
OPTION_RDMA_TRAFFIC_CLASS = "RdmaTrafficClass"
OPTION_RDMA_SERVICE_LEVEL = "RdmaServiceLevel"
OPTION_BUFFER_POOL = "BufferPool"
OPTION_GLOBAL_RESOURCE_CONFIG = "GlobalResourceConfig"
OPTION_AUTO_CONNECT = "AutoConnect"
OPTION_LOCAL_COMM_RES = "LocalCommRes"
_OPTIONS = {OPTION_ENABLE_USE_FABRIC_MEM, OPTION_RDMA_TRAFFIC_CLASS, OPTION_RDMA_SERVICE_LEVEL, OPTION_BUFFER_POOL,
            OPTION_GLOBAL_RESOURCE_CONFIG, OPTION_AUTO_CONNECT, OPTION_LOCAL_COMM_RES}

FEATURE_SUPPORTED = 1
FEATURE_NOT_SUPPORTED = 0

MAX_REGISTRATIONS = 4096
MAX_DEVICE_BYTES = 50 << 30


class MemType(enum.IntEnum):
    MEM_DEVICE = 0
    MEM_HOST = 1


MEM_DEVICE = MemType.MEM_DEVICE
MEM_HOST = MemType.MEM_HOST


class TransferOp(enum.IntEnum):
    READ = 0
    WRITE = 1


READ = TransferOp.READ
WRITE = TransferOp.WRITE


class TransferStatus(enum.IntEnum):
    WAITING = 0
    COMPLETED = 1
    TIMEOUT = 2
    FAILED = 3


class AsyncConnectStatus(enum.IntEnum):
    NOT_CONNECT = 0
    CONNECT_PENDING = 1
    CONNECTING = 2
    CONNECTED = 3
    CONNECT_FAILED = 4
    DISCONNECT_PENDING = 5
    DISCONNECTING = 6


class FeatureType(enum.IntEnum):
    AUTO_CONNECT = 0
    CLIENT_SERVER_COMM = 1


@dataclass
class MemDesc:
    addr: int
    len: int


@dataclass
class TransferOpDesc:
    local_addr: int
    remote_addr: int
    len: int


@dataclass
class TransferArgs:
    user_data: int = 0


def get_capability(feature: FeatureType) -> tuple[int, int]:
    return SUCCESS, FEATURE_SUPPORTED


# -- fault injection and contract bookkeeping (not part of HIXL's surface) ---------------------------------------------
@dataclass
class Faults:
    transfer_delay_s: float = 0.0
    """Each transfer completes this long after it is posted."""
    transfer_return: int | None = None
    """transfer_async / transfer_sync return this status (once) instead of posting."""
    transfer_result: TransferStatus | None = None
    """The next posted request ends in this state (FAILED, TIMEOUT) instead of COMPLETED."""
    async_unsupported: bool = False
    """transfer_async answers UNSUPPORTED (as HIXL does for staged transfers): the adapter must use transfer_sync."""
    connect_delay_s: float = 0.0
    """A link takes this long to set up: connect blocks that long, connect_async completes that much later."""
    links_held: threading.Event | None = None
    """While this event is not set, links set up with connect_async stay CONNECTING (they still fail at their
    timeout): a test decides when a link is made instead of racing a delay."""
    connect_async_unsupported: bool = False
    """connect_async answers UNSUPPORTED: the adapter must fall back to a bounded connect."""
    register_delay_s: float = 0.0
    """register_mem takes this long (pinning a large region on a real NPU does), on the engine's thread."""
    deregister_delay_s: float = 0.0
    """deregister_mem takes this long, on the engine's thread."""
    registrations_held: threading.Event | None = None
    """While this event is not set, register_mem waits for it (at most 30 s) on the engine's thread, and the engine's
    `held` names it: a slow registration whose end the test decides."""
    deregistrations_held: threading.Event | None = None
    """The same for deregister_mem."""


FAULTS = Faults()
VIOLATIONS: list[str] = []
"""Every contract breach seen (wrong thread, missing set_device); tests assert it stays empty."""
CALLS: list[tuple[str, str, str]] = []
"""(engine, method, thread name) of every call, in order."""
_ENGINES: dict[str, Hixl] = {}
_WORLD_LOCK = threading.Lock()


def reset() -> None:
    """Forgets every engine, fault and record (between tests)."""
    global FAULTS
    with _WORLD_LOCK:
        _ENGINES.clear()
    FAULTS = Faults()
    VIOLATIONS.clear()
    CALLS.clear()
    acl._reset()


def drop_links_to(engine_name: str) -> None:
    """What a dead peer or a lost heartbeat does: every link to `engine_name` is gone on both ends."""
    with _WORLD_LOCK:
        engines = list(_ENGINES.values())
    for e in engines:
        e._links.pop(engine_name, None)


def engine(name: str) -> Hixl:
    return _ENGINES[name]


def live_engines() -> list[str]:
    """Engines initialised and not finalised."""
    return sorted(_ENGINES)


# -- the engine --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Region:
    handle: int
    addr: int
    length: int
    kind: MemType

    def holds(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length


@dataclass
class _Link:
    """What one side of a link can address: the regions registered on both engines when it was made."""

    local: frozenset[int]
    remote: frozenset[int]
    pending: dict[int, _Request] = field(default_factory=dict)


@dataclass
class _Request:
    remote: str
    op: TransferOp
    descs: list[TransferOpDesc]
    done_at: float
    result: TransferStatus


_handles = itertools.count(0x1000)


class Hixl:
    def __init__(self) -> None:
        self.name = ""
        self.options: dict[str, str] = {}
        self.staged = 0
        self.finalized = False
        self._thread: int | None = None
        self._context: object | None = None
        self._regions: dict[int, _Region] = {}
        self._links: dict[str, _Link] = {}
        self._connecting: dict[str, tuple[float, float, _Link | None]] = {}
        """Pending connect_async: (completes at, gives up at, what the link will see)."""
        self._requests: dict[int, _Request] = {}
        self._pool_on = True
        self._lock = threading.Lock()
        self.held: set[str] = set()
        """Calls waiting now on a `Faults.*_held` event."""

    # A call from another thread than initialize's is undocumented behaviour on hardware (ACL errors); the stand-in
    # answers FAILED and records the breach.
    def _enter(self, method: str) -> bool:
        CALLS.append((self.name, method, threading.current_thread().name))
        if self._thread is None:
            return False
        if threading.get_ident() != self._thread and acl._context_of_thread() is not self._context:
            VIOLATIONS.append(f"{self.name}.{method} called on thread {threading.current_thread().name!r}, not the "
                              "thread that called initialize (and no aclrtSetCurrentContext there)")
            return False
        return True

    def initialize(self, local_engine: str, options: dict[str, str] | None = None) -> int:
        CALLS.append((local_engine, "initialize", threading.current_thread().name))
        if self._thread is not None:
            return SUCCESS  # the binding returns SUCCESS on a second initialize
        if acl._context_of_thread() is None:
            VIOLATIONS.append(f"initialize({local_engine}) before aclrtSetDevice on thread "
                              f"{threading.current_thread().name!r}")
            return FAILED
        host, sep, port = local_engine.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            return PARAM_INVALID
        options = dict(options or {})
        if any(k not in _OPTIONS or not isinstance(v, str) for k, v in options.items()):
            return PARAM_INVALID
        pool = options.get(OPTION_BUFFER_POOL, "4:8")
        try:
            count, size = (int(x) for x in pool.split(":"))
        except ValueError:
            return PARAM_INVALID
        with _WORLD_LOCK:
            if local_engine in _ENGINES:
                return FAILED  # the port is taken
            _ENGINES[local_engine] = self
        self.name, self.options, self._pool_on = local_engine, options, (count, size) != (0, 0)
        self._thread, self._context = threading.get_ident(), acl._context_of_thread()
        return SUCCESS

    def finalize(self) -> None:
        if not self._enter("finalize"):
            return
        with _WORLD_LOCK:
            _ENGINES.pop(self.name, None)
        for e in list(_ENGINES.values()):
            e._links.pop(self.name, None)
        self._links.clear()
        self._regions.clear()
        self._thread = None
        self.finalized = True

    def register_mem(self, mem_desc: MemDesc, mem_type: MemType, /) -> tuple[int, int]:
        if not self._enter("register_mem"):
            return FAILED, 0
        if not isinstance(mem_type, MemType) or mem_desc.addr <= 0 or mem_desc.len <= 0:
            return PARAM_INVALID, 0
        time.sleep(FAULTS.register_delay_s)  # the scenario, not a wait: an injected delay (as all sleeps here)
        self._hold("register_mem", FAULTS.registrations_held)
        for r in self._regions.values():
            if (r.addr, r.length, r.kind) == (mem_desc.addr, mem_desc.len, mem_type):
                return SUCCESS, r.handle  # documented: the same addr+len gives the same handle
        device = sum(r.length for r in self._regions.values() if r.kind == MEM_DEVICE)
        if len(self._regions) >= MAX_REGISTRATIONS or (
                mem_type == MEM_DEVICE and device + mem_desc.len > MAX_DEVICE_BYTES):
            return RESOURCE_EXHAUSTED, 0
        handle = next(_handles)
        self._regions[handle] = _Region(handle, mem_desc.addr, mem_desc.len, mem_type)
        return SUCCESS, handle

    def deregister_mem(self, mem_handle: int, /) -> int:
        if not self._enter("deregister_mem"):
            return FAILED
        time.sleep(FAULTS.deregister_delay_s)  # (injected)
        self._hold("deregister_mem", FAULTS.deregistrations_held)
        if self._regions.pop(mem_handle, None) is None:
            return PARAM_INVALID
        return SUCCESS

    def _snapshot(self, remote_engine: str) -> _Link | None:
        """What a link made now would see; None when nothing listens there (the TCP connect is refused)."""
        peer = _ENGINES.get(remote_engine)
        if peer is None or peer is self:
            return None
        return _Link(frozenset(dict(self._regions)), frozenset(dict(peer._regions)))

    def connect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        if not self._enter("connect"):
            return FAILED
        if timeout_in_millis <= 0:
            return PARAM_INVALID
        if remote_engine in self._links:
            return ALREADY_CONNECTED
        link = self._snapshot(remote_engine)
        if link is None:
            return FAILED
        if FAULTS.connect_delay_s * 1000 > timeout_in_millis:
            time.sleep(timeout_in_millis / 1000)  # (HIXL's own timeout, spent as it would be)
            return TIMEOUT
        time.sleep(FAULTS.connect_delay_s)  # (injected)
        self._links[remote_engine] = link
        return SUCCESS

    # A link set up asynchronously sees what was registered when connect_async was called (the strict reading of
    # "registered before the link"; HIXL does not say which moment counts).
    def connect_async(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        if not self._enter("connect_async"):
            return FAILED
        if FAULTS.connect_async_unsupported:
            return UNSUPPORTED
        if timeout_in_millis <= 0:
            return PARAM_INVALID
        if remote_engine in self._links or remote_engine in self._connecting:
            return ALREADY_CONNECTED
        now = time.monotonic()
        self._connecting[remote_engine] = (now + FAULTS.connect_delay_s, now + timeout_in_millis / 1000,
                                           self._snapshot(remote_engine))
        return SUCCESS

    def get_async_connect_status(self, remote_engine: str, /) -> tuple[int, AsyncConnectStatus]:
        if not self._enter("get_async_connect_status"):
            return FAILED, AsyncConnectStatus.NOT_CONNECT
        if remote_engine in self._links:
            return SUCCESS, AsyncConnectStatus.CONNECTED
        pending = self._connecting.get(remote_engine)
        if pending is None:
            return SUCCESS, AsyncConnectStatus.NOT_CONNECT
        done_at, give_up, link = pending
        now = time.monotonic()
        held = FAULTS.links_held is not None and not FAULTS.links_held.is_set()
        if link is None or (now >= give_up and (done_at > give_up or held)):
            del self._connecting[remote_engine]
            return SUCCESS, AsyncConnectStatus.CONNECT_FAILED
        if now < done_at or held:
            return SUCCESS, AsyncConnectStatus.CONNECTING
        del self._connecting[remote_engine]
        self._links[remote_engine] = link
        return SUCCESS, AsyncConnectStatus.CONNECTED

    def _hold(self, method: str, gate: threading.Event | None) -> None:
        if gate is None:
            return
        self.held.add(method)
        try:
            gate.wait(30)
        finally:
            self.held.discard(method)

    # -- what a test may look at (not part of HIXL's surface) ----------------------------------------------------------
    def links_being_made(self) -> list[str]:
        """Remote engines whose connect_async has not completed yet."""
        return sorted(self._connecting)

    def open_requests(self) -> int:
        """Posted transfer requests not yet over: the only ones that can still move bytes."""
        return len(self._requests)

    def disconnect(self, remote_engine: str, timeout_in_millis: int = 1000) -> int:
        if not self._enter("disconnect"):
            return FAILED
        if self._connecting.pop(remote_engine, None) is not None:
            return SUCCESS
        link = self._links.pop(remote_engine, None)
        if link is None:
            return NOT_CONNECTED
        for req in link.pending:  # in-flight requests end with the link and never touch memory again
            self._requests.pop(req, None)
        return SUCCESS

    def _check(self, remote_engine: str, descs: list[TransferOpDesc]) -> tuple[int, _Link | None, Hixl | None]:
        link = self._links.get(remote_engine)
        peer = _ENGINES.get(remote_engine)
        if link is None or peer is None:
            return NOT_CONNECTED, None, None
        if not descs:
            return PARAM_INVALID, None, None
        mine, theirs = dict(self._regions), dict(peer._regions)  # the peer's thread may be registering meanwhile
        for d in descs:
            if d.len <= 0:
                return PARAM_INVALID, None, None
            local = _visible(mine, link.local, d.local_addr, d.len)
            remote = _visible(theirs, link.remote, d.remote_addr, d.len)
            if local == "unregistered" or remote == "unregistered":
                if not self._pool_on:
                    return PARAM_INVALID, None, None
                self.staged += 1  # HIXL would stage it through its pool as if it were host memory
            # Registered after the link was made: HIXL documents "not remotely accessible" without a code; the
            # stand-in answers PARAM_INVALID.
            elif local == "after-link" or remote == "after-link":
                return PARAM_INVALID, None, None
        return SUCCESS, link, peer

    def transfer_sync(self, remote_engine: str, op: TransferOp, op_descs: list[TransferOpDesc],
                      timeout_in_millis: int = 1000) -> int:
        if not self._enter("transfer_sync"):
            return FAILED
        if FAULTS.transfer_return is not None:
            ret, FAULTS.transfer_return = FAULTS.transfer_return, None
            return ret
        if timeout_in_millis <= 0:
            return PARAM_INVALID
        ret, _, _ = self._check(remote_engine, op_descs)
        if ret != SUCCESS:
            return ret
        result = FAULTS.transfer_result or TransferStatus.COMPLETED
        FAULTS.transfer_result = None
        if FAULTS.transfer_delay_s * 1000 > timeout_in_millis:
            time.sleep(timeout_in_millis / 1000)  # (HIXL's own timeout, spent as it would be)
            return TIMEOUT
        time.sleep(FAULTS.transfer_delay_s)  # (injected)
        if result != TransferStatus.COMPLETED:
            return TIMEOUT if result == TransferStatus.TIMEOUT else FAILED
        _move(op, op_descs)
        return SUCCESS

    def transfer_async(self, remote_engine: str, op: TransferOp, op_descs: list[TransferOpDesc],
                       args: TransferArgs | None = None) -> tuple[int, int]:
        if not self._enter("transfer_async"):
            return FAILED, 0
        if FAULTS.transfer_return is not None:
            ret, FAULTS.transfer_return = FAULTS.transfer_return, None
            return ret, 0
        if FAULTS.async_unsupported:
            return UNSUPPORTED, 0
        ret, link, _ = self._check(remote_engine, op_descs)
        if ret != SUCCESS or link is None:
            return ret, 0
        result = FAULTS.transfer_result or TransferStatus.COMPLETED
        FAULTS.transfer_result = None
        req_id = next(_handles)
        req = _Request(remote_engine, op, list(op_descs), time.monotonic() + FAULTS.transfer_delay_s, result)
        self._requests[req_id] = link.pending[req_id] = req
        return SUCCESS, req_id

    def get_transfer_status(self, req: int, /) -> tuple[int, TransferStatus]:
        if not self._enter("get_transfer_status"):
            return FAILED, TransferStatus.FAILED
        request = self._requests.get(req)
        if request is None:  # unknown, or already reported COMPLETED/FAILED (documented: the request is freed)
            return PARAM_INVALID, TransferStatus.FAILED
        if time.monotonic() < request.done_at:
            return SUCCESS, TransferStatus.WAITING
        del self._requests[req]
        link = self._links.get(request.remote)
        if link is not None:
            link.pending.pop(req, None)
        if request.result == TransferStatus.COMPLETED:
            if link is None or request.remote not in _ENGINES:
                return SUCCESS, TransferStatus.FAILED
            _move(request.op, request.descs)
        return SUCCESS, request.result


def _visible(regions: dict[int, _Region], at_link: frozenset[int], addr: int, length: int) -> str:
    for r in regions.values():
        if r.holds(addr, length):
            return "visible" if r.handle in at_link else "after-link"
    return "unregistered"


def _move(op: TransferOp, descs: list[TransferOpDesc]) -> None:
    for d in descs:
        if op == READ:
            ctypes.memmove(d.local_addr, d.remote_addr, d.len)
        else:
            ctypes.memmove(d.remote_addr, d.local_addr, d.len)


# -- pyACL: the device/context calls an HIXL user makes before initialize ---------------------------------------------
class _AclRuntime:
    def __init__(self) -> None:
        self._local = threading.local()
        self.devices_set: list[tuple[int, str]] = []
        self.devices_reset: list[tuple[int, str]] = []
        self._buffers: dict[int, Any] = {}

    def set_device(self, device_id: int) -> int:
        self._local.context = ("ctx", device_id, threading.get_ident())
        self.devices_set.append((device_id, threading.current_thread().name))
        return 0

    def reset_device(self, device_id: int) -> int:
        self._local.context = None
        self.devices_reset.append((device_id, threading.current_thread().name))
        return 0

    def get_context(self) -> tuple[Any, int]:
        return getattr(self._local, "context", None), 0

    def set_context(self, context: Any) -> int:
        self._local.context = context
        return 0

    # "Device" memory is host memory here (ctypes buffers kept alive until free).
    def get_device_count(self) -> tuple[int, int]:
        return 2, 0

    def malloc(self, size: int, policy: int) -> tuple[int, int]:
        buf = (ctypes.c_ubyte * size)()
        addr = ctypes.addressof(buf)
        self._buffers[addr] = buf
        return addr, 0

    def free(self, addr: int) -> int:
        return 0 if self._buffers.pop(addr, None) is not None else 107000

    def malloc_host(self, size: int) -> tuple[int, int]:
        return self.malloc(size, 0)

    def free_host(self, addr: int) -> int:
        return self.free(addr)

    def memcpy(self, dst: int, dst_max: int, src: int, count: int, kind: int) -> int:
        if count > dst_max:
            return 107000
        ctypes.memmove(dst, src, count)
        return 0


class _Acl:
    """`import acl` stand-in: init/finalize and `acl.rt` device and context calls, all returning ACL error ints."""

    REPEAT_INITIALIZE = 100002

    def __init__(self) -> None:
        self.rt = _AclRuntime()
        self.initialized = False

    def init(self, config_path: str = "") -> int:
        if self.initialized:
            return self.REPEAT_INITIALIZE
        self.initialized = True
        return 0

    def finalize(self) -> int:
        self.initialized = False
        return 0

    def _context_of_thread(self) -> object | None:
        return getattr(self.rt._local, "context", None)

    def _reset(self) -> None:
        self.rt = _AclRuntime()
        self.initialized = False


acl = _Acl()
