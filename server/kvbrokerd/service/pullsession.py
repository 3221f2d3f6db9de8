"""`KvBroker.PullKvBlocksSession`: a long-lived stream of pulls and their completions (a decode engine worker's hot
path), without a call's set-up, metadata and trailers per pull.

Every pull of a message is checked as PullKvBlocks checks it and gets exactly one completion with its id: the
status, message, ErrorInfo metadata and TransferReport that PullKvBlocks would have ended with. The pulls of one
message run as one step (transfers/steps.py). When the caller half-closes, the session finishes the pulls in flight,
sends their completions and ends; when the caller goes away, they are cancelled (as a cancelled PullKvBlocks is).

Everything a caller sends is bounded before it is expanded or queued: a message of more than
`MAX_SESSION_PULLS_PER_MESSAGE` pulls ends the stream once (LLM_PARAM_INVALID), before any of its pulls is looked at;
a message whose pulls name more block pairs than the daemon's `max_session_message_pairs` has each pull refused,
counted from the runs' sizes before any pair is written out. A pull holds a place of the session's
`MAX_SESSION_PULLS_IN_FLIGHT` from its start until its completion is handed to gRPC, so refusals count too; and while
`MAX_SESSION_PULLS_IN_FLIGHT` completions wait for a caller that does not read them, no further message is read (its
sends then wait on flow control). `MAX_PULL_SESSIONS` sessions per daemon.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable

from kvbroker import blockruns
from kvbroker.status import LlmStatus
from kvbroker.tracecontext import TraceContext
from kvbroker.types import TransferResult
from kvbroker.v1 import broker_pb2
from kvbrokerd import tracing
from kvbrokerd.errors import LlmError
from kvbrokerd.limits import DEFAULT_SESSION_MESSAGE_PAIRS
from kvbrokerd.service.errors import report_to_pb
from kvbrokerd.transfers.manager import TransferManager
from kvbrokerd.transfers.reports import TransferReport
from kvbrokerd.transfers.requests import BlocksRequest
from kvbrokerd.transfers.steps import Outcome, StepPull, start_step

log = logging.getLogger(__name__)

MAX_SESSION_PULLS_PER_MESSAGE = 256
"""Pulls in one PullSessionRequest (an engine step's loads); a message with more ends the stream (LLM_PARAM_INVALID)."""
MAX_SESSION_PULLS_IN_FLIGHT = 1024
"""Pulls of one session whose completion has not been handed to gRPC yet; a pull past it is refused
(LLM_OUT_OF_MEMORY). As many completions waiting for the caller stop the reading of its messages."""
MAX_COMPLETIONS_PER_RESPONSE = 256
"""Completions sent as one PullSessionResponse (those ready together)."""
MAX_PULL_SESSIONS = 64
"""Open PullKvBlocksSession streams per daemon (an engine opens one per worker); the next is refused at its start."""


class PullSession:
    """One PullKvBlocksSession stream: reads pulls, starts each message's as one step, streams completions."""

    def __init__(self, transfers: TransferManager, parse: Callable[[broker_pb2.PullKvBlocksRequest], BlocksRequest],
                 stream_timeout: float | None, max_message_pairs: int = DEFAULT_SESSION_MESSAGE_PAIRS,
                 stream_trace: TraceContext | None = None) -> None:
        """`stream_trace`: the trace context of the stream's metadata (tracing on), for pulls that carry none."""
        self._transfers = transfers
        self._stream_trace = stream_trace
        self._parse = parse
        self._stream_timeout = stream_timeout
        self._max_message_pairs = max_message_pairs
        self._in_flight: dict[int, asyncio.Future[Outcome]] = {}
        self._out: asyncio.Queue[broker_pb2.PullCompletion | None] = asyncio.Queue()
        self._unsent = 0
        """Completions queued and not yet handed to gRPC."""
        self._taken = asyncio.Event()
        """Set when completions leave the queue: a reader held back may read again."""
        self._failed: LlmError | None = None
        """Why the stream ends with an error (a message over the limit), sent instead of what is queued."""
        self._reading = True

    async def serve(self, requests: AsyncIterator[broker_pb2.PullSessionRequest]
                    ) -> AsyncIterator[broker_pb2.PullSessionResponse]:
        """The completions, as they come. Raises the LlmError that ends the stream, if the caller broke a bound
        that a completion cannot answer."""
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                first = await self._out.get()
                if self._failed is not None:
                    raise self._failed
                if first is None:
                    break
                batch = [first]
                # Completions that are ready together go as one message.
                while not self._out.empty() and len(batch) < MAX_COMPLETIONS_PER_RESPONSE:
                    more = self._out.get_nowait()
                    if more is None:
                        self._out.put_nowait(None)
                        break
                    batch.append(more)
                self._unsent -= len(batch)
                self._taken.set()
                yield broker_pb2.PullSessionResponse(completions=batch)
        finally:
            reader.cancel()
            for fut in list(self._in_flight.values()):
                fut.cancel()

    async def _read(self, requests: AsyncIterator[broker_pb2.PullSessionRequest]) -> None:
        try:
            async for msg in requests:
                if len(msg.pulls) > MAX_SESSION_PULLS_PER_MESSAGE:
                    self._fail(LlmError(LlmStatus.LLM_PARAM_INVALID, f"a message of {len(msg.pulls)} pulls; at most "
                                        f"{MAX_SESSION_PULLS_PER_MESSAGE} per message: the session ends, its pulls in "
                                        "flight are cancelled"))
                    return
                self._start(msg)
                del msg  # not held while we wait
                while self._unsent >= MAX_SESSION_PULLS_IN_FLIGHT:  # the caller does not read: nor do we
                    self._taken.clear()
                    await self._taken.wait()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the caller's side broke: the pulls in flight still complete
            log.info("pull session: reading ended: %s", e)
        self._reading = False
        self._maybe_end()

    def _fail(self, err: LlmError) -> None:
        self._failed = err
        self._out.put_nowait(None)

    def _maybe_end(self) -> None:
        if not self._reading and not self._in_flight:
            self._out.put_nowait(None)

    def _complete(self, completion: broker_pb2.PullCompletion) -> None:
        self._unsent += 1
        self._out.put_nowait(completion)

    def _refuse(self, pull_id: int, status: LlmStatus, message: str) -> None:
        self._complete(completion_of(pull_id, LlmError(status, message)))

    def _start(self, msg: broker_pb2.PullSessionRequest) -> None:
        # A pull over the bound of one request is refused alone (as PullKvBlocks refuses it), never written out.
        pairs = sum(n for p in msg.pulls if p.HasField("pull") and (n := pairs_named(p.pull)) <= blockruns.MAX_PAIRS)
        if pairs > self._max_message_pairs:
            for p in msg.pulls:
                self._refuse(p.id, LlmStatus.LLM_PARAM_INVALID, f"the pulls of this message name {pairs} block "
                             f"pairs; at most {self._max_message_pairs} per message: send them as several")
            return
        ids: list[int] = []
        seen: set[int] = set()
        pulls: list[StepPull] = []
        for p in msg.pulls:
            if p.id in self._in_flight or p.id in seen:
                self._refuse(p.id, LlmStatus.LLM_PARAM_INVALID, f"pull id {p.id} is already in flight on this session")
                continue
            if len(self._in_flight) + self._unsent + len(ids) >= MAX_SESSION_PULLS_IN_FLIGHT:
                self._refuse(p.id, LlmStatus.LLM_OUT_OF_MEMORY, f"{MAX_SESSION_PULLS_IN_FLIGHT} pulls in flight on "
                             "this session (at most); retry when some have completed")
                continue
            if not p.HasField("pull"):
                self._refuse(p.id, LlmStatus.LLM_PARAM_INVALID, f"pull {p.id} has no pull request")
                continue
            try:
                request = self._parse(p.pull)
            except LlmError as e:
                self._complete(completion_of(p.id, e))
                continue
            ids.append(p.id)
            seen.add(p.id)
            trace = None
            if tracing.tracer is not None:
                trace = TraceContext.parse(p.traceparent, p.tracestate) if p.traceparent else self._stream_trace
            pulls.append(StepPull(request, self._timeout(p.timeout_ms), trace))
        for pull_id, fut in zip(ids, start_step(self._transfers, pulls), strict=True):
            self._in_flight[pull_id] = fut
            fut.add_done_callback(functools.partial(self._done, pull_id))

    def _timeout(self, timeout_ms: int) -> float | None:
        """The pull's own timeout, within the stream's deadline (if the caller gave the stream one)."""
        own = timeout_ms / 1000 if timeout_ms else None
        if self._stream_timeout is None:
            return own
        return self._stream_timeout if own is None else min(own, self._stream_timeout)

    def _done(self, pull_id: int, task: asyncio.Future[Outcome]) -> None:
        if self._in_flight.get(pull_id) is task:
            del self._in_flight[pull_id]
        if task.cancelled():
            return  # the session is ending: no one reads completions any more
        exc = task.exception()
        if exc is None:
            self._complete(completion_of(pull_id, *task.result()))
        elif isinstance(exc, LlmError):
            self._complete(completion_of(pull_id, exc))
        else:
            log.error("pull session: pull %d failed", pull_id, exc_info=exc)
            self._complete(completion_of(
                pull_id, LlmError(LlmStatus.LLM_FAILED, f"internal error: {type(exc).__name__}: {exc}")))
        self._maybe_end()


def pairs_named(pull: broker_pb2.PullKvBlocksRequest) -> int:
    """The block pairs a pull names, from the sizes of its lists or runs (nothing written out, nothing checked)."""
    if pull.HasField("block_runs"):
        runs = pull.block_runs
        return blockruns.pairs_named(runs.length, runs.count)
    return max(len(pull.src_blocks), len(pull.dst_blocks))


def completion_of(pull_id: int, outcome: TransferResult | LlmError, job_id: str = "") -> broker_pb2.PullCompletion:
    """A pull's completion: what PullKvBlocks would have answered (and, in `metadata["job"]`, the id of the job that
    moved its bytes), or the status and details it would have failed with (the ErrorInfo metadata and the
    TransferReport with its block lists)."""
    if isinstance(outcome, TransferResult):
        status = LlmStatus.LLM_SUCCESS
        return broker_pb2.PullCompletion(
            id=pull_id, status=status.name, status_code=int(status), metadata={"job": job_id},
            result=broker_pb2.PullKvBlocksResponse(bytes_moved=outcome.bytes_moved, backend=outcome.backend,
                                                   transfer_id=outcome.transfer_id, num_runs=outcome.num_runs))
    err = outcome
    metadata = {k: str(v) for k, v in err.details.items() if isinstance(v, str | int | float)}
    metadata["status_code"] = str(int(err.status))
    msg = broker_pb2.PullCompletion(id=pull_id, status=err.status.name, status_code=int(err.status),
                                    message=err.message, metadata=metadata)
    report = err.details.get("transfer_report")
    if isinstance(report, TransferReport):
        msg.report.CopyFrom(report_to_pb(report))
    return msg
