"""The transfer manager: validates a request completely, plans it, runs it on the link's backend off the event loop,
and ends it in exactly one terminal state (DONE, or a raised LlmError saying why)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvbroker._types import TransferResult
from kvbroker.v1 import errors_pb2
from kvbrokerd.errors import LlmError, LlmStatus, fail, param_invalid
from kvbrokerd.links import LinkTable
from kvbrokerd.planner import LayerSelection, Progress, block_array, check_block_lists, plan_blocks
from kvbrokerd.registry import Registry

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 60.0
GRACE_S = 1.0
REPLY_MARGIN_S = 0.05


@dataclass(frozen=True, slots=True)
class PullBlocksRequest:
    src_cluster_id: int
    src_cache_id: int
    src_batch_index: int
    dst_cache_id: int
    src_blocks: Sequence[int]
    dst_blocks: Sequence[int]
    layers: LayerSelection


class TransferManager:
    def __init__(self, registry: Registry, links: LinkTable, executor: concurrent.futures.Executor) -> None:
        self._registry = registry
        self._links = links
        self._executor = executor
        self.in_flight = 0

    async def pull_blocks(self, req: PullBlocksRequest, timeout: float | None) -> TransferResult:
        transfer_id = uuid.uuid4().hex[:12]
        started = time.monotonic()
        # Give up a little before the caller's deadline so that the caller gets our report, not a bare timeout.
        budget = DEFAULT_DEADLINE_S if timeout is None else timeout
        deadline = started + budget - min(REPLY_MARGIN_S, budget * 0.1)
        # LLM-DataDist's order of checks: request shape, then local cache, link, remote cache, then the plan.
        if req.src_batch_index != 0:
            param_invalid(f"src_cache_index.batch_index must be 0 for block pulls, got {req.src_batch_index}")
        if req.src_cluster_id == self._links.cluster_id:
            param_invalid(f"cannot pull from our own cluster {req.src_cluster_id}")
        src_blocks = block_array(req.src_blocks, "src_blocks")
        dst_blocks = block_array(req.dst_blocks, "dst_blocks")
        check_block_lists(src_blocks, dst_blocks)
        dst = self._registry.get(req.dst_cache_id)
        link = self._links.get_ready(req.src_cluster_id)
        remote = await link.remote_cache(req.src_cache_id, max(0.001, deadline - time.monotonic()))
        plan = plan_blocks(remote.desc, dst.desc, src_blocks, dst_blocks, req.layers)
        channel = link.channel
        assert channel is not None
        pinned_dst = self._registry.pin(req.dst_cache_id)
        progress = Progress(plan)
        work: asyncio.Future[int]
        if channel.runs_inline(plan):
            work = asyncio.get_running_loop().create_future()
            try:
                work.set_result(channel.pull(remote, pinned_dst, plan, progress, deadline))
            except Exception as e:
                work.set_exception(e)
        else:
            work = asyncio.get_running_loop().run_in_executor(self._executor, channel.pull, remote, pinned_dst, plan,
                                                              progress, deadline)
        self.in_flight += 1
        try:
            # The worker honours the same deadline; the grace only guards against a stuck system call.
            if not work.done():
                await asyncio.wait({work}, timeout=max(0.0, deadline - time.monotonic()) + GRACE_S)
            if not work.done():
                fail(LlmStatus.LLM_TIMEOUT, f"transfer {transfer_id} passed its deadline")
            moved = work.result()
        except LlmError as e:
            if e.status == LlmStatus.LLM_KV_CACHE_NOT_EXIST:
                link.forget_cache(req.src_cache_id)
            elif e.status == LlmStatus.LLM_LINK_FAILED:
                link.mark_broken(e.message)
            e.details.update(transfer_id=transfer_id, backend=link.backend, stage="transfer",
                             cluster_id=str(req.src_cluster_id))
            e.details["transfer_report"] = errors_pb2.TransferReport(
                transfer_id=transfer_id, backend=link.backend, stage="transfer",
                failed_dst_blocks=progress.failed_dst_blocks().tolist(), bytes_moved=progress.bytes_moved)
            log.warning("transfer %s from cluster %d failed on %s: %s", transfer_id, req.src_cluster_id,
                        link.backend, e)
            raise
        finally:
            self.in_flight -= 1
            # A copy still running (timeout, cancelled caller) keeps the destination mapped until it stops.
            if work.done():
                self._registry.unpin(pinned_dst)
            else:
                work.add_done_callback(lambda _: self._registry.unpin(pinned_dst))
        elapsed = time.monotonic() - started
        log.debug("transfer %s: %d bytes in %d runs from cluster %d via %s in %.3f ms", transfer_id, moved,
                  plan.num_runs, req.src_cluster_id, link.backend, elapsed * 1e3)
        return TransferResult(bytes_moved=moved, backend=link.backend, transfer_id=transfer_id,
                              num_runs=plan.num_runs)
