"""The HIXL engine's plumbing for the `hccl` backend: settings, HIXL status codes, the one thread that may call the
engine, and the liveness words. Links and plans are hccl_channel.py's; registration is hccl.py's."""

from __future__ import annotations

import concurrent.futures
import ctypes
import ipaddress
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvbrokerd.dataplane.seam import BackendSettings, DaemonFacts
from kvbrokerd.errors import LlmStatus

NAME = "hccl"
DEFAULT_ENGINE_PORT = 26000
"""Engine port of device 0 when the hccl_engine setting names none (device n: + n); not HIXL's device-NIC port 16666."""
DISCONNECT_TIMEOUT_MS = 1000

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
class HcclSettings(BackendSettings):
    """The hccl backend's settings: flags --hccl-*, KVBROKER_HCCL_* and the [backends.hccl] table."""

    device: int = field(default=0, metadata={
        "help": "the NPU its HIXL engine binds (logical id, as ASCEND_RT_VISIBLE_DEVICES numbers them)",
        "aliases": ("hccl_device",)})
    engine: str = field(default="", metadata={
        "help": "ip:port (or [v6]:port) peers dial for its HIXL engine, an IP literal (empty = the peer listener's IP, "
                f"port {DEFAULT_ENGINE_PORT} + device)", "aliases": ("hccl_engine",)})
    options: dict[str, str] = field(default_factory=dict, metadata={
        "help": "extra HIXL options passed to initialize (GlobalResourceConfig, LocalCommRes, RdmaTrafficClass, ...): "
                "a JSON object of strings (a table in the config file); BufferPool and AutoConnect are kvbroker's",
        "aliases": ("hccl_options",)})
    connect_timeout_ms: int = field(default=3000, metadata={
        "help": "longest HIXL link set-up in milliseconds (a transfer's deadline may cut it shorter)",
        "aliases": ("hccl_connect_timeout_ms",)})

    def check(self, daemon: DaemonFacts | None = None) -> None:
        if not 0 <= self.device < 1024:
            raise ValueError(f"device: {self.device} is not a device id (0..1023)")
        if self.engine:
            parse_engine(self.engine, "engine")
        if not 1 <= self.connect_timeout_ms <= 600_000:
            raise ValueError(f"connect_timeout_ms: {self.connect_timeout_ms} is not in [1, 600000]")
        # kvbroker makes and remakes links itself (registration epochs): an engine that links on its own could link
        # before a registration and never show the peer that memory. And the pool must stay off (module docstring).
        for key, why in (("AutoConnect", "kvbroker links engines itself, after registering"),
                         ("BufferPool", 'kvbroker keeps it "0:0" so unregistered memory fails instead of staging')):
            if key in self.options:
                raise ValueError(f"options: {key} cannot be set ({why})")


def parse_engine(value: str, what: str) -> tuple[str, int]:
    """(IP, port) of an engine id `ip:port` or `[v6]:port`; ValueError naming `what`. Engines are dialled by IP."""
    host, sep, port = value.rpartition(":")
    if not sep:
        raise ValueError(f"{what}: {value[:80]!r} needs a port: ip:port, or [v6]:port")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{what}: {value[:80]!r} is not ip:port (an IP literal, not a name)") from None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: {value[:80]!r} needs a port in [1, 65535]")
    if ip.is_unspecified:
        raise ValueError(f"{what}: {value[:80]!r} is a wildcard address; name the IP peers reach")
    return str(ip), int(port)


def engine_id(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


# -- the engine thread ----------------------------------------------------------------------------------------------
class EngineThread:
    """The one thread that binds the NPU and calls the engine (HIXL: calls on the thread that initialised it)."""

    def __init__(self, device: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kvbroker-hixl-npu{device}")
        self._ident: int | None = None

    def call(self, fn: Callable[[], _T]) -> _T:
        if threading.get_ident() == self._ident:
            return fn()  # already on it (a nested call would wait on itself)
        return self.submit(fn).result()

    def submit(self, fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        """fn() queued for the engine thread (from another thread: the event loop awaits the future); RuntimeError
        once the thread is shut down."""
        return self._pool.submit(self._on_thread, fn)

    def _on_thread(self, fn: Callable[[], _T]) -> _T:
        self._ident = threading.get_ident()
        return fn()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)




class LiveWords:
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
