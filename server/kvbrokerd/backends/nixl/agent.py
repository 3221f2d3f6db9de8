"""The NIXL agent of the `nixl` backend, confined to one thread, and what kvbroker needs to know about NIXL 1.5.1.

A NIXL agent created without a listener thread runs unsynchronised (NIXL_THREAD_SYNC_NONE): it is not thread-safe.
So every call goes through `AgentThread`, in order, on one thread, which also polls the transfers in flight between
commands. A transfer's waiter gets its outcome only once NIXL no longer touches its memory: a transfer past its
deadline (or cancelled by its caller) is aborted first, and one that NIXL cannot abort is polled until it ends, so
the caches it reads or writes stay pinned meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import importlib
import importlib.util
import logging
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from kvbroker.status import LlmError, make_error
from kvbrokerd.errors import LlmStatus

log = logging.getLogger(__name__)

_T = TypeVar("_T")

IMPLEMENTATIONS = ("nixl_cu12", "nixl_cu13")
"""NIXL's wheels, tried in this order. Imported directly: the `nixl` meta package may import torch (seconds, and
hundreds of MiB) only to pick a CUDA flavour, which host memory does not need."""

# Completion polls back off from busy polling to this interval while nothing completes: a same-host (CMA) transfer
# mostly completes inside `transfer()`, while over TCP a busy poll would starve UCX's own progress threads.
_MIN_POLL_S = 20e-6
_MAX_POLL_S = 1e-3
_STUCK_LOG_EVERY_S = 10.0

_STATUS_BY_ERROR = {
    "nixlRemoteDisconnectError": LlmStatus.LLM_LINK_FAILED,
    "nixlBackendError": LlmStatus.LLM_LINK_FAILED,
    "nixlUnknownError": LlmStatus.LLM_LINK_FAILED,
    "nixlInvalidParamError": LlmStatus.LLM_PARAM_INVALID,
    "nixlMismatchError": LlmStatus.LLM_PARAM_INVALID,
    "nixlNotFoundError": LlmStatus.LLM_KV_CACHE_NOT_EXIST,
    "nixlNotSupportedError": LlmStatus.LLM_FEATURE_NOT_ENABLED,
    "nixlCancelledError": LlmStatus.LLM_FAILED,
}
"""NIXL's exceptions (nixl._bindings) by name; anything else NIXL raises (NotAllowed, RepostActive, NotPosted: misuse
of the API) is LLM_FAILED."""


def api_installed() -> str | None:
    """The name of an installed NIXL implementation, found without loading it: its native libraries (UCX and
    friends) must only ever be loaded by a daemon that runs the backend (loaded into a process that later imports
    grpc_tools, they crash it)."""
    for name in IMPLEMENTATIONS:
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec(name) is not None:
                return name
    return None


def load_api() -> ModuleType:
    """NIXL's Python API module (`nixl_cuXX._api`); ImportError saying what was tried."""
    errors = []
    for name in IMPLEMENTATIONS:
        raise_exceptions = logging.raiseExceptions
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        finally:
            logging.raiseExceptions = raise_exceptions  # NIXL's logging set-up turns it off process-wide
        adopt_logging()
        return api
    raise ImportError("; ".join(errors))


def adopt_logging() -> None:
    """NIXL gives its Python logger its own stdout handler and format at INFO: route its records through the
    daemon's handlers instead (JSON logs stay JSON), warnings and up. (NIXL's and UCX's C++ logs go to stderr.)"""
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    nixl_log.setLevel(logging.WARNING)


def is_nixl_error(e: BaseException) -> bool:
    return type(e).__name__.startswith("nixl") and type(e).__name__.endswith("Error")


def llm_error(e: BaseException, what: str, status: LlmStatus | None = None) -> LlmError:
    """The LlmError for NIXL exception `e` raised while doing `what`."""
    kind = type(e).__name__
    code = status or _STATUS_BY_ERROR.get(kind, LlmStatus.LLM_FAILED)
    return make_error(code, f"{what}: NIXL {kind}: {e}", {"backend": "nixl", "nixl_error": kind})


