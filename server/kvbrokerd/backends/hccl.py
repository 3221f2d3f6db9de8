"""`hccl` backend: one-sided READ/WRITE of NPU (and host) memory through CANN's HIXL engine (HCCS or RoCE).

HIXL's rules shape this module (docs/ascend.md has the sources):

- Every engine call must come from the thread that initialised it, after `aclrtSetDevice` there: one dedicated
  thread (`_EngineThread`) binds the NPU, owns the engine, and runs every call; data-plane threads only wait on it.
- A peer sees only memory registered before the link was made. Each registration of new memory bumps this
  engine's registration epoch; caches are described with the epoch their memory was registered at, and a channel
  whose link predates an epoch it now needs (ours or the peer's) drains its transfers and remakes the link first.
- With HIXL's buffer pool on, a descriptor on unregistered memory is silently staged as if it were host memory; the
  pool is off (`BufferPool "0:0"`) so such a descriptor fails instead.
- Calls return status ints (103900...), never raise; they map to LLM statuses here (`llm_status`).

Settings come from the environment (docs/ascend.md): `KVBROKER_HCCL_DEVICE`, `KVBROKER_HCCL_ENGINE`,
`KVBROKER_HCCL_OPTIONS`, `KVBROKER_HCCL_CONNECT_TIMEOUT_MS`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import importlib
import ipaddress
import json
import logging
import os
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvbroker._status import LlmError
from kvbroker._types import Placement
from kvbrokerd.backends.base import (
    Backend,
    BackendUnusable,
    Capabilities,
    LocalContext,
    PeerChannel,
    PeerInfo,
    RemoteCache,
)
from kvbrokerd.errors import LlmStatus, fail

if TYPE_CHECKING:
    from kvbrokerd.planner import Plan, Progress
    from kvbrokerd.registry import CacheEntry

log = logging.getLogger(__name__)

NAME = "hccl"
CAPABILITIES = Capabilities(same_host_only=False, one_sided_read=True, memory_kinds=frozenset({"npu", "host"}))
ADVERT_VERSION = 1
DEFAULT_ENGINE_PORT = 26000
"""Engine port of device 0 when KVBROKER_HCCL_ENGINE names none (device n: + n); not HIXL's device-NIC port 16666."""
MAX_DESCS_PER_TRANSFER = 4096
"""Descriptors per HIXL request: progress (failed_dst_blocks) is reported per request."""
_POLL_FIRST_S = 50e-6
_POLL_MAX_S = 2e-3
_LINK_POLL_MAX_S = 20e-3
_ASYNC_LINK_GRACE_MS = 200
_DISCONNECT_TIMEOUT_MS = 1000
_ACL_REPEAT_INITIALIZE = 100002

_T = TypeVar("_T")

_LLM_BY_HIXL_NAME = {
    "PARAM_INVALID": LlmStatus.LLM_PARAM_INVALID,
    "TIMEOUT": LlmStatus.LLM_TIMEOUT,
    "NOT_CONNECTED": LlmStatus.LLM_LINK_FAILED,
    "ALREADY_CONNECTED": LlmStatus.LLM_ALREADY_LINK,
    "NOTIFY_FAILED": LlmStatus.LLM_FAILED,
    "UNSUPPORTED": LlmStatus.LLM_FEATURE_NOT_ENABLED,
    "RESOURCE_EXHAUSTED": LlmStatus.LLM_OUT_OF_MEMORY,
    "FAILED": LlmStatus.LLM_FAILED,
}


def hixl_name(hixl: Any, code: int) -> str:
    """`NAME (code)` of a HIXL status, for messages."""
    for name in ("SUCCESS", *_LLM_BY_HIXL_NAME):
        if getattr(hixl, name, None) == code:
            return f"{name} ({code})"
    return f"unknown HIXL status {code}"


def llm_status(hixl: Any, code: int) -> LlmStatus:
    """The LLM status of a HIXL status int (the binding's own constants, so a renumbered build still maps)."""
    for name, status in _LLM_BY_HIXL_NAME.items():
        if getattr(hixl, name, None) == code:
            return status
    return LlmStatus.LLM_FAILED


