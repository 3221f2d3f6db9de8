"""Scheduler side of the connector: decides which requests pull, which hold their blocks, and tells the workers.

It runs in vLLM's engine-core process. Everything it needs from the workers (cluster id, cache id and layout tag per
TP rank) arrives once through vLLM's handshake metadata. It owns the request's grant: on the prefill side it asks
the daemon for one when a request finishes (so the grant exists before its id leaves the engine, and a decode node's
first renewal can never arrive before it); on the decode side its GrantKeeper renews the grant from the moment the
request arrives until its pull ended, then releases it, on a thread of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbroker._client import Client
from kvbroker.integrations import otel
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.grants import GrantKeeper, PeerLinks, renewal_lease
from kvbroker.integrations.vllm.groups import GroupMismatch, group_parts
from kvbroker.integrations.vllm.layout import FULL_ATTENTION, KvLayout, layout_of_tag
from kvbroker.integrations.vllm.params import (
    HISTORY_PULLED_PARAM,
    KEEP_TURN_PARAM,
    NULL_BLOCK,
    TRACE_PARAM,
    TRACE_STATE_PARAM,
    BadTransferParams,
    PullSpec,
    RemoteKv,
    WorkerEndpoint,
    handed_back_turn,
    matched_tokens,
    parse_remote,
    prefill_output_params,
    release_topic,
    trace_of,
    turn_output_params,
    wants_remote_prefill,
)
from kvbroker.integrations.vllm.remap import Refusal, refusal
from kvbroker.integrations.vllm.spans import RequestSpans
from kvbroker.integrations.vllm.stats import RequestTransfer, TransferLog
from kvbroker.status import LlmError
from kvbroker.types import Grant

# Under "vllm." so that the lines join vLLM's own log output (vLLM configures only its logger tree).
log = logging.getLogger(f"vllm.{__name__}")

RELEASE_DELAY_S = 0.5
"""The latest a pulled request's grant is released after its pull ended, on an engine that stops stepping (on one
that steps: at the next step's output, see `SchedulerSide.on_pulls_ended`)."""


