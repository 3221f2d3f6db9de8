"""The one way a block transfer is prepared: check -> grant -> endpoints -> plan. PullKvBlocks, PushKvBlocks, each
group of a batch, the layer-wise stream and every step of a pull session pass here, as `Transfer`s to one peer; the
manager then runs the jobs (claim and pin -> run -> report, manager.py). Nothing here moves a byte, so a refused
transfer never writes one.

- check: the batch index (a request's pairs were checked where it arrived, dataplane/pairs.py);
- grant: a pull of granted blocks becomes a plain pull of exactly what the granting daemon names (`_redeem`);
- endpoints: our cluster, the local cache, the READY link, the remote cache (LLM-DataDist's order of checks), and what
  the link's backend can move;
- plan: transfers that name the same caches, layers and `share` are planned as one (a session's step: one claim, one
  pin, one data-plane job), up to a job's bytes. If that plan is refused, each is planned alone, so that the refusal
  is the guilty one's, and the others run together again where no two write one block. Pulls from several of the
  peer's caches into one cache (a decode rank's from the prefill's TP ranks), same layers and `share`, are one job
  where the link's channel runs one over several caches (shm: `pull_several`): each cache's pulls checked and
  planned as they are alone, then their destinations checked apart across the caches; if any of that fails, each
  cache's pulls are prepared on their own, as above.

A transfer refused on the way has its `error` set and is in no job; the others are unaffected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvbroker.status import make_error
from kvbroker.types import CacheDesc
from kvbrokerd import tracing
from kvbrokerd.dataplane.pairs import BlockPairs, TooLongForTheLoop
from kvbrokerd.dataplane.plan import Plan
from kvbrokerd.dataplane.seam import PeerChannel, RemoteCache
from kvbrokerd.errors import LlmError, LlmStatus, fail, param_invalid
from kvbrokerd.links.grantcache import HOLD_MARGIN_S
from kvbrokerd.links.table import Link, LinkTable
from kvbrokerd.registry import devicemem
from kvbrokerd.registry.caches import CacheEntry, Registry
from kvbrokerd.transfers.planner import LayerSelection, concatenated, plan_pairs, side_by_side
from kvbrokerd.transfers.requests import BlocksRequest, Direction, Job
from kvbrokerd.transfers.tracking import Deadline

PLAN_ON_LOOP_MAX_BLOCKS = 1 << 14
MAX_GROUP_BYTES = 1 << 30
"""At most this many bytes (and at most half of max_inflight_bytes) are planned as one job: a larger one would hold
its destination claims and its share of the in-flight limit for longer than the transfers that make it up would."""
MIN_GRANTED_PULL_S = 0.05
"""A pull by a grant that ends sooner than this is refused: a pull shortened to that would only time out."""


@dataclass(eq=False)
class Transfer:
    """One request on its way through the pipeline."""

    direction: Direction
    request: BlocksRequest
    """After the grant: the redeemed request (the granted cache, sourced pairs)."""
    deadline: Deadline
    share: object = None
    """Transfers that name the same caches and layers are planned as one only if their `share` is equal too."""
    error: LlmError | None = None
    plan: Plan | None = None
    """Its own plan, when it had to be planned alone."""


Prepared = tuple[Job, list[Transfer]]


class Pipeline:
    def __init__(self, registry: Registry, links: LinkTable, executor: concurrent.futures.Executor, *,
                 max_inflight_bytes: int) -> None:
        self._registry = registry
        self._links = links
        self._executor = executor
        self._max_group_bytes = max(1, min(MAX_GROUP_BYTES, max_inflight_bytes // 2))

    async def prepare(self, transfers: Sequence[Transfer]) -> list[Prepared]:
        """Jobs for transfers to one peer, each with the transfers it carries."""
        granted = [t for t in transfers if t.request.grant is not None]
        if granted:  # a grant is redeemed with the peer (a round trip): concurrently
            await asyncio.gather(*(self._redeem(t) for t in granted))
        groups: dict[tuple[object, ...], list[Transfer]] = {}
        for t in transfers:
            if t.error is None:
                r = t.request
                groups.setdefault((t.direction, r.local_cache_id, r.layers, t.share), []).append(t)
        jobs: list[Prepared] = []
        for group in groups.values():
            by_cache: dict[int, list[Transfer]] = {}
            for t in group:
                if self._check(t):
                    by_cache.setdefault(t.request.remote_cache_id, []).append(t)
            if len(by_cache) > 1 and group[0].direction == Direction.PULL:
                several = await self._plan_sources(list(by_cache.values()))
                if several is not None:
                    jobs.append(several)
                    continue
            for same in by_cache.values():
                jobs.extend(await self._plan_group(same))
        return jobs

    async def prepare_one(self, direction: Direction, request: BlocksRequest, deadline: Deadline) -> Job:
        """The job of one transfer, or its LlmError raised."""
        t = Transfer(direction, request, deadline)
        jobs = await self.prepare([t])
        if t.error is not None:
            raise t.error
        return jobs[0][0]

    async def endpoints(self, direction: Direction, cluster_id: int, cache_id: int, local_cache_id: int,
                        deadline: Deadline) -> tuple[CacheEntry, Link, RemoteCache]:
        """LLM-DataDist's order of checks: own cluster, local cache, link, remote cache."""
        if cluster_id == self._links.cluster_id:
            param_invalid(f"cannot {direction.value} with our own cluster {cluster_id}")
        local = self._registry.get(local_cache_id)
        link = self._links.get_ready(cluster_id)
        remote = await link.remote_cache(cache_id, deadline.remaining())
        devicemem.check_moves(self._links.backends.get(link.backend), (f"local cache {local_cache_id}", local.tensors),
                              (f"remote cache {cache_id}", remote.tensors))
        return local, link, remote

    async def plan(self, src: CacheDesc, dst: CacheDesc, pairs: BlockPairs, layers: LayerSelection) -> Plan:
        """`plan_pairs`, off the event loop when it would take long: planning 2^20 pairs takes a good part of a
        second, which other callers must not wait for; a few stretches or strided runs plan in microseconds."""
        if pairs.checks_quickly(PLAN_ON_LOOP_MAX_BLOCKS):
            try:
                return plan_pairs(src, dst, pairs, layers, loop_budget=PLAN_ON_LOOP_MAX_BLOCKS)
            except TooLongForTheLoop:  # runs that interleave at different steps: checked one by one
                pass
        return await asyncio.get_running_loop().run_in_executor(self._executor, plan_pairs, src, dst, pairs, layers)

    # -- check and grant -------------------------------------------------------------------------------------------
    @staticmethod
    def _check(t: Transfer) -> bool:
        if t.request.remote_batch_index != 0:
            side = "src" if t.direction == Direction.PULL else "dst"
            t.error = LlmError(LlmStatus.LLM_PARAM_INVALID, f"{side}_cache_index.batch_index must be 0 for block "
                               f"transfers, got {t.request.remote_batch_index}")
        return t.error is None

    async def _redeem(self, t: Transfer) -> None:
        if self._check(t):
            try:
                with tracing.stage(t.deadline.span, "redeem"):
                    t.request = await self._redeemed(t.direction, t.request, t.deadline)
            except LlmError as e:
                t.error = e

    async def _redeemed(self, direction: Direction, req: BlocksRequest, deadline: Deadline) -> BlocksRequest:
        """A pull of granted blocks becomes a plain pull of exactly the cache and blocks that the granting daemon
        names (never what the caller names): redeemed over the link, before any byte moves (or as a renewal through
        us described it, links/grantcache.py). The granting daemon holds the blocks for us past our deadline
        (registry/grants.py says how, whatever ends the grant meanwhile), and every copy stops writing at the
        deadline (its fence): a pull that succeeds read only blocks that were still granted."""
        claim = req.grant
        assert claim is not None
        if direction != Direction.PULL:
            param_invalid("a grant is pulled from, never pushed to")
        if req.remote_cluster_id == self._links.cluster_id:
            param_invalid(f"cannot pull with our own cluster {req.remote_cluster_id}")
        pairs = req.pairs
        if pairs.runs is not None and claim.first_block:
            param_invalid("first_block says where in the grant's own blocks a pull that names no source blocks "
                          "starts; block_runs name their source blocks: leave it 0")
        self._registry.get(req.local_cache_id)
        link = self._links.get_ready(req.remote_cluster_id)
        # From here until the pull is over, a release of the grant through this link keeps the blocks for it.
        deadline.when_over(link.readers.begin(claim.grant_id, deadline.at))
        granted, lives_until = await link.granted(claim.grant_id, claim.secret, deadline.remaining() + HOLD_MARGIN_S,
                                                  deadline.remaining())  # a renewal's answer, or a RedeemGrant
        if deadline.span is not None and granted.traceparent:  # the span the grant was made under (CreateGrant's)
            tracing.link(deadline.span, granted.traceparent, **{"kvbroker.link": "grant"})
        if lives_until < deadline.at:  # the grant's cap is near: the pull must end before it (its fence stops it)
            if lives_until - time.monotonic() < MIN_GRANTED_PULL_S:
                fail(LlmStatus.LLM_KV_CACHE_NOT_EXIST, f"the grant ends in "
                     f"{max(0, int((lives_until - time.monotonic()) * 1000))} ms (its max hold is near): its blocks "
                     "may be reused under any pull now, so nothing was pulled")
            deadline.at = lives_until
        # Slots past the caches are the grant's views of their memory, in their own units.
        slots = [*granted.cache_ids, *granted.view_cache_ids]
        if claim.cache_slot >= len(slots):
            param_invalid(f"the grant covers {len(slots)} caches; there is no cache_slot {claim.cache_slot}")
        cache_id = int(slots[claim.cache_slot])
        if req.remote_cache_id not in (0, cache_id):
            param_invalid(f"the grant covers cache {cache_id} in slot {claim.cache_slot}, not cache "
                          f"{req.remote_cache_id}")
        blocks = np.array(list(granted.blocks), dtype=np.uint64)
        units = max(1, int(granted.units_per_block if claim.cache_slot < len(granted.cache_ids)
                           else granted.view_units_per_block))
        if pairs.sourced:
            outside = pairs.outside_grant(blocks, units)
            if len(outside):
                shown = [int(b) for b in outside[:8]]
                param_invalid(f"the grant does not cover src blocks {shown}{'...' if len(outside) > 8 else ''}")
            return replace(req, remote_cache_id=cache_id, grant=None)
        wanted = pairs.num_pairs
        if claim.first_block + wanted > len(blocks) * units:
            param_invalid(f"the grant covers {len(blocks) * units} blocks; {wanted} from its block "
                          f"{claim.first_block} on were asked for")
        at = np.arange(claim.first_block, claim.first_block + wanted, dtype=np.uint64)
        src = blocks[at // np.uint64(units)] * np.uint64(units) + at % np.uint64(units)
        return replace(req, remote_cache_id=cache_id, pairs=pairs.with_sources(src), grant=None)

    # -- endpoints and plan ----------------------------------------------------------------------------------------
    async def _plan_group(self, group: list[Transfer]) -> list[Prepared]:
        """Jobs for transfers that name the same caches and layers: one plan per job where they allow it."""
        group = [t for t in group if self._check(t)]
        if not group:
            return []
        first = group[0]
        r = first.request
        try:
            with tracing.stage(first.deadline.span, "endpoints"):
                local, link, remote = await self.endpoints(first.direction, r.remote_cluster_id, r.remote_cache_id,
                                                           r.local_cache_id, min((t.deadline for t in group),
                                                                                 key=lambda d: d.at))
        except LlmError as e:
            for t in group:  # each its own error: each is answered (and its details amended) on its own
                t.error = e if len(group) == 1 else make_error(e.status, e.message, dict(e.details))
            return []
        src, dst = (remote.desc, local.desc) if first.direction == Direction.PULL else (local.desc, remote.desc)
        channel = channel_of(link)

        def job(plan: Plan) -> Job:
            return Job(first.direction, plan, r.local_cache_id, channel, remote, link)

        jobs = []
        for chunk in _chunks(group, local.desc.block_nbytes * local.desc.num_tensors, self._max_group_bytes):
            try:
                with tracing.stage(chunk[0].deadline.span, "plan"):
                    plan = await self.plan(src, dst, BlockPairs.joined([t.request.pairs for t in chunk]), r.layers)
            except LlmError as e:
                if len(chunk) == 1:
                    chunk[0].error = e
                else:
                    jobs.extend(await self._plan_alone(chunk, src, dst, job))
                continue
            jobs.append((job(plan), chunk))
        return jobs

    async def _plan_sources(self, parts: list[list[Transfer]]) -> Prepared | None:
        """One job for pulls from several of the peer's caches into one cache (a decode rank's pulls from the
        prefill's TP ranks), on a channel that can run it: each cache's pulls checked and planned as they would be
        alone, and no two of them writing one destination block. None when any of that fails or does not apply:
        then each cache's pulls are prepared on their own, so that a refusal is the guilty one's."""
        transfers = [t for part in parts for t in part]
        first = transfers[0]
        r = first.request
        ready = self._links.links.get(r.remote_cluster_id)
        if ready is None or ready.channel is None or not ready.channel.pulls_from_several:
            return None  # (a link that is not READY: `endpoints` says so to each cache's pulls)
        deadline = min((t.deadline for t in transfers), key=lambda d: d.at)
        try:
            with tracing.stage(first.deadline.span, "endpoints"):
                local, link, remote = await self.endpoints(first.direction, r.remote_cluster_id, r.remote_cache_id,
                                                           r.local_cache_id, deadline)
                channel = channel_of(link)
                if not channel.pulls_from_several:
                    return None
                remotes = [remote]
                for part in parts[1:]:
                    other = await link.remote_cache(part[0].request.remote_cache_id, deadline.remaining())
                    devicemem.check_moves(self._links.backends.get(link.backend),
                                          (f"remote cache {other.cache_id}", other.tensors))
                    remotes.append(other)
            bytes_per_block = local.desc.block_nbytes * local.desc.num_tensors
            if sum(t.request.pairs.num_pairs for t in transfers) * bytes_per_block > self._max_group_bytes:
                return None
            with tracing.stage(first.deadline.span, "plan"):
                pairs = [BlockPairs.joined([t.request.pairs for t in part]) for part in parts]
                plans = [await self.plan(source.desc, local.desc, each, r.layers)
                         for source, each in zip(remotes, pairs, strict=True)]
                if not _write_apart(BlockPairs.joined(pairs), local.desc.num_blocks):
                    return None
        except LlmError:
            return None
        first_tensors = np.cumsum([0] + [source.desc.num_tensors for source in remotes[:-1]]).tolist()
        plan = side_by_side(plans, first_tensors)
        return Job(Direction.PULL, plan, r.local_cache_id, channel, remote, link, sources=tuple(remotes)), transfers

    async def _plan_alone(self, chunk: list[Transfer], src: CacheDesc, dst: CacheDesc,
                          job: Callable[[Plan], Job]) -> list[Prepared]:
        """The transfers of a refused plan, each planned alone (a refusal is then the guilty one's own), and those
        that pass run together again where no two write one block."""
        planned = []
        for t in chunk:
            try:
                t.plan = await self.plan(src, dst, t.request.pairs, t.request.layers)
                planned.append(t)
            except LlmError as e:
                t.error = e
        return [(job(merged_plan([t.plan for t in group if t.plan is not None])), group)
                for group in _disjoint(planned)]


def channel_of(link: Link) -> PeerChannel:
    if link.channel is None:  # pragma: no cover - a READY link has its channel
        fail(LlmStatus.LLM_LINK_FAILED, f"link to cluster {link.remote_cluster_id} has no data channel")
    return link.channel


def merged_plan(plans: Sequence[Plan]) -> Plan:
    """The plans' runs one after the other."""
    if len(plans) == 1:
        return plans[0]
    return concatenated(plans)  # (strided plans, rare in a merged group, are written out)


def _write_apart(pairs: BlockPairs, dst_num_blocks: int) -> bool:
    """Whether no two of these pairs (each source's already checked on its own) name one destination block, judged
    without writing them out: False also when that would take long on the loop."""
    if not pairs.checks_quickly(PLAN_ON_LOOP_MAX_BLOCKS):
        return False
    src_max, _ = pairs.bounds()
    try:
        pairs.checked_runs(src_max + 1, dst_num_blocks, loop_budget=PLAN_ON_LOOP_MAX_BLOCKS)
    except (LlmError, TooLongForTheLoop):
        return False
    return True


def _chunks(transfers: list[Transfer], bytes_per_block: int, max_bytes: int) -> Iterator[list[Transfer]]:
    """Consecutive transfers of at most `max_bytes` together (a larger one alone)."""
    if len(transfers) == 1:
        yield transfers
        return
    chunk: list[Transfer] = []
    size = 0
    for t in transfers:
        n = t.request.pairs.num_pairs * bytes_per_block
        if chunk and size + n > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(t)
        size += n
    if chunk:
        yield chunk


def _disjoint(transfers: list[Transfer]) -> list[list[Transfer]]:
    """Groups in which no two transfers write one destination block (first fit, in order). The blocks stay in numpy
    arrays (8 bytes each; a Python set would cost ~70): a message's pairs are bounded, not small."""
    groups: list[tuple[list[Transfer], np.ndarray]] = []
    for t in transfers:
        blocks = np.sort(t.request.pairs.dst)  # a planned transfer's destination blocks are distinct
        for i, (group, taken) in enumerate(groups):
            at = np.searchsorted(taken, blocks)
            if not (taken[np.minimum(at, len(taken) - 1)] == blocks).any():
                group.append(t)
                groups[i] = (group, np.union1d(taken, blocks))
                break
        else:
            groups.append(([t], blocks))
    return [g for g, _ in groups]

