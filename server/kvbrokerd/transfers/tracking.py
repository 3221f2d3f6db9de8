"""A transfer's deadline and its record from arrival to its terminal state: id, log context and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvbroker.tracecontext import TraceContext
from kvbrokerd import tracing
from kvbrokerd.errors import LlmError
from kvbrokerd.logs import LOG_CONTEXT
from kvbrokerd.metrics import Metrics
from kvbrokerd.transfers.reports import TransferReport

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 60.0
REPLY_MARGIN_S = 0.05
MAX_REPLY_MARGIN_S = 0.25


class Deadline:
    """The caller's deadline, minus a margin so that the caller gets our report instead of a bare timeout.

    It travels with the request through every stage, and so carries the request's span too (`span`: None unless
    tracing is on; the stages put theirs under it, tracing.stage)."""

    span: Span | None = None

    def __init__(self, timeout: float | None) -> None:
        budget = DEFAULT_DEADLINE_S if timeout is None else timeout
        # 10% of the budget (50-250 ms): on a loaded host a reply sent 50 ms early can still miss a 1 s deadline.
        margin = min(MAX_REPLY_MARGIN_S, max(REPLY_MARGIN_S, budget * 0.1), budget * 0.2)
        self.at = time.monotonic() + budget - margin
        self._when_over: list[Callable[[], None]] = []

    def remaining(self) -> float:
        return max(0.001, self.at - time.monotonic())

    def when_over(self, callback: Callable[[], None]) -> None:
        """Calls `callback` when the request that has this deadline is over (`over`)."""
        self._when_over.append(callback)

    def over(self) -> None:
        """The request reached its terminal state: whatever waited for its end is told (once)."""
        callbacks, self._when_over = self._when_over, []
        for callback in callbacks:
            callback()


# Transfer ids: a random per-process prefix and a counter, 12 hex digits for the first 16M transfers and longer
# after (cheaper than a uuid per request; never repeated within a daemon's life, and distinct across daemons and
# restarts as far as logs need).
_ID_PREFIX = secrets.token_hex(3)
_ID_COUNTER = itertools.count(1)


class Tracked:
    """One transfer request from arrival to its terminal state: its id and log context (every log line of the
    transfer carries them, threads included), and its metrics (outcome, bytes, queue and wire time)."""

    def __init__(self, metrics: Metrics | None, op: str, peer: str, deadline: Deadline,
                 trace_context: TraceContext | None = None) -> None:
        """`trace_context`: the caller's, where it came with the request itself (a session's pull) rather than with
        the call (then the current span, its RPC's, is the parent)."""
        self.id = f"{_ID_PREFIX}{next(_ID_COUNTER):06x}"
        self.op, self.peer, self.deadline = op, peer, deadline
        self.backend = "none"
        self.moved = 0
        self._metrics = metrics
        self._arrived = time.monotonic()
        self._wire_started: float | None = None
        self._token: contextvars.Token[Mapping[str, str]] | None = None
        if tracing.tracer is not None:
            deadline.span = tracing.transfer_span(op, peer, trace_context)

    def started(self, backend: str) -> None:
        """Validation and planning are over: data starts to move over `backend`."""
        self.backend = backend
        self._wire_started = time.monotonic()
        LOG_CONTEXT.set({**LOG_CONTEXT.get(), "backend": self.backend})

    def __enter__(self) -> Tracked:
        self._token = LOG_CONTEXT.set({"transfer": self.id, "op": self.op, "peer": self.peer})
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.deadline.over()
        if isinstance(exc, LlmError):
            outcome = exc.status.name
            report = exc.details.get("transfer_report")
            self.moved = report.bytes_moved if isinstance(report, TransferReport) else self.moved
            exc.details.setdefault("transfer_id", self.id)
        elif exc is not None:
            outcome = "CANCELLED" if isinstance(exc, asyncio.CancelledError | GeneratorExit) else "LLM_FAILED"
        else:
            outcome = "DONE"
        now = time.monotonic()
        wire_started = self._wire_started or now
        span = self.deadline.span
        if self._metrics is not None:
            self._metrics.observe(self.op, self.backend, self.peer, outcome, self.moved,
                                  wire_started - self._arrived, now - wire_started,
                                  None if span is None else tracing.sampled_trace_id(span))
        if span is not None:
            tracing.end_transfer(span, self.id, self.backend, self.moved, outcome)
        if outcome not in ("DONE", "LLM_PARAM_INVALID", "LLM_KV_CACHE_NOT_EXIST", "LLM_NOT_YET_LINK"):
            log.info("ended %s after %.1f ms (%d bytes moved)", outcome, (now - self._arrived) * 1e3, self.moved)
        if self._token is not None:
            with contextlib.suppress(ValueError):  # an async generator closed from another context
                LOG_CONTEXT.reset(self._token)
