"""Pull sessions (`Client.open_pull_session`, `AsyncClient.open_pull_session`): one long-lived
KvBroker.PullKvBlocksSession stream that carries many pulls and their completions, with no call set-up per pull.

`submit` sends its pulls as one message (the daemon runs them as one step; pulls that name more block pairs in all
than the daemon takes per message, `MAX_PAIRS_PER_MESSAGE`, go as several) and returns one future per pull, which
ends with the pull's TransferResult or raises the LlmError that `pull_kv_blocks` would have raised (same status,
message, details and `failed_dst_blocks`). If the stream itself ends (the daemon stopped, the session was refused, or
the daemon ended it over a message it cannot answer pull by pull: LLM_PARAM_INVALID naming the bound), every pull
still pending fails with that error, and so does every later `submit`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

import grpc
import grpc.aio

from kvbroker import blockruns, tracecontext
from kvbroker import convert as cv
from kvbroker._errors import error_from_rpc, with_block_lists
from kvbroker.status import LlmError, LlmStatus, ParamInvalidError, make_error
from kvbroker.types import SessionPull, TransferResult
from kvbroker.v1 import broker_pb2

Metadata = tuple[tuple[str, str], ...]

MAX_PULLS_PER_SUBMIT = 256
"""The daemon's limit of pulls per message (a larger `submit` is refused before anything is sent)."""
MAX_PAIRS_PER_MESSAGE = blockruns.MAX_PAIRS
"""The daemon's default budget of block pairs per message (`--max-session-message-pairs`): a `submit` whose pulls
name more goes as several messages."""


def _add_pull(msg: broker_pb2.PullSessionRequest, pull: SessionPull, pull_id: int, default_timeout: float | None
              ) -> None:
    """Appends `pull` to `msg`, built in place (no message is built twice: this is every pull's cost)."""
    timeout = default_timeout if pull.timeout is None else pull.timeout
    if timeout is not None and timeout <= 0:
        raise ParamInvalidError(LlmStatus.LLM_PARAM_INVALID, f"timeout must be > 0 seconds, got {timeout}")
    timeout_ms = 0 if timeout is None else min(0xFFFFFFFF, max(1, int(timeout * 1000)))
    one = msg.pulls.add(id=pull_id, timeout_ms=timeout_ms)
    req = one.pull
    index = pull.src_cache_index
    req.src_cache_index.cluster_id = index.cluster_id
    req.src_cache_index.cache_id = index.cache_id
    req.src_cache_index.batch_index = index.batch_index
    req.dst_cache_id = int(pull.dst_cache)
    cv.set_block_pairs(req, pull.src_blocks, pull.dst_blocks, pull.block_runs)
    ext = cv.ext_param_to_pb(pull.ext_param)
    if ext is not None:
        req.ext_param.CopyFrom(ext)
    if pull.grant is not None:
        req.grant.grant.grant_id = pull.grant.grant_id
        req.grant.grant.secret = pull.grant.secret
        req.grant.cache_slot = pull.cache_slot
        req.grant.first_block = pull.first_block
    trace = tracecontext.current() if pull.trace_context is None else pull.trace_context
    if trace is not None:
        one.traceparent = trace.traceparent
        one.tracestate = trace.tracestate


def _pairs(pull: SessionPull) -> int:
    if pull.block_runs is not None:
        return pull.block_runs.num_pairs
    return max(len(pull.src_blocks), len(pull.dst_blocks))


def _messages(pulls: Sequence[SessionPull], ids: Iterator[int], default_timeout: float | None
              ) -> tuple[list[int], list[broker_pb2.PullSessionRequest]]:
    """The pulls' ids, and the pulls as messages within the daemon's budget of pairs (one, unless they name more)."""
    if not pulls:
        raise ParamInvalidError(LlmStatus.LLM_PARAM_INVALID, "submit needs at least one pull")
    if len(pulls) > MAX_PULLS_PER_SUBMIT:
        raise ParamInvalidError(LlmStatus.LLM_PARAM_INVALID, f"{len(pulls)} pulls in one submit; at most "
                                f"{MAX_PULLS_PER_SUBMIT}")
    messages = [broker_pb2.PullSessionRequest()]
    ids_used = []
    pairs = 0
    for p in pulls:
        n = _pairs(p)
        if messages[-1].pulls and pairs + n > MAX_PAIRS_PER_MESSAGE:
            messages.append(broker_pb2.PullSessionRequest())
            pairs = 0
        pairs += n
        ids_used.append(next(ids))
        _add_pull(messages[-1], p, ids_used[-1], default_timeout)
    return ids_used, messages


