"""BOOKKEEPING ONLY: the `nixl` backend on a real registry with a recording stand-in for the NIXL agent (its thread
run inline) and tests/fakecuda.py for CUDA: which registrations and IPC imports a daemon makes, and in what order.
Nothing here shows what NIXL or CUDA would accept."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from kvbrokerd.backends.common.cudaipc import CudaIpcImporter
from kvbrokerd.backends.nixl.backend import NixlBackend
from kvbrokerd.dataplane.seam import LocalContext
from kvbrokerd.registry.caches import Registry
from tests.fakecuda import FakeRuntime


class Agent:
    """Records registrations; every call also goes into the shared `events` (to check the order against CUDA's)."""

    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        self.events = events
        self.live: dict[int, tuple[str, tuple[tuple[int, int, int, str], ...]]] = {}
        self._ids = itertools.count(1)

    def register_memory(self, descs: list[tuple[int, int, int, str]], mem: str) -> int:
        handle = next(self._ids)
        self.live[handle] = (mem, tuple(descs))
        self.events.append(("register", handle))
        return handle

    def deregister_memory(self, handle: int) -> None:
        assert handle in self.live, f"registration {handle} deregistered twice"
        del self.live[handle]
        self.events.append(("deregister", handle))

    def get_partial_agent_metadata(self, handle: int, *_: Any) -> bytes:
        return b"md%d" % handle


class Recorder(FakeRuntime):
    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.events = events

    def _record(self, *call: Any) -> None:
        super()._record(*call)
        if call[0] in ("open", "close"):
            self.events.append(call[:2])


@dataclasses.dataclass
class Rig:
    registry: Registry
    backend: NixlBackend
    agent: Agent
    runtime: Recorder
    events: list[tuple[Any, ...]]

    def remove(self, cache_id: int) -> None:
        """As UnregisterKvCache / DeallocateCache do: the backend forgets the cache, then the registry unmaps it."""
        asyncio.run(self.registry.remove(cache_id, daemon_owned=None))

    def kinds(self) -> list[str]:
        return [e[0] for e in self.events]


@contextlib.contextmanager
def nixl_rig(tmp_path: Path) -> Iterator[Rig]:
    """A registry and a nixl backend on it, with the stand-in agent (its thread inline) and fake CUDA; every NIXL
    registration and CUDA IPC open and close goes into the list, in order."""
    registry = Registry(tmp_path, max_caches=16)
    registry.open()
    events: list[tuple[Any, ...]] = []
    agent = Agent(events)
    backend = NixlBackend(cast(LocalContext, SimpleNamespace(cluster_id=8, registry=registry)))
    backend.agent = cast(Any, SimpleNamespace(call=lambda fn: fn(agent), submit=lambda fn: _done(fn(agent))))
    runtime = Recorder(events)
    backend._cuda = CudaIpcImporter(runtime, runtime)
    backend.cuda_missing = ""
    registry.on_remove.append(backend.forget_cache)
    try:
        yield Rig(registry, backend, agent, runtime, events)
    finally:
        registry.close()


def _done(result: Any) -> concurrent.futures.Future[Any]:
    """The agent thread's answer, inline."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(result)
    return future


