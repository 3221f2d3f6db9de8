"""A decode worker's loads: each scheduler step's pulls go to the daemon as one message on one long-lived pull
session (KvBroker.PullKvBlocksSession) per worker, so that a step of N requests costs one message, not N calls.

The unit is a generic `PullItem` (one grant, one source cache slot, its blocks and layers, its deadline): a request
may map to several items (e.g. one per source rank when the TP sizes differ), and its outcome is the combination of
its items' (the union of the local blocks that did not land). Items of one step from different prefill daemons
still go in one message; the daemon plans them per peer. A link is made on first use, on this module's own thread,
so the engine's step never waits for a handshake.

An item whose cluster was not linked (the daemon dropped the link, e.g. the peer restarted), or whose link failed
before any byte moved, is tried once more after the link is checked again, as `pull_granted_kv_blocks` callers do.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvbroker._client import Client
from kvbroker._session import MAX_PULLS_PER_SUBMIT, PullSession
from kvbroker.blockruns import Runs, expand
from kvbroker.status import LlmError, LlmStatus, NotYetLinkError
from kvbroker.tracecontext import TraceContext
from kvbroker.types import CacheIndex, Grant, KvCacheExtParam, SessionPull, TransferResult

log = logging.getLogger(f"vllm.{__name__}")


class Links(Protocol):
    """The worker's links to trusted prefill daemons (grants.PeerLinks)."""

    def ensure(self, cluster_id: int) -> None: ...

    def forget(self, cluster_id: int) -> None: ...


@dataclass(frozen=True, slots=True)
class PullItem:
    """One pull of granted blocks into this worker's cache."""

    request_id: str
    cluster_id: int
    """The prefill daemon that made the grant."""
    grant: Grant
    cache_slot: int
    """Which of the grant's caches (the source rank)."""
    dst_cache: int
    dst_blocks: tuple[int, ...] | np.ndarray
    """Long lists as numpy arrays (they go to the daemon as runs); empty with `runs`."""
    src_blocks: tuple[int, ...] | np.ndarray = ()
    """Empty: the grant's blocks from `first_block` on (or `runs`)."""
    runs: Runs | None = None
    """The (source, destination) pairs as runs (a remap plan: token units), sent as they are."""
    first_block: int = 0
    ext_param: KvCacheExtParam | None = None
    timeout: float | None = None
    trace: TraceContext | None = None
    """The request's trace, which the daemon's span of the pull continues."""


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """A request's loads, all items ended."""

    request_id: str
    failed_blocks: frozenset[int]
    """Destination entries that did not land (empty: everything landed)."""
    bytes_moved: int
    seconds: float
    """From the step's submit to the last item's completion."""
    backend: str
    status: LlmStatus | None = None
    """The status of its first item that failed (None: none did)."""


@dataclass(eq=False)
class _Request:
    request_id: str
    pending: int
    started: float
    failed: set[int] = field(default_factory=set)
    moved: int = 0
    backends: set[str] = field(default_factory=set)
    status: LlmStatus | None = None


