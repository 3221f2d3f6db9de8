"""A step of pulls: pulls that arrived together (one PullKvBlocksSession message, e.g. one engine step's loads), each
with its own deadline and its own terminal state, run with as little per-pull work as the bytes allow.

Each pull is validated and planned alone (`TransferManager.prepare_blocks`: a stale grant, an unknown cache or a bad
block fails that pull alone, before any byte moves). The pulls to one peer then wait for each other's planning (a
dead peer's pulls wait only for each other, never for the other peers'), and the planned ones are packed into
groups: same link, same remote and local cache, same timeout, disjoint destination blocks, at most
`MAX_GROUP_BYTES`. A group's plans are concatenated into one plan that runs as one job: one turn at the gate, one
claim of the destination blocks, one pin, one data-plane job. If the job fails, every pull of the group fails with
its status and a report of its own blocks that did not land.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbroker.status import make_error
from kvbroker.types import TransferResult
from kvbrokerd.errors import LlmError
from kvbrokerd.transfers.manager import BlocksRequest, Direction, Job, TransferManager
from kvbrokerd.transfers.planner import Plan
from kvbrokerd.transfers.reports import TransferReport
from kvbrokerd.transfers.tracking import Deadline, Tracked

MAX_GROUP_BYTES = 1 << 30
"""At most this many bytes (and at most half of max_inflight_bytes) run as one job: a larger group would hold its
destination claims and its share of the in-flight limit for longer than the pulls that make it up would."""

_PLAN_COLUMNS = ("src_tensor", "src_offset", "dst_tensor", "dst_offset", "length", "dst_blocks")


@dataclass(frozen=True, slots=True)
class StepPull:
    """One pull of a step and its own timeout (seconds; None: the default deadline)."""

    request: BlocksRequest
    timeout: float | None


@dataclass(eq=False)
class _Member:
    """A planned pull waiting for its group's job."""

    index: int
    job: Job
    tracked: Tracked
    timeout: float | None
    moved: asyncio.Future[tuple[int, str]]
    """Its bytes moved and the id of the job that moved them."""


def start_step(manager: TransferManager, pulls: Sequence[StepPull]) -> list[asyncio.Task[tuple[TransferResult, str]]]:
    """One task per pull, in order; each ends with the pull's TransferResult and the id of the job that moved its
    bytes (shared by the pulls that ran together), or raises its LlmError."""
    rounds: dict[int, _PeerRound] = {}
    for pull in pulls:
        peer = pull.request.remote_cluster_id
        rounds.setdefault(peer, _PeerRound(manager)).expected += 1
    return [asyncio.ensure_future(_pull(manager, rounds[p.request.remote_cluster_id], i, p))
            for i, p in enumerate(pulls)]


async def _pull(manager: TransferManager, peer_round: _PeerRound, index: int, pull: StepPull
                ) -> tuple[TransferResult, str]:
    with manager.track("pull_blocks", pull.request.remote_cluster_id, pull.timeout) as t:
        try:
            job = await manager.prepare_blocks(Direction.PULL, pull.request, t.deadline)
        except BaseException:
            peer_round.planned(None)
            raise
        t.started(job.backend)
        member = _Member(index, job, t, pull.timeout, asyncio.get_running_loop().create_future())
        peer_round.planned(member)
        t.moved, job_id = await member.moved
        return TransferResult(bytes_moved=t.moved, backend=job.backend, transfer_id=t.id,
                              num_runs=job.plan.num_runs), job_id


