"""Live-cache slots: one 64-bit word per registry slot holding the id of the cache that lives there (0 = none).

One-sided backends have no server to ask whether a cache still exists, and a removed cache's memory (or address) may
already belong to another: peers read a cache's word instead, before and after they touch its memory (`shm` with
pread of its control page, `nixl` with a NIXL READ). The registry keeps the ids of live caches distinct modulo
`max_caches`, so the word of cache `id` is `id % max_caches` and never shared; its hooks keep the words current: set
before an id is handed out, cleared before the cache's memory is unmapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvbrokerd.registry.caches import CacheEntry, Registry


class LiveSlots:
    """The words over `words` (uint64, one per registry slot: a mapped page, or memory an engine registered)."""

    def __init__(self, words: np.ndarray) -> None:
        self._words: np.ndarray | None = words
        self._registry: Registry | None = None

    def address(self, cache_id: int) -> int:
        """Address in this process of the word of cache `cache_id`."""
        assert self._words is not None
        return int(self._words.ctypes.data) + 8 * (cache_id % len(self._words))

    def follow(self, registry: Registry) -> None:
        """Marks the caches `registry` holds now, then every cache it adds or removes until `stop`."""
        assert self._words is not None and len(self._words) == registry.max_caches
        self._registry = registry
        registry.on_add.append(self.added)
        registry.on_remove.append(self.removed)
        for entry in registry.list():
            self.added(entry)

    def added(self, entry: CacheEntry) -> None:
        words = self._words
        if words is not None:
            words[entry.cache_id % len(words)] = entry.cache_id

    def removed(self, entry: CacheEntry) -> None:
        words = self._words
        # Only its own id: the slot may already hold a cache added after this one left the registry's table.
        if words is not None and words[entry.cache_id % len(words)] == entry.cache_id:
            words[entry.cache_id % len(words)] = 0

    def stop(self) -> None:
        """Clears every word (no cache is live for peers any more) and stops following the registry; idempotent."""
        if self._registry is not None:
            for hooks, hook in ((self._registry.on_add, self.added), (self._registry.on_remove, self.removed)):
                if hook in hooks:
                    hooks.remove(hook)
            self._registry = None
        if self._words is not None:
            self._words[:] = 0
            self._words = None