class StepLoads:
    """`submit(items)` hands one step's items to the daemon as one message (more than 256: as few as fit);
    `on_done(LoadOutcome)` is called once per request, from this module's threads, when its last item has ended."""

    def __init__(self, client: Client, links: Links, on_done: Callable[[LoadOutcome], None]) -> None:
        self._client = client
        self._links = links
        self._on_done = on_done
        self._lock = threading.Lock()
        self._steps: queue.SimpleQueue[tuple[list[PullItem], dict[str, _Request], int] | None] = queue.SimpleQueue()
        self._session: PullSession | None = None
        self.messages_sent = 0
        """Messages sent on the session (a step is one, unless it has more than 256 items or some are retried)."""
        self._thread = threading.Thread(target=self._dispatch, name="kvbroker-loads", daemon=True)
        self._thread.start()

    def submit(self, items: Sequence[PullItem]) -> None:
        """Starts one step's items (returns at once: linking and sending happen on this module's thread)."""
        if not items:
            return
        now = time.monotonic()
        requests: dict[str, _Request] = {}
        for item in items:
            r = requests.setdefault(item.request_id, _Request(item.request_id, 0, now))
            r.pending += 1
        self._steps.put((list(items), requests, 1))

    # -- this module's thread ----------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while (step := self._steps.get()) is not None:
            items, requests, attempt = step
            try:
                self._send(items, requests, attempt)
            except Exception:  # a bug must not strand the requests in WAITING_FOR_REMOTE_KVS
                log.exception("kvbroker loads: sending a step failed; recomputing its KV")
                for item in items:
                    self._ended(requests[item.request_id], item, None, LlmError(LlmStatus.LLM_FAILED, "internal error"))

    def _send(self, items: list[PullItem], requests: dict[str, _Request], attempt: int) -> None:
        ready: list[PullItem] = []
        unlinked: dict[int, LlmError] = {}
        for cluster_id in dict.fromkeys(i.cluster_id for i in items):
            try:
                self._links.ensure(cluster_id)  # a link on first use: a handshake, not the engine's wait
            except LlmError as e:
                unlinked[cluster_id] = e
        for item in items:
            err = unlinked.get(item.cluster_id)
            if err is not None:
                self._ended(requests[item.request_id], item, None, err)
            else:
                ready.append(item)
        for start in range(0, len(ready), MAX_PULLS_PER_SUBMIT):
            chunk = ready[start:start + MAX_PULLS_PER_SUBMIT]
            try:
                futures = self._submit([_session_pull(i) for i in chunk])
            except LlmError as e:  # the daemon is unreachable (or refused the session): these are recomputed
                for item in chunk:
                    self._ended(requests[item.request_id], item, None, e)
                continue
            for item, fut in zip(chunk, futures, strict=True):
                fut.add_done_callback(functools.partial(self._item_done, requests[item.request_id], item,
                                                        attempt=attempt))

    def _submit(self, pulls: list[SessionPull]) -> list[concurrent.futures.Future[TransferResult]]:
        """One message on the session, opening (or, after it ended, reopening) it first."""
        for retry in (False, True):
            with self._lock:
                if self._session is None:
                    self._session = self._client.open_pull_session()
                session = self._session
            try:
                futures = session.submit(pulls)
                self.messages_sent += 1
                return futures
            except LlmError as e:
                if e.status == LlmStatus.LLM_PARAM_INVALID or retry:
                    raise
                log.warning("kvbroker loads: the pull session ended (%s); opening a new one", e.message)
                with self._lock:
                    if self._session is session:
                        self._session = None
                session.close(wait=0)
        raise AssertionError("unreachable")

    def _item_done(self, request: _Request, item: PullItem, fut: concurrent.futures.Future[TransferResult], *,
                   attempt: int) -> None:
        try:
            result = fut.result()
        except LlmError as e:
            if attempt == 1 and _worth_retrying(e):
                self._links.forget(item.cluster_id)  # check the link (restarted or moved peer) and try once more
                self._steps.put(([item], {item.request_id: request}, 2))
                return
            if e.status in (LlmStatus.LLM_LINK_FAILED, LlmStatus.LLM_TIMEOUT):
                self._links.forget(item.cluster_id)
            self._ended(request, item, None, e)
            return
        except Exception as e:  # the future of a closed session, or a bug: the item did not land
            self._ended(request, item, None, LlmError(LlmStatus.LLM_FAILED, f"{type(e).__name__}: {e}"))
            return
        self._ended(request, item, result, None)

    def _ended(self, request: _Request, item: PullItem, result: TransferResult | None, err: LlmError | None) -> None:
        with self._lock:
            if err is not None:
                landed_partly = err.failed_dst_blocks
                dst = item.dst_blocks if item.runs is None else expand(item.runs)[1]
                blocks = set(np.asarray(dst, dtype=np.uint64).tolist())
                failed = (set(landed_partly) & blocks or blocks) if landed_partly else blocks
                request.failed |= failed
                request.status = request.status or err.status
                log.warning("request %s: pull from cluster %d failed (%s: %s); recomputing %d of %d blocks",
                            item.request_id, item.cluster_id, err.status.name, err.message, len(failed), len(blocks))
            elif result is not None:
                request.moved += result.bytes_moved
                request.backends.add(result.backend)
            request.pending -= 1
            if request.pending:
                return
        self._on_done(LoadOutcome(request.request_id, frozenset(request.failed), request.moved,
                                  time.monotonic() - request.started, ",".join(sorted(request.backends)),
                                  request.status))

    def close(self) -> None:
        """Stops the thread and closes the session (pulls still in flight end as the daemon ends them, or fail)."""
        self._steps.put(None)
        self._thread.join(timeout=30)
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.close(wait=5.0)


def _worth_retrying(e: LlmError) -> bool:
    if isinstance(e, NotYetLinkError):
        return True  # the daemon dropped the link (peer restart): link again once
    return e.status == LlmStatus.LLM_LINK_FAILED and not e.failed_dst_blocks


def _session_pull(item: PullItem) -> SessionPull:
    return SessionPull(CacheIndex(item.cluster_id, 0), item.dst_cache, item.dst_blocks, item.src_blocks,
                       item.ext_param, item.grant, item.cache_slot, item.first_block, item.timeout, item.runs,
                       item.trace)
