"""The transfer manager: one pass per request, ending in exactly one terminal state: DONE (a TransferResult) or
FAILED / TIMEOUT / CANCELLED (a raised LlmError whose report says which destination blocks and layers did not land).

The pass, in the order of this module: an operation (`transfer_blocks`, `transfer_cache`, `copy_blocks`,
`pull_blocks_by_layer`, `transfer_batch`) opens its `Tracked` record (tracking.py), then
1. check, grant, endpoints and plan: a block transfer passes the pipeline (pipeline.py), a cache transfer or a
   local copy its own checks; the result is a `Job` with its `Plan` of byte runs (planner.py), and nothing has
   moved yet, so a rejected request never writes a byte;
2. claim and pin: `run` waits for the link's turn, checks the limits, claims the destination blocks (blocklocks.py)
   and pins the local cache;
3. run on the backend: the link's channel pulls or pushes, on the event loop, inline or on a worker thread;
4. report: on failure `_on_failure` builds the TransferReport (reports.py) of what did not land; the pins and claims
   are released when the backend has stopped touching the memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

import numpy as np

from kvbroker.types import TransferResult
from kvbrokerd.backends.common.localcopy import LocalCopyChannel
from kvbrokerd.dataplane import blocklocks
from kvbrokerd.dataplane.pairs import block_array
from kvbrokerd.dataplane.plan import Plan, Progress
from kvbrokerd.dataplane.seam import PeerChannel
from kvbrokerd.errors import LlmError, LlmStatus, fail, param_invalid
from kvbrokerd.links.table import LinkTable
from kvbrokerd.metrics import Metrics
from kvbrokerd.registry import devicemem
from kvbrokerd.registry.caches import CacheEntry, Registry
from kvbrokerd.transfers.pipeline import Pipeline, channel_of
from kvbrokerd.transfers.planner import LayerSelection, concatenated, layer_plans, plan_blocks, plan_cache
from kvbrokerd.transfers.reports import GroupReport, TransferReport
from kvbrokerd.transfers.requests import BlocksRequest, CacheRequest, Direction, Job
from kvbrokerd.transfers.tracking import Deadline, Tracked

log = logging.getLogger(__name__)

GRACE_S = 1.0
MAX_BATCH_GROUPS = 64
MAX_COPY_LISTS = 64


class TransferManager:
    def __init__(self, registry: Registry, links: LinkTable, executor: concurrent.futures.Executor,
                 parts_executor: concurrent.futures.Executor, *,
                 max_transfers: int = 256, max_inflight_bytes: int = 16 << 30, metrics: Metrics | None = None,
                 parallel_transfers: int = 2, block_locks: blocklocks.BlockLocks = blocklocks.DEFAULT) -> None:
        # Transfers that need worker threads run at most `parallel_transfers` at a time (each already spreads its
        # bytes over several threads or connections); the rest wait their turn in FIFO order. On a machine with few
        # cores, dozens of transfers copying at once only thrash: the same bytes take longer.
        self._gate = asyncio.Semaphore(parallel_transfers)
        self._local = LocalCopyChannel(registry, parts_executor)
        self.pipeline = Pipeline(registry, links, executor)
        self._channel_gates: weakref.WeakKeyDictionary[PeerChannel, asyncio.Semaphore] = weakref.WeakKeyDictionary()
        self.metrics = metrics
        self._registry = registry
        self._links = links
        self._executor = executor
        self._parts_executor = parts_executor
        self._block_locks = block_locks
        self.max_transfers = max_transfers
        self.max_inflight_bytes = max_inflight_bytes
        self.in_flight = 0
        self.inflight_bytes = 0

    # -- validation and planning (pipeline.py; no byte moves) ---------------------------------------------------------
    async def prepare_blocks(self, direction: Direction, req: BlocksRequest, deadline: Deadline) -> Job:
        return await self.pipeline.prepare_one(direction, req, deadline)

    async def prepare_cache(self, direction: Direction, req: CacheRequest, deadline: Deadline) -> Job:
        local, link, remote = await self.pipeline.endpoints(direction, req.remote_cluster_id, req.remote_cache_id,
                                                            req.local_cache_id, deadline)
        src, dst = (remote.desc, local.desc) if direction == Direction.PULL else (local.desc, remote.desc)
        plan = plan_cache(src, dst, req.src_batch_index, req.dst_batch_index, req.size, req.layers)
        return Job(direction, plan, req.local_cache_id, channel_of(link), remote, link)

    def prepare_copy(self, src_cache_id: int, dst_cache_id: int, src_blocks: Sequence[int],
                     dst_blocks_list: Sequence[Sequence[int]]) -> Job:
        if not dst_blocks_list:
            param_invalid("dst_blocks_list is empty")
        if len(dst_blocks_list) > MAX_COPY_LISTS:
            param_invalid(f"{len(dst_blocks_list)} destination lists; at most {MAX_COPY_LISTS}")
        src = self._registry.get(src_cache_id)
        dst = self._registry.get(dst_cache_id)
        devicemem.check_moves(None, (f"cache {src_cache_id}", src.tensors), (f"cache {dst_cache_id}", dst.tensors))
        src_arr = block_array(src_blocks, "src_blocks")
        plans = [plan_blocks(src.desc, dst.desc, src_arr, block_array(d, f"dst_blocks_list[{i}]"), LayerSelection())
                 for i, d in enumerate(dst_blocks_list)]
        all_dst = np.concatenate([p.dst_blocks for p in plans])
        if len(np.unique(all_dst)) != len(all_dst):
            param_invalid("a destination block appears in more than one dst_blocks list")
        if src_cache_id == dst_cache_id and np.intersect1d(all_dst, src_arr).size:
            param_invalid("copying within one cache: a destination block is also a source block")
        plan = concatenated(plans)
        # A copy is a pull from this daemon itself.
        return Job(Direction.PULL, plan, dst_cache_id, self._local, LocalCopyChannel.describe(src))

    # -- execution ---------------------------------------------------------------------------------------------------
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
        on_loop = job.direction == Direction.PULL and channel.runs_on_loop(plan)
        inline = job.direction == Direction.PULL and channel.runs_inline(plan)
        if on_loop or inline:
            return await self._run(job, deadline, transfer_id, plan, on_loop, inline)
        gate = self._gate_of(channel)
        try:
            async with asyncio.timeout(deadline.remaining()):
                await gate.acquire()
        except TimeoutError:
            err = LlmError(LlmStatus.LLM_TIMEOUT, f"transfer {transfer_id} waited for its turn past its deadline")
            self._on_failure(job, err, transfer_id, Progress(plan))
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
            claim = await self._claim_destination(job, plan, deadline, transfer_id)
        except LlmError as e:
            if e.status == LlmStatus.LLM_TIMEOUT:  # waited for its turn past the deadline: report every block
                self._on_failure(job, e, transfer_id, progress)
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
            self._on_failure(job, e, transfer_id, progress)
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
        cells: blocklocks.Spans | np.ndarray | None = None
        if plan.count is not None and plan.dst_stride is not None:
            cells = blocklocks.strided_spans(plan.dst_tensor, plan.dst_offset, plan.length, plan.count,
                                             plan.dst_stride, plan.block_nbytes, desc.num_blocks)
            plan = plan.plain() if cells is None else plan  # entries with gaps between them: their cells, exactly
        if cells is None:
            cells = blocklocks.run_spans(plan.dst_tensor, plan.dst_offset, plan.length, plan.block_nbytes,
                                         desc.num_blocks) or blocklocks.run_cells(
                plan.dst_tensor, plan.dst_offset, plan.length, plan.block_nbytes, desc.num_blocks)
        return await self._block_locks.claim_async(key, desc.num_tensors, desc.num_blocks, cells, deadline.at,
                                                   f"transfer {transfer_id}")

    @staticmethod
    def _operation(job: Job, plan: Plan, progress: Progress, local: CacheEntry, deadline: Deadline
                   ) -> Callable[[], int]:
        channel, remote = job.channel, job.remote
        if job.direction == Direction.PULL:
            return lambda: channel.pull(remote, local, plan, progress, deadline.at)
        return lambda: channel.push(local, remote, plan, progress, deadline.at)

    def _on_failure(self, job: Job, e: LlmError, transfer_id: str, progress: Progress) -> None:
        if job.link is not None:
            if e.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST:
                job.link.forget_cache(job.remote.cache_id)
            elif e.status == LlmStatus.LLM_LINK_FAILED:
                job.link.mark_broken(e.message)
            e.details["cluster_id"] = str(job.link.remote_cluster_id)
        e.details.update(transfer_id=transfer_id, backend=job.backend, stage="transfer")
        e.details["transfer_report"] = TransferReport(
            transfer_id=transfer_id, backend=job.backend, stage="transfer",
            failed_dst_blocks=progress.failed_dst_blocks(), bytes_moved=progress.bytes_moved)
        log.warning("transfer %s (%s via %s) failed: %s", transfer_id, job.direction.value, job.backend, e)

    def track(self, op: str, peer: int | str, timeout: float | None) -> Tracked:
        return Tracked(self.metrics, op, str(peer), Deadline(timeout))

    async def execute(self, job: Job, t: Tracked) -> TransferResult:
        t.started(job.backend)
        t.moved = await self.run(job, t.deadline, t.id)
        log.debug("%s: %d bytes in %d runs", job.direction.value, t.moved, job.plan.num_runs)
        return TransferResult(bytes_moved=t.moved, backend=job.backend, transfer_id=t.id, num_runs=job.plan.num_copies)

    # -- the operations ----------------------------------------------------------------------------------------------
    async def transfer_blocks(self, direction: Direction, req: BlocksRequest, timeout: float | None
                              ) -> TransferResult:
        with self.track(direction.value + "_blocks", req.remote_cluster_id, timeout) as t:
            return await self.execute(await self.prepare_blocks(direction, req, t.deadline), t)

    async def transfer_cache(self, direction: Direction, req: CacheRequest, timeout: float | None) -> TransferResult:
        with self.track(direction.value + "_cache", req.remote_cluster_id, timeout) as t:
            return await self.execute(await self.prepare_cache(direction, req, t.deadline), t)

    async def copy_blocks(self, src_cache_id: int, dst_cache_id: int, src_blocks: Sequence[int],
                          dst_blocks_list: Sequence[Sequence[int]], timeout: float | None) -> TransferResult:
        with self.track("copy_blocks", "local", timeout) as t:
            return await self.execute(self.prepare_copy(src_cache_id, dst_cache_id, src_blocks, dst_blocks_list), t)

    async def pull_blocks_by_layer(self, req: BlocksRequest, timeout: float | None
                                   ) -> AsyncIterator[tuple[int, int] | TransferResult]:
        """Yields (destination layer, bytes) as each layer lands, then the TransferResult."""
        with self.track("pull_blocks_stream", req.remote_cluster_id, timeout) as t:
            job = await self.prepare_blocks(Direction.PULL, req, t.deadline)
            t.started(job.backend)
            completed: list[int] = []
            layers = layer_plans(job.plan, req.layers.tensor_num_per_layer)
            for k, (layer, sub) in enumerate(layers):
                try:
                    t.moved += await self.run(job, t.deadline, t.id, sub)
                except LlmError as e:
                    report = e.details.get("transfer_report")
                    refused = report is None  # a limit refused this layer before any of its bytes moved
                    if report is None:
                        report = TransferReport(transfer_id=t.id, backend=job.backend, stage="transfer")
                    if k < len(layers) - 1 or refused:
                        # Later layers never started: every requested block misses those layers' bytes.
                        report = replace(report, failed_dst_blocks=job.plan.destination_blocks())
                    e.details["transfer_report"] = replace(
                        report, completed_layers=(*report.completed_layers, *completed),
                        bytes_moved=report.bytes_moved + t.moved)
                    raise
                completed.append(layer)
                yield layer, sub.total_bytes
            yield TransferResult(bytes_moved=t.moved, backend=job.backend, transfer_id=t.id,
                                 num_runs=job.plan.num_copies)

    async def transfer_batch(self, groups: Sequence[tuple[Direction, BlocksRequest]], timeout: float | None
                             ) -> tuple[TransferResult, list[str]]:
        peers = {str(r.remote_cluster_id) for _, r in groups}
        # One peer label per transfer: a batch over several peers gets a shared one (not their list, which would make
        # a new series for every combination).
        with self.track("batch", peers.pop() if len(peers) == 1 else "several", timeout) as t:
            return await self._transfer_batch(groups, t)

    async def _transfer_batch(self, groups: Sequence[tuple[Direction, BlocksRequest]], t: Tracked
                              ) -> tuple[TransferResult, list[str]]:
        if not groups:
            param_invalid("a batch needs at least one group")
        if len(groups) > MAX_BATCH_GROUPS:
            param_invalid(f"{len(groups)} groups in one batch; at most {MAX_BATCH_GROUPS}")
        jobs = []
        for i, (direction, req) in enumerate(groups):
            try:
                jobs.append(await self.prepare_blocks(direction, req, t.deadline))
            except LlmError as e:
                e.details["group"] = str(i)
                raise type(e)(e.status, f"group {i}: {e.message}", e.details) from None
        t.started(",".join(sorted({j.backend for j in jobs})))
        outcomes = await asyncio.gather(*(self.run(job, t.deadline, f"{t.id}.{i}") for i, job in enumerate(jobs)),
                                        return_exceptions=True)
        failures = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
        if failures:
            first = failures[0][1]
            err = first if isinstance(first, LlmError) else LlmError(LlmStatus.LLM_FAILED, str(first))
            reports, moved = [], 0
            for i, (job, outcome) in enumerate(zip(jobs, outcomes, strict=True)):
                report = outcome.details.get("transfer_report") if isinstance(outcome, LlmError) else None
                if isinstance(report, TransferReport):
                    reports.append(GroupReport(i, done=False, failed_dst_blocks=report.failed_dst_blocks))
                    moved += report.bytes_moved
                elif isinstance(outcome, BaseException):
                    reports.append(GroupReport(i, done=False, failed_dst_blocks=job.plan.destination_blocks()))
                else:
                    reports.append(GroupReport(i, done=True))
                    moved += int(outcome)
            err.details["transfer_report"] = TransferReport(transfer_id=t.id, stage="transfer", bytes_moved=moved,
                                                            groups=tuple(reports))
            err.details["transfer_id"] = t.id
            raise err
        t.moved = sum(o for o in outcomes if isinstance(o, int))
        result = TransferResult(bytes_moved=t.moved, backend=",".join(j.backend for j in jobs), transfer_id=t.id,
                                num_runs=sum(j.plan.num_copies for j in jobs))
        return result, [j.backend for j in jobs]

