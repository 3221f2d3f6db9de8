"""The `hccl` backend's per-peer channel: the HIXL link to one peer's engine, made after registering and remade when
a registration epoch needs it, and the transfers on it (see backend.py for the rules)."""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from kvbroker.status import LlmError
from kvbrokerd.backends.hccl.engine import DISCONNECT_TIMEOUT_MS, NAME, HcclSettings, hixl_name, llm_status
from kvbrokerd.dataplane.seam import PeerChannel, RemoteCache
from kvbrokerd.errors import LlmStatus, fail

if TYPE_CHECKING:
    from kvbrokerd.dataplane.plan import Plan, Progress
    from kvbrokerd.registry.caches import CacheEntry

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Engine(Protocol):
    """What a channel uses of its backend (HcclBackend): the HIXL module, the engine thread, registrations."""

    hixl: Any
    epoch: int
    live: Any
    settings: HcclSettings

    @property
    def serving(self) -> bool: ...

    def call(self, fn: Callable[[Any], _T]) -> _T: ...

    def registration(self, entry: CacheEntry) -> Any: ...

    def forget_channel(self, channel: HcclChannel) -> None: ...

MAX_DESCS_PER_TRANSFER = 4096
"""Descriptors per HIXL request."""
_POLL_FIRST_S = 50e-6
_POLL_MAX_S = 2e-3
_LINK_POLL_MAX_S = 20e-3
_ASYNC_LINK_GRACE_MS = 200


@dataclass(frozen=True)
class RemoteRegion:
    """A peer's cache as its (validated) hccl description gives it: where each tensor is in the peer's engine, the
    epoch a link must have reached to see it, and its liveness word and token."""

    engine: str
    epoch: int
    addresses: np.ndarray
    live: int
    token: int