_MD_PREFIX = b"nixlSerDes|Agent"
_MD_LENGTH = struct.Struct("<Q")
MAX_AGENT_NAME = 128


def agent_name_of(metadata: bytes) -> str:
    """The agent name inside NIXL metadata (full or partial), read WITHOUT loading it (NIXL merges what it loads into
    the agent of that name, so a name is checked first); ValueError when the bytes are not NIXL 1.5 metadata."""
    start = len(_MD_PREFIX) + _MD_LENGTH.size
    if not metadata.startswith(_MD_PREFIX) or len(metadata) < start:
        raise ValueError("not NIXL agent metadata")
    (length,) = _MD_LENGTH.unpack_from(metadata, len(_MD_PREFIX))
    if not 0 < length <= MAX_AGENT_NAME or metadata[start + length : start + length + 1] != b"|":
        raise ValueError("NIXL metadata with an unreadable agent name")
    return metadata[start : start + length].decode("ascii", errors="strict")


@dataclass(eq=False)
class _Transfer:
    handle: Any
    deadline: float
    cancelled: Callable[[], bool]
    done: concurrent.futures.Future[None]
    what: str
    on_end: Callable[[Any, BaseException | None], None]
    stop: LlmError | None = None
    """Why we asked NIXL to abort it (deadline, caller) while it still ran."""
    stuck_since: float = 0.0


