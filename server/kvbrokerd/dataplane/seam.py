"""The data-plane interface every backend implements, and the remote-cache view backends read from.

A backend describes itself: its `Backend` subclass names it, declares its capabilities (the memory kinds it moves
and, for device kinds, the IPC handles it imports) and its own settings (a `BackendSettings` dataclass that the
daemon exposes as flags, `KVBROKER_<NAME>_*` variables and a `[backend.<name>]` table). Built-in backends are
listed in backends/__init__.py; others register through the `kvbrokerd.backends` entry point group. The daemon
makes one instance per allowed backend (`--backends`), starts it, and puts what `advertise()` returns in the link
handshake; a peer that finds the same backend name awaits `connect()` with those bytes and gets the `PeerChannel`
its transfers run on, or a reason why not. `describe_cache()` adds per-backend bytes to a cache's
description for peers (e.g. a device engine's registration of its memory); it runs on the event loop, so a backend
whose engine thread does the work awaits it there (`engine_result`) instead of blocking the loop.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kvbroker.status import LlmError, LlmStatus
from kvbroker.types import CacheDesc, TensorLocation

if TYPE_CHECKING:
    from kvbrokerd.dataplane.plan import Plan, Progress
    from kvbrokerd.registry.caches import CacheEntry, Registry
    from kvbrokerd.tls import TlsMaterial


_Result = TypeVar("_Result")


@dataclass(eq=False)
class RemoteCache:
    """What a linked peer told us about one of its caches (Peer.GetCacheInfo)."""

    cache_id: int
    desc: CacheDesc
    tensors: tuple[TensorLocation, ...]
    backend_info: dict[str, bytes] = field(default_factory=dict)
    """What each of the peer's backends added to the description (Backend.describe_cache), untrusted."""
    backend_state: dict[str, Any] = field(default_factory=dict)
    """Per-backend handles (e.g. the shm backend's mappings), released with `Backend.forget`."""


@dataclass(frozen=True, slots=True)
class DeviceKind:
    """A device memory kind a backend imports from a model server by IPC handle."""

    name: str
    """"cuda", "npu", ...: what a registration's DeviceMemory.kind says."""
    handle_bytes: tuple[int, int]
    """Smallest and largest IPC handle of this kind, in bytes (checked before the backend sees a registration)."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    memory_kinds: frozenset[str] = frozenset({"host"})
    """Memory kinds this backend reads and writes ("host"; device kinds "cuda", "npu")."""
    device_kinds: tuple[DeviceKind, ...] = ()
    """The device kinds of `memory_kinds` that it imports (RegisterKvCache of device memory), with their handles."""


@dataclass(frozen=True)
class DaemonFacts:
    """What a backend's settings may be checked against at start-up."""

    peer_host: str
    """Host of the peer listener."""
    mutual_tls: bool
    """The daemon has mutual TLS material (--tls-cert/--tls-key/--tls-ca)."""


@dataclass(frozen=True)
class BackendSettings:
    """A backend's own settings. Subclasses are frozen dataclasses whose fields carry `metadata={"help": ...}` (and
    optionally `"aliases": (...)`, former top-level names still accepted); each field is settable as
    `--<backend>-<field>`, `KVBROKER_<BACKEND>_<FIELD>` or `<field>` in the `[backend.<backend>]` table, and shown
    by `--print-config`. Field types: int, float, bool, str, dict[str, str]."""

    def check(self, daemon: DaemonFacts) -> None:
        """Raises ValueError when a value cannot work, its message starting with the field's name ("port: ...");
        called at start-up for every backend."""


MAX_ADVERTISEMENT_BYTES = 64 << 10
"""Largest backend_info a peer may send per backend (a NIXL agent's metadata is a few KiB)."""


class BackendUnusable(Exception):
    """`connect` cannot reach the peer through this backend; the message says why (the link tries the next)."""


@dataclass(frozen=True)
class LocalContext:
    """What a backend may use of its daemon."""

    cluster_id: int
    registry: Registry
    shm_dir: Path
    peer_host: str
    """Host of the peer listener: where served endpoints bind."""
    parts_executor: concurrent.futures.Executor
    secret_for: Callable[[bytes], bytes | None]
    """Link secret by link id (any thread), for backends that authenticate their own connections."""
    settings: BackendSettings = field(default_factory=BackendSettings)
    """This backend's own settings (its `settings_type`), validated."""
    tls: TlsMaterial | None = None
    """The daemon's mutual TLS material, for backends that secure their own connections."""


@dataclass(frozen=True)
class PeerInfo:
    """The peer a link is being made to, as the authenticated handshake established it."""

    cluster_id: int
    peer_address: str
    """host:port of its peer API (an advertised endpoint without a host means this host)."""
    secret: bytes
    """The link's secret (derived on both sides; never sent)."""