# -- settings -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HcclSettings:
    device: int = 0
    """NPU (logical id, as ASCEND_RT_VISIBLE_DEVICES numbers them) this daemon's engine binds."""
    engine: str = ""
    """`ip:port` of this daemon's HIXL engine, as peers dial it ("" = the peer listener's IP, port 26000 + device)."""
    options: Mapping[str, str] = field(default_factory=dict)
    """Extra HIXL options (GlobalResourceConfig, LocalCommRes, RdmaTrafficClass, ...) passed to initialize."""
    connect_timeout_ms: int = 3000
    """Longest a link set-up may take (a transfer's own deadline may cut it shorter)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HcclSettings:
        """Reads KVBROKER_HCCL_*; raises ValueError naming the variable."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for var, key in (("KVBROKER_HCCL_DEVICE", "device"), ("KVBROKER_HCCL_CONNECT_TIMEOUT_MS",
                                                              "connect_timeout_ms")):
            if env.get(var, "").strip():
                try:
                    values[key] = int(env[var])
                except ValueError:
                    raise ValueError(f"{var}: {env[var]!r} is not an integer") from None
        if env.get("KVBROKER_HCCL_ENGINE", "").strip():
            values["engine"] = env["KVBROKER_HCCL_ENGINE"].strip()
        if env.get("KVBROKER_HCCL_OPTIONS", "").strip():
            try:
                options = json.loads(env["KVBROKER_HCCL_OPTIONS"])
            except ValueError as e:
                raise ValueError(f"KVBROKER_HCCL_OPTIONS: not JSON ({e})") from None
            if not isinstance(options, dict) or not all(isinstance(v, str) for v in options.values()):
                raise ValueError('KVBROKER_HCCL_OPTIONS: want a JSON object of strings, e.g. '
                                 '{"GlobalResourceConfig": "{\\"comm_resource_config.protocol_desc\\": '
                                 '[\\"roce:device\\"]}"}')
            values["options"] = options
        return cls(**values).validated()

    def validated(self) -> HcclSettings:
        if not 0 <= self.device < 1024:
            raise ValueError(f"KVBROKER_HCCL_DEVICE: {self.device} is not a device id")
        if self.engine:
            parse_engine(self.engine, "KVBROKER_HCCL_ENGINE")
        if not 1 <= self.connect_timeout_ms <= 600_000:
            raise ValueError(f"KVBROKER_HCCL_CONNECT_TIMEOUT_MS: {self.connect_timeout_ms} is not in [1, 600000]")
        # kvbroker makes and remakes links itself (registration epochs): an engine that links on its own could link
        # before a registration and never show the peer that memory. And the pool must stay off (module docstring).
        for key, why in (("AutoConnect", "kvbroker links engines itself, after registering"),
                         ("BufferPool", 'kvbroker keeps it "0:0" so unregistered memory fails instead of staging')):
            if key in self.options:
                raise ValueError(f"KVBROKER_HCCL_OPTIONS: {key} cannot be set ({why})")
        return self


def parse_engine(value: str, what: str) -> tuple[str, int]:
    """(IP, port) of an engine id `ip:port` or `[v6]:port`; ValueError naming `what`. Engines are dialled by IP."""
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{what}: {value[:80]!r} is not ip:port (an IP literal, not a name)") from None
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: {value[:80]!r} needs a port in [1, 65535]")
    if ip.is_unspecified:
        raise ValueError(f"{what}: {value[:80]!r} is a wildcard address; name the IP peers reach")
    return str(ip), int(port)