def outcome_of(c: broker_pb2.PullCompletion) -> TransferResult | LlmError:
    """A completion as `pull_kv_blocks` would have ended: its result, or the error it would have raised."""
    if c.status_code == LlmStatus.LLM_SUCCESS and c.status == LlmStatus.LLM_SUCCESS.name:
        return cv.transfer_result_from_pb(c.result)
    try:
        status = LlmStatus(c.status_code)
    except ValueError:
        status = LlmStatus.LLM_FAILED
    if status == LlmStatus.LLM_SUCCESS:  # a status name and code that disagree: not a success
        status = LlmStatus.LLM_FAILED
    details: dict[str, Any] = dict(c.metadata)
    if c.HasField("report"):
        details["transfer_report"] = with_block_lists(c.report)
    return make_error(status, c.message, details)


class _Future(Protocol):
    """What both kinds of future (concurrent.futures', asyncio's) offer the pending table."""

    def done(self) -> bool: ...

    def set_result(self, result: TransferResult, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


F = TypeVar("F", bound=_Future)


class _Pending(Generic[F]):
    """The pulls of one session awaiting their completions, and how the session ended: the core that the blocking and
    the asyncio session share (each brings its own kind of future and its own way of moving messages)."""

    def __init__(self, default_timeout: float | None, new_future: Callable[[], F]) -> None:
        self._default_timeout = default_timeout
        self._new_future = new_future
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the blocking session submits from any thread while its reader completes
        self._futures: dict[int, F] = {}
        self.ended: LlmError | None = None
        self.closing = False

    def submit(self, pulls: Sequence[SessionPull]) -> tuple[list[F], list[broker_pb2.PullSessionRequest]]:
        """The pulls' futures, registered, and the messages that carry them; raises if the session cannot take them
        (ended, closed, or pulls that fail the client's own checks: then nothing is registered)."""
        with self._lock:
            if self.ended is not None:
                raise make_error(self.ended.status, self.ended.message, self.ended.details)
            if self.closing:
                raise LlmError(LlmStatus.LLM_FAILED, "the pull session is closed")
            ids, messages = _messages(pulls, self._ids, self._default_timeout)
            futures = [self._new_future() for _ in ids]
            self._futures.update(zip(ids, futures, strict=True))
        return futures, messages

    def complete(self, resp: broker_pb2.PullSessionResponse) -> None:
        for c in resp.completions:
            with self._lock:
                fut = self._futures.pop(c.id, None)
            if fut is None or fut.done():
                continue  # not ours (a daemon never sends one; a wrong id must not break the others)
            outcome = outcome_of(c)
            if isinstance(outcome, LlmError):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

    def end(self, error: LlmError) -> None:
        """The stream ended: every pull still pending, and every later submit, fails with `error`."""
        with self._lock:
            self.ended = error
            pending, self._futures = self._futures, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(make_error(error.status, error.message, error.details))


_ENDED_IN_FLIGHT = "the pull session ended with pulls in flight"


class PullSession:
    """A blocking client's pull session: `submit` from any thread; completions arrive on a reader thread."""

    def __init__(self, stub: Any, metadata: Metadata, default_timeout: float | None, timeout: float | None) -> None:
        self._pending = _Pending(default_timeout, concurrent.futures.Future[TransferResult])
        self._sending = threading.Lock()  # a submit's messages go before close's end of the stream, or not at all
        self._requests: queue.SimpleQueue[broker_pb2.PullSessionRequest | None] = queue.SimpleQueue()
        self._call = stub.PullKvBlocksSession(self._outgoing(), metadata=metadata, timeout=timeout)
        self._reader = threading.Thread(target=self._read, name="kvbroker-pull-session", daemon=True)
        self._reader.start()

    def _outgoing(self) -> Iterator[broker_pb2.PullSessionRequest]:
        while (msg := self._requests.get()) is not None:
            yield msg

    def submit(self, pulls: Sequence[SessionPull]) -> list[concurrent.futures.Future[TransferResult]]:
        """Sends `pulls` as one message (the daemon runs them as one step; as several if they name more than
        `MAX_PAIRS_PER_MESSAGE` block pairs in all).

        Args:
            pulls: 1..256 pulls, each with its own deadline (`SessionPull.timeout`).

        Returns:
            One future per pull, in order: its TransferResult, or the LlmError `pull_kv_blocks` would raise.

        Raises:
            ParamInvalidError: no pulls, too many, or a timeout that is not > 0 (nothing was sent).
            LlmError: the session has ended (closed, or the stream failed: its error).
        """
        with self._sending:
            futures, messages = self._pending.submit(pulls)
            for msg in messages:
                self._requests.put(msg)
        return futures

    def _read(self) -> None:
        error = LlmError(LlmStatus.LLM_FAILED, _ENDED_IN_FLIGHT)
        try:
            for resp in self._call:
                self._pending.complete(resp)
        except grpc.RpcError as err:
            error = error_from_rpc(err)
        self._pending.end(error)
        self._requests.put(None)  # gRPC's thread that sends our messages stops waiting for more

    def close(self, wait: float | None = None) -> None:
        """Stops submitting; the daemon finishes the pulls in flight. Idempotent.

        Args:
            wait: seconds to wait for their completions (None: until the daemon ends the stream, which it does once
                every pull has completed, each within its deadline); then the stream is cancelled, and pulls still
                pending fail.

        Returns:
            None.

        Raises:
            LlmError: never; failures reach the futures.
        """
        with self._sending:
            if not self._pending.closing:
                self._pending.closing = True
                self._requests.put(None)
        self._reader.join(wait)
        if self._reader.is_alive():
            self._call.cancel()
            self._reader.join()

    def __enter__(self) -> PullSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncPullSession:
    """An asyncio client's pull session: `await submit(...)` returns futures of this loop."""

    def __init__(self, call: Any, default_timeout: float | None) -> None:
        self._call = call
        self._pending = _Pending(default_timeout, asyncio.get_running_loop().create_future)
        self._reader = asyncio.ensure_future(self._read())

    async def submit(self, pulls: Sequence[SessionPull]) -> list[asyncio.Future[TransferResult]]:
        """Sends `pulls` as one message (the daemon runs them as one step; as several if they name more than
        `MAX_PAIRS_PER_MESSAGE` block pairs in all).

        Args:
            pulls: 1..256 pulls, each with its own deadline (`SessionPull.timeout`).

        Returns:
            One future per pull, in order: its TransferResult, or the LlmError `pull_kv_blocks` would raise.

        Raises:
            ParamInvalidError: no pulls, too many, or a timeout that is not > 0 (nothing was sent).
            LlmError: the session has ended (closed, or the stream failed: its error).
        """
        futures, messages = self._pending.submit(pulls)
        try:
            for msg in messages:
                await self._call.write(msg)
        except (grpc.RpcError, asyncio.InvalidStateError) as err:
            # The stream ended: the reader fails every pending pull (these too) with its status.
            await asyncio.wait({self._reader})
            if isinstance(err, grpc.RpcError) and self._pending.ended is None:
                raise error_from_rpc(err) from None
        return futures

    async def _read(self) -> None:
        error = LlmError(LlmStatus.LLM_FAILED, _ENDED_IN_FLIGHT)
        try:
            async for resp in _responses(self._call):
                self._pending.complete(resp)
        except grpc.RpcError as err:
            error = error_from_rpc(err)
        except asyncio.CancelledError:
            error = LlmError(LlmStatus.LLM_FAILED, "the pull session was cancelled")
        self._pending.end(error)

    async def close(self, wait: float | None = None) -> None:
        """Stops submitting; the daemon finishes the pulls in flight. Idempotent.

        Args:
            wait: seconds to wait for their completions (None: until the daemon ends the stream, which it does once
                every pull has completed, each within its deadline); then the stream is cancelled, and pulls still
                pending fail.

        Returns:
            None.

        Raises:
            LlmError: never; failures reach the futures.
        """
        if not self._pending.closing:
            self._pending.closing = True
            if self._pending.ended is None:
                with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):  # ended: the reader says how
                    await self._call.done_writing()
        done, _ = await asyncio.wait({self._reader}, timeout=wait)
        if not done:
            self._call.cancel()
            await asyncio.wait({self._reader})

    async def __aenter__(self) -> AsyncPullSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _responses(call: Any) -> AsyncIterator[broker_pb2.PullSessionResponse]:
    while True:
        msg = await call.read()
        if msg is grpc.aio.EOF:
            return
        yield msg
