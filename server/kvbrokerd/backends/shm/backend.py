"""`shm` backend: same-host transfers straight between this daemon's caches and a peer's shared-memory segments.

A peer is trusted with nothing local. It names its control page and its segments; paths are built only from this
daemon's own shm directory, names must be plain (shmseg.check_name), and a file is used only if it is a regular file
(never through a symlink) owned by the user that owns the peer's control page. A name that a kvbroker daemon
manages must be the peer's own (`kvbroker-<its instance>-...`); other plain names are segments its model servers
registered. The control page is read with pread, never mapped, so a peer cannot kill us by truncating it.

Usable only when this daemon can open the peer's control page and read the nonce the peer sent in the handshake:
proof, not a guess from host names, that both daemons see the same host memory. The peer's instance lock says
whether its daemon still runs; the control page lists its live cache ids. Both are checked before and after each
copy, so a cache deallocated, or a daemon killed, meanwhile is reported, never taken for a good transfer.

Pulls open the peer's segments read-only (mapped PROT_READ only when a copy reads them through a mapping:
memcopy.maps_to_copy); pushes open them read-write. Which copy is used is memcopy's rule: the fault-safe memmove
when it is built, else memmove only between segments no model server can truncate (this daemon's own AllocateCache
segments, and the peer's when owned by our user: a process that could truncate those could as well kill us) and the
kernel's copy for the others.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvbrokerd.backends.common import memcopy
from kvbrokerd.backends.shm.control import CONTROL_SUFFIX, NONCE_BYTES, ShmControlPage
from kvbrokerd.dataplane.seam import Backend, BackendUnusable, Capabilities, PeerChannel, PeerInfo, RemoteCache
from kvbrokerd.errors import LlmError, LlmStatus, fail
from kvbrokerd.registry import shmseg
from kvbrokerd.registry.endpoint import Endpoint, side_by_side

if TYPE_CHECKING:
    from kvbrokerd.dataplane.plan import Plan, Progress
    from kvbrokerd.registry.caches import CacheEntry

log = logging.getLogger(__name__)

NAME = "shm"
_MAX_CONTROL_SLOTS = 1 << 24
MAX_OPEN_CACHES = 64
"""Remote caches a link keeps open (and mapped) at most; the least recently used is closed beyond that, and opened
again by its next transfer. Without a bound a puller kept every cache it ever read, holding the peer's tmpfs."""
_WRITABLE = NAME + ":rw"


