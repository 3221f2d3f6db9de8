"""Local copies (CopyKvBlocks) as a channel like any other: the "peer" is this daemon itself.

The source is named by a description, like a peer's cache, and resolved and pinned in this daemon's own registry
for the length of the copy (as the tcp data server does with what a peer reads), so the transfer manager treats a
copy as a pull over this channel and knows nothing of how memory is copied.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING

from kvbrokerd.backends.common import memcopy
from kvbrokerd.dataplane.seam import PeerChannel, RemoteCache

if TYPE_CHECKING:
    from kvbrokerd.dataplane.plan import Plan, Progress
    from kvbrokerd.registry.caches import CacheEntry, Registry

NAME = "local"


class LocalCopyChannel(PeerChannel):
    name = NAME
    copies_strided = True  # memcopy copies strided pieces (as plain runs where it cannot copy fault-safely)

    def __init__(self, registry: Registry, executor: concurrent.futures.Executor, copy_threads: int = 2) -> None:
        self._registry = registry
        self._executor = executor
        self._copy_threads = copy_threads

    @staticmethod
    def describe(entry: CacheEntry) -> RemoteCache:
        """One of our caches as the far side of a copy."""
        return RemoteCache(cache_id=entry.cache_id, desc=entry.desc, tensors=entry.tensors)

    def runs_inline(self, plan: Plan) -> bool:
        return memcopy.small_enough_for_the_loop(plan)

    def pull(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        # Pinned: a cache released meanwhile stays mapped until the copy ends, so its addresses stay valid.
        with self._registry.pinned(remote.cache_id) as src:
            return memcopy.copy_plan(src.endpoint(), dst.endpoint(), plan, progress, deadline, self._executor,
                                     self._copy_threads)

    def push(self, src: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress, deadline: float) -> int:
        with self._registry.pinned(remote.cache_id) as dst:
            return memcopy.copy_plan(src.endpoint(), dst.endpoint(), plan, progress, deadline, self._executor,
                                     self._copy_threads)

    def close(self) -> None:
        """Nothing to release: every copy pins and unpins its source itself."""