def _engine_id(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


# -- the engine thread ----------------------------------------------------------------------------------------------
class _EngineThread:
    """The one thread that binds the NPU and calls the engine (HIXL: calls on the thread that initialised it)."""

    def __init__(self, device: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kvbroker-hixl-npu{device}")
        self._ident: int | None = None

    def call(self, fn: Callable[[], _T]) -> _T:
        if threading.get_ident() == self._ident:
            return fn()  # already on it (a nested call would wait on itself)
        return self._pool.submit(self._on_thread, fn).result()

    def _on_thread(self, fn: Callable[[], _T]) -> _T:
        self._ident = threading.get_ident()
        return fn()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass
class _Span:
    handle: int
    refs: int
    epoch: int


@dataclass(frozen=True)
class _Registration:
    """One cache's memory as registered: its spans, the epoch a link must have reached to see all of them, and its
    liveness word (address and token)."""

    spans: tuple[tuple[int, int, int], ...]
    epoch: int
    live: int
    token: int


class _LiveWords:
    """Host memory registered before any link: one 64-bit word per cache slot holding the live cache's random
    token (0 = none), which peers READ after a pull and around a push -- one-sided transfers have no server to ask
    whether a cache still exists, and a removed cache's address may already belong to a new one -- and scratch
    words where our own such READs land."""

    SCRATCH = 256

    def __init__(self, acl: Any, slots: int) -> None:
        self.slots = slots
        self.nbytes = 8 * (slots + self.SCRATCH)
        address, ret = acl.rt.malloc_host(self.nbytes)  # HIXL: host memory from aclrtMallocHost on A2/A3
        self.address = int(address)
        if ret != 0:
            raise OSError(f"hccl: acl.rt.malloc_host({self.nbytes}) failed with ACL error {ret}")
        ctypes.memset(self.address, 0, self.nbytes)
        self.free_scratch: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(self.SCRATCH):
            self.free_scratch.put(self.address + 8 * (slots + i))

    def word(self, cache_id: int) -> int:
        return self.address + 8 * (cache_id % self.slots)

    @staticmethod
    def read(address: int) -> int:
        return int(ctypes.c_uint64.from_address(address).value)

    @staticmethod
    def write(address: int, value: int) -> None:
        ctypes.c_uint64.from_address(address).value = value


@dataclass(frozen=True)
class _RemoteRegion:
    engine: str
    epoch: int
    addresses: np.ndarray
    live: int
    token: int


def memory_kind(entry: CacheEntry) -> str:
    """"npu" for device-placed caches (kvbroker's only device kind on Ascend), else "host"."""
    return "npu" if entry.desc.placement == Placement.DEVICE else "host"


def _spans(entry: CacheEntry) -> list[tuple[int, int]]:
    """(address, length) ranges covering the cache's tensors: touching or overlapping tensors share one range, so
    a cache in one contiguous allocation is one registration (HIXL advises at most 4K per engine)."""
    n = entry.desc.tensor_nbytes
    spans: list[tuple[int, int]] = []
    for addr in sorted(set(entry.addresses)):
        if spans and addr <= spans[-1][0] + spans[-1][1]:
            start, length = spans[-1]
            spans[-1] = (start, max(length, addr + n - start))
        else:
            spans.append((addr, n))
    return spans


class HcclBackend(Backend):
    """One HIXL engine per daemon, on one NPU."""

    name = NAME
    capabilities = CAPABILITIES
    extra = ""  # HIXL and pyACL come with the CANN toolkit, not from pip

    def __init__(self, ctx: LocalContext, settings: HcclSettings | None = None) -> None:
        super().__init__(ctx)
        self.settings = settings
        self.local_engine = ""
        self._hixl: Any = None
        self._acl: Any = None
        self._engine: Any = None
        self._thread: _EngineThread | None = None
        self._acl_initialised = False
        self._epoch = 0
        self._spans: dict[tuple[int, int, int], _Span] = {}
        self._caches: dict[int, _Registration] = {}
        self._channels: weakref.WeakSet[HcclChannel] = weakref.WeakSet()
        self._closed = False
        self.live: _LiveWords | None = None
        self._live_handle = 0

    @classmethod
    def unavailable(cls) -> str | None:
        for module, why in (("hixl", "needs CANN >= 9.0 with HIXL's Python binding"),
                            ("acl", "needs pyACL (the CANN toolkit's `acl` module) to bind the NPU")):
            try:
                importlib.import_module(module)
            except ImportError as e:
                return f"hccl {why} (import {module}: {e}); see docs/ascend.md"
        try:
            HcclSettings.from_env()
        except ValueError as e:
            return f"hccl: {e}"
        return None

    # -- lifecycle ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            settings = self.settings = (self.settings or HcclSettings.from_env()).validated()
            if settings.engine:
                self.local_engine = _engine_id(*parse_engine(settings.engine, "KVBROKER_HCCL_ENGINE"))
            else:
                ip, _ = parse_engine(f"{self.ctx.peer_host}:1", "the peer listener's host (set KVBROKER_HCCL_ENGINE)")
                self.local_engine = _engine_id(ip, DEFAULT_ENGINE_PORT + settings.device)
        except ValueError as e:
            raise OSError(f"hccl: {e}") from None
        self._hixl = importlib.import_module("hixl")
        self._acl = importlib.import_module("acl")
        self._thread = _EngineThread(settings.device)
        self._thread.call(self._start_on_engine_thread)
        log.info("hccl: HIXL engine %s on NPU %d (options %s)", self.local_engine, settings.device,
                 sorted(self._options()))

    def _options(self) -> dict[str, str]:
        assert self.settings is not None
        return {**self.settings.options, self._hixl.OPTION_BUFFER_POOL: "0:0"}

    def _start_on_engine_thread(self) -> None:
        assert self.settings is not None
        device = self.settings.device
        ret = self._acl.init()
        if ret not in (0, _ACL_REPEAT_INITIALIZE):
            raise OSError(f"hccl: acl.init() failed with ACL error {ret}")
        self._acl_initialised = ret == 0
        ret = self._acl.rt.set_device(device)
        if ret != 0:
            raise OSError(f"hccl: acl.rt.set_device({device}) failed with ACL error {ret} (is NPU {device} visible?)")
        engine = self._hixl.Hixl()
        ret = engine.initialize(self.local_engine, self._options())
        if ret != self._hixl.SUCCESS:
            self._acl.rt.reset_device(device)
            raise OSError(f"hccl: HIXL initialize({self.local_engine}) failed: {hixl_name(self._hixl, ret)}; is the "
                          "port free and the IP this host's? (docs/ascend.md)")
        self._engine = engine
        live = _LiveWords(self._acl, self.ctx.registry.max_caches)
        ret, self._live_handle = engine.register_mem(self._hixl.MemDesc(live.address, live.nbytes),
                                                     self._hixl.MemType.MEM_HOST)
        if ret != self._hixl.SUCCESS:
            self._acl.rt.free_host(live.address)
            raise OSError(f"hccl: HIXL register_mem of the liveness words failed: {hixl_name(self._hixl, ret)}")
        self.live = live

    @property
    def serving(self) -> bool:
        return self._engine is not None and not self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for channel in list(self._channels):
            channel.mark_closed()
        if self._thread is None:
            return
        try:
            self._thread.call(self._close_on_engine_thread)
        finally:
            self._thread.shutdown()

    def _close_on_engine_thread(self) -> None:
        """Peers' links first, then our memory, then the engine and the device, in HIXL's order."""
        if self._engine is not None:
            for channel in list(self._channels):
                channel.disconnect_on_engine_thread()
            for span in self._spans.values():
                ret = self._engine.deregister_mem(span.handle)
                if ret != self._hixl.SUCCESS:
                    log.warning("hccl: deregister_mem at close: %s", hixl_name(self._hixl, ret))
            self._spans.clear()
            self._caches.clear()
            if self.live is not None:
                self._engine.deregister_mem(self._live_handle)
            self._engine.finalize()
            self._engine = None
        if self.live is not None:
            self._acl.rt.free_host(self.live.address)
            self.live = None
        if self.settings is not None and self._acl is not None:
            self._acl.rt.reset_device(self.settings.device)
            if self._acl_initialised:
                self._acl.finalize()

    def call(self, fn: Callable[[Any], _T]) -> _T:
        """Runs fn(engine) on the engine thread; LLM_NOT_YET_LINK once the backend is closed."""
        if self._thread is None:
            fail(LlmStatus.LLM_NOT_YET_LINK, "the hccl engine is not running")

        def run() -> _T:
            if self._engine is None:
                fail(LlmStatus.LLM_NOT_YET_LINK, "the hccl engine was shut down")
            return fn(self._engine)

        try:
            return self._thread.call(run)
        except RuntimeError as e:  # the executor was shut down under us
            fail(LlmStatus.LLM_NOT_YET_LINK, f"the hccl engine was shut down ({e})")

    # -- handshake ------------------------------------------------------------------------------------------------
    def advertise(self) -> bytes:
        return json.dumps({"v": ADVERT_VERSION, "engine": self.local_engine, "epoch": self._epoch}).encode()

    def connect(self, peer: PeerInfo, info: bytes) -> PeerChannel:
        if not self.serving:
            raise BackendUnusable("our HIXL engine is not running")
        try:
            ad = json.loads(info)
            version, engine, epoch = ad["v"], ad["engine"], ad["epoch"]
        except (ValueError, TypeError, KeyError) as e:
            raise BackendUnusable(f"unreadable hccl advertisement ({type(e).__name__})") from None
        if version != ADVERT_VERSION:
            raise BackendUnusable(f"hccl advertisement version {str(version)[:20]!r}, we speak {ADVERT_VERSION}")
        if type(engine) is not str or type(epoch) is not int or epoch < 0:
            raise BackendUnusable("malformed hccl advertisement")
        try:
            remote = _engine_id(*parse_engine(engine, "the peer's HIXL engine"))
        except ValueError as e:
            raise BackendUnusable(str(e)) from None
        if remote == self.local_engine:
            raise BackendUnusable(f"the peer advertises our own HIXL engine {remote}")
        channel = HcclChannel(self, remote, epoch)
        self._channels.add(channel)
        return channel

    # -- registration ---------------------------------------------------------------------------------------------
    def describe_cache(self, entry: CacheEntry) -> bytes:
        """Registers the cache's memory (once) and tells peers where it is and from which epoch a link sees it. A
        registration HIXL refuses is described too, so the peer's transfer fails with the reason."""
        try:
            reg = self.registration(entry)
        except LlmError as e:
            log.warning("hccl: cannot register cache %d: %s", entry.cache_id, e.message)
            return json.dumps({"error": e.message, "status": int(e.status)}).encode()
        return json.dumps({"engine": self.local_engine, "epoch": reg.epoch, "live": reg.live, "token": reg.token,
                           "addresses": [int(a) for a in entry.addresses]}).encode()

    def registration(self, entry: CacheEntry) -> _Registration:
        """The cache's registration, registering its memory first if needed (any thread)."""
        reg = self._caches.get(entry.cache_id)
        if reg is not None:
            return reg
        return self.call(lambda engine: self._register(engine, entry))

    def _register(self, engine: Any, entry: CacheEntry) -> _Registration:
        reg = self._caches.get(entry.cache_id)
        if reg is not None:
            return reg
        # Caches removed without forget_cache must not lend their (possibly re-used) addresses to a new one.
        self._prune(engine)
        hixl = self._hixl
        kind = memory_kind(entry)
        mem_type = hixl.MemType.MEM_DEVICE if kind == "npu" else hixl.MemType.MEM_HOST
        keys: list[tuple[int, int, int]] = []
        new = False
        try:
            for addr, length in _spans(entry):
                key = (addr, length, int(mem_type))
                span = self._spans.get(key)
                if span is None:
                    ret, handle = engine.register_mem(hixl.MemDesc(addr, length), mem_type)
                    if ret != hixl.SUCCESS:
                        fail(llm_status(hixl, ret), f"HIXL register_mem of cache {entry.cache_id} ({kind}, {length} "
                             f"bytes) failed: {hixl_name(hixl, ret)}", cache_id=entry.cache_id)
                    if not new:
                        self._epoch += 1
                        new = True
                    span = self._spans[key] = _Span(handle, 0, self._epoch)
                span.refs += 1
                keys.append(key)
        except BaseException:
            self._release(engine, keys)
            raise
        assert self.live is not None
        word = self.live.word(entry.cache_id)
        reg = _Registration(tuple(keys), max(self._spans[k].epoch for k in keys), word, secrets.randbits(64) | 1)
        self.live.write(word, reg.token)
        self._caches[entry.cache_id] = reg
        return reg

    def _prune(self, engine: Any) -> None:
        live = {e.cache_id for e in self.ctx.registry.list()}
        for cache_id in [c for c in self._caches if c not in live]:
            self._unregister(engine, cache_id)

    def _unregister(self, engine: Any, cache_id: int) -> None:
        reg = self._caches.pop(cache_id, None)
        if reg is None:
            return
        if self.live is not None and self.live.read(reg.live) == reg.token:
            self.live.write(reg.live, 0)  # peers' next liveness READ sees the cache gone
        self._release(engine, list(reg.spans))

    def _release(self, engine: Any, keys: list[tuple[int, int, int]]) -> None:
        for key in keys:
            span = self._spans[key]
            span.refs -= 1
            if span.refs == 0:
                del self._spans[key]
                ret = engine.deregister_mem(span.handle)
                if ret != self._hixl.SUCCESS:
                    log.warning("hccl: deregister_mem: %s", hixl_name(self._hixl, ret))

    def forget_cache(self, entry: CacheEntry) -> None:
        if entry.cache_id not in self._caches or self._closed:
            return

        self.call(lambda engine: self._unregister(engine, entry.cache_id))


class HcclChannel(PeerChannel):
    """The link from our engine to one peer's engine: made lazily, remade when a registration epoch needs it."""

    name = NAME

    def __init__(self, backend: HcclBackend, remote_engine: str, remote_epoch: int) -> None:
        self._backend = backend
        self.remote_engine = remote_engine
        self._seen_remote_epoch = remote_epoch
        self._link: tuple[int, int] | None = None
        """(our epoch, the peer's epoch) when the HIXL link was made; None = no link."""
        self._generation = 0
        """Counts links made and dropped: a request outlives its link when this moved on."""
        self._cond = threading.Condition()
        self._in_flight = 0
        self._remaking = False
        self._remakes_queued = 0
        self._closed = False
        self.connects = 0

    # -- transfers -------------------------------------------------------------------------------------------------
    def pull(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._run(True, dst, remote, plan, progress, deadline)

    def push(self, src: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._run(False, src, remote, plan, progress, deadline)

    def _run(self, read: bool, local: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress,
             deadline: float) -> int:
        hixl = self._backend._hixl
        region = self._remote_region(remote)
        reg = self._backend.registration(local)
        local_tensor, local_off = (plan.dst_tensor, plan.dst_offset) if read else (plan.src_tensor, plan.src_offset)
        remote_tensor, remote_off = (plan.src_tensor, plan.src_offset) if read else (plan.dst_tensor, plan.dst_offset)
        local_addr = np.asarray(local.addresses, dtype=np.uint64)[local_tensor] + local_off
        remote_addr = region.addresses[remote_tensor] + remote_off
        op = hixl.TransferOp.READ if read else hixl.TransferOp.WRITE
        if not read:
            self._check_live(remote.cache_id, region, progress, deadline)  # never write into a removed cache
        for start in range(0, plan.num_runs, MAX_DESCS_PER_TRANSFER):
            part = slice(start, start + MAX_DESCS_PER_TRANSFER)
            descs = [hixl.TransferOpDesc(a, b, n) for a, b, n in zip(
                local_addr[part].tolist(), remote_addr[part].tolist(), plan.length[part].tolist(), strict=True)]
            self._transfer(op, descs, reg.epoch, region.epoch, progress, deadline)
        # The peer may have removed the cache while we moved bytes: then what we read may belong to another cache,
        # and nothing counts as landed.
        self._check_live(remote.cache_id, region, progress, deadline)
        for i, n in enumerate(plan.length.tolist()):
            progress.mark(i, n)
        return plan.total_bytes

    def _check_live(self, cache_id: int, region: _RemoteRegion, progress: Progress, deadline: float) -> None:
        """READs the peer's liveness word for the cache (registered before any link: epoch 0)."""
        hixl, live = self._backend._hixl, self._backend.live
        if live is None:
            fail(LlmStatus.LLM_NOT_YET_LINK, "the hccl engine was shut down")
        try:
            scratch = live.free_scratch.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            fail(LlmStatus.LLM_TIMEOUT, "deadline passed waiting for a liveness check slot")
        try:
            live.write(scratch, 0)
            self._transfer(hixl.TransferOp.READ, [hixl.TransferOpDesc(scratch, region.live, 8)], 0, 0, progress,
                           deadline)
            value = live.read(scratch)
        finally:
            live.free_scratch.put(scratch)
        if value != region.token:
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {cache_id} no longer exists on {self.remote_engine}")

    def _remote_region(self, remote: RemoteCache) -> _RemoteRegion:
        """The peer's registration of `remote` (from its cache description: untrusted), parsed once."""
        cached: _RemoteRegion | None = remote.backend_state.get(NAME)
        if cached is not None:
            return cached
        raw = remote.backend_info.get(NAME)
        where = f"the peer's description of cache {remote.cache_id}"
        if raw is None:
            fail(LlmStatus.LLM_FEATURE_NOT_ENABLED, f"{where} has no hccl registration (its daemon does not serve "
                 "hccl for this cache)")
        try:
            info = json.loads(raw)
            if "error" in info:
                try:
                    status = LlmStatus(int(info["status"]))
                except (ValueError, TypeError, KeyError):
                    status = LlmStatus.LLM_FAILED
                fail(status, f"the peer could not register cache {remote.cache_id} with HIXL: "
                     f"{str(info['error'])[:300]}")
            engine, epoch, addresses = info["engine"], info["epoch"], info["addresses"]
            live, token = info["live"], info["token"]
            if type(epoch) is not int or epoch < 0 or type(addresses) is not list or \
                    len(addresses) != remote.desc.num_tensors:
                raise ValueError("wrong epoch or address count")
            if type(live) is not int or not 0 < live <= 2**64 - 8 or type(token) is not int or \
                    not 0 < token < 2**64:
                raise ValueError("bad liveness word")
            limit = 2**64 - remote.desc.tensor_nbytes
            if not all(type(a) is int and 0 < a <= limit for a in addresses):
                raise ValueError("an address is out of range")
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            fail(LlmStatus.LLM_LINK_FAILED, f"{where} is unusable for hccl: {e}")
        if engine != self.remote_engine:
            fail(LlmStatus.LLM_LINK_FAILED, f"{where} names HIXL engine {str(engine)[:80]!r}, but the link is to "
                 f"{self.remote_engine}")
        region = _RemoteRegion(engine, epoch, np.asarray(addresses, dtype=np.uint64), live, token)
        remote.backend_state[NAME] = region
        return region

    def _transfer(self, op: Any, descs: list[Any], local_epoch: int, remote_epoch: int, progress: Progress,
                  deadline: float) -> None:
        hixl = self._backend._hixl
        for attempt in (1, 2):
            self._acquire(local_epoch, remote_epoch, deadline)
            try:
                ret, req = self._backend.call(lambda e: e.transfer_async(self.remote_engine, op, descs))
                if ret == hixl.UNSUPPORTED:  # this build or path has no async transfers: one blocking call
                    ret = self._transfer_sync(op, descs, deadline)
                    if ret == hixl.SUCCESS:
                        return
                if ret == hixl.NOT_CONNECTED and attempt == 1:
                    # The link died under us (the peer restarted its engine, a heartbeat was lost): make it again once.
                    self._forget_link()
                    continue
                if ret != hixl.SUCCESS:
                    if ret == hixl.TIMEOUT:
                        self._drop_link()
                    fail(llm_status(hixl, ret), f"HIXL {_op_name(hixl, op)} with {self.remote_engine} refused: "
                         f"{hixl_name(hixl, ret)}{_hint(hixl, ret)}")
                self._wait(req, op, progress, deadline, self._generation)
                return
            finally:
                self._release()

    def _transfer_sync(self, op: Any, descs: list[Any], deadline: float) -> int:
        timeout_ms = int((deadline - time.monotonic()) * 1000)
        if timeout_ms < 1:
            fail(LlmStatus.LLM_TIMEOUT, "deadline passed before the HIXL transfer started")
        return int(self._backend.call(lambda e: e.transfer_sync(self.remote_engine, op, descs, timeout_ms)))

    def _wait(self, req: int, op: Any, progress: Progress, deadline: float, generation: int) -> None:
        """Polls the request until it ends; on our deadline or cancellation the link is dropped, which is HIXL's way
        to abandon a request (nothing lands after that, so the caller may release the memory)."""
        hixl = self._backend._hixl
        pause = _POLL_FIRST_S
        while True:
            ret, status = self._backend.call(lambda e: e.get_transfer_status(req))
            if ret != hixl.SUCCESS:
                if generation != self._generation:  # another transfer dropped the link, and our request with it
                    fail(LlmStatus.LLM_FAILED, f"HIXL {_op_name(hixl, op)} with {self.remote_engine} was abandoned "
                         "with its link (another transfer on it failed or timed out); retry")
                self._drop_link()
                fail(llm_status(hixl, ret), f"HIXL get_transfer_status on {self.remote_engine}: "
                     f"{hixl_name(hixl, ret)}")
            if status == hixl.TransferStatus.COMPLETED:
                return
            if status == hixl.TransferStatus.FAILED:
                self._drop_link()
                fail(LlmStatus.LLM_FAILED, f"HIXL {_op_name(hixl, op)} with {self.remote_engine} FAILED (peer memory "
                     "gone, or a device/NIC error; see the plog)")
            if status == hixl.TransferStatus.TIMEOUT:
                self._drop_link()
                fail(LlmStatus.LLM_TIMEOUT, f"HIXL {_op_name(hixl, op)} with {self.remote_engine} timed out")
            if progress.cancelled:
                self._drop_link()
                fail(LlmStatus.LLM_FAILED, "cancelled by the caller")
            now = time.monotonic()
            if now >= deadline:
                self._drop_link()
                fail(LlmStatus.LLM_TIMEOUT, f"deadline passed during the HIXL {_op_name(hixl, op)} with "
                     f"{self.remote_engine}")
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, _POLL_MAX_S)

    # -- the link ----------------------------------------------------------------------------------------------------
    def _acquire(self, local_epoch: int, remote_epoch: int, deadline: float) -> None:
        """Waits until the link sees both epochs, (re)making it if needed; transfers hold it while they run, and a
        remake waits for them to finish (a disconnect would abort them). Once a transfer waits for a remake, new
        transfers queue behind it, so a steady stream cannot keep the old link busy forever."""
        with self._cond:
            self._seen_remote_epoch = max(self._seen_remote_epoch, remote_epoch)
            queued = False
            try:
                while True:
                    if self._closed:
                        fail(LlmStatus.LLM_NOT_YET_LINK, "the link was closed")
                    link = self._link
                    current = link is not None and local_epoch <= link[0] and remote_epoch <= link[1]
                    if current and not self._remaking and (queued or self._remakes_queued == 0):
                        self._in_flight += 1
                        return
                    if not current and not queued:
                        queued = True
                        self._remakes_queued += 1
                    if not current and not self._remaking and self._in_flight == 0:
                        self._remaking = True
                        break
                    if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                        fail(LlmStatus.LLM_TIMEOUT, f"deadline passed waiting for the link to {self.remote_engine}")
            finally:
                if queued:
                    self._remakes_queued -= 1
                    self._cond.notify_all()
        made = False
        try:
            made = self._make_link(deadline)
        finally:
            with self._cond:
                self._remaking = False
                if made:
                    self._in_flight += 1
                self._cond.notify_all()

    def _release(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def _make_link(self, deadline: float) -> bool:
        """Connects (after disconnecting a stale link). `connect_async` keeps the engine thread free while the link
        is set up: other links' transfers and registrations (hence the event loop's describe_cache) never wait
        behind a slow or dead peer."""
        hixl = self._backend._hixl
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms < 1:
            fail(LlmStatus.LLM_TIMEOUT, f"deadline passed before linking to {self.remote_engine}")
        assert self._backend.settings is not None
        timeout_ms = min(remaining_ms, self._backend.settings.connect_timeout_ms)
        give_up = time.monotonic() + timeout_ms / 1000
        remote_epoch = self._seen_remote_epoch
        stale = self._link is not None

        def start(engine: Any) -> tuple[int, int, bool]:
            if stale:
                engine.disconnect(self.remote_engine, _DISCONNECT_TIMEOUT_MS)
            epoch = self._backend._epoch  # exact: registrations run on this thread too
            # HIXL's own timeout on an asynchronous link is a little longer than ours: we give up (and disconnect)
            # first, so a link that is late is always our timeout, never a failure HIXL reports at the same moment.
            for connect, pending in ((engine.connect_async, True), (engine.connect, False)):
                limit = timeout_ms + (_ASYNC_LINK_GRACE_MS if pending else 0)
                ret = connect(self.remote_engine, limit)
                if ret == hixl.ALREADY_CONNECTED:  # a link made before this channel (an earlier one, not closed)
                    engine.disconnect(self.remote_engine, _DISCONNECT_TIMEOUT_MS)
                    ret = connect(self.remote_engine, limit)
                if ret != hixl.UNSUPPORTED:  # else a build without asynchronous links: one bounded connect
                    return int(ret), epoch, pending
            return int(ret), epoch, False

        with self._cond:
            self._link = None
        ret, local_epoch, pending = self._backend.call(start)
        if ret == hixl.SUCCESS and pending:
            ret = self._await_link(give_up, deadline)
        if ret == hixl.TIMEOUT and remaining_ms <= self._backend.settings.connect_timeout_ms:
            fail(LlmStatus.LLM_TIMEOUT, f"deadline passed while linking to HIXL engine {self.remote_engine}")
        if ret != hixl.SUCCESS:
            fail(LlmStatus.LLM_LINK_FAILED, f"HIXL connect to {self.remote_engine} failed: {hixl_name(hixl, ret)} "
                 "(is the peer's engine up, its port open, hccn configured? see docs/ascend.md)")
        if stale:
            log.info("hccl: re-linked to %s (registrations since the last link)", self.remote_engine)
        with self._cond:
            self._link = (local_epoch, remote_epoch)
            self._generation += 1
        self.connects += 1
        return True

    def _await_link(self, give_up: float, deadline: float) -> int:
        """Polls an asynchronous connect; a HIXL status (TIMEOUT when we gave up, FAILED when HIXL did)."""
        hixl = self._backend._hixl
        pause = _POLL_FIRST_S
        while True:
            ret, status = self._backend.call(lambda e: e.get_async_connect_status(self.remote_engine))
            if ret != hixl.SUCCESS:
                return int(ret)
            if status == hixl.AsyncConnectStatus.CONNECTED:
                return int(hixl.SUCCESS)
            if status in (hixl.AsyncConnectStatus.CONNECT_FAILED, hixl.AsyncConnectStatus.NOT_CONNECT):
                log.warning("hccl: link to %s: %s", self.remote_engine, getattr(status, "name", status))
                return int(hixl.FAILED)
            now = time.monotonic()
            if now >= min(give_up, deadline):
                self._backend.call(lambda e: e.disconnect(self.remote_engine, _DISCONNECT_TIMEOUT_MS))
                return int(hixl.TIMEOUT)
            time.sleep(min(pause, min(give_up, deadline) - now))
            pause = min(pause * 2, _LINK_POLL_MAX_S)

    def _forget_link(self) -> None:
        """The link is gone already: the next transfer makes a new one."""
        with self._cond:
            self._link = None
            self._generation += 1

    def _drop_link(self) -> None:
        """Disconnects (which abandons the link's requests); the next transfer makes a new link."""
        with self._cond:
            had, self._link = self._link is not None, None
            self._generation += 1
        if had and self._backend.serving:
            with contextlib.suppress(LlmError):  # the engine is shutting down: that ends the link too
                self._backend.call(lambda e: e.disconnect(self.remote_engine, _DISCONNECT_TIMEOUT_MS))

    def mark_closed(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def disconnect_on_engine_thread(self) -> None:
        if self._link is not None:
            self._link = None
            self._backend._engine.disconnect(self.remote_engine, _DISCONNECT_TIMEOUT_MS)

    def close(self) -> None:
        self.mark_closed()
        self._drop_link()
        self._backend._channels.discard(self)


def _op_name(hixl: Any, op: Any) -> str:
    return "READ" if op == hixl.TransferOp.READ else "WRITE"


def _hint(hixl: Any, ret: int) -> str:
    if ret == hixl.PARAM_INVALID:
        return " (an address is not registered on one side: the peer may have dropped the cache)"
    if ret == hixl.NOT_CONNECTED:
        return " (the link to the peer's engine is gone)"
    return ""


BACKEND = HcclBackend
