"""`shm` backend: same-host pulls by mapping the peer's shared-memory segments and copying directly.

Usable only when this daemon can open the peer's control page and read the nonce the peer sent in the handshake:
proof, not a guess from host names, that both daemons see the same host memory. The control page also lists the
peer's live cache ids, checked before and after each copy, so a deallocated cache is never read as if it were live.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvbroker._shm import SegmentMap
from kvbrokerd.backends import memcopy
from kvbrokerd.backends.base import Backend, BackendUnusable, Capabilities, PeerChannel, PeerInfo, RemoteCache
from kvbrokerd.errors import LlmStatus, fail
from kvbrokerd.registry import control_view, is_live

if TYPE_CHECKING:
    from kvbrokerd.planner import Plan, Progress
    from kvbrokerd.registry import CacheEntry

NAME = "shm"
CAPABILITIES = Capabilities(same_host_only=True, one_sided_read=True)


class _Mapping:
    """A remote cache's segments mapped into this process, with each tensor's base address."""

    def __init__(self, maps: dict[str, SegmentMap], arrays: list[np.ndarray]) -> None:
        self.maps = maps
        self.arrays = arrays  # hold buffer exports: the mmaps cannot close while these live
        self.addresses = [int(a.ctypes.data) for a in arrays]

    @classmethod
    def open(cls, remote: RemoteCache) -> _Mapping:
        maps: dict[str, SegmentMap] = {}
        try:
            for loc in remote.tensors:
                if loc.segment not in maps:
                    maps[loc.segment] = SegmentMap(Path(remote.shm_dir) / loc.segment)
            n = remote.desc.tensor_nbytes
            return cls(maps, [np.frombuffer(maps[t.segment].mmap, np.uint8, n, t.offset) for t in remote.tensors])
        except (OSError, ValueError) as e:
            for m in maps.values():
                m.close()
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {remote.cache_id}: cannot map its memory ({e})")


def probe(control_path: str, nonce: bytes) -> SegmentMap | None:
    """Maps the peer's control page if it holds `nonce`; None when the peer's memory is not reachable from here."""
    try:
        seg = SegmentMap(control_path)
    except OSError:
        return None
    if control_view(seg)[0] != nonce:
        seg.close()
        return None
    return seg


class ShmChannel(PeerChannel):
    name = NAME

    def __init__(self, control: SegmentMap, executor: concurrent.futures.Executor, copy_threads: int = 2) -> None:
        self._control = control
        self._live = control_view(control)[1]
        self._executor = executor
        self._copy_threads = copy_threads
        self._lock = threading.Lock()

    def runs_inline(self, plan: Plan) -> bool:
        return memcopy.small_enough_for_the_loop(plan)

    def _mapping(self, remote: RemoteCache) -> _Mapping:
        """The peer's segments mapped here, made once per remote cache (under a lock: concurrent transfers of a
        new cache must share one mapping). A copy holds the returned object: the mapping stays valid while it
        runs, even if the cache is forgotten meanwhile (the memory is unmapped when the last holder lets go)."""
        with self._lock:
            mapping: _Mapping | None = remote.backend_state.get(NAME)
            if mapping is None:
                mapping = remote.backend_state[NAME] = _Mapping.open(remote)
            return mapping

    def _check_live(self, remote: RemoteCache) -> None:
        if not is_live(self._live, remote.cache_id):
            self.forget(remote)
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {remote.cache_id} no longer exists")

    def pull(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        self._check_live(remote)
        source = self._mapping(remote)
        moved = memcopy.copy_plan(source.addresses, dst.addresses, plan, progress, deadline, self._executor,
                                  self._copy_threads)
        # The peer may have dropped the cache while we copied: then what we read may be stale, and we say so.
        self._check_live(remote)
        return moved

    def push(self, src: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress, deadline: float) -> int:
        self._check_live(remote)
        target = self._mapping(remote)
        return memcopy.copy_plan(src.addresses, target.addresses, plan, progress, deadline, self._executor,
                                 self._copy_threads)

    def forget(self, remote: RemoteCache) -> None:
        with self._lock:
            remote.backend_state.pop(NAME, None)  # unmapped once no running copy holds it

    def close(self) -> None:
        self._live = np.zeros(1, dtype=np.uint64)
        self._control.close()


_SEGMENT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")


class ShmBackend(Backend):
    """Advertises this daemon's control page (by name) and nonce; a peer that can map the page by that name in its
    OWN shm dir and finds the nonce shares our host memory."""

    name = NAME
    capabilities = CAPABILITIES

    def advertise(self) -> bytes:
        control = self.ctx.registry.control_path
        if control is None:
            return b""
        return json.dumps({"segment": control.name, "nonce": self.ctx.registry.nonce.hex()}).encode()

    def connect(self, peer: PeerInfo, info: bytes) -> PeerChannel:
        try:
            ad = json.loads(info)
            segment, nonce = str(ad["segment"]), bytes.fromhex(str(ad["nonce"]))
        except (ValueError, TypeError, KeyError) as e:
            raise BackendUnusable(f"unreadable shm advertisement ({type(e).__name__})") from None
        if not _SEGMENT_NAME.fullmatch(segment):
            raise BackendUnusable(f"invalid shm segment name {segment[:80]!r}")
        control = probe(str(self.ctx.shm_dir / segment), nonce)  # our dir, never a path the peer chose
        if control is None:
            raise BackendUnusable("no shared host memory (the probe found no such page here)")
        return ShmChannel(control, self.ctx.parts_executor)


BACKEND = ShmBackend
