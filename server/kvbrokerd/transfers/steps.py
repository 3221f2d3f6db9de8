"""A step of pulls: pulls that arrived together (one PullKvBlocksSession message, e.g. one engine step's loads), each
with its own deadline and its own terminal state, run with as little per-pull work as the bytes allow.

Per pull, only what is the pull's own: its record (`Tracked`: id, metrics) and its outcome. The pulls to one peer
pass the pipeline together (pipeline.py: those that name the same caches, layers and timeout become one job: one turn
at the gate, one claim, one pin, one data-plane job; over shm, so do those from several of the peer's caches into one
cache that write apart); a dead peer's pulls wait only for each other, never for the other
peers'. If a job fails, every pull of it fails with its status and a report of its own blocks that did not land.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbroker.status import make_error
from kvbroker.tracecontext import TraceContext
from kvbroker.types import TransferResult
from kvbrokerd.errors import LlmError
from kvbrokerd.logs import LOG_CONTEXT
from kvbrokerd.transfers.manager import TransferManager
from kvbrokerd.transfers.pipeline import Transfer
from kvbrokerd.transfers.reports import TransferReport
from kvbrokerd.transfers.requests import BlocksRequest, Direction, Job
from kvbrokerd.transfers.tracking import Deadline, Tracked

Outcome = tuple[TransferResult, str]
"""A pull's result and the id of the job that moved its bytes (shared by the pulls that ran together)."""

_running: set[asyncio.Task[None]] = set()
"""Steps in progress (kept referenced until they end)."""


@dataclass(frozen=True, slots=True)
class StepPull:
    """One pull of a step and its own timeout (seconds; None: the default deadline)."""

    request: BlocksRequest
    timeout: float | None
    trace_context: TraceContext | None = None
    """The trace of the request the pull serves (tracing on), which its span continues."""


