"""The `shm` backend's control page: how a daemon on the same host proves it maps our memory, and learns which of
our caches still live.

A segment `kvbroker-<instance>-ctl` in this daemon's shm directory, mode 0600: NONCE_BYTES of random nonce, then one
little-endian uint64 per registry slot (liveslots.py). The handshake advertises its name and nonce; a peer that can
open the page by that name in its OWN shm directory and finds the nonce there shares our host memory (shm.probe),
and reads the slots with pread before and after each copy (shm.PeerControl).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvbrokerd.backends.common.liveslots import LiveSlots
from kvbrokerd.registry import shmseg

if TYPE_CHECKING:
    from kvbrokerd.registry.caches import Registry

NONCE_BYTES = 16
CONTROL_SUFFIX = "ctl"


class ShmControlPage:
    """This daemon's control page, published while the shm backend runs."""

    def __init__(self, shm_dir: Path, instance: str) -> None:
        self.name = shmseg.segment_name(instance, CONTROL_SUFFIX)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self._path = shm_dir / self.name
        self._segment: shmseg.Segment | None = None
        self._slots: LiveSlots | None = None

    def publish(self, registry: Registry) -> None:
        """Creates the page (after the registry claimed the instance, whose stale files it removed) and keeps its
        slots in step with `registry`; OSError when the page cannot be created."""
        segment = shmseg.create_segment(self._path.parent, self.name, NONCE_BYTES + 8 * registry.max_caches)
        try:
            page = segment.map()
            page[:NONCE_BYTES] = self.nonce
            slots = LiveSlots(np.frombuffer(page, dtype=np.uint64, offset=NONCE_BYTES))
            slots.follow(registry)
        except BaseException:
            segment.close()
            self._path.unlink(missing_ok=True)
            raise
        self._segment, self._slots = segment, slots

    def close(self) -> None:
        """Marks every cache gone (peers holding the page open see that), then unmaps and removes it; idempotent."""
        if self._slots is not None:
            self._slots.stop()
            self._slots = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None
            self._path.unlink(missing_ok=True)
