"""A step of pulls: pulls that arrived together (one PullKvBlocksSession message, e.g. one engine step's loads), each
with its own deadline and its own terminal state, run with as little per-pull work as the bytes allow.

Per pull, only what is the pull's own: its record (`Tracked`: id, metrics), the checks PullKvBlocks makes first (batch
index, grant redeemed, block lists; a stale grant or a bad list fails that pull alone, before any byte moves). The
pulls to one peer then wait for each other (a dead peer's pulls wait only for each other, never for the other
peers'), and those that name the same caches, layers and timeout are handled as one: one look-up of the caches and the
link, one plan of all their blocks, one job (one turn at the gate, one claim of the destination blocks, one pin, one
data-plane job), up to `MAX_GROUP_BYTES` a job. If that plan is refused (a pull's block out of range, two pulls
writing one block), each pull is planned alone, so that the refusal is the guilty pull's, with PullKvBlocks' message,
and the others still run together where their blocks are disjoint. If a job fails, every pull of it fails with its
status and a report of its own blocks that did not land.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbroker import blockruns
from kvbroker.status import make_error
from kvbroker.types import TransferResult
from kvbrokerd.dataplane.plan import Plan
from kvbrokerd.dataplane.seam import RemoteCache
from kvbrokerd.errors import LlmError
from kvbrokerd.links.table import Link
from kvbrokerd.logs import LOG_CONTEXT
from kvbrokerd.registry.caches import CacheEntry
from kvbrokerd.transfers.manager import BlocksRequest, Direction, Job, TransferManager
from kvbrokerd.transfers.planner import concatenated
from kvbrokerd.transfers.reports import TransferReport
from kvbrokerd.transfers.tracking import Deadline, Tracked

MAX_GROUP_BYTES = 1 << 30
"""At most this many bytes (and at most half of max_inflight_bytes) run as one job: a larger one would hold its
destination claims and its share of the in-flight limit for longer than the pulls that make it up would."""


Outcome = tuple[TransferResult, str]
"""A pull's result and the id of the job that moved its bytes (shared by the pulls that ran together)."""

_running: set[asyncio.Task[None]] = set()
"""Steps in progress (kept referenced until they end)."""


@dataclass(frozen=True, slots=True)
class StepPull:
    """One pull of a step and its own timeout (seconds; None: the default deadline)."""

    request: BlocksRequest
    timeout: float | None


@dataclass(eq=False)
class _Member:
    """A pull of the step on its way to its terminal state."""

    pull: StepPull
    tracked: Tracked
    future: asyncio.Future[Outcome]
    request: BlocksRequest | None = None
    """After the first checks: the request (a granted one redeemed)."""
    src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    dst: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    plan: Plan | None = None
    """Its own plan, when it had to be planned alone."""
    ended: bool = False

    @property
    def runs(self) -> blockruns.Runs | None:
        """The pull's pairs as runs, when it came as runs: then `src` and `dst` stay empty (written out only where
        a list is needed: `pairs`)."""
        return None if self.request is None else self.request.runs

    @property
    def num_pairs(self) -> int:
        return len(self.dst) if self.runs is None else self.runs.num_pairs

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        if self.runs is not None and not len(self.dst):
            self.src, self.dst = blockruns.expand(self.request.segments if self.request is not None and
                                                  self.request.segments is not None else self.runs)
        return self.src, self.dst

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
    members = [_Member(p, manager.track("pull_blocks", p.request.remote_cluster_id, p.timeout), loop.create_future())
               for p in pulls]
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
        # A grant is redeemed with the peer (a round trip): those run concurrently; the other checks need no task.
        await asyncio.gather(*(_check(manager, m) for m in members if m.pull.request.grant is not None))
        for m in members:
            if m.pull.request.grant is None:
                await _check(manager, m)
        groups: dict[tuple[object, ...], list[_Member]] = {}
        for m in members:
            if m.request is not None and not m.ended:
                r = m.request
                groups.setdefault((r.remote_cache_id, r.local_cache_id, r.layers, m.pull.timeout), []).append(m)
        jobs: list[tuple[Job, list[_Member]]] = []
        for ms in groups.values():
            jobs.extend(await _plan_group(manager, ms))
        if len(jobs) == 1:
            await _run_job(manager, *jobs[0])
        else:
            await asyncio.gather(*(_run_job(manager, job, ms) for job, ms in jobs))
    except Exception as e:  # a bug: every pull of the peer that has not ended ends with it
        for m in members:
            m.fail(e)


async def _check(manager: TransferManager, m: _Member) -> None:
    try:
        m.request, m.src, m.dst = await manager.check_blocks(Direction.PULL, m.pull.request, m.tracked.deadline,
                                                             written_out=False)
    except LlmError as e:
        m.fail(e)


def _joined(members: Sequence[_Member]) -> blockruns.Runs | None:
    """The runs of several pulls as one request's (None unless every one came as runs)."""
    runs = [m.runs for m in members if m.runs is not None]
    return blockruns.concatenated(runs) if len(runs) == len(members) else None


def _earliest(members: Sequence[_Member]) -> Deadline:
    return min((m.tracked.deadline for m in members), key=lambda d: d.at)


