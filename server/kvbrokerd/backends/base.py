"""The data-plane interface every backend implements, and the remote-cache view backends read from."""

from __future__ import annotations

import abc
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvbroker._types import CacheDesc, TensorLocation

if TYPE_CHECKING:
    from kvbrokerd.planner import Plan, Progress
    from kvbrokerd.registry import CacheEntry


_Part = TypeVar("_Part")


@dataclass(eq=False)
class RemoteCache:
    """What a linked peer told us about one of its caches (Peer.GetCacheInfo)."""

    cache_id: int
    desc: CacheDesc
    tensors: tuple[TensorLocation, ...]
    shm_dir: str
    backend_state: dict[str, Any] = field(default_factory=dict)
    """Per-backend handles (e.g. the shm backend's mappings), released with `Backend.forget`."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    same_host_only: bool
    one_sided_read: bool


class PeerChannel(abc.ABC):
    """A backend's per-link state: how to reach one peer's memory."""

    name: str

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

    @abc.abstractmethod
    def close(self) -> None:
        """Releases connections and mappings; idempotent."""


def run_parts(executor: concurrent.futures.Executor, work: Callable[[_Part], None], parts: list[_Part]) -> None:
    """Runs work(part) for every part, the first on this thread and the others on `executor`, and returns only
    when every one has stopped (callers unpin memory after that); then raises the first error, if any."""
    futures = [executor.submit(work, p) for p in parts[1:]]
    errors: list[BaseException] = []
    try:
        work(parts[0])
    except BaseException as e:
        errors.append(e)
    concurrent.futures.wait(futures)
    for f in futures:
        if f.exception() is not None:
            errors.append(f.exception())  # type: ignore[arg-type]
    if errors:
        raise errors[0]
