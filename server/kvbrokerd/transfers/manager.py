"""The transfer manager: one pass per request, ending in exactly one terminal state: DONE (a TransferResult) or
FAILED / TIMEOUT / CANCELLED (a raised LlmError whose report says which destination blocks and layers did not land).

The pass: an operation of this module (`transfer_blocks`, `transfer_cache`, `copy_blocks`, `pull_blocks_by_layer`,
`transfer_batch`) opens its `Tracked` record (tracking.py), then
1. check, grant, endpoints and plan: a block transfer passes the pipeline (pipeline.py), a cache transfer or a
   local copy its own checks; the result is a `Job` with its `Plan` of byte runs (planner.py), and nothing has
   moved yet, so a rejected request never writes a byte;
2. claim and pin, run on the backend, report: the job runner (runner.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import numpy as np

from kvbroker.tracecontext import TraceContext
from kvbroker.types import TransferResult
from kvbrokerd import tracing
from kvbrokerd.backends.common.localcopy import LocalCopyChannel
from kvbrokerd.dataplane import blocklocks
from kvbrokerd.dataplane.pairs import block_array
from kvbrokerd.errors import LlmError, LlmStatus, param_invalid
from kvbrokerd.links.table import LinkTable
from kvbrokerd.metrics import Metrics
from kvbrokerd.registry import devicemem
from kvbrokerd.registry.caches import Registry
from kvbrokerd.transfers.pipeline import Pipeline, channel_of
from kvbrokerd.transfers.planner import LayerSelection, concatenated, layer_plans, plan_blocks, plan_cache
from kvbrokerd.transfers.reports import GroupReport, TransferReport
from kvbrokerd.transfers.requests import BlocksRequest, CacheRequest, Direction, Job
from kvbrokerd.transfers.runner import JobRunner
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
        self._local = LocalCopyChannel(registry, parts_executor)
        self.pipeline = Pipeline(registry, links, executor, max_inflight_bytes=max_inflight_bytes)
        self.runner = JobRunner(registry, executor, max_transfers=max_transfers,
                                max_inflight_bytes=max_inflight_bytes, parallel_transfers=parallel_transfers,
                                block_locks=block_locks)
        self.metrics = metrics
        self._registry = registry

    # -- validation and planning (pipeline.py; no byte moves) ---------------------------------------------------------
    async def prepare_blocks(self, direction: Direction, req: BlocksRequest, deadline: Deadline) -> Job:
        return await self.pipeline.prepare_one(direction, req, deadline)

    async def prepare_cache(self, direction: Direction, req: CacheRequest, deadline: Deadline) -> Job:
        with tracing.stage(deadline.span, "endpoints"):
            local, link, remote = await self.pipeline.endpoints(direction, req.remote_cluster_id,
                                                                req.remote_cache_id, req.local_cache_id, deadline)
        src, dst = (remote.desc, local.desc) if direction == Direction.PULL else (local.desc, remote.desc)
        with tracing.stage(deadline.span, "plan"):
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

    def track(self, op: str, peer: int | str, timeout: float | None,
              trace_context: TraceContext | None = None) -> Tracked:
        return Tracked(self.metrics, op, str(peer), Deadline(timeout), trace_context)

    async def execute(self, job: Job, t: Tracked) -> TransferResult:
        t.started(job.backend)
        t.moved = await self.runner.run(job, t.deadline, t.id)
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

    async def pull_blocks_by_layer(self, req: BlocksRequest, timeout: float | None,
                                   trace_context: TraceContext | None = None
                                   ) -> AsyncIterator[tuple[int, int] | TransferResult]:
        """Yields (destination layer, bytes) as each layer lands, then the TransferResult."""
        with self.track("pull_blocks_stream", req.remote_cluster_id, timeout, trace_context) as t:
            job = await self.prepare_blocks(Direction.PULL, req, t.deadline)
            t.started(job.backend)
            completed: list[int] = []
            layers = layer_plans(job.plan, req.layers.tensor_num_per_layer)
            for k, (layer, sub) in enumerate(layers):
                try:
                    t.moved += await self.runner.run(job, t.deadline, t.id, sub)
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
        runs = (self.runner.run(job, t.deadline, f"{t.id}.{i}") for i, job in enumerate(jobs))
        outcomes = await asyncio.gather(*runs, return_exceptions=True)
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

