"""`shm` backend: same-host pulls by mapping the peer's shared-memory segments and copying directly.

Usable only when this daemon can open the peer's control page and read the nonce the peer sent in the handshake:
proof, not a guess from host names, that both daemons see the same host memory. The control page also lists the
peer's live cache ids, checked before and after each copy, so a deallocated cache is never read as if it were live.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvbroker._shm import SegmentMap
from kvbrokerd.backends import memcopy
from kvbrokerd.backends.base import Capabilities, PeerChannel, RemoteCache
from kvbrokerd.errors import LlmStatus, fail
from kvbrokerd.registry import control_view, is_live

if TYPE_CHECKING:
    from kvbrokerd.planner import Plan, Progress
    from kvbrokerd.registry import CacheEntry

NAME = "shm"
CAPABILITIES = Capabilities(same_host_only=True, one_sided_read=True)


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

    def runs_inline(self, plan: Plan) -> bool:
        return memcopy.small_enough_for_the_loop(plan)

    def _remote_addresses(self, remote: RemoteCache) -> list[int]:
        state = remote.backend_state.get(NAME)
        if state is None:
            maps: dict[str, SegmentMap] = {}
            try:
                for loc in remote.tensors:
                    if loc.segment not in maps:
                        maps[loc.segment] = SegmentMap(Path(remote.shm_dir) / loc.segment)
                n = remote.desc.tensor_nbytes
                views = [np.frombuffer(maps[t.segment].mmap, np.uint8, n, t.offset) for t in remote.tensors]
            except (OSError, ValueError) as e:
                for m in maps.values():
                    m.close()
                fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {remote.cache_id}: cannot map its memory ({e})")
            state = remote.backend_state[NAME] = (maps, *memcopy.addresses(views))
        return state[2]

    def _check_live(self, remote: RemoteCache) -> None:
        if not is_live(self._live, remote.cache_id):
            self.forget(remote)
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {remote.cache_id} no longer exists")

    def pull(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        self._check_live(remote)
        src_addr = self._remote_addresses(remote)
        moved = memcopy.copy_plan(src_addr, dst.addresses, plan, progress, deadline, self._executor,
                                  self._copy_threads)
        # The peer may have dropped the cache while we copied: then what we read may be stale, and we say so.
        self._check_live(remote)
        return moved

    def push(self, src: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress, deadline: float) -> int:
        self._check_live(remote)
        dst_addr = self._remote_addresses(remote)
        moved = memcopy.copy_plan(src.addresses, dst_addr, plan, progress, deadline, self._executor,
                                  self._copy_threads)
        return moved

    def forget(self, remote: RemoteCache) -> None:
        state = remote.backend_state.pop(NAME, None)
        if state is not None:
            state[1].clear()
            for m in state[0].values():
                m.close()

    def close(self) -> None:
        self._live = np.zeros(1, dtype=np.uint64)
        self._control.close()