class PeerControl:
    """A linked peer's control page and instance lock, both open here."""

    def __init__(self, page: shmseg.Segment, lock_fd: int, instance: str) -> None:
        self.page = page
        self.instance = instance
        self.owner = page.uid
        self._lock_fd = lock_fd
        self._slots = (page.size - NONCE_BYTES) // 8
        self.closed = False

    def is_live(self, cache_id: int) -> bool:
        try:
            raw = os.pread(self.page.fd, 8, NONCE_BYTES + 8 * (cache_id % self._slots))
        except OSError:
            return False
        return len(raw) == 8 and int.from_bytes(raw, "little") == cache_id

    def daemon_alive(self) -> bool:
        return shmseg.instance_alive(self._lock_fd)

    def close(self) -> None:
        """Fails later checks; the descriptors close with the last reference (a running copy may still check)."""
        self.closed = True

    def __del__(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def probe(segment_name: str, nonce: bytes, shm_dir: Path) -> PeerControl | None:
    """Opens the peer's control page `segment_name` in our `shm_dir` if it holds `nonce` and its daemon runs; None
    when the peer's memory is not reachable from here, or its answer does not name a kvbroker control page."""
    instance = shmseg.instance_of(segment_name)
    if instance is None or segment_name != shmseg.segment_name(instance, CONTROL_SUFFIX):
        log.warning("shm probe: %.64r is not a kvbroker control page name", segment_name)
        return None
    if len(nonce) != NONCE_BYTES:
        return None
    try:
        page = shmseg.Segment.open(shm_dir, segment_name, writable=False, owner=None, min_size=NONCE_BYTES + 8)
    except shmseg.SegmentError as e:
        log.debug("shm probe: %s", e)
        return None
    lock_fd = -1
    try:
        slots, odd = divmod(page.size - NONCE_BYTES, 8)
        if odd or slots > _MAX_CONTROL_SLOTS or os.pread(page.fd, NONCE_BYTES, 0) != nonce:
            raise shmseg.SegmentError("not the control page that the peer announced")
        lock = shmseg.Segment.open(shm_dir, shmseg.lock_name(instance), writable=False, owner=page.uid,
                                   min_size=0)
        lock_fd, lock.fd = lock.fd, -1
        if not shmseg.instance_alive(lock_fd):
            raise shmseg.SegmentError(f"the daemon of instance {instance} no longer runs")
        return PeerControl(page, lock_fd, instance)
    except (shmseg.SegmentError, OSError) as e:
        log.info("shm probe of %s failed: %s", segment_name, e)
        page.close()
        if lock_fd >= 0:
            os.close(lock_fd)
        return None


class _Opened:
    """A remote cache's segments, open here (read-only for pulls, read-write for pushes), as a copy endpoint."""

    def __init__(self, segments: dict[str, shmseg.Segment], endpoint: Endpoint) -> None:
        self.segments = segments  # a copy holds this object: the descriptors stay open while it runs
        self.endpoint = endpoint

    @classmethod
    def open(cls, remote: RemoteCache, control: PeerControl, shm_dir: Path, *, writable: bool) -> _Opened:
        label = f"remote cache {remote.cache_id}"
        if len(remote.tensors) != remote.desc.num_tensors:
            fail(LlmStatus.LLM_LINK_FAILED, f"{label}: the peer described {remote.desc.num_tensors} tensors but "
                 f"located {len(remote.tensors)}", cache_id=remote.cache_id)
        n = remote.desc.tensor_nbytes
        extents: dict[str, int] = {}
        for t in remote.tensors:
            extents[t.segment] = max(extents.get(t.segment, 0), t.offset + n)
        segments: dict[str, shmseg.Segment] = {}
        try:
            for name, extent in extents.items():
                if shmseg.instance_of(name) not in (None, control.instance):
                    raise shmseg.SegmentError(f"segment {name!r} belongs to another kvbroker daemon")
                segments[name] = shmseg.Segment.open(shm_dir, name, writable=writable, owner=control.owner,
                                                     min_size=extent)
            # Segments the peer daemon created, of our own user: no model server sizes them (see the module doc).
            stable = control.owner == os.geteuid() and all(shmseg.instance_of(s) == control.instance
                                                           for s in segments)
            bases = {}
            if memcopy.maps_to_copy(stable) or writable:
                bases = {name: memcopy.base_address(seg.map()) for name, seg in segments.items()}
        except shmseg.SegmentError as e:
            for seg in segments.values():
                seg.close()
            status = LlmStatus.LLM_KV_CACHE_NOT_EXIST if e.missing else LlmStatus.LLM_LINK_FAILED
            fail(status, f"{label}: {e}", cache_id=remote.cache_id)
        except (OSError, ValueError) as e:
            for seg in segments.values():
                seg.close()
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"{label}: cannot map its memory ({e})", cache_id=remote.cache_id)

        cache_id = remote.cache_id  # not `remote`: remote -> backend_state -> this -> remote would be a cycle, and
        # a dropped cache's segments would stay open (holding the peer's tmpfs) until the garbage collector ran

        def check() -> None:
            for name, extent in extents.items():
                size = segments[name].current_size()
                if size < extent:
                    fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"{label}: segment {name!r} shrank to {size} bytes, the "
                         f"cache needs {extent} (its owner truncated it)", cache_id=cache_id)

        endpoint = Endpoint(
            label=label, addresses=[bases[t.segment] + t.offset for t in remote.tensors] if bases else [],
            fds=[segments[t.segment].fd for t in remote.tensors], offsets=[t.offset for t in remote.tensors],
            stable=stable, check=check, holds=segments)
        return cls(segments, endpoint)


