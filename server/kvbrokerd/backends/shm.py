"""`shm` backend: same-host pulls by mapping the peer's shared-memory segments and copying directly.

Usable only when this daemon can open the peer's control page and read the nonce the peer sent in the handshake:
proof, not a guess from host names, that both daemons see the same host memory. The control page also lists the
peer's live cache ids, checked before and after each copy, so a deallocated cache is never read as if it were live.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvbroker._shm import SegmentMap
from kvbrokerd.backends.base import Capabilities, PeerChannel, RemoteCache
from kvbrokerd.errors import LlmStatus, fail
from kvbrokerd.planner import Progress, Run, split_runs
from kvbrokerd.registry import control_view, is_live

if TYPE_CHECKING:
    from kvbrokerd.planner import Plan
    from kvbrokerd.registry import CacheEntry

NAME = "shm"
CAPABILITIES = Capabilities(same_host_only=True, one_sided_read=True)
# Below this many bytes a second copying thread costs more than it saves.
_PARALLEL_MIN_BYTES = 8 << 20
# A memcpy this small (tens of microseconds) is cheaper on the event loop than a hand-off to a worker thread.
_INLINE_MAX_BYTES = 512 << 10


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
        return plan.total_bytes <= _INLINE_MAX_BYTES

    def _source_arrays(self, remote: RemoteCache) -> list[np.ndarray]:
        state = remote.backend_state.get(NAME)
        if state is None:
            maps: dict[str, SegmentMap] = {}
            try:
                for loc in remote.tensors:
                    if loc.segment not in maps:
                        maps[loc.segment] = SegmentMap(Path(remote.shm_dir) / loc.segment)
            except OSError as e:
                for m in maps.values():
                    m.close()
                fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {remote.cache_id}: cannot map its memory ({e})")
            n = remote.desc.tensor_nbytes
            try:
                arrays = [np.frombuffer(maps[t.segment].mmap, np.uint8, n, t.offset) for t in remote.tensors]
            except ValueError:
                for m in maps.values():
                    m.close()
                fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {remote.cache_id}: its segments are smaller "
                     "than its descriptor says")
            state = remote.backend_state[NAME] = (maps, arrays)
        return state[1]

    def _check_live(self, remote: RemoteCache) -> None:
        if not is_live(self._live, remote.cache_id):
            self.forget(remote)
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {remote.cache_id} no longer exists")

    def pull(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        self._check_live(remote)
        src_arrays = self._source_arrays(remote)
        dst_arrays = [np.frombuffer(v, np.uint8) for v in dst.views]
        # Raw addresses: the planner has checked every run against both caches' sizes, the arrays above keep the
        # mappings alive, and ctypes.memmove releases the GIL, so two copiers really run in parallel.
        src_addr = [a.ctypes.data for a in src_arrays]
        dst_addr = [a.ctypes.data for a in dst_arrays]
        runs = plan.runs()

        def copy(chunk: list[Run]) -> None:
            for i, (idx, st, so, dt, do, n) in enumerate(chunk):
                if i % 256 == 0 and time.monotonic() > deadline:
                    fail(LlmStatus.LLM_TIMEOUT, "deadline passed during the shm copy")
                ctypes.memmove(dst_addr[dt] + do, src_addr[st] + so, n)
                progress.mark(idx, n)

        threads = self._copy_threads if plan.total_bytes >= _PARALLEL_MIN_BYTES and len(runs) > 1 else 1
        if threads == 1:
            copy(runs)
        else:
            chunks = split_runs(runs, threads)
            futures = [self._executor.submit(copy, c) for c in chunks[1:]]
            try:
                copy(chunks[0])
            finally:
                # Every copier stops before we return: the caller unpins the destination after that.
                concurrent.futures.wait(futures)
            for f in futures:
                f.result()
        self._check_live(remote)
        return plan.total_bytes

    def forget(self, remote: RemoteCache) -> None:
        state = remote.backend_state.pop(NAME, None)
        if state is not None:
            state[1].clear()
            for m in state[0].values():
                m.close()

    def close(self) -> None:
        self._live = np.zeros(1, dtype=np.uint64)
        self._control.close()

