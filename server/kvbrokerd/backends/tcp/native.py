"""READs the C extension (kvbrokerd._tcpread) serves without Python: a plain version-2 connection's thread hands
its socket to `NativeReads.serve`, which answers READs of the caches in its table with the GIL released and returns
only for a request that needs Python (server.py answers it as before). Without the extension (no C compiler at
install, or `KVBROKER_TCP_NATIVE=0`) every request takes the Python path.

The table follows the registry: a cache joins it when it joins the registry and leaves it after its last pin,
before its memory is unmapped (`Registry.on_remove`), and the leaving waits until no native read sends from it.
Caches registered before the server started are served by Python (listing them would race with their removal).
"""

from __future__ import annotations

import logging
import os
import socket
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from kvbrokerd.backends.common import sockio
from kvbrokerd.backends.tcp.wire import IDLE_TIMEOUT_S, MAX_REQUEST_S, REQUEST_TIMEOUT_S, STALL_TIMEOUT_S
from kvbrokerd.errors import LlmStatus

if TYPE_CHECKING:
    from kvbrokerd._tcpread import ReadTable
    from kvbrokerd.registry.caches import CacheEntry, Registry

log = logging.getLogger(__name__)

MAX_BYTES = 4 << 20
"""Largest READ served natively: bounds how long the removal of a cache waits for a read of it (a peer reading at the
minimum rate); larger ones take the Python path, where their per-request cost is small beside their bytes."""


NATIVE_ENV = "KVBROKER_TCP_NATIVE"
"""`KVBROKER_TCP_NATIVE=0` in the daemon's environment: every READ takes the Python path (to compare, or to rule the
extension out)."""


def _load() -> ModuleType | None:
    if os.environ.get(NATIVE_ENV) == "0":
        log.info("the tcp data port serves reads in Python: turned off (%s=0)", NATIVE_ENV)
        return None
    try:
        from kvbrokerd import _tcpread
    except ImportError as e:
        log.info("the tcp data port serves reads in Python: kvbrokerd._tcpread is not available (%s)", e)
        return None
    return _tcpread


_tcpread = _load()


def available() -> bool:
    return _tcpread is not None


class NativeReads:
    def __init__(self, registry: Registry, min_rate: sockio.MinRate) -> None:
        assert _tcpread is not None
        self._table: ReadTable = _tcpread.ReadTable()
        self._max_runs = int(_tcpread.MAX_RUNS)
        self._min_rate = min_rate
        self._registry = registry
        registry.on_add.append(self._added)
        registry.on_remove.append(self._removed)

    def stop(self) -> None:
        """No cache joins the table any more. The removal hook stays: a connection may still be winding down, and
        a cache must not be unmapped under it."""
        if self._added in self._registry.on_add:
            self._registry.on_add.remove(self._added)

    def _added(self, entry: CacheEntry) -> None:
        n = entry.desc.num_tensors
        if len(entry.views) == n and len(entry.addresses) == n:  # mapped here (a device cache has no views)
            self._table.put(entry.cache_id, entry.desc.tensor_nbytes, np.asarray(entry.addresses, dtype=np.uint64))

    def _removed(self, entry: CacheEntry) -> None:
        self._table.drop(entry.cache_id)

    def serve(self, sock: socket.socket) -> bytes | int | None:
        """Serves READs until one needs Python: None (the peer left or idled out), that request's bytes, or the id of
        a cache that lost its memory under a read (answered: padded with zeros, its trailer says so). Raises what
        must end the connection (TimeoutError, ConnectionError, OSError)."""
        rate = self._min_rate
        return self._table.serve(sock.fileno(), IDLE_TIMEOUT_S, REQUEST_TIMEOUT_S, STALL_TIMEOUT_S, MAX_REQUEST_S,
                                 float(rate.bytes_per_s), rate.window_s, MAX_BYTES, self._max_runs,
                                 int(LlmStatus.LLM_KV_CACHE_NOT_EXIST))

    def size(self) -> int:
        return self._table.size()
