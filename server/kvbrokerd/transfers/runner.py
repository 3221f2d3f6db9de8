"""A planned job run to its terminal state: claim and pin -> run on the backend -> report.

`run` waits for the link's turn (a backend that keeps its own count, or the daemon-wide gate), checks the limits,
claims the destination blocks (dataplane/blocklocks.py: two sources never interleave in one block), pins the local
cache, and runs the job on its channel: on the event loop, inline, or on a worker thread. On failure the
TransferReport (reports.py) says which destination blocks did not land. The pins and claims are released when the
backend has stopped touching the memory, not before (a timed-out copy still running keeps them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import sys
import time
import weakref
from collections.abc import Callable

from kvbrokerd import tracing
from kvbrokerd.dataplane import blocklocks
from kvbrokerd.dataplane.plan import Plan, Progress
from kvbrokerd.dataplane.seam import PeerChannel
from kvbrokerd.errors import LlmError, LlmStatus, fail
from kvbrokerd.registry.caches import CacheEntry, Registry
from kvbrokerd.transfers.reports import TransferReport
from kvbrokerd.transfers.requests import Direction, Job
from kvbrokerd.transfers.tracking import Deadline

log = logging.getLogger(__name__)

GRACE_S = 1.0


class JobRunner:
    def __init__(self, registry: Registry, executor: concurrent.futures.Executor, *, max_transfers: int,
                 max_inflight_bytes: int, parallel_transfers: int, block_locks: blocklocks.BlockLocks) -> None:
        # Transfers that need worker threads run at most `parallel_transfers` at a time (each already spreads its
        # bytes over several threads or connections); the rest wait their turn in FIFO order. On a machine with few
        # cores, dozens of transfers copying at once only thrash: the same bytes take longer.
        self._gate = asyncio.Semaphore(parallel_transfers)
        self._channel_gates: weakref.WeakKeyDictionary[PeerChannel, asyncio.Semaphore] = weakref.WeakKeyDictionary()
        self._registry = registry
        self._executor = executor
        self._block_locks = block_locks
        self.max_transfers = max_transfers
        self.max_inflight_bytes = max_inflight_bytes
        self.in_flight = 0
        self.inflight_bytes = 0

    async def run(self, job: Job, deadline: Deadline, transfer_id: str, plan: Plan | None = None) -> int:
        """Runs `plan` (default: the job's whole plan) to its terminal state; returns the bytes moved."""
        if job.link is None:
            return await self._run_plan(job, deadline, transfer_id, plan)
        job.link.busy += 1  # a link carrying a transfer is not idle, however long the transfer takes
        try:
            return await self._run_plan(job, deadline, transfer_id, plan)
        finally:
            job.link.busy -= 1
            job.link.last_used = time.monotonic()

    async def _run_plan(self, job: Job, deadline: Deadline, transfer_id: str, plan: Plan | None) -> int:
        plan = job.plan if plan is None else plan
        channel = job.channel
        if not channel.copies_strided:
            plan = plan.plain()
        on_loop = job.direction == Direction.PULL and not job.sources and channel.runs_on_loop(plan)
        inline = job.direction == Direction.PULL and channel.runs_inline(plan)
        if on_loop or inline:
            return await self._run(job, deadline, transfer_id, plan, on_loop, inline)
        gate = self._gate_of(channel)
        try:
            with tracing.stage(deadline.span, "turn"):
                async with asyncio.timeout(deadline.remaining()):
                    await gate.acquire()
        except TimeoutError:
            err = LlmError(LlmStatus.LLM_TIMEOUT, f"transfer {transfer_id} waited for its turn past its deadline")
            self._on_failure(job, err, transfer_id, Progress(plan), deadline)
            raise err from None
        try:
            return await self._run(job, deadline, transfer_id, plan, False, False)
        finally:
            gate.release()

    def _gate_of(self, channel: PeerChannel) -> asyncio.Semaphore:
        """The turn a transfer waits for: its link's own when its backend says how many keep it busy, else the
        daemon-wide one."""
        if channel.parallel_transfers is None:
            return self._gate
        gate = self._channel_gates.get(channel)
        if gate is None:
            gate = self._channel_gates[channel] = asyncio.Semaphore(channel.parallel_transfers)
        return gate

    async def _run(self, job: Job, deadline: Deadline, transfer_id: str, plan: Plan, on_loop: bool,
                   inline: bool) -> int:
        if self.in_flight >= self.max_transfers:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"{self.in_flight} transfers in flight (max_transfers); retry later")
        if self.inflight_bytes + plan.total_bytes > self.max_inflight_bytes:
            fail(LlmStatus.LLM_OUT_OF_MEMORY, f"{plan.total_bytes} more bytes would exceed max_inflight_bytes="
                 f"{self.max_inflight_bytes} ({self.inflight_bytes} in flight); retry later or split the request")
        progress = Progress(plan)
        try:
            with tracing.stage(deadline.span, "claim"):
                claim = await self._claim_destination(job, plan, deadline, transfer_id)
        except LlmError as e:
            if e.status == LlmStatus.LLM_TIMEOUT:  # waited for its turn past the deadline: report every block
                self._on_failure(job, e, transfer_id, progress, deadline)
            raise
        pinned: list[CacheEntry] = []
        try:
            pinned.append(self._registry.pin(job.local_cache_id))
            call = self._operation(job, plan, progress, pinned[0], deadline)
        except BaseException:
            for entry in pinned:
                self._registry.unpin(entry)
            self._block_locks.release(claim)
            raise
        copying = None
        if deadline.span is not None:
            deadline.span.set_attribute("kvbroker.blocks", plan.num_dst_blocks)
            copying = tracing.open_stage(deadline.span, "copy", {
                "kvbroker.backend": job.backend, "kvbroker.bytes": plan.total_bytes,
                "kvbroker.blocks": plan.num_dst_blocks})
        work: asyncio.Future[int]
        if on_loop:
            work = asyncio.ensure_future(job.channel.pull_on_loop(job.remote, pinned[0], plan, progress,
                                                                  deadline.at))
        elif inline:
            work = asyncio.get_running_loop().create_future()
            try:
                work.set_result(call())
            except Exception as e:
                work.set_exception(e)
        else:
            # The copy thread logs with this transfer's context too.
            work = asyncio.get_running_loop().run_in_executor(self._executor, contextvars.copy_context().run, call)
        self.in_flight += 1
        self.inflight_bytes += plan.total_bytes
        try:
            if not work.done():
                # The worker honours the same deadline; the grace only guards against a stuck system call.
                await asyncio.wait({work}, timeout=deadline.remaining() + GRACE_S)
            if not work.done():
                fail(LlmStatus.LLM_TIMEOUT, f"transfer {transfer_id} passed its deadline")
            return work.result()
        except LlmError as e:
            self._on_failure(job, e, transfer_id, progress, deadline)
            raise
        except asyncio.CancelledError:
            # The caller cancelled or disconnected: stop moving bytes for it.
            progress.cancel()  # a worker thread stops at its next check or when its socket is shut down
            if isinstance(work, asyncio.Task):
                work.cancel()  # a coroutine on the loop stops at its next await
            # (never cancel an executor future: that would release the memory while the thread still copies)
            log.info("cancelled by the caller")
            raise
        finally:
            if copying is not None:
                tracing.close_stage(copying, sys.exc_info()[1])

            def release(_: object = None) -> None:
                self.in_flight -= 1
                self.inflight_bytes -= plan.total_bytes
                for entry in pinned:
                    self._registry.unpin(entry)
                self._block_locks.release(claim)

            # A copy still running (timeout, cancelled caller) keeps its memory mapped and its place in the limits
            # until it stops.
            if work.done():
                release()
            else:
                work.add_done_callback(release)

    async def _claim_destination(self, job: Job, plan: Plan, deadline: Deadline, transfer_id: str
                                 ) -> blocklocks.Claim:
        """Waits (within the deadline) until no other write of this daemon's targets the plan's destination
        blocks, and claims them: two sources never interleave in one block."""
        if job.direction == Direction.PUSH:
            # Over shm this daemon writes the peer's memory itself; over tcp the peer's data server claims too.
            assert job.remote is not None
            key: object = job.remote
            desc = job.remote.desc
        else:
            entry = self._registry.get(job.local_cache_id)
            key, desc = entry, entry.desc
        cells = blocklocks.plan_cells(plan, desc.num_blocks)
        return await self._block_locks.claim_async(key, desc.num_tensors, desc.num_blocks, cells, deadline.at,
                                                   f"transfer {transfer_id}")

    @staticmethod
    def _operation(job: Job, plan: Plan, progress: Progress, local: CacheEntry, deadline: Deadline
                   ) -> Callable[[], int]:
        channel, remote, sources = job.channel, job.remote, job.sources
        if sources:
            return lambda: channel.pull_several(sources, local, plan, progress, deadline.at)
        if job.direction == Direction.PULL:
            return lambda: channel.pull(remote, local, plan, progress, deadline.at)
        return lambda: channel.push(local, remote, plan, progress, deadline.at)

    def _on_failure(self, job: Job, e: LlmError, transfer_id: str, progress: Progress, deadline: Deadline) -> None:
        with tracing.stage(deadline.span, "report", **{"kvbroker.status": e.status.name}) as span:
            self._report_failure(job, e, transfer_id, progress)
            if span is not None:
                span.set_attribute("kvbroker.failed_blocks", len(e.details["transfer_report"].failed_dst_blocks))

    def _report_failure(self, job: Job, e: LlmError, transfer_id: str, progress: Progress) -> None:
        if job.link is not None:
            if e.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST:
                job.link.forget_cache(_cache_of(job, e))
            elif e.status == LlmStatus.LLM_LINK_FAILED:
                job.link.mark_broken(e.message)
            e.details["cluster_id"] = str(job.link.remote_cluster_id)
        e.details.update(transfer_id=transfer_id, backend=job.backend, stage="transfer")
        e.details["transfer_report"] = TransferReport(
            transfer_id=transfer_id, backend=job.backend, stage="transfer",
            failed_dst_blocks=progress.failed_dst_blocks(), bytes_moved=progress.bytes_moved)
        log.warning("transfer %s (%s via %s) failed: %s", transfer_id, job.direction.value, job.backend, e)


def _cache_of(job: Job, e: LlmError) -> int:
    """The remote cache a failure is about: the one it names, of a job over several."""
    named = e.details.get("cache_id")
    for remote in job.sources:
        if str(remote.cache_id) == named:
            return remote.cache_id
    return job.remote.cache_id