class ShmChannel(PeerChannel):
    name = NAME
    copies_strided = True  # memcopy copies strided pieces (as plain runs where it cannot copy fault-safely)
    pulls_from_several = True  # the caches' tensors side by side: one copy, one split over the copy threads

    def __init__(self, control: PeerControl, executor: concurrent.futures.Executor, shm_dir: Path,
                 copy_threads: int = 2) -> None:
        self._control = control
        self._executor = executor
        self._shm_dir = shm_dir
        self._copy_threads = copy_threads
        self._lock = threading.Lock()
        self._open: OrderedDict[RemoteCache, None] = OrderedDict()
        """The remote caches whose segments are open here, least recently used first (at most MAX_OPEN_CACHES)."""

    def runs_inline(self, plan: Plan) -> bool:
        return memcopy.small_enough_for_the_loop(plan)

    def _opened(self, remote: RemoteCache, writable: bool) -> _Opened:
        """The peer's segments open here, once per remote cache and access mode (under a lock: concurrent
        transfers of a new cache must share them). A copy holds the returned object: its descriptors and mappings
        stay valid while it runs, even if the cache is forgotten meanwhile."""
        key = _WRITABLE if writable else NAME
        with self._lock:
            opened: _Opened | None = remote.backend_state.get(key)
            if opened is None:
                opened = remote.backend_state[key] = _Opened.open(remote, self._control, self._shm_dir,
                                                                  writable=writable)
            self._open[remote] = None
            self._open.move_to_end(remote)
            while len(self._open) > MAX_OPEN_CACHES:
                self._drop(self._open.popitem(last=False)[0])
            return opened

    @staticmethod
    def _drop(remote: RemoteCache) -> None:
        remote.backend_state.pop(NAME, None)  # closed once no running copy holds them
        remote.backend_state.pop(_WRITABLE, None)

    def _check_peer(self, remote: RemoteCache) -> None:
        if self._control.closed:
            fail(LlmStatus.LLM_LINK_FAILED, "the link was closed during the transfer", cache_id=remote.cache_id)
        if not self._control.daemon_alive():
            fail(LlmStatus.LLM_LINK_FAILED, f"the daemon that holds remote cache {remote.cache_id} is gone (its "
                 "instance lock is free)", cache_id=remote.cache_id)
        if not self._control.is_live(remote.cache_id):
            self.forget(remote)
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {remote.cache_id} no longer exists",
                 cache_id=remote.cache_id)

    def _transfer(self, remotes: Sequence[RemoteCache], plan: Plan, progress: Progress, deadline: float,
                  endpoints: Callable[[], tuple[Endpoint, Endpoint]]) -> int:
        for remote in remotes:
            self._check_peer(remote)
        src, dst = endpoints()
        landed: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []
        error: LlmError | None = None
        try:
            memcopy.copy_plan(src, dst, plan, progress, deadline, self._executor, self._copy_threads,
                              mark=lambda runs, nbytes, first_repeat: landed.append((runs, nbytes, first_repeat)))
        except LlmError as e:
            error = e
        # What was copied counts only if the peer still holds the cache: otherwise it was read from, or written
        # into, memory that no longer belongs to it, and every block of the plan is reported as failed.
        for remote in remotes:
            self._check_peer(remote)
        for runs, nbytes, first_repeat in landed:
            progress.mark_runs(runs, nbytes, first_repeat)
        if error is not None:
            raise error
        return plan.total_bytes

    def pull(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._transfer((remote,), plan, progress, deadline,
                              lambda: (self._opened(remote, writable=False).endpoint, dst.endpoint()))

    def pull_several(self, remotes: Sequence[RemoteCache], dst: CacheEntry, plan: Plan, progress: Progress,
                     deadline: float) -> int:
        return self._transfer(remotes, plan, progress, deadline, lambda: (
            side_by_side([self._opened(remote, writable=False).endpoint for remote in remotes]), dst.endpoint()))

    def push(self, src: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._transfer((remote,), plan, progress, deadline,
                              lambda: (src.endpoint(), self._opened(remote, writable=True).endpoint))

    def forget(self, remote: RemoteCache) -> None:
        with self._lock:
            self._open.pop(remote, None)
            self._drop(remote)

    def gone(self, remote: RemoteCache) -> bool:
        # Two preads and a lock probe: cheap enough for every known cache at each heartbeat.
        return self._control.closed or not self._control.daemon_alive() or not self._control.is_live(remote.cache_id)

    def close(self) -> None:
        self._control.close()


_SEGMENT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


class ShmBackend(Backend):
    """Publishes this daemon's control page (shm_control.py) and advertises its name and nonce; a peer that can map
    the page by that name in its OWN shm dir and finds the nonce shares our host memory."""

    name = NAME
    capabilities = Capabilities()
    default = True
    control: ShmControlPage | None = None
    """Published by `start`, removed by `close`."""

    async def start(self) -> None:
        registry = self.ctx.registry
        if not registry.instance:
            raise OSError("shm: the registry has claimed no instance name (open it first)")
        control = ShmControlPage(self.ctx.shm_dir, registry.instance)
        control.publish(registry)
        self.control = control

    def advertise(self) -> bytes:
        if self.control is None:
            return b""
        return json.dumps({"segment": self.control.name, "nonce": self.control.nonce.hex()}).encode()

    async def connect(self, peer: PeerInfo, info: bytes) -> PeerChannel:
        try:
            ad = json.loads(info)
            segment, nonce = str(ad["segment"]), bytes.fromhex(str(ad["nonce"]))
        except (ValueError, TypeError, KeyError) as e:
            raise BackendUnusable(f"unreadable shm advertisement ({type(e).__name__})") from None
        if not _SEGMENT_NAME.fullmatch(segment):
            raise BackendUnusable(f"invalid shm segment name {segment[:80]!r}")
        control = probe(segment, nonce, self.ctx.shm_dir)  # our dir, never a path the peer chose
        if control is None:
            raise BackendUnusable("no shared host memory (the probe found no such page here)")
        return ShmChannel(control, self.ctx.parts_executor, self.ctx.shm_dir)

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None


BACKEND = ShmBackend