@dataclass(eq=False)
class _Member:
    """A pull of the step on its way to its terminal state."""

    pull: StepPull
    tracked: Tracked
    future: asyncio.Future[Outcome]
    transfer: Transfer
    ended: bool = False

    @property
    def num_pairs(self) -> int:
        return self.transfer.request.pairs.num_pairs

    def fail(self, err: BaseException) -> None:
        if self.ended:
            return
        self.ended = True
        self.tracked.__exit__(type(err), err, None)
        if not self.future.done():
            self.future.set_exception(err)

    def succeed(self, result: TransferResult, job_id: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.tracked.moved = result.bytes_moved
        self.tracked.__exit__(None, None, None)
        if not self.future.done():
            self.future.set_result((result, job_id))

    def cancel(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.tracked.__exit__(asyncio.CancelledError, asyncio.CancelledError(), None)
        self.future.cancel()


def start_step(manager: TransferManager, pulls: Sequence[StepPull]) -> list[asyncio.Future[Outcome]]:
    """One future per pull, in order: its TransferResult and job id, or its LlmError. Cancelling every future
    cancels the step (its jobs stop moving bytes, as a cancelled PullKvBlocks does)."""
    loop = asyncio.get_running_loop()
    members = []
    for p in pulls:
        tracked = manager.track("pull_blocks", p.request.remote_cluster_id, p.timeout, p.trace_context)
        members.append(_Member(p, tracked, loop.create_future(),
                               Transfer(Direction.PULL, p.request, tracked.deadline, share=p.timeout)))
    task = asyncio.ensure_future(_step(manager, members))
    _running.add(task)
    task.add_done_callback(_running.discard)
    left = [len(members)]

    def one_gone(fut: asyncio.Future[Outcome]) -> None:
        if fut.cancelled():
            left[0] -= 1
            if left[0] == 0:
                task.cancel()

    for m in members:
        m.future.add_done_callback(one_gone)
    return [m.future for m in members]


async def _step(manager: TransferManager, members: list[_Member]) -> None:
    by_peer: dict[int, list[_Member]] = {}
    for m in members:
        by_peer.setdefault(m.pull.request.remote_cluster_id, []).append(m)
    try:
        if len(by_peer) == 1:  # the common step (one prefill node): no task per peer
            await _peer(manager, members)
        else:
            await asyncio.gather(*(_peer(manager, ms) for ms in by_peer.values()))
    finally:
        for m in members:
            m.cancel()  # (only those that have not ended: a bug, or the step was cancelled)


async def _peer(manager: TransferManager, members: list[_Member]) -> None:
    try:
        owner = {id(m.transfer): m for m in members}
        jobs = await manager.pipeline.prepare([m.transfer for m in members])
        for m in members:
            if m.transfer.error is not None:
                m.fail(m.transfer.error)
        carried = [(job, [owner[id(t)] for t in transfers]) for job, transfers in jobs]
        if len(carried) == 1:
            await _run_job(manager, *carried[0])
        else:
            await asyncio.gather(*(_run_job(manager, job, ms) for job, ms in carried))
    except Exception as e:  # a bug: every pull of the peer that has not ended ends with it
        for m in members:
            m.fail(e)


def _earliest(members: Sequence[_Member]) -> Deadline:
    return min((m.tracked.deadline for m in members), key=lambda d: d.at)


async def _run_job(manager: TransferManager, job: Job, members: list[_Member]) -> None:
    first = members[0]
    transfer_id = first.tracked.id if len(members) == 1 else f"{first.tracked.id}+{len(members) - 1}"
    LOG_CONTEXT.set({"transfer": transfer_id, "op": "pull_session", "peer": first.tracked.peer})
    for m in members:
        m.tracked.started(job.backend)
    if len(members) == 1:
        await _run_one(manager, job, first)
        return
    # Bytes of a pull: its blocks times the bytes each moves (the same in every run of one plan's selection).
    per_block = job.plan.total_bytes // max(1, job.plan.num_dst_blocks)
    try:
        await manager.runner.run(job, _earliest(members), transfer_id)
    except LlmError as e:
        for m in members:
            m.fail(_member_error(e, m, per_block))
        return
    for m in members:
        own = m.transfer.plan
        runs = job.plan.num_copies * m.num_pairs // max(1, job.plan.num_dst_blocks) if own is None \
            else own.num_copies
        m.succeed(TransferResult(bytes_moved=per_block * m.num_pairs, backend=job.backend, transfer_id=m.tracked.id,
                                 num_runs=max(1, runs)), transfer_id)


async def _run_one(manager: TransferManager, job: Job, m: _Member) -> None:
    try:
        moved = await manager.runner.run(job, m.tracked.deadline, m.tracked.id)
    except LlmError as e:
        m.fail(e)
        return
    m.succeed(TransferResult(bytes_moved=moved, backend=job.backend, transfer_id=m.tracked.id,
                             num_runs=job.plan.num_copies), m.tracked.id)


def _member_error(err: LlmError, m: _Member, per_block: int) -> LlmError:
    """A job's failure as one of its pulls sees it: same status and message, its own report (its destination blocks
    that did not land; the job's pulls write disjoint blocks, so they are exactly its share)."""
    details = dict(err.details)
    details["transfer_id"] = m.tracked.id
    details["job"] = str(err.details.get("transfer_id", ""))
    report = err.details.get("transfer_report")
    if isinstance(report, TransferReport):
        dst = m.transfer.request.pairs.dst
        failed = np.intersect1d(report.failed_dst_blocks, dst) if len(report.failed_dst_blocks) else dst[:0]
        # Which of the job's bytes were this pull's is not kept; a block that did not land counts as no bytes.
        moved = max(0, per_block * (len(dst) - len(failed)))
        details["transfer_report"] = dataclasses.replace(report, transfer_id=m.tracked.id, failed_dst_blocks=failed,
                                                         bytes_moved=moved)
    return make_error(err.status, err.message, details)