class Backend(abc.ABC):
    """One data-plane backend of one daemon."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    settings_type: ClassVar[type[BackendSettings]] = BackendSettings
    default: ClassVar[bool] = False
    """Allowed when the daemon's --backends is not given (in the order backends are listed)."""

    def __init__(self, ctx: LocalContext) -> None:
        self.ctx = ctx

    @property
    def memory_kinds(self) -> frozenset[str]:
        """The memory kinds this instance moves on this machine: its capabilities', less what the machine lacks (a
        backend that can move device memory declares the kind only where the device and its libraries are usable)."""
        return self.capabilities.memory_kinds

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this backend cannot run on this machine (a library is missing), or None."""
        return None

    @classmethod
    def listen_addresses(cls, settings: BackendSettings, peer_host: str) -> list[tuple[str, str]]:
        """(host:port, what) this backend will listen on with `settings`, checked free before the daemon starts
        anything (a port of 0 need not be listed)."""
        return []

    @property
    def endpoint(self) -> str:
        """Where this backend serves, for the daemon's start-up line ("" when it serves nothing of its own)."""
        return ""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Starts what the backend serves (a listener, an engine); raises OSError when it cannot."""

    @property
    def serving(self) -> bool:
        """False while what the backend serves is down (health reports NOT_SERVING)."""
        return True

    @abc.abstractmethod
    def advertise(self) -> bytes:
        """What a peer needs to reach us through this backend (opaque to the handshake; never pickled)."""

    @abc.abstractmethod
    async def connect(self, peer: PeerInfo, info: bytes) -> PeerChannel:
        """A channel to `peer` from its advertisement `info` (untrusted bytes: parse defensively), or
        BackendUnusable with the reason. Awaited on the event loop: work that waits (an engine thread loading the
        peer's metadata) is awaited with a bound, never waited for on the loop thread."""

    async def describe_cache(self, entry: CacheEntry) -> bytes:
        """Per-backend bytes a peer needs to address `entry` (empty: the generic description suffices).

        Called on the event loop with `entry` pinned: work that waits for an engine (registering memory) is awaited,
        never waited for on the loop thread."""
        return b""

    def import_device_cache(self, desc: CacheDesc, tensors: Sequence[TensorLocation], owner: str) -> CacheEntry:
        """Imports the IPC handles of a device cache (validated by devicemem.py) and registers it; backends that
        declare a device memory kind implement it."""
        raise LlmError(LlmStatus.LLM_FEATURE_NOT_ENABLED,
                       f"the {self.name} backend cannot import {desc.placement.name} memory yet")

    def forget_cache(self, entry: CacheEntry) -> None:  # noqa: B027 - optional hook
        """`entry` is leaving the registry: drop what `describe_cache` set up for it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stops serving and releases everything; idempotent."""


class PeerChannel(abc.ABC):
    """A backend's per-link state: how to reach one peer's memory."""

    name: str
    parallel_transfers: int | None = None
    """How many of this link's transfers may move data at once. None: they share the daemon-wide turn
    (`--parallel-transfers`), right for copies that compete for this host's CPUs; a backend that mostly waits on its
    peer (tcp: one transfer per pooled connection) says how many keep it busy."""
    copies_strided: bool = False
    """Whether `pull`/`push` take strided plans (`Plan.count`); others get the plan with every repetition written
    out as a run (`Plan.plain`)."""
    pulls_from_several: bool = False
    """Whether `pull_several` runs one plan over several of the peer's caches (a decode rank's pulls from the
    prefill's TP ranks, one job); others get one job per remote cache."""

    @abc.abstractmethod
    def pull(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        """Copies every run of `plan` from the peer's `remote` cache into `dst` before `deadline` (time.monotonic),
        marking each run in `progress` as it lands.

        Blocking: runs on a data-plane thread. Returns the bytes moved; raises LlmError (LLM_TIMEOUT,
        LLM_LINK_FAILED, LLM_KV_CACHE_NOT_EXIST) and leaves bytes outside the plan's destination runs untouched.
        """

    @abc.abstractmethod
    def push(self, src: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress, deadline: float) -> int:
        """The mirror of `pull`: writes every run of `plan` from the local `src` cache into the peer's `remote` cache
        (one-sided write where the backend has it; `tcp` sends and the peer writes)."""

    def pull_several(self, remotes: Sequence[RemoteCache], dst: CacheEntry, plan: Plan, progress: Progress,
                     deadline: float) -> int:
        """`pull` from several of the peer's caches at once (channels with `pulls_from_several`): the plan's source
        tensors are the `remotes`' tensors one cache after the other (the second cache's first tensor is index
        `remotes[0].desc.num_tensors`). An error names the cache it is about (`cache_id`)."""
        raise NotImplementedError

    def runs_inline(self, plan: Plan) -> bool:
        """True when `pull` is cheap and never waits on a peer, so the event loop may call it directly: a thread
        hand-off would cost more than the copy."""
        return False

    def runs_on_loop(self, plan: Plan) -> bool:
        """True when `pull_on_loop` serves this plan (small transfers on backends with non-blocking I/O)."""
        return False

    async def pull_on_loop(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress,
                           deadline: float) -> int:
        """`pull` as a coroutine on the event loop, for plans where `runs_on_loop` is true."""
        raise NotImplementedError

    def forget(self, remote: RemoteCache) -> None:
        """Drops per-cache state (mappings) when the peer's cache is gone or the link closes."""
        remote.backend_state.pop(self.name, None)

    def gone(self, remote: RemoteCache) -> bool:
        """True when this channel can tell, cheaply and without asking the peer, that the peer no longer holds
        `remote` (deallocated, or its daemon died). The link asks about every cache it knows at each heartbeat and
        forgets those gone, so nothing held for a peer's cache (a mapping of its memory) outlives it."""
        return False

    @abc.abstractmethod
    def close(self) -> None:
        """Releases connections and mappings; idempotent."""


async def engine_result(future: concurrent.futures.Future[_Result]) -> _Result:
    """The result of work submitted to a backend's engine thread, awaited without blocking the event loop.

    If the awaiting task is cancelled (its RPC was), work the engine thread has already started is still waited for
    before the cancellation goes on: it touches memory the caller keeps pinned only until this returns."""
    waiter = asyncio.wrap_future(future)
    try:
        return await asyncio.shield(waiter)
    except asyncio.CancelledError:
        if not future.cancel():
            while not waiter.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([waiter])
        raise