class AgentThread:
    """Owns one NIXL agent: `call` runs a function on it, `transfer` runs a transfer to its end; both from any
    thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[Any], Any], concurrent.futures.Future[Any]] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="kvbroker-nixl", daemon=True)
        self._agent: Any = None
        self._transfers: list[_Transfer] = []
        self._closed = False
        self._closing = threading.Lock()  # no command is queued after the stop sentinel

    def start(self, make_agent: Callable[[], Any]) -> None:
        """Starts the thread and creates the agent on it (errors propagate)."""
        self._thread.start()
        self._agent = self.call(lambda _: make_agent())

    def call(self, fn: Callable[[Any], _T]) -> _T:
        """fn(agent) on the agent thread; returns its result or raises its exception."""
        return self.submit(fn).result()

    def submit(self, fn: Callable[[Any], _T]) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        with self._closing:
            if self._closed:
                future.set_exception(make_error(LlmStatus.LLM_FAILED, "the nixl backend is closed"))
                return future
            self._queue.put((fn, future))
        return future

    def transfer(self, post: Callable[[Any], Any], deadline: float, cancelled: Callable[[], bool], what: str,
                 on_end: Callable[[Any, BaseException | None], None] = lambda _, __: None) -> None:
        """Makes a transfer with post(agent) (it returns the NIXL handle), posts it and waits until it ends: returns
        when it is DONE, raises LlmError otherwise. on_end(agent, error) runs on the agent thread once NIXL is done
        with it (whether or not post succeeded)."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def start(agent: Any) -> None:
            try:
                handle = post(agent)
            except BaseException as e:
                error = llm_error(e, what) if is_nixl_error(e) else e
                on_end(agent, error)
                done.set_exception(error)
                return
            t = _Transfer(handle, deadline, cancelled, done, what, on_end)
            try:
                state = agent.transfer(handle)
            except Exception as e:
                self._end(t, llm_error(e, what) if is_nixl_error(e) else e)
                return
            if state == "DONE":
                self._end(t, None)
            elif state == "PROC":
                self._transfers.append(t)
            else:
                self._end(t, make_error(LlmStatus.LLM_LINK_FAILED, f"{what}: NIXL could not post the transfer"))

        posted = self.submit(start)
        posted.result()  # only fails when the thread is closed
        done.result()

    def close(self, teardown: Callable[[Any], None]) -> None:
        """Fails what is in flight, runs teardown(agent), destroys the agent and stops the thread; idempotent."""
        if self._closed or not self._thread.is_alive():
            self._closed = True
            return
        try:
            self.call(lambda agent: self._shutdown(agent, teardown))
        finally:
            with self._closing:
                self._closed = True
                self._queue.put(None)
            self._thread.join(timeout=10)

    # -- on the agent thread ------------------------------------------------------------------------------------------
    def _main(self) -> None:
        wait = _MIN_POLL_S
        while True:
            try:
                item = self._queue.get(timeout=wait) if self._transfers else self._queue.get()
            except queue.Empty:
                item = None
            else:
                if item is None:
                    # The agent dies here, on its thread, before interpreter exit: UCX torn down by the interpreter's
                    # final collection can crash the process (exit status 139).
                    self._agent = None
                    gc.collect()
                    return
                fn, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self._agent))
                    except BaseException as e:
                        future.set_exception(e)
                wait = _MIN_POLL_S
            if self._transfers:
                wait = _MIN_POLL_S if self._poll() else min(wait * 2, _MAX_POLL_S)

    def _poll(self) -> bool:
        """One completion check of every transfer in flight; True when one ended."""
        ended = False
        now = time.monotonic()
        for t in list(self._transfers):
            try:
                state = self._agent.check_xfer_state(t.handle)
            except Exception as e:
                self._end(t, t.stop or (llm_error(e, t.what) if is_nixl_error(e) else e))
                ended = True
                continue
            if state == "DONE":
                self._end(t, t.stop)
            elif state != "PROC":
                self._end(t, t.stop or make_error(LlmStatus.LLM_LINK_FAILED, f"{t.what}: the transfer failed"))
            elif t.stop is None and (now > t.deadline or t.cancelled()):
                t.stop = (make_error(LlmStatus.LLM_FAILED, "cancelled by the caller") if t.cancelled() else
                          make_error(LlmStatus.LLM_TIMEOUT, f"{t.what}: deadline passed during the NIXL transfer"))
                self._abort(t)
                continue
            elif t.stop is not None and now - t.stuck_since > _STUCK_LOG_EVERY_S:
                t.stuck_since = now
                log.warning("%s: NIXL cannot abort the transfer; its caches stay pinned until it ends", t.what)
                continue
            else:
                continue
            ended = True
        return ended

    def _abort(self, t: _Transfer) -> None:
        """Releasing a transfer in progress asks NIXL to abort it; only a successful release frees its memory."""
        try:
            t.handle.release()
        except Exception as e:
            t.stuck_since = time.monotonic()
            log.warning("%s: NIXL could not abort the transfer yet (%s); polling it to its end", t.what, e)
            return
        self._transfers.remove(t)
        self._settle(t, t.stop)

    def _end(self, t: _Transfer, error: BaseException | None) -> None:
        with contextlib.suppress(ValueError):
            self._transfers.remove(t)
        try:
            t.handle.release()
        except Exception as e:  # NIXL keeps it on its leak list and frees it with the agent
            log.warning("%s: releasing the NIXL transfer handle failed: %s", t.what, e)
        self._settle(t, error)

    def _settle(self, t: _Transfer, error: BaseException | None) -> None:
        try:
            t.on_end(self._agent, error)
        except Exception:
            log.exception("%s: clean-up after the transfer failed", t.what)
        if error is None:
            t.done.set_result(None)
        else:
            t.done.set_exception(error)

    def _shutdown(self, agent: Any, teardown: Callable[[Any], None]) -> None:
        stopping = make_error(LlmStatus.LLM_FAILED, "the daemon is stopping")
        for t in list(self._transfers):
            t.stop = stopping
            self._abort(t)
        for t in list(self._transfers):  # NIXL could not abort these: the agent goes anyway, the process is ending
            self._transfers.remove(t)
            self._settle(t, stopping)
        teardown(agent)