async def _plan_group(manager: TransferManager, members: list[_Member]) -> list[tuple[Job, list[_Member]]]:
    """Jobs for pulls that name the same caches and layers: one plan per job where the pulls allow it."""
    first = members[0].request
    assert first is not None
    try:
        local, link, remote = await manager.endpoints(Direction.PULL, first.remote_cluster_id, first.remote_cache_id,
                                                      first.local_cache_id, _earliest(members))
    except LlmError as e:
        for m in members:
            m.fail(make_error(e.status, e.message, dict(e.details)))
        return []
    jobs = []
    for chunk in _chunks(members, local.desc.block_nbytes * local.desc.num_tensors, _max_bytes(manager)):
        alone = chunk[0].request if len(chunk) == 1 else None
        segments, runs = (alone.segments, alone.runs) if alone is not None else (None, _joined(chunk))
        if runs is not None:  # the runs as they came: the plan takes them (and writes them out only if it must)
            src = dst = chunk[0].dst[:0]
        else:
            src = np.concatenate([m.pairs()[0] for m in chunk])
            dst = np.concatenate([m.pairs()[1] for m in chunk])
        try:
            plan = await manager.plan(remote.desc, local.desc, src, dst, first.layers, segments, runs)
        except LlmError as e:
            if len(chunk) == 1:
                chunk[0].fail(e)
                continue
            jobs.extend(await _plan_alone(manager, chunk, local, link, remote))
            continue
        jobs.append((_job(plan, first.local_cache_id, link, remote), chunk))
    return jobs


async def _plan_alone(manager: TransferManager, members: list[_Member], local: CacheEntry, link: Link,
                      remote: RemoteCache) -> list[tuple[Job, list[_Member]]]:
    """The pulls of a refused plan, each planned alone (a refusal is then the guilty pull's own), and those that pass
    run together again where no two write one block."""
    planned = []
    for m in members:
        assert m.request is not None
        try:
            m.plan = await manager.plan(remote.desc, local.desc, m.src, m.dst, m.request.layers, m.request.segments,
                                        m.request.runs)
            planned.append(m)
        except LlmError as e:
            m.fail(e)
    jobs = []
    for group in _disjoint(planned):
        plan = merged_plan([m.plan for m in group if m.plan is not None])
        jobs.append((_job(plan, local.cache_id, link, remote), group))
    return jobs


def _job(plan: Plan, local_cache_id: int, link: Link, remote: RemoteCache) -> Job:
    return Job(Direction.PULL, plan, local_cache_id, TransferManager.channel_of(link), remote, link)


def _max_bytes(manager: TransferManager) -> int:
    return max(1, min(MAX_GROUP_BYTES, manager.max_inflight_bytes // 2))


def _chunks(members: list[_Member], bytes_per_block: int, max_bytes: int) -> Iterator[list[_Member]]:
    """Consecutive runs of members of at most `max_bytes` (a member larger than that alone)."""
    chunk: list[_Member] = []
    size = 0
    for m in members:
        n = m.num_pairs * bytes_per_block
        if chunk and size + n > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(m)
        size += n
    if chunk:
        yield chunk


def _disjoint(members: list[_Member]) -> list[list[_Member]]:
    """Groups in which no two members write one destination block (first fit, in order). The blocks stay in numpy
    arrays (8 bytes each; a Python set would cost ~70): a message's pairs are bounded, not small."""
    groups: list[tuple[list[_Member], np.ndarray]] = []
    for m in members:
        blocks = np.sort(m.pairs()[1])  # a planned pull's destination blocks are distinct
        for i, (group, taken) in enumerate(groups):
            at = np.searchsorted(taken, blocks)
            if not (taken[np.minimum(at, len(taken) - 1)] == blocks).any():
                group.append(m)
                groups[i] = (group, np.union1d(taken, blocks))
                break
        else:
            groups.append(([m], blocks))
    return [g for g, _ in groups]


def merged_plan(plans: Sequence[Plan]) -> Plan:
    """The plans' runs one after the other."""
    if len(plans) == 1:
        return plans[0]
    return concatenated(plans)  # (strided plans, rare in a merged group, are written out)


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
        await manager.run(job, _earliest(members), transfer_id)
    except LlmError as e:
        for m in members:
            m.fail(_member_error(e, m, per_block))
        return
    for m in members:
        runs = job.plan.num_copies * m.num_pairs // max(1, job.plan.num_dst_blocks) if m.plan is None \
            else m.plan.num_copies
        m.succeed(TransferResult(bytes_moved=per_block * m.num_pairs, backend=job.backend, transfer_id=m.tracked.id,
                                 num_runs=max(1, runs)), transfer_id)


async def _run_one(manager: TransferManager, job: Job, m: _Member) -> None:
    try:
        moved = await manager.run(job, m.tracked.deadline, m.tracked.id)
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
        dst = m.pairs()[1]
        failed = np.intersect1d(report.failed_dst_blocks, dst) if len(report.failed_dst_blocks) else dst[:0]
        # Which of the job's bytes were this pull's is not kept; a block that did not land counts as no bytes.
        moved = max(0, per_block * (len(dst) - len(failed)))
        details["transfer_report"] = dataclasses.replace(report, transfer_id=m.tracked.id, failed_dst_blocks=failed,
                                                         bytes_moved=moved)
    return make_error(err.status, err.message, details)