@dataclass
class StepPlan:
    """What the workers do this step (becomes the connector metadata)."""

    pulls: list[PullSpec] = field(default_factory=list)
    holds: dict[str, float] = field(default_factory=dict)
    """Prefill requests whose blocks are held for a decode node, until their grant ends: request id -> its lease."""


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, engine_id: str, block_size: int, client: Client | None = None
                 ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.endpoints: dict[int, WorkerEndpoint] = {}
        self._plan = StepPlan()
        self._pulling: set[str] = set()
        self._releasing: set[str] = set()
        """Requests whose pull ended, their grant's release held back until the next step's output (on_pulls_ended)."""
        self._transfers: dict[str, RequestTransfer] = {}
        self._local_tokens: dict[str, int] = {}
        """Decode requests between num_new_matched_tokens and after_alloc: prompt tokens in the local prefix cache."""
        self._reports: dict[str, dict[str, Any]] = {}
        """Decode requests that asked for remote KV: what their output will say about where their prompt's KV came
        from (completed with the workers' transfers)."""
        self.layout: KvLayout | None = None
        # No I/O here: the channel opens on the first call (an engine that never grants nor pulls never makes one).
        self.client = client or Client(config.target, timeout=config.link_timeout_s, lease_ttl=None)
        self.links = PeerLinks(self.client, config.trusted_prefill(), config.link_timeout_s)
        self.grants = GrantKeeper(self.links, renewal_lease(config.pull_timeout_s))
        self.stats = TransferLog()
        """Requests this side decided to compute locally (refused KV), for vLLM's connector stats."""
        self.spans: RequestSpans | None = None
        """The requests' spans where tracing is on (spans.for_engine); None: off, no call made."""

    def set_endpoints(self, endpoints: Mapping[int, WorkerEndpoint]) -> None:
        clusters = {(e.cluster_id, e.peer_address) for e in endpoints.values()}
        if len(clusters) != 1:
            # The request protocol names one prefill daemon (per-rank caches on it); ranks on several nodes would
            # need one per rank.
            raise ValueError(f"KvBrokerConnector: this engine's TP ranks use different kvbrokerd daemons {clusters}; "
                             "all ranks of an engine must share one daemon")
        self.endpoints = dict(endpoints)
        first = self.endpoints[min(self.endpoints)]
        self.layout = layout_of_tag(first.layout_tag)
        if self.layout.has_view and not all(e.view_cache_id for e in self.endpoints.values()):
            # A rank whose daemon made no token view: none is offered, so that the tag and the grants agree.
            log.warning("kvbroker connector: not every TP rank has a token view of its KV cache; pulls between "
                        "engines of different block sizes are refused")
            self.layout = dataclasses.replace(self.layout, token_view=False, unit_geometry="")
            self.endpoints = {r: dataclasses.replace(e, view_cache_id=0, layout_tag=dataclasses.replace(
                layout_of_tag(e.layout_tag), token_view=False, unit_geometry="").tag())
                for r, e in self.endpoints.items()}
            first = self.endpoints[min(self.endpoints)]
        log.info("kvbroker connector: engine %s, cluster %d, peer address %s, caches %s, layout %r", self.engine_id,
                 first.cluster_id, first.peer_address, [e.cache_id for e in self.endpoints.values()],
                 first.layout_tag)

    # -- decode side ---------------------------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        """A request arrived: from now until its pull ends, its grant is renewed (however long it waits). A prefill
        request of a model with Mamba state stops one token short (`_stop_one_short`); one that continues a turn a
        decode node kept pulls that turn's matching tokens (`_take_turn`)."""
        params = request.kv_transfer_params
        if handed_back_turn(params):
            self._take_turn(request)
        if params and params.get("do_remote_decode") and self.layout is not None and self.layout.has_state:
            _stop_one_short(request)
        if not wants_remote_prefill(params):
            return
        try:
            remote = parse_remote(params)
        except BadTransferParams:
            return  # said in num_new_matched_tokens
        if self.spans is not None:
            self.spans.arrived(request, remote)
        if not self._refusal(remote):
            self.grants.watch(request.request_id, remote.cluster_id, remote.grant)

    def _take_turn(self, request: Any) -> None:
        """A prefill request carrying the previous turn's KV on a decode node (`handed_back_turn`): it pulls the
        tokens its prompt shares with that turn, as a decode request pulls a prompt (from here on its params say
        `do_remote_prefill`, over the matched tokens only), or computes them where nothing matches or the turn
        cannot be read; then the decode node is told at once that it may free the blocks."""
        params = request.kv_transfer_params
        try:
            remote = parse_remote(params)
        except BadTransferParams as e:
            log.error("request %s: the previous turn's KV is ignored, computing it: %s", request.request_id, e)
            self._drop_turn(params)
            return
        why = ""
        if self.layout is None or self.layout.has_state or len(self.layout.windows) > 1 or self.layout.windows[0]:
            why = "this engine's KV cache groups take no turn's KV (one full-attention group only)"
        elif request.prompt_token_ids is None:
            why = "the prompt has no token ids"
        elif len(remote.block_ids) != 1:
            why = f"the turn's KV is in {len(remote.block_ids)} KV cache groups"
        tokens = 0
        if not why:
            try:
                tokens = min(remote.num_tokens, matched_tokens(params, request.prompt_token_ids,
                                                               layout_of_tag(remote.layout_tag).block_size))
            except (BadTransferParams, ValueError) as e:
                why = str(e)
        if why or tokens <= 0:
            log.info("request %s: not reusing the previous turn's KV (%s)", request.request_id,
                     why or "its tokens are not where this prompt starts")
            self._drop_turn(params)
            self._release(request.request_id, remote, "turn not reused")
            return
        params.update({"do_remote_prefill": True, "remote_num_tokens": tokens})

    @staticmethod
    def _drop_turn(params: dict[str, Any]) -> None:
        """The request computes its whole prompt, and its output does not carry the dropped turn's addressing."""
        for key in list(params):
            if key not in ("do_remote_decode", TRACE_PARAM, TRACE_STATE_PARAM):
                del params[key]

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return 0, False
        try:
            remote = parse_remote(params)
        except BadTransferParams as e:
            log.error("request %s: remote KV ignored, computing locally: %s", request.request_id, e)
            return 0, False
        if self._refusal(remote) or self._state_refusal(remote, request.num_prompt_tokens):
            return 0, False  # said once, in after_alloc, where the prefill node is also told to free its blocks
        count = min(remote.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        # Where the pull starts, for a model of several KV cache groups (their block lists say it less directly).
        self._local_tokens[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, all_blocks: Sequence[int], new_blocks: Sequence[int],
                    num_external_tokens: int, groups: Sequence[Sequence[int]] = ()) -> None:
        """`all_blocks`: the request's block ids; `new_blocks`: those not filled from the local prefix cache. With
        several KV cache groups, `groups` holds every group's block ids (then the first two name group 0)."""
        local_tokens = self._local_tokens.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if it is preempted and rescheduled
        try:
            remote = parse_remote(params)
        except BadTransferParams:
            self.stats.record_recompute("bad_params")
            return  # logged by num_new_matched_tokens; without addressing nobody can be told anything
        prompt = request.num_prompt_tokens
        refused = self._refusal(remote) or self._state_refusal(remote, prompt)
        if refused:
            self.stats.record_recompute(self._refusal_reason(refused))
            self.stats.record_refused(refused.field)
            log.error("request %s: refusing KV of prefill engine %s, computing locally: %s", request.request_id,
                      remote.engine_id, refused.message)
            self._reports[request.request_id] = {"prompt": prompt, "cached": 0, "refused": refused.message}
            self._release(request.request_id, remote, "incompatible")
            if self.spans is not None:
                self.spans.not_pulled(request.request_id, f"refused_{refused.field}")
            return
        # Blocks filled from the local prefix cache come first; the pull covers the rest of the prompt's tokens.
        num_local_hits = len(all_blocks) - len(new_blocks)
        start = num_local_hits * self.block_size if local_tokens is None or not groups else local_tokens
        self._reports[request.request_id] = {"prompt": prompt, "cached": min(start, prompt), "refused": ""}
        if num_external_tokens <= 0:
            self._release(request.request_id, remote, "cached locally")
            if self.spans is not None:
                self.spans.not_pulled(request.request_id, "cached")
            return
        assert self.layout is not None  # set with the endpoints, without which _refusal refuses
        theirs = layout_of_tag(remote.layout_tag)
        end = min(remote.num_tokens, prompt)
        if self.spans is not None:  # the pull's span: the daemon's span of the pull continues it
            remote = self.spans.pull_started(request.request_id, remote, end - start)
        if len(self.layout.windows) > 1 or self.layout.windows[0] is not None:
            self._plan.pulls.append(self._group_pull(request.request_id, remote, theirs, groups or (all_blocks,),
                                                     start, end))
            self._pulling.add(request.request_id)
            return
        local = tuple(new_blocks[: -(-end // self.block_size) - num_local_hits])
        src = remote.block_ids[0][start // theirs.block_size: -(-end // theirs.block_size)]
        why = ""
        if (len(remote.block_ids) != 1 or end <= start or not local
                or len(src) != -(-end // theirs.block_size) - start // theirs.block_size):
            why = (f"block counts do not line up (remote {sum(map(len, remote.block_ids))} blocks of "
                   f"{theirs.block_size} tokens in {len(remote.block_ids)} group(s) for {remote.num_tokens} tokens, "
                   f"{num_local_hits} blocks cached locally, {len(new_blocks)} allocated)")
            local = tuple(new_blocks)
        self._plan.pulls.append(PullSpec(request.request_id, local, tuple(src), remote, first_block=num_local_hits,
                                         refused=why, start_token=start, end_token=end))
        self._pulling.add(request.request_id)

    def _group_pull(self, request_id: str, remote: RemoteKv, theirs: KvLayout, local: Sequence[Sequence[int]],
                    start: int, end: int) -> PullSpec:
        """Several KV cache groups (or a sliding window): one part per group, each over the tokens it needs."""
        assert self.layout is not None
        try:
            if end <= start:
                raise GroupMismatch(f"no tokens to pull ([{start}, {end}))")
            parts = group_parts(self.layout, theirs, local, remote.block_ids, start, end)
        except GroupMismatch as e:
            every = tuple(dict.fromkeys(b for group in local for b in group if b != NULL_BLOCK))
            return PullSpec(request_id, every, (), remote, refused=f"block lists do not line up: {e}",
                            start_token=start, end_token=end)
        union = tuple(dict.fromkeys(b for part in parts for b in part.local_blocks))
        return PullSpec(request_id, union, (), remote, start_token=start, end_token=end, parts=parts)

    def on_pulls_ended(self, request_ids: set[str]) -> None:
        """Every rank's pull of these requests ended (vLLM's finished_recving): their grants may go, once the step
        that computes their first token is over. The release (a call through both daemons, and the prefill engine
        woken by the grant's event) would otherwise share the CPU with that step, which ends the decode's TTFT: it
        is sent at the next step's output (`on_step_output`), or `RELEASE_DELAY_S` from now on an engine that stops
        stepping."""
        for req_id in request_ids:
            self.grants.release(req_id, "pulled", delay=RELEASE_DELAY_S)
        self._releasing |= request_ids
        if self.spans is not None:
            self.spans.pulls_ended(request_ids, self._transfers)

    def on_step_output(self) -> None:
        """A step ended (its output): the releases held back by `on_pulls_ended` at an earlier step go now."""
        if self.spans is not None:
            self.spans.step_output()
        if self._releasing:
            self.grants.hurry(self._releasing)
            self._releasing = set()

    def _release(self, request_id: str, remote: RemoteKv, reason: str) -> None:
        """The prefill node may free the blocks now, not when the lease lapses (unless the daemon is untrusted)."""
        if self.links.refusal(remote.cluster_id):
            self.grants.release(request_id, reason)  # stops any renewal; nothing is sent to an untrusted cluster
        else:
            self.grants.release(request_id, reason, remote.cluster_id, remote.grant)

    def on_transfers(self, transfers: Mapping[str, RequestTransfer]) -> None:
        """The workers' finished pulls: reported in the request's output (`kv_transfer_params`) when it finishes."""
        for req_id, transfer in transfers.items():
            if req_id in self._pulling:  # not for requests that finished (aborted) while their pull ran
                # TP ranks whose pulls end in different steps report in different steps
                earlier = self._transfers.get(req_id)
                self._transfers[req_id] = transfer if earlier is None else earlier.combine(transfer)

    def _refusal(self, remote: RemoteKv) -> Refusal | None:
        if self.layout is None:
            return Refusal("engine", "this engine's workers have not reported their kvbroker caches")
        if why := self.links.refusal(remote.cluster_id):
            return Refusal("cluster", why)
        refused = refusal(self.layout, remote.layout_tag)
        if refused is None and layout_of_tag(remote.layout_tag).tp_size != remote.tp_size:
            return Refusal("tp", f"tp: the prefill engine's params say tp_size {remote.tp_size}, its layout tp "
                                 f"{layout_of_tag(remote.layout_tag).tp_size}")
        return refused

    def _state_refusal(self, remote: RemoteKv, prompt: int) -> Refusal | None:
        """A Mamba state is after every token the prefill engine computed: it must be exactly the prompt less the
        last token, which this engine then computes (once more would apply it to the state twice)."""
        if self.layout is None or not self.layout.has_state or remote.num_tokens == prompt - 1:
            return None
        return Refusal("state", f"state: the prefill engine's Mamba state is after {remote.num_tokens} tokens of "
                                f"this {prompt}-token prompt, not {prompt - 1} (its engine must stop one token "
                                "short)")

    @staticmethod
    def _refusal_reason(refused: Refusal) -> str:
        """A refusal's recompute reason, as a metric label."""
        return {"engine": "not_ready", "cluster": "untrusted"}.get(refused.field, "layout")

    # -- both sides ----------------------------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: Sequence[int] | Sequence[Sequence[int]],
                         finished_normally: bool) -> tuple[bool, dict[str, Any] | None]:
        """`block_ids`: the request's blocks, one list per KV cache group (or one flat list: one group)."""
        params = request.kv_transfer_params
        if self.spans is not None:
            self.spans.finished(request.request_id)
        self._pulling.discard(request.request_id)
        self._local_tokens.pop(request.request_id, None)
        transfer = self._transfers.pop(request.request_id, None)
        report = self._reports.pop(request.request_id, None)
        if report is not None:  # (an aborted request's output carries nothing: nobody reads it)
            if not finished_normally:
                return False, None
            out = self._decode_report(report, transfer, params)
            if params.get("do_remote_decode"):  # a prefill request that pulled the previous turn: now it grants
                delay, granted = self._grant(request, block_ids, params)
                return delay, {**out, **(granted or {}), HISTORY_PULLED_PARAM: out["kvbroker_tokens_pulled"]}
            if params.get(KEEP_TURN_PARAM):
                delay, granted = self._grant_turn(request, block_ids, params)
                return delay, {**out, **(granted or {})}
            return False, out
        if transfer is not None:
            return False, transfer.params()
        if not params:
            return False, None
        # Aborted during its pull or before it was ever scheduled: the prefill node may free its blocks now.
        if not wants_remote_prefill(params):
            self.grants.release(request.request_id, "finished")
        else:
            params["do_remote_prefill"] = False
            with contextlib.suppress(BadTransferParams):  # logged when it arrived
                self._release(request.request_id, parse_remote(params), "aborted")
            return False, None
        if not finished_normally:
            return False, None
        if params.get("do_remote_decode"):
            return self._grant(request, block_ids, params)
        if params.get(KEEP_TURN_PARAM):
            return self._grant_turn(request, block_ids, params)
        return False, None

    def _grant(self, request: Any, block_ids: Sequence[int] | Sequence[Sequence[int]], params: dict[str, Any]
               ) -> tuple[bool, dict[str, Any] | None]:
        """A finished prefill request: its blocks granted to the decode node, held under the grant's lease."""
        num_tokens = request.num_computed_tokens
        groups = [list(group)[: -(-num_tokens // self.block_size)] for group in _as_groups(block_ids)]
        if not any(groups) or self.layout is None:
            return False, None
        kinds = self.layout.kinds
        if len(groups) != len(kinds):
            log.error("request %s: %d block lists for %d KV cache groups; not granting its KV", request.request_id,
                      len(groups), len(kinds))
            return False, None
        # Every group's blocks that hold KV or state (a sliding window's dropped ones do not), each once.
        blocks = list(dict.fromkeys(b for group, kind in zip(groups, kinds, strict=True) for b in group
                                    if kind == FULL_ATTENTION or b != NULL_BLOCK))
        grant = self._create_grant(request, blocks, params, "the decode node will compute them")
        if grant is None:
            return False, None
        return True, prefill_output_params(self.endpoints, self.engine_id, request.request_id, groups, num_tokens,
                                           grant)

    def _grant_turn(self, request: Any, block_ids: Sequence[int] | Sequence[Sequence[int]], params: dict[str, Any]
                    ) -> tuple[bool, dict[str, Any] | None]:
        """A finished decode request whose next turn may reuse its KV (`KEEP_TURN_PARAM`): the whole blocks of its
        prompt and generated tokens granted, held under the grant's lease as a prefill request's are (unused, they
        are freed when it lapses). One full-attention KV cache group only."""
        layout = self.layout
        if layout is None or layout.has_state or len(layout.kinds) != 1 or layout.windows[0] is not None:
            return False, None
        tokens = list(request.all_token_ids)
        num_blocks = min(request.num_computed_tokens, len(tokens)) // self.block_size
        blocks = list(_as_groups(block_ids)[0])[:num_blocks]
        if not blocks or len(blocks) < num_blocks or NULL_BLOCK in blocks:
            return False, None
        grant = self._create_grant(request, blocks, params, "the next turn computes them")
        if grant is None:
            return False, None
        return True, turn_output_params(self.endpoints, self.engine_id, request.request_id, blocks,
                                        tokens[: num_blocks * self.block_size], grant)

    def _create_grant(self, request: Any, blocks: list[int], params: Mapping[str, Any], fallback: str
                      ) -> Grant | None:
        """A grant on this engine's `blocks` (every rank's cache), held from this step on; None if the daemon
        refuses (logged: then another engine computes them)."""
        assert self.layout is not None
        ranks = sorted(self.endpoints)
        span = self.spans.grant(request, len(blocks)) if self.spans is not None else None
        try:
            # Made before the params leave the engine: every renewal or redeem of it finds it.
            grant = self.client.create_grant(
                [self.endpoints[r].cache_id for r in ranks], blocks, self.config.hold_lease_s,
                max_hold=self.config.release_timeout_s, label=request.request_id,
                event_topics=[release_topic(self.engine_id, r) for r in ranks], units_per_block=self.layout.grant_units,
                # The same blocks in each rank's token view, for an engine of another block size.
                view_cache_ids=[self.endpoints[r].view_cache_id for r in ranks] if self.layout.has_view else (),
                view_units_per_block=self.layout.view_grant_units, timeout=self.config.link_timeout_s,
                trace_context=trace_of(params) if span is None else otel.trace_of(span))
        except LlmError as e:
            if self.spans is not None and span is not None:
                self.spans.granted(request, span, e.status.name, len(blocks))
            log.error("request %s: cannot grant its KV blocks to another engine (%s: %s); %s", request.request_id,
                      e.status.name, e.message, fallback)
            return None
        self._plan.holds[request.request_id] = self.config.hold_lease_s
        if self.spans is not None and span is not None:
            self.spans.granted(request, span, "ok", len(blocks))
        return grant

    def shutdown(self) -> None:
        self.grants.stop()
        self.client.close()
        if self.spans is not None:
            self.spans.shutdown()

    @staticmethod
    def _decode_report(report: dict[str, Any], transfer: RequestTransfer | None, params: Mapping[str, Any]
                       ) -> dict[str, Any]:
        """Where the prompt's KV came from: pulled from the prefill side, found in the local prefix cache, or
        recomputed here (a refusal or a failed pull), so that nobody mistakes a silent fallback for a transfer.
        Repeats what the prefill engine said it pulled of the conversation's previous turn (bounded: informative)."""
        pulled = transfer.tokens if transfer is not None else 0
        out = {**(transfer.params() if transfer is not None else {}),
               "kvbroker_prompt_tokens": report["prompt"], "kvbroker_tokens_pulled": pulled,
               "kvbroker_tokens_cached": report["cached"],
               "kvbroker_tokens_recomputed": max(0, report["prompt"] - report["cached"] - pulled)}
        if report["refused"]:
            out["kvbroker_refused"] = report["refused"]
        history = params.get(HISTORY_PULLED_PARAM)
        if type(history) is int and 0 <= history <= report["prompt"]:
            out[HISTORY_PULLED_PARAM] = history
        return out

    def take_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan


def _stop_one_short(request: Any) -> None:
    """Drops a prefill request's last prompt token, as NixlConnector does for Mamba models: the prefill engine's
    state is then after N - 1 tokens, and the decode engine, which always computes the last prompt token itself,
    derives the state after N from it. Once per request (a preempted one is scheduled again)."""
    params = request.kv_transfer_params
    if params.get("kvbroker_one_short") or request.num_prompt_tokens < 2 or request.prompt_token_ids is None:
        return
    del request.prompt_token_ids[-1:]
    del request._all_token_ids[-1:]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    _rehash(request)
    params["kvbroker_one_short"] = True


def _rehash(request: Any) -> None:
    """Hashes a shortened request's blocks again. With a connector, vLLM hashes every request's full blocks when it
    arrives (0.34: in the front end), prefix caching on or off: the last block's hash still named the dropped token,
    and once the generated token filled that block, whatever reads the hashes (the prefix cache, KV cache events)
    would take it for the prompt's. Harmless while a Mamba model runs with prefix caching off, as it must here today;
    vLLM 0.34's NixlConnector truncates its hashes for the same reason (`truncate_block_hashes` needs the hash block
    size, which 0.32 does not give a connector; hashing a prompt again is cheap)."""
    if getattr(request, "_block_hasher", None) is None:
        return  # an engine that hashes nothing (neither prefix caching nor a connector)
    del request.block_hashes[:]
    request.update_block_hashes()


def _as_groups(block_ids: Sequence[int] | Sequence[Sequence[int]]) -> list[Sequence[int]]:
    if block_ids and not isinstance(block_ids[0], int):
        return list(block_ids)  # type: ignore[arg-type]  # a list per group
    return [block_ids]  # type: ignore[list-item]  # one group's flat list