class HcclChannel(PeerChannel):
    """The link from our engine to one peer's engine: made lazily, remade when a registration epoch needs it."""

    name = NAME

    def __init__(self, backend: Engine, remote_engine: str, remote_epoch: int) -> None:
        self._backend = backend
        self.remote_engine = remote_engine
        self._seen_remote_epoch = remote_epoch
        self._link: tuple[int, int] | None = None
        """(our epoch, the peer's epoch) when the HIXL link was made; None = no link."""
        self._generation = 0
        """Counts links made and dropped: a request outlives its link when this moved on."""
        self._cond = threading.Condition()
        self._in_flight = 0
        self._remaking = False
        self._remakes_queued = 0
        self._closed = False
        self.connects = 0

    # -- transfers -------------------------------------------------------------------------------------------------
    def pull(self, remote: RemoteCache, dst: CacheEntry, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._run(True, dst, remote, plan, progress, deadline)

    def push(self, src: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress, deadline: float) -> int:
        return self._run(False, src, remote, plan, progress, deadline)

    def _run(self, read: bool, local: CacheEntry, remote: RemoteCache, plan: Plan, progress: Progress,
             deadline: float) -> int:
        hixl = self._backend.hixl
        region = self._remote_region(remote)
        reg = self._backend.registration(local)
        local_tensor, local_off = (plan.dst_tensor, plan.dst_offset) if read else (plan.src_tensor, plan.src_offset)
        remote_tensor, remote_off = (plan.src_tensor, plan.src_offset) if read else (plan.dst_tensor, plan.dst_offset)
        local_addr = np.asarray(local.addresses, dtype=np.uint64)[local_tensor] + local_off
        remote_addr = region.addresses[remote_tensor] + remote_off
        op = hixl.TransferOp.READ if read else hixl.TransferOp.WRITE
        if not read:
            self._check_live(remote.cache_id, region, progress, deadline)  # never write into a removed cache
        for start in range(0, plan.num_runs, MAX_DESCS_PER_TRANSFER):
            part = slice(start, start + MAX_DESCS_PER_TRANSFER)
            descs = [hixl.TransferOpDesc(a, b, n) for a, b, n in zip(
                local_addr[part].tolist(), remote_addr[part].tolist(), plan.length[part].tolist(), strict=True)]
            self._transfer(op, descs, reg.epoch, region.epoch, progress, deadline)
        # The peer may have removed the cache while we moved bytes: then what we read may belong to another cache,
        # and nothing counts as landed.
        self._check_live(remote.cache_id, region, progress, deadline)
        for i, n in enumerate(plan.length.tolist()):
            progress.mark(i, n)
        return plan.total_bytes

    def _check_live(self, cache_id: int, region: RemoteRegion, progress: Progress, deadline: float) -> None:
        """READs the peer's liveness word for the cache (registered before any link: epoch 0)."""
        hixl, live = self._backend.hixl, self._backend.live
        if live is None:
            fail(LlmStatus.LLM_NOT_YET_LINK, "the hccl engine was shut down")
        try:
            scratch = live.free_scratch.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            fail(LlmStatus.LLM_TIMEOUT, "deadline passed waiting for a liveness check slot")
        try:
            live.write(scratch, 0)
            self._transfer(hixl.TransferOp.READ, [hixl.TransferOpDesc(scratch, region.live, 8)], 0, 0, progress,
                           deadline)
            value = live.read(scratch)
        finally:
            live.free_scratch.put(scratch)
        if value != region.token:
            fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"remote cache {cache_id} no longer exists on {self.remote_engine}")

    def _remote_region(self, remote: RemoteCache) -> RemoteRegion:
        """The peer's registration of `remote` (from its cache description: untrusted), parsed once."""
        cached: RemoteRegion | None = remote.backend_state.get(NAME)
        if cached is not None:
            return cached
        raw = remote.backend_info.get(NAME)
        where = f"the peer's description of cache {remote.cache_id}"
        if raw is None:
            fail(LlmStatus.LLM_FEATURE_NOT_ENABLED, f"{where} has no hccl registration (its daemon does not serve "
                 "hccl for this cache)")
        try:
            info = json.loads(raw)
            if "error" in info:
                try:
                    status = LlmStatus(int(info["status"]))
                except (ValueError, TypeError, KeyError):
                    status = LlmStatus.LLM_FAILED
                if status == LlmStatus.LLM_SUCCESS:  # a peer's word, not ours: an error is never a success
                    status = LlmStatus.LLM_FAILED
                fail(status, f"the peer could not register cache {remote.cache_id} with HIXL: "
                     f"{str(info['error'])[:300]}")
            engine, epoch, addresses = info["engine"], info["epoch"], info["addresses"]
            live, token = info["live"], info["token"]
            if type(epoch) is not int or epoch < 0 or type(addresses) is not list or \
                    len(addresses) != remote.desc.num_tensors:
                raise ValueError("wrong epoch or address count")
            if type(live) is not int or not 0 < live <= 2**64 - 8 or type(token) is not int or \
                    not 0 < token < 2**64:
                raise ValueError("bad liveness word")
            limit = 2**64 - remote.desc.tensor_nbytes
            if not all(type(a) is int and 0 < a <= limit for a in addresses):
                raise ValueError("an address is out of range")
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            fail(LlmStatus.LLM_LINK_FAILED, f"{where} is unusable for hccl: {e}")
        if engine != self.remote_engine:
            fail(LlmStatus.LLM_LINK_FAILED, f"{where} names HIXL engine {str(engine)[:80]!r}, but the link is to "
                 f"{self.remote_engine}")
        region = RemoteRegion(engine, epoch, np.asarray(addresses, dtype=np.uint64), live, token)
        remote.backend_state[NAME] = region
        return region

    def _transfer(self, op: Any, descs: list[Any], local_epoch: int, remote_epoch: int, progress: Progress,
                  deadline: float) -> None:
        hixl = self._backend.hixl
        for attempt in (1, 2):
            self._acquire(local_epoch, remote_epoch, deadline)
            try:
                ret, req = self._backend.call(lambda e: e.transfer_async(self.remote_engine, op, descs))
                if ret == hixl.UNSUPPORTED:  # this build or path has no async transfers: one blocking call
                    ret = self._transfer_sync(op, descs, deadline)
                    if ret == hixl.SUCCESS:
                        return
                if ret == hixl.NOT_CONNECTED and attempt == 1:
                    # The link died under us (the peer restarted its engine, a heartbeat was lost): make it again once.
                    self._forget_link()
                    continue
                if ret != hixl.SUCCESS:
                    if ret == hixl.TIMEOUT:
                        self._drop_link()
                    fail(llm_status(hixl, ret), f"HIXL {_op_name(hixl, op)} with {self.remote_engine} refused: "
                         f"{hixl_name(hixl, ret)}{_hint(hixl, ret)}")
                self._wait(req, op, progress, deadline, self._generation)
                return
            finally:
                self._release()

    def _transfer_sync(self, op: Any, descs: list[Any], deadline: float) -> int:
        timeout_ms = int((deadline - time.monotonic()) * 1000)
        if timeout_ms < 1:
            fail(LlmStatus.LLM_TIMEOUT, "deadline passed before the HIXL transfer started")
        return int(self._backend.call(lambda e: e.transfer_sync(self.remote_engine, op, descs, timeout_ms)))

    def _wait(self, req: int, op: Any, progress: Progress, deadline: float, generation: int) -> None:
        """Polls the request until it ends; on our deadline or cancellation the link is dropped, which is HIXL's way
        to abandon a request (nothing lands after that, so the caller may release the memory)."""
        hixl = self._backend.hixl
        pause = _POLL_FIRST_S
        while True:
            ret, status = self._backend.call(lambda e: e.get_transfer_status(req))
            if ret != hixl.SUCCESS:
                if generation != self._generation:  # another transfer dropped the link, and our request with it
                    fail(LlmStatus.LLM_FAILED, f"HIXL {_op_name(hixl, op)} with {self.remote_engine} was abandoned "
                         "with its link (another transfer on it failed or timed out); retry")
                self._drop_link()
                fail(llm_status(hixl, ret), f"HIXL get_transfer_status on {self.remote_engine}: "
                     f"{hixl_name(hixl, ret)}")
            if status == hixl.TransferStatus.COMPLETED:
                return
            if status == hixl.TransferStatus.FAILED:
                self._drop_link()
                fail(LlmStatus.LLM_FAILED, f"HIXL {_op_name(hixl, op)} with {self.remote_engine} FAILED (peer memory "
                     "gone, or a device/NIC error; see the plog)")
            if status == hixl.TransferStatus.TIMEOUT:
                self._drop_link()
                fail(LlmStatus.LLM_TIMEOUT, f"HIXL {_op_name(hixl, op)} with {self.remote_engine} timed out")
            if progress.cancelled:
                self._drop_link()
                fail(LlmStatus.LLM_FAILED, "cancelled by the caller")
            now = time.monotonic()
            if now >= deadline:
                self._drop_link()
                fail(LlmStatus.LLM_TIMEOUT, f"deadline passed during the HIXL {_op_name(hixl, op)} with "
                     f"{self.remote_engine}")
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, _POLL_MAX_S)

    # -- the link ----------------------------------------------------------------------------------------------------
    def _acquire(self, local_epoch: int, remote_epoch: int, deadline: float) -> None:
        """Waits until the link sees both epochs, (re)making it if needed; transfers hold it while they run, and a
        remake waits for them to finish (a disconnect would abort them). Once a transfer waits for a remake, new
        transfers queue behind it, so a steady stream cannot keep the old link busy forever."""
        with self._cond:
            self._seen_remote_epoch = max(self._seen_remote_epoch, remote_epoch)
            queued = False
            try:
                while True:
                    if self._closed:
                        fail(LlmStatus.LLM_NOT_YET_LINK, "the link was closed")
                    link = self._link
                    current = link is not None and local_epoch <= link[0] and remote_epoch <= link[1]
                    if current and not self._remaking and (queued or self._remakes_queued == 0):
                        self._in_flight += 1
                        return
                    if not current and not queued:
                        queued = True
                        self._remakes_queued += 1
                    if not current and not self._remaking and self._in_flight == 0:
                        self._remaking = True
                        break
                    if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                        fail(LlmStatus.LLM_TIMEOUT, f"deadline passed waiting for the link to {self.remote_engine}")
            finally:
                if queued:
                    self._remakes_queued -= 1
                    self._cond.notify_all()
        made = False
        try:
            made = self._make_link(deadline)
        finally:
            with self._cond:
                self._remaking = False
                if made:
                    self._in_flight += 1
                self._cond.notify_all()

    def _release(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def _make_link(self, deadline: float) -> bool:
        """Connects (after disconnecting a stale link). `connect_async` keeps the engine thread free while the link
        is set up: other links' transfers and registrations (hence the event loop's describe_cache) never wait
        behind a slow or dead peer."""
        hixl = self._backend.hixl
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms < 1:
            fail(LlmStatus.LLM_TIMEOUT, f"deadline passed before linking to {self.remote_engine}")
        timeout_ms = min(remaining_ms, self._backend.settings.connect_timeout_ms)
        give_up = time.monotonic() + timeout_ms / 1000
        remote_epoch = self._seen_remote_epoch
        stale = self._link is not None

        def start(engine: Any) -> tuple[int, int, bool]:
            if stale:
                engine.disconnect(self.remote_engine, DISCONNECT_TIMEOUT_MS)
            epoch = self._backend.epoch  # exact: registrations run on this thread too
            # HIXL's own timeout on an asynchronous link is a little longer than ours: we give up (and disconnect)
            # first, so a link that is late is always our timeout, never a failure HIXL reports at the same moment.
            for connect, pending in ((engine.connect_async, True), (engine.connect, False)):
                limit = timeout_ms + (_ASYNC_LINK_GRACE_MS if pending else 0)
                ret = connect(self.remote_engine, limit)
                if ret == hixl.ALREADY_CONNECTED:  # a link made before this channel (an earlier one, not closed)
                    engine.disconnect(self.remote_engine, DISCONNECT_TIMEOUT_MS)
                    ret = connect(self.remote_engine, limit)
                if ret != hixl.UNSUPPORTED:  # else a build without asynchronous links: one bounded connect
                    return int(ret), epoch, pending
            return int(ret), epoch, False

        with self._cond:
            self._link = None
        ret, local_epoch, pending = self._backend.call(start)
        if ret == hixl.SUCCESS and pending:
            ret = self._await_link(give_up, deadline)
        if ret == hixl.TIMEOUT and remaining_ms <= self._backend.settings.connect_timeout_ms:
            fail(LlmStatus.LLM_TIMEOUT, f"deadline passed while linking to HIXL engine {self.remote_engine}")
        if ret != hixl.SUCCESS:
            fail(LlmStatus.LLM_LINK_FAILED, f"HIXL connect to {self.remote_engine} failed: {hixl_name(hixl, ret)} "
                 "(is the peer's engine up, its port open, hccn configured? see docs/ascend.md)")
        if stale:
            log.info("hccl: re-linked to %s (registrations since the last link)", self.remote_engine)
        with self._cond:
            self._link = (local_epoch, remote_epoch)
            self._generation += 1
        self.connects += 1
        return True

    def _await_link(self, give_up: float, deadline: float) -> int:
        """Polls an asynchronous connect; a HIXL status (TIMEOUT when we gave up, FAILED when HIXL did)."""
        hixl = self._backend.hixl
        pause = _POLL_FIRST_S
        while True:
            ret, status = self._backend.call(lambda e: e.get_async_connect_status(self.remote_engine))
            if ret != hixl.SUCCESS:
                return int(ret)
            if status == hixl.AsyncConnectStatus.CONNECTED:
                return int(hixl.SUCCESS)
            if status in (hixl.AsyncConnectStatus.CONNECT_FAILED, hixl.AsyncConnectStatus.NOT_CONNECT):
                log.warning("hccl: link to %s: %s", self.remote_engine, getattr(status, "name", status))
                return int(hixl.FAILED)
            now = time.monotonic()
            if now >= min(give_up, deadline):
                self._backend.call(lambda e: e.disconnect(self.remote_engine, DISCONNECT_TIMEOUT_MS))
                return int(hixl.TIMEOUT)
            time.sleep(min(pause, min(give_up, deadline) - now))
            pause = min(pause * 2, _LINK_POLL_MAX_S)

    def _forget_link(self) -> None:
        """The link is gone already: the next transfer makes a new one."""
        with self._cond:
            self._link = None
            self._generation += 1

    def _drop_link(self) -> None:
        """Disconnects (which abandons the link's requests); the next transfer makes a new link."""
        with self._cond:
            had, self._link = self._link is not None, None
            self._generation += 1
        if had and self._backend.serving:
            with contextlib.suppress(LlmError):  # the engine is shutting down: that ends the link too
                self._backend.call(lambda e: e.disconnect(self.remote_engine, DISCONNECT_TIMEOUT_MS))

    def mark_closed(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def disconnect_on_engine_thread(self, engine: Any) -> None:
        if self._link is not None:
            self._link = None
            engine.disconnect(self.remote_engine, DISCONNECT_TIMEOUT_MS)

    def close(self) -> None:
        self.mark_closed()
        self._drop_link()
        self._backend.forget_channel(self)


def _op_name(hixl: Any, op: Any) -> str:
    return "READ" if op == hixl.TransferOp.READ else "WRITE"


def _hint(hixl: Any, ret: int) -> str:
    if ret == hixl.PARAM_INVALID:
        return " (an address is not registered on one side: the peer may have dropped the cache)"
    if ret == hixl.NOT_CONNECTED:
        return " (the link to the peer's engine is gone)"
    return ""