class _PeerRound:
    """The pulls of one step to one peer: once every one has been planned (or refused), the planned ones are packed
    into groups and each group is started as one job."""

    def __init__(self, manager: TransferManager) -> None:
        self.manager = manager
        self.expected = 0
        self.members: list[_Member] = []
        self.runs: set[asyncio.Task[None]] = set()

    def planned(self, member: _Member | None) -> None:
        self.expected -= 1
        if member is not None:
            self.members.append(member)
        if self.expected == 0:
            for group in _pack(sorted(self.members, key=lambda m: m.index), self._group_bytes()):
                task = asyncio.ensure_future(_run_group(self.manager, group))
                self.runs.add(task)
                task.add_done_callback(self.runs.discard)
                _cancel_when_abandoned(task, group)

    def _group_bytes(self) -> int:
        return max(1, min(MAX_GROUP_BYTES, self.manager.max_inflight_bytes // 2))


@dataclass(eq=False)
class _Group:
    key: tuple[object, ...]
    members: list[_Member]
    blocks: set[int]
    nbytes: int


def _pack(members: Sequence[_Member], max_bytes: int) -> list[list[_Member]]:
    """Groups of members that can share one job, in arrival order (greedy: a member joins the first group of its
    key that it fits, i.e. under `max_bytes` and with none of its destination blocks)."""
    groups: list[_Group] = []
    for m in members:
        job = m.job
        key = (id(job.link), id(job.channel), job.remote.cache_id, job.local_cache_id, m.timeout,
               job.plan.block_nbytes)
        blocks = set(job.plan.dst_blocks.tolist())
        size = job.plan.total_bytes
        for g in groups:
            if g.key == key and g.nbytes + size <= max_bytes and g.blocks.isdisjoint(blocks):
                g.members.append(m)
                g.blocks |= blocks
                g.nbytes += size
                break
        else:
            groups.append(_Group(key, [m], blocks, size))
    return [g.members for g in groups]


def _cancel_when_abandoned(task: asyncio.Task[None], group: list[_Member]) -> None:
    """A group whose every pull was cancelled (the session ended) stops moving bytes."""
    left = [len(group)]

    def one_gone(fut: asyncio.Future[tuple[int, str]]) -> None:
        if fut.cancelled():
            left[0] -= 1
            if left[0] == 0:
                task.cancel()

    for m in group:
        m.moved.add_done_callback(one_gone)


def merged_plan(plans: Sequence[Plan]) -> Plan:
    """The plans' runs one after the other: each plan's runs stay contiguous and in order."""
    if len(plans) == 1:
        return plans[0]
    return Plan(**{c: np.concatenate([getattr(p, c) for p in plans]) for c in _PLAN_COLUMNS},
                block_nbytes=plans[0].block_nbytes)


async def _run_group(manager: TransferManager, group: list[_Member]) -> None:
    first = group[0]
    if len(group) == 1:
        job, deadline, transfer_id = first.job, first.tracked.deadline, first.tracked.id
    else:
        job = dataclasses.replace(first.job, plan=merged_plan([m.job.plan for m in group]))
        deadline = min((m.tracked.deadline for m in group), key=_at)
        transfer_id = f"{first.tracked.id}+{len(group) - 1}"
    try:
        moved = await manager.run(job, deadline, transfer_id)
    except LlmError as e:
        for m in group:
            _settle(m.moved, exc=e if len(group) == 1 else _member_error(e, m))
        return
    except asyncio.CancelledError:
        for m in group:
            m.moved.cancel()
        raise
    except Exception as e:  # a bug: every pull of the group ends with it (the service reports LLM_FAILED)
        for m in group:
            _settle(m.moved, exc=e)
        return
    for m in group:
        _settle(m.moved, result=(moved if len(group) == 1 else m.job.plan.total_bytes, transfer_id))


def _at(deadline: Deadline) -> float:
    return deadline.at


def _settle(fut: asyncio.Future[tuple[int, str]], *, result: tuple[int, str] = (0, ""),
            exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _member_error(err: LlmError, member: _Member) -> LlmError:
    """The group's failure as one of its pulls sees it: same status and message, its own report (its destination
    blocks that did not land; the group's blocks are disjoint, so they are exactly its share)."""
    details = dict(err.details)
    details["transfer_id"] = member.tracked.id
    details["group_transfer_id"] = str(err.details.get("transfer_id", ""))
    report = err.details.get("transfer_report")
    if isinstance(report, TransferReport):
        own = member.job.plan.dst_blocks
        failed = np.intersect1d(report.failed_dst_blocks, own) if len(report.failed_dst_blocks) else own[:0]
        # The group's runs do not say which member's bytes landed; a block that did not land counts as no bytes.
        per_block = member.job.plan.total_bytes // max(1, len(own))
        moved = max(0, member.job.plan.total_bytes - per_block * len(failed))
        details["transfer_report"] = dataclasses.replace(report, transfer_id=member.tracked.id,
                                                         failed_dst_blocks=failed, bytes_moved=moved)
    return make_error(err.status, err.message, details)
