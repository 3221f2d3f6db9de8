"""`hccl` backend: one-sided READ/WRITE of NPU (and host) memory through CANN's HIXL engine (HCCS or RoCE).

HIXL's rules shape this module (docs/ascend.md has the sources):

- Every engine call must come from the thread that initialised it, after `aclrtSetDevice` there: one dedicated
  thread (`hccl_engine.EngineThread`) binds the NPU, owns the engine, and runs every call; data-plane threads
  only wait on it.
- A peer sees only memory registered before the link was made. Each registration of new memory bumps this
  engine's registration epoch; caches are described with the epoch their memory was registered at, and a channel
  whose link predates an epoch it now needs (ours or the peer's) drains its transfers and remakes the link first.
  (`hccl_channel.HcclChannel`)
- With HIXL's buffer pool on, a descriptor on unregistered memory is silently staged as if it were host memory; the
  pool is off (`BufferPool "0:0"`) so such a descriptor fails instead.
- One-sided transfers have no server to ask whether a cache still exists: each registered cache has a random token
  in a liveness word (`hccl_engine.LiveWords`) that peers READ after a pull and around a push.
- Calls return status ints (103900...), never raise; they map to LLM statuses (`hccl_engine.llm_status`).

Settings are the daemon's `hccl_*` config fields (`LocalContext.hccl`; docs/ascend.md): device, engine address,
HIXL options and link set-up timeout.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import logging
import secrets
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from kvbroker.status import LlmError
from kvbroker.types import CacheDesc, Placement, TensorLocation
from kvbrokerd.backends.hccl.channel import HcclChannel
from kvbrokerd.backends.hccl.engine import (
    DEFAULT_ENGINE_PORT,
    NAME,
    EngineThread,
    HcclSettings,
    LiveWords,
    engine_id,
    hixl_name,
    llm_status,
    parse_engine,
)
from kvbrokerd.dataplane.seam import (
    Backend,
    BackendUnusable,
    Capabilities,
    DeviceKind,
    LocalContext,
    PeerChannel,
    PeerInfo,
    engine_result,
)
from kvbrokerd.errors import LlmStatus, fail, param_invalid

if TYPE_CHECKING:
    from kvbrokerd.registry.caches import CacheEntry

__all__ = ["BACKEND", "NAME", "HcclBackend", "HcclChannel", "HcclSettings", "hixl_name", "llm_status"]

log = logging.getLogger(__name__)

CAPABILITIES = Capabilities(memory_kinds=frozenset({"npu", "host"}),
                            device_kinds=(DeviceKind("npu", handle_bytes=(1, 256)),))  # an IPC export key
ADVERT_VERSION = 1
_ACL_REPEAT_INITIALIZE = 100002
_ACL_IPC_IMPORT_ENABLE_PEER_ACCESS = 1
"""ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS (as Mooncake's real client imports; value to be confirmed by
tests/device/ascend_check.py on hardware)."""
_ACL_IPC_CALLS = ("ipc_mem_import_by_key", "ipc_mem_close")

_T = TypeVar("_T")


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


def memory_kind(entry: CacheEntry) -> str:
    """"npu" for device caches (kvbroker's only device kind on Ascend), else "host"."""
    device = entry.desc.placement == Placement.DEVICE or any(t.device is not None for t in entry.tensors)
    return "npu" if device else "host"


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
    settings_type = HcclSettings

    def __init__(self, ctx: LocalContext, settings: HcclSettings | None = None) -> None:
        super().__init__(ctx)
        self.settings = settings or cast(HcclSettings, ctx.settings)
        self.local_engine = ""
        self.hixl: Any = None
        self._acl: Any = None
        self._engine: Any = None
        self._thread: EngineThread | None = None
        self._acl_initialised = False
        self.epoch = 0
        self._spans: dict[tuple[int, int, int], _Span] = {}
        self._caches: dict[int, _Registration] = {}
        self._channels: weakref.WeakSet[HcclChannel] = weakref.WeakSet()
        self._closed = False
        self.live: LiveWords | None = None
        self._live_handle = 0
        self._imports: dict[str, list[int]] = {}
        """Ascend IPC key -> [address here, caches using it] (engine thread only)."""
        self._cache_keys: dict[int, list[str]] = {}

    @classmethod
    def unavailable(cls) -> str | None:
        for module, why in (("hixl", "needs CANN >= 9.0 with HIXL's Python binding"),
                            ("acl", "needs pyACL (the CANN toolkit's `acl` module) to bind the NPU")):
            try:
                importlib.import_module(module)
            except ImportError as e:
                return f"hccl {why} (import {module}: {e}); see docs/ascend.md"
        return None

    # -- lifecycle ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            settings = self.settings
            settings.check()  # settings that bypass the daemon's config (tests, embedders) are checked too
            if settings.engine:
                self.local_engine = engine_id(*parse_engine(settings.engine, "engine"))
            else:
                ip, _ = parse_engine(f"{self.ctx.peer_host}:1", "the peer listener's host (set --hccl-engine)")
                self.local_engine = engine_id(ip, DEFAULT_ENGINE_PORT + settings.device)
        except ValueError as e:
            raise OSError(f"hccl: {e}") from None
        self.hixl = importlib.import_module("hixl")
        self._acl = importlib.import_module("acl")
        self._thread = EngineThread(settings.device)
        self._thread.call(self._start_on_engine_thread)
        log.info("hccl: HIXL engine %s on NPU %d (options %s)", self.local_engine, settings.device,
                 sorted(self._options()))

    def _options(self) -> dict[str, str]:
        return {**self.settings.options, self.hixl.OPTION_BUFFER_POOL: "0:0"}

    def _start_on_engine_thread(self) -> None:
        device = self.settings.device
        ret = self._acl.init()
        if ret not in (0, _ACL_REPEAT_INITIALIZE):
            raise OSError(f"hccl: acl.init() failed with ACL error {ret}")
        self._acl_initialised = ret == 0
        ret = self._acl.rt.set_device(device)
        if ret != 0:
            raise OSError(f"hccl: acl.rt.set_device({device}) failed with ACL error {ret} (is NPU {device} visible?)")
        engine = self.hixl.Hixl()
        ret = engine.initialize(self.local_engine, self._options())
        if ret != self.hixl.SUCCESS:
            self._acl.rt.reset_device(device)
            raise OSError(f"hccl: HIXL initialize({self.local_engine}) failed: {hixl_name(self.hixl, ret)}; is the "
                          "port free and the IP this host's? (docs/ascend.md)")
        self._engine = engine
        live = LiveWords(self._acl, self.ctx.registry.max_caches)
        ret, self._live_handle = engine.register_mem(self.hixl.MemDesc(live.address, live.nbytes),
                                                     self.hixl.MemType.MEM_HOST)
        if ret != self.hixl.SUCCESS:
            self._acl.rt.free_host(live.address)
            raise OSError(f"hccl: HIXL register_mem of the liveness words failed: {hixl_name(self.hixl, ret)}")
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
                channel.disconnect_on_engine_thread(self._engine)
            for span in self._spans.values():
                ret = self._engine.deregister_mem(span.handle)
                if ret != self.hixl.SUCCESS:
                    log.warning("hccl: deregister_mem at close: %s", hixl_name(self.hixl, ret))
            self._spans.clear()
            self._caches.clear()
            for key in list(self._imports):  # after HIXL let go of the memory; before its owner may free it
                self._close_import(key)
            self._cache_keys.clear()
            if self.live is not None:
                self._engine.deregister_mem(self._live_handle)
            self._engine.finalize()
            self._engine = None
        if self.live is not None:
            self._acl.rt.free_host(self.live.address)
            self.live = None
        if self._acl is not None:
            self._acl.rt.reset_device(self.settings.device)
            if self._acl_initialised:
                self._acl.finalize()

    def call(self, fn: Callable[[Any], _T]) -> _T:
        """Runs fn(engine) on the engine thread; LLM_NOT_YET_LINK once the backend is closed."""
        thread = self._engine_thread()
        try:
            return thread.call(lambda: self._on_engine(fn))
        except RuntimeError as e:  # the executor was shut down under us
            fail(LlmStatus.LLM_NOT_YET_LINK, f"the hccl engine was shut down ({e})")

    def submit(self, fn: Callable[[Any], _T]) -> concurrent.futures.Future[_T]:
        """`call` for the event loop: fn(engine) queued on the engine thread, its future to await."""
        thread = self._engine_thread()
        try:
            return thread.submit(lambda: self._on_engine(fn))
        except RuntimeError as e:
            fail(LlmStatus.LLM_NOT_YET_LINK, f"the hccl engine was shut down ({e})")

    def _engine_thread(self) -> EngineThread:
        if self._thread is None:
            fail(LlmStatus.LLM_NOT_YET_LINK, "the hccl engine is not running")
        return self._thread

    def _on_engine(self, fn: Callable[[Any], _T]) -> _T:
        if self._engine is None:
            fail(LlmStatus.LLM_NOT_YET_LINK, "the hccl engine was shut down")
        return fn(self._engine)

    # -- handshake ------------------------------------------------------------------------------------------------
    def advertise(self) -> bytes:
        return json.dumps({"v": ADVERT_VERSION, "engine": self.local_engine, "epoch": self.epoch}).encode()

    async def connect(self, peer: PeerInfo, info: bytes) -> PeerChannel:
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
            remote = engine_id(*parse_engine(engine, "the peer's HIXL engine"))
        except ValueError as e:
            raise BackendUnusable(str(e)) from None
        if remote == self.local_engine:
            raise BackendUnusable(f"the peer advertises our own HIXL engine {remote}")
        channel = HcclChannel(self, remote, epoch)
        self._channels.add(channel)
        return channel

    # -- registration ---------------------------------------------------------------------------------------------
    async def describe_cache(self, entry: CacheEntry) -> bytes:
        """Registers the cache's memory (once) and tells peers where it is and from which epoch a link sees it. A
        registration HIXL refuses is described too, so the peer's transfer fails with the reason. The engine thread
        may be busy (a link set-up, a large registration): the event loop awaits it."""
        try:
            reg = self._caches.get(entry.cache_id)
            if reg is None:
                reg = await engine_result(self.submit(lambda engine: self._register(engine, entry)))
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
        hixl = self.hixl
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
                        self.epoch += 1
                        new = True
                    span = self._spans[key] = _Span(handle, 0, self.epoch)
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
        if reg is not None:
            if self.live is not None and self.live.read(reg.live) == reg.token:
                self.live.write(reg.live, 0)  # peers' next liveness READ sees the cache gone
            self._release(engine, list(reg.spans))
        self._release_imports(self._cache_keys.pop(cache_id, []))

    # -- device caches (Ascend IPC) -------------------------------------------------------------------------------
    def import_device_cache(self, desc: CacheDesc, tensors: Sequence[TensorLocation], owner: str) -> CacheEntry:
        """Imports the model server's NPU memory by its IPC export keys (pyACL, on the engine thread, each key once)
        and registers it with HIXL as device memory before listing the cache."""
        devices = [t.device for t in tensors if t.device is not None]
        rt = getattr(self._acl, "rt", None)
        missing = [f"acl.rt.{name}" for name in _ACL_IPC_CALLS if not hasattr(rt, name)]
        if devices[0].kind != "npu" or missing or not self.serving:
            why = (f"pyACL lacks {' and '.join(missing)} (CANN >= 9.0 has them)" if missing and self._acl is not None
                   else "its HIXL engine is not running" if not self.serving else "it moves npu and host memory only")
            fail(LlmStatus.LLM_FEATURE_NOT_ENABLED, f"the hccl backend cannot import {devices[0].kind} memory on this "
                 f"daemon: {why}")
        assert self.settings is not None
        if {d.device for d in devices} != {str(self.settings.device)}:
            param_invalid(f"this daemon's HIXL engine is on NPU {self.settings.device}; the cache names "
                          f"{sorted({d.device for d in devices})}")

        def run(engine: Any) -> CacheEntry:
            keys: list[str] = []

            def register(e: CacheEntry) -> None:
                self._cache_keys[e.cache_id] = keys
                self._register(engine, e)

            try:
                addresses = [self._import(i, t, d, keys) for i, (t, d) in enumerate(zip(tensors, devices, strict=True))]
                return self.ctx.registry.add_device(desc, tensors, addresses, owner, register)
            except BaseException:
                # HIXL's registration (if any) goes before the memory it covers; _unregister releases the keys.
                listed = [c for c, k in self._cache_keys.items() if k is keys]
                for cache_id in listed:
                    self._unregister(engine, cache_id)
                if not listed:
                    self._release_imports(keys)
                raise

        return self.call(run)

    def _import(self, index: int, tensor: TensorLocation, device: Any, keys: list[str]) -> int:
        try:
            key = bytes(device.ipc_handle).rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            param_invalid(f"tensor {index}: an Ascend IPC export key is ASCII text")
        held = self._imports.get(key)
        if held is None:
            address, ret = self._acl.rt.ipc_mem_import_by_key(key, _ACL_IPC_IMPORT_ENABLE_PEER_ACCESS)
            if ret != 0:
                param_invalid(f"tensor {index}: acl.rt.ipc_mem_import_by_key failed with ACL error {ret} (a key of a "
                              "live process on this host, exported for this process's PID or without PID checks)")
            held = self._imports[key] = [int(address), 0]
        held[1] += 1
        keys.append(key)
        return held[0] + tensor.offset

    def _release_imports(self, keys: list[str]) -> None:
        for key in keys:
            held = self._imports.get(key)
            if held is not None:
                held[1] -= 1
                if held[1] == 0:
                    self._close_import(key)

    def _close_import(self, key: str) -> None:
        self._imports.pop(key, None)
        ret = self._acl.rt.ipc_mem_close(key)
        if ret != 0:
            log.warning("hccl: acl.rt.ipc_mem_close failed with ACL error %s", ret)

    def _release(self, engine: Any, keys: list[tuple[int, int, int]]) -> None:
        for key in keys:
            span = self._spans[key]
            span.refs -= 1
            if span.refs == 0:
                del self._spans[key]
                ret = engine.deregister_mem(span.handle)
                if ret != self.hixl.SUCCESS:
                    log.warning("hccl: deregister_mem: %s", hixl_name(self.hixl, ret))

    def forget_channel(self, channel: HcclChannel) -> None:
        self._channels.discard(channel)

    def forget_cache(self, entry: CacheEntry) -> None:
        if entry.cache_id not in self._caches or self._closed:
            return

        self.call(lambda engine: self._unregister(engine, entry.cache_id))


BACKEND = HcclBackend
