"""Worker side of the connector: owns the engine's KV memory (through the daemon), runs pulls, keeps held blocks.

Decode role: a step's pulls go to the daemon as one message of one long-lived pull session (loads.py; the engine
keeps stepping meanwhile); a finished pull, good or bad, is reported through `get_finished` in the same step as the
blocks that did not land, so vLLM recomputes those instead of reading them. A pull names only the request's
grant: the daemon redeems it with the prefill daemon (a trusted one: `kvbroker_prefill_daemons`), which names the
cache and blocks. The scheduler side releases the grant.

Prefill role: a finished request's blocks stay allocated until its grant ends (released by the decode node, lapsed,
or capped), which this node's own daemon posts on the rank's topic; notes from anyone else there are ignored. No
hold outlives its grant even where that event never comes: past the grant's cap (`kvbroker_release_timeout_s`) plus
a margin the blocks are freed anyway (the daemon lets no pull read a grant past its cap), and when the daemon
restarts (a new instance epoch) every hold made before is freed at once (its grants died with the old instance).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvbroker._client import Client
from kvbroker.integrations.vllm.config import ConnectorConfig
from kvbroker.integrations.vllm.cuda_layout import read_runs
from kvbroker.integrations.vllm.cuda_remap import Geometry, NoRemap, read_geometry, remote_geometry, units_desc
from kvbroker.integrations.vllm.cuda_remap import plan_pull as cuda_remap_pull
from kvbroker.integrations.vllm.gpu import GpuKv, open_gpu_kv
from kvbroker.integrations.vllm.grants import PeerLinks
from kvbroker.integrations.vllm.layout import MEMORY_MLA, KvLayout, layout_of_tag
from kvbroker.integrations.vllm.lifecycle import session_id
from kvbroker.integrations.vllm.loads import LoadOutcome, PullItem, StepLoads
from kvbroker.integrations.vllm.memory import DaemonKvAllocation
from kvbroker.integrations.vllm.params import (
    PullPart,
    PullSpec,
    WorkerEndpoint,
    parse_release,
    release_topic,
)
from kvbroker.integrations.vllm.remap import (
    UnitPull,
    blocks_of_units,
    merged,
    plan_pull,
    plan_state,
    refusal,
    settle,
)
from kvbroker.integrations.vllm.stages import layer_pulls
from kvbroker.integrations.vllm.stats import TransferLog, reason_of
from kvbroker.shm import Cache
from kvbroker.status import LlmError
from kvbroker.types import KvCacheExtParam

# Under "vllm." so that the lines join vLLM's own log output (vLLM configures only its logger tree).
log = logging.getLogger(f"vllm.{__name__}")

# One tensor per layer, addressed in units of a few tokens of one head (layout.KvLayout.desc).
_ONE_TENSOR_PER_LAYER = KvCacheExtParam(tensor_num_per_layer=1)
_POLL_WAIT_S = 1.0
_RELEASED_KEPT_S = 600.0
"""A grant's end for a request this rank does not (yet) hold is kept this long (the daemon's notification age)."""
CAP_MARGIN_S = 10.0
"""Past its grant's cap by this much a hold is freed without the grant's event: the hold is noted after the grant was
made, so this is later than the daemon's cap, and no pull reads a grant past its cap."""
_EPOCH_CHECK_S = 5.0
"""How often the release poller asks whether its daemon restarted (and at once after a failed fetch)."""
_DAEMON_RESTARTED = "daemon restarted"


@dataclass(frozen=True, slots=True)
class _Loading:
    """A request whose pulls are in flight: what its outcome is reported against."""

    spec: PullSpec
    sources: int
    """Prefill ranks it reads."""
    layout: KvLayout
    """How the pull addressed our KV (our cache's units, or our token view's)."""
    gpu_units: int = 0
    """A GPU engine's remap: units per block of its unit cache (its failed units are reported as their blocks)."""


@dataclass(frozen=True, slots=True)
class PullOutcome:
    request_id: str
    failed_blocks: frozenset[int]


def _merged(plans: Iterable[list[UnitPull]]) -> list[UnitPull]:
    """The pulls of several KV cache groups, one per prefill rank (the groups' blocks are distinct)."""
    plans = list(plans)
    if len(plans) == 1:
        return plans[0]
    by_rank: dict[int, list[UnitPull]] = {}
    for plan in plans:
        for one in plan:
            by_rank.setdefault(one.remote_rank, []).append(one)
    return [merged(pulls) for _, pulls in sorted(by_rank.items())]


class WorkerSide:
    def __init__(self, config: ConnectorConfig, engine_id: str, rank: int, layout: KvLayout,
                 client: Client | None = None, slot: int | None = None) -> None:
        self.config = config
        self.engine_id = engine_id
        self.rank = rank
        """This worker's TP rank (which KV heads it holds)."""
        self.slot = rank if slot is None else slot
        """Its place among the engine's workers (pipeline stage x TP size + TP rank): where a grant names its cache."""
        self.layout = layout
        if client is None:
            client = Client(config.target, timeout=config.pull_timeout_s, lease_ttl=config.lease_ttl_s)
            # Named after the engine, so that the server's front end can free the cache when it stops (lifecycle.py).
            client.session_id = session_id(engine_id, self.slot)
        self.client = client
        self.cache: Cache | None = None
        self.view: Cache | None = None
        """The cache's token view (`KvLayout.token_view`): the same memory, addressed for block-size remaps."""
        self.endpoint: WorkerEndpoint | None = None
        self.transfers = TransferLog()
        self._allocation: DaemonKvAllocation | None = None
        self.gpu: GpuKv | None = None
        """Set on a GPU engine (register_gpu): the mode serving vLLM's device KV buffer."""
        self._geometry: Geometry | None = None
        """A GPU engine's remap units (`self.view` serves them)."""
        self._lock = threading.Lock()
        self._pull_ended = threading.Condition(self._lock)
        self._in_flight = 0
        self._pulled: list[PullOutcome] = []
        self._load_errors: set[int] = set()
        self.links = PeerLinks(self.client, config.trusted_prefill(), config.link_timeout_s)
        self.loads = StepLoads(self.client, self.links, self._loaded)
        self._loading: dict[str, _Loading] = {}
        self._held: dict[str, float] = {}
        """Requests whose blocks are held for a decode node -> when (time.monotonic()) they go without an event."""
        self._epoch = ""
        """The instance epoch of the daemon this rank's grants live on."""
        self._released: dict[str, tuple[float, str]] = {}
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    # -- memory ---------------------------------------------------------------------------------------------------
    def allocation_context(self) -> DaemonKvAllocation:
        self._allocation = DaemonKvAllocation(self.layout, self._allocate)
        return self._allocation

    def _allocate(self) -> Cache:
        try:
            return self.client.allocate_cache(self.layout.desc())
        except LlmError as e:
            raise RuntimeError(f"KvBrokerConnector: cannot allocate the KV cache ({self.layout.buffer_bytes} bytes) "
                               f"through kvbrokerd at {self.config.target} (kvbroker_target): {e.status.name}: "
                               f"{e.message}") from e

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Checks that every layer vLLM will use lies in the daemon's cache, where the daemon expects it."""
        if self._allocation is None or self._allocation.cache is None or self._allocation.buffer is None:
            raise RuntimeError("vLLM allocated its KV cache outside the connector's allocation context (this vLLM "
                               "version is not supported by KvBrokerConnector)")
        self.cache = self._allocation.cache
        base = self._allocation.buffer.data_ptr()
        stride = self.cache.desc.tensor_nbytes
        layers = sorted({t.data_ptr() for t in kv_caches.values()})
        expected = [base + i * stride for i in range(self.layout.num_layers)]
        if layers != expected:
            raise RuntimeError(f"vLLM's KV layers start at offsets {[p - base for p in layers]} of the buffer, "
                               f"expected {[p - base for p in expected]}")
        # The tag says which byte is which token of which head: the attention backend's views must agree with it.
        lay = self.layout
        shape = ((lay.num_blocks, lay.block_size, lay.head_size) if lay.memory == MEMORY_MLA
                 else (lay.num_blocks, lay.num_kv_heads, lay.block_size, 2 * lay.head_size))
        # A Mamba layer's state, as vLLM hands it over: its bytes from the start of each block.
        state = (lay.num_blocks, 1, 1, lay.state_bytes) if lay.has_state else None
        for name, t in kv_caches.items():
            if tuple(t.shape) == state and t.element_size() == 1 and t.stride(0) == lay.page_bytes:
                continue
            if tuple(t.shape) != shape:
                raise RuntimeError(f"vLLM's KV layer {name} has shape {tuple(t.shape)}, not the {shape} of memory "
                                   f"layout {lay.memory} (this attention backend is not supported by "
                                   "KvBrokerConnector)")
        if lay.token_view:
            self._open_view()
        self._serve()

    def _open_view(self) -> None:
        """The token view of the cache (a second daemon cache over the same memory), or none: then the tag says so,
        and only engines of our block size pull from us or into us (as before views)."""
        assert self.cache is not None
        try:
            view = self.client.allocate_cache(self.layout.token_layout().desc(), view_of=self.cache)
        except LlmError as e:
            log.warning("kvbroker connector: no token view of KV cache %d (%s); pulls between engines of different "
                        "block sizes are refused", self.cache.cache_id, e.message)
            view = None
        if view is not None and view.record.tensors != self.cache.record.tensors:
            # A daemon that predates views ignores view_of and allocates new memory: never use that.
            log.warning("kvbroker connector: the daemon does not make views of a cache (older kvbrokerd); pulls "
                        "between engines of different block sizes are refused")
            with contextlib.suppress(LlmError):  # (else its lease frees it)
                self.client.deallocate_cache(view.cache_id, timeout=5.0)
            view = None
        self.view = view
        if view is None:
            self.layout = dataclasses.replace(self.layout, token_view=False)

    def register_gpu(self, kv_caches: dict[str, torch.Tensor], mode: str, vllm_layout: str | None,
                     saves: bool = True) -> None:
        """A GPU engine: vLLM keeps its KV buffer; the daemon serves it device-direct or host-staged (gpu.py)."""
        self.gpu, self.layout = open_gpu_kv(self.client, kv_caches, self.layout, mode, vllm_layout, saves=saves)
        self.cache = self.gpu.cache
        self._open_units(kv_caches)
        self._serve()

    def _open_units(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """A GPU engine's KV in the units of a TP or block-size remap (cuda_remap), as a second cache over the same
        memory; or none (said in the tag), and then only engines of our shape pull from us or into us."""
        assert self.gpu is not None
        try:
            runs = read_runs(kv_caches)
            geometry = read_geometry(kv_caches, runs, self.layout.block_size)
            self.view = self.gpu.open_units(units_desc(runs, geometry, self.layout, self.gpu.cache.desc.placement))
        except NoRemap as e:
            log.info("kvbroker connector: KV moves between engines of this TP size and block size only: %s", e)
            return
        except LlmError as e:
            log.warning("kvbroker connector: no remap units of KV cache %d (%s); pulls between engines of other TP "
                        "or block sizes are refused", self.gpu.cache.cache_id, e.message)
            return
        self._geometry = geometry
        self.layout = dataclasses.replace(self.layout, unit_geometry=geometry.text)

    def _serve(self) -> None:
        assert self.cache is not None
        info = self.client.get_cluster_info()
        self._epoch = info.instance_epoch
        self.endpoint = WorkerEndpoint(rank=self.slot, cluster_id=info.cluster_id,
                                       peer_address=self.config.peer_address or info.peer_address,
                                       cache_id=self.cache.cache_id, layout_tag=self.layout.tag(),
                                       view_cache_id=self.view.cache_id if self.view is not None else 0)
        log.info("kvbroker connector rank %d: KV cache %d (%d layers x %d blocks x %d bytes) in daemon %d's memory",
                 self.rank, self.cache.cache_id, self.layout.num_layers, self.layout.num_blocks,
                 self.layout.page_bytes, info.cluster_id)
        self._poller = threading.Thread(target=self._poll_releases, name="kvbroker-release", daemon=True)
        self._poller.start()

    # -- per step -------------------------------------------------------------------------------------------------
    def start(self, pulls: Iterable[PullSpec], holds: dict[str, float]) -> None:
        pulls = list(pulls)
        give_up = time.monotonic() + self.config.release_timeout_s + CAP_MARGIN_S
        with self._lock:
            for req_id in holds:
                self._held.setdefault(req_id, give_up)
            self._in_flight += len(pulls)
        items: list[PullItem] = []
        for spec in pulls:
            try:
                planned = self._items(spec)
            except Exception:  # a bug must not strand the request in WAITING_FOR_REMOTE_KVS
                log.exception("request %s: pull crashed; recomputing its KV", spec.request_id)
                self.transfers.record_recompute("error", pull_failed=True)
                planned = None
            if planned is None:
                self._report(spec.request_id, frozenset(spec.local_blocks))
                continue
            addressed, mine = planned
            remapped = addressed.physical and any(i.runs is not None for i in mine)  # (a GPU engine's unit cache)
            units = self._geometry.units_per_block if remapped and self._geometry else 0
            with self._lock:
                self._loading[spec.request_id] = _Loading(spec, len(mine), addressed, units)
            items += mine
        self.loads.submit(items)  # the step's pulls, one message

    def finished(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """(requests whose held blocks may be freed, requests whose pull ended); the pulls' failed blocks are
        moved to `take_load_errors` in the same call. With `wait_s`, and pulls in flight but none ended yet, first
        waits up to that long for one to end (for a step that computed nothing: see `ConnectorConfig.idle_wait_s`)."""
        with self._lock:
            if wait_s > 0:
                self._pull_ended.wait_for(lambda: self._pulled or not self._in_flight, timeout=wait_s)
            now = time.monotonic()
            pulled, self._pulled = self._pulled, []
            for outcome in pulled:
                self._load_errors |= outcome.failed_blocks
            sending = set()
            for req_id, give_up in list(self._held.items()):
                if req_id in self._released:
                    _, ended = self._released.pop(req_id)
                    if ended != "released":
                        log.warning("request %s: its grant ended (%s) before a decode node released it; freeing its "
                                    "KV blocks", req_id, ended)
                        self.transfers.record_expired_hold(ended.replace(" ", "_"))
                elif now >= give_up:
                    log.warning("request %s: no event for its grant by its cap (kvbroker_release_timeout_s = %g s) "
                                "plus %g s; freeing its KV blocks", req_id, self.config.release_timeout_s,
                                CAP_MARGIN_S)
                    self.transfers.record_expired_hold("no_event")
                else:
                    continue
                del self._held[req_id]
                sending.add(req_id)
            # Ends of grants this worker never held (or no longer holds) are forgotten after a while.
            for req_id, (at, _) in list(self._released.items()):
                if now - at > _RELEASED_KEPT_S:
                    del self._released[req_id]
        return sending, {o.request_id for o in pulled}

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -- decode: pulls --------------------------------------------------------------------------------------------
    def _report(self, request_id: str, failed: frozenset[int]) -> None:
        if failed:  # reported too: the request's output says its tokens were recomputed, not pulled
            self.transfers.record_failed(request_id)
        with self._lock:
            self._pulled.append(PullOutcome(request_id, failed))
            self._in_flight -= 1
            self._pull_ended.notify_all()
        self.transfers.record_outcome(ok=not failed)

    def _items(self, spec: PullSpec) -> tuple[KvLayout, list[PullItem]] | None:
        """How the pull addresses our KV, and the request's pulls as items of the step (one per prefill rank read);
        None when it cannot pull (then it is recomputed)."""
        if spec.refused:
            log.error("request %s: not pulling from prefill engine %s: %s", spec.request_id, spec.remote.engine_id,
                      spec.refused)
            self.transfers.record_recompute("block_mismatch")
            return None
        assert self.cache is not None
        remote = spec.remote
        refused = refusal(self.layout, remote.layout_tag)
        if refused is not None:
            log.error("request %s: incompatible KV layouts, recomputing: %s", spec.request_id, refused.message)
            self.transfers.record_recompute("layout")
            return None
        if why := self.links.refusal(remote.cluster_id):
            log.error("request %s: not pulling: %s", spec.request_id, why)
            self.transfers.record_recompute("untrusted")
            return None
        timeout = self.config.pull_timeout_s
        dst = self.cache.cache_id
        if self.layout.physical and (remote.tp_size != self.layout.tp_size or
                                     layout_of_tag(remote.layout_tag).block_size != self.layout.block_size):
            return self._gpu_remap_items(spec)  # a GPU engine of another shape (cuda_remap.refusal mapped it)
        if self.layout.physical:  # a GPU engine: whole blocks, rank to rank (remap.refusal saw equal shapes)
            if self.rank >= remote.tp_size:
                log.error("request %s: prefill engine has %d TP ranks, this is rank %d", spec.request_id,
                          remote.tp_size, self.rank)
                self.transfers.record_recompute("layout")
                return None
            return self.layout, [PullItem(spec.request_id, remote.cluster_id, remote.grant, self.rank, dst,
                                          tuple(spec.local_blocks), first_block=spec.first_block,
                                          ext_param=_ONE_TENSOR_PER_LAYER, timeout=timeout, trace=remote.trace)]
        described = layout_of_tag(remote.layout_tag)
        settled = settle(self.layout, described)
        assert settled is not None  # (refusal settled them)
        mine, theirs = settled
        # Their token view's slots follow their caches' in the grant; ours is another cache of the same memory.
        their_stages = described.stages
        workers = described.tp_size * their_stages.count
        first_slot = workers if theirs.token_units and not described.token_units else 0
        if mine.token_units and not self.layout.token_units:
            assert self.view is not None  # (no view: the tag says no remap, and refusal refused)
            dst = self.view.cache_id
        start, end = (spec.start_token, spec.end_token) if spec.end_token else (
            0, len(spec.local_blocks) * self.layout.block_size)
        parts = spec.parts or (PullPart(spec.local_blocks, spec.remote_blocks, start, end),)
        try:
            plan = _merged(plan_state(mine, self.rank, theirs, part.local_blocks[0], part.remote_blocks[0])
                           if part.state else
                           plan_pull(mine, self.rank, theirs, part.local_blocks, part.remote_blocks,
                                     part.start_token, part.end_token) for part in parts)
        except ValueError as e:
            log.error("request %s: cannot map the prefill engine's blocks, recomputing: %s", spec.request_id, e)
            self.transfers.record_recompute("block_mismatch")
            return None
        # One pull per prefill worker read (a TP rank of each pipeline stage holding some of our layers), each naming
        # units of that worker's cache that the grant must cover.
        layers = ([(self.layout.stage, _ONE_TENSOR_PER_LAYER)] if self.layout.pp == described.pp else
                  [(p.stage, p.ext_param) for p in layer_pulls(self.layout.stages, self.layout.stage, their_stages)])
        return mine, [PullItem(spec.request_id, remote.cluster_id, remote.grant,
                               first_slot + stage * described.tp_size + one.remote_rank, dst, (), runs=one.runs,
                               ext_param=ext, timeout=timeout, trace=remote.trace)
                      for stage, ext in layers for one in plan]

    def _gpu_remap_items(self, spec: PullSpec) -> tuple[KvLayout, list[PullItem]] | None:
        """A GPU engine's pull from one of another TP or block size: both sides' unit caches (cuda_remap)."""
        remote = spec.remote
        described = layout_of_tag(remote.layout_tag)
        theirs = remote_geometry(remote.layout_tag)
        assert self.view is not None and self._geometry is not None and theirs is not None  # (refusal saw units)
        start, end = (spec.start_token, spec.end_token) if spec.end_token else (
            0, len(spec.local_blocks) * self.layout.block_size)
        parts = spec.parts or (PullPart(spec.local_blocks, spec.remote_blocks, start, end),)
        try:
            plan = _merged(cuda_remap_pull(self.layout, self._geometry, self.rank, described, theirs,
                                           part.local_blocks, part.remote_blocks, part.start_token, part.end_token)
                           for part in parts)
        except ValueError as e:
            log.error("request %s: cannot map the prefill engine's blocks, recomputing: %s", spec.request_id, e)
            self.transfers.record_recompute("block_mismatch")
            return None
        # Their unit caches' slots follow their caches' in the grant.
        return self.layout, [PullItem(spec.request_id, remote.cluster_id, remote.grant,
                                      described.tp_size + one.remote_rank, self.view.cache_id, (), runs=one.runs,
                                      ext_param=_ONE_TENSOR_PER_LAYER, timeout=self.config.pull_timeout_s,
                                      trace=remote.trace) for one in plan]

    def _loaded(self, outcome: LoadOutcome) -> None:
        """A request's pulls ended (from loads.py's threads)."""
        with self._lock:
            loading = self._loading.pop(outcome.request_id, None)
        if loading is None:  # pragma: no cover - every item submitted was registered first
            return
        spec = loading.spec
        everything = frozenset(spec.local_blocks)
        failed: frozenset[int] = frozenset()
        try:
            if outcome.failed_blocks:  # the local units (or blocks) that did not land, as the blocks holding them
                units = sorted(outcome.failed_blocks)
                # (A GPU engine's cache is addressed in whole blocks, its unit cache in `gpu_units` per block.)
                held = (frozenset(u // (loading.gpu_units or 1) for u in units) if loading.layout.physical else
                        blocks_of_units(loading.layout, units))
                failed = held & everything or everything
                self.transfers.record_recompute(reason_of(outcome.status) if outcome.status is not None else "error",
                                                pull_failed=True)
            else:
                if self.gpu is not None:
                    self.gpu.landed(spec.local_blocks)  # host-staged: into VRAM before vLLM may schedule it
                whole = len(spec.local_blocks) * self.layout.block_size
                tokens = spec.end_token - spec.start_token if spec.end_token else whole
                backend = ",".join(dict.fromkeys(outcome.backend.split(",")))
                self.transfers.record(spec.request_id, outcome.bytes_moved, outcome.seconds, backend, tokens=tokens)
                if self.config.log_transfers:
                    log.info("kvbroker pull: request %s, %d blocks, %d bytes in %.2f ms over %s (%.2f GB/s) from %d "
                             "prefill rank(s)", spec.request_id, len(spec.local_blocks), outcome.bytes_moved,
                             outcome.seconds * 1e3, backend, outcome.bytes_moved / max(outcome.seconds, 1e-9) / 1e9,
                             loading.sources)
        except Exception:
            log.exception("request %s: finishing its pull crashed; recomputing its KV", spec.request_id)
            self.transfers.record_recompute("error", pull_failed=True)
            failed = everything
        self._report(spec.request_id, failed)

    # -- prefill: releases ----------------------------------------------------------------------------------------
    def _poll_releases(self) -> None:
        topic = release_topic(self.engine_id, self.slot)
        failing_since = 0.0
        epoch_checked = time.monotonic()
        while not self._stop.is_set():
            try:
                if failing_since or time.monotonic() - epoch_checked >= _EPOCH_CHECK_S:
                    self.check_daemon_epoch()
                    epoch_checked = time.monotonic()
                notes = self.client.fetch_notifications(
                    topic, wait=_POLL_WAIT_S, timeout=_POLL_WAIT_S + 10.0)
                failing_since = 0.0
            except LlmError as e:
                if not failing_since:
                    failing_since = time.monotonic()
                    log.warning("kvbroker connector: cannot fetch grant events (%s); held blocks stay held until "
                                "this recovers", e.message)
                self._stop.wait(_POLL_WAIT_S)
                continue
            now = time.monotonic()
            ours = self.endpoint.cluster_id if self.endpoint is not None else -1
            for note in notes:
                if note.cluster_id != ours:
                    # Only our daemon ends our grants; a peer's note on this topic frees nothing.
                    log.warning("kvbroker connector: ignoring a note on the grant topic from cluster %d",
                                note.cluster_id)
                    continue
                try:
                    req_id, outcome = parse_release(note.payload)
                except ValueError:
                    log.warning("kvbroker connector: ignoring a malformed grant event")
                    continue
                self.note_release(req_id, outcome, now)

    def check_daemon_epoch(self) -> None:
        """Frees every hold made before, where the daemon is a new instance: the grants lived in the old one's memory
        (no event will ever come for them, and no pull can read them). Raises LlmError where the daemon does not
        answer."""
        epoch = self.client.get_cluster_info().instance_epoch
        with self._lock:
            if epoch == self._epoch or not self._epoch:  # (none yet: no grants were made before)
                self._epoch = epoch
                return
            old, self._epoch = self._epoch, epoch
            now = time.monotonic()
            for req_id in self._held:
                self._released[req_id] = (now, _DAEMON_RESTARTED)
            stranded = len(self._held)
        log.warning("kvbroker connector: the daemon restarted (instance %s, was %s); freeing the KV blocks of the %d "
                    "requests granted before", epoch, old, stranded)

    def note_release(self, request_id: str, outcome: str, at: float | None = None) -> None:
        """A request's grant ended (the event may arrive before the hold itself)."""
        with self._lock:
            self._released[request_id] = (time.monotonic() if at is None else at, outcome)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the threads and gives the KV memory back to the daemon; idempotent."""
        self._stop.set()
        self.loads.close()
        if self._poller is not None:
            self._poller.join(timeout=_POLL_WAIT_S + 11.0)
            self._poller = None
        if self.view is not None and self.gpu is None:  # (a GPU engine's units close with it)
            try:
                self.client.deallocate_cache(self.view.cache_id, timeout=5.0)
            except LlmError as e:  # the lease frees it anyway
                log.warning("kvbroker connector: could not free KV cache view %d (%s)", self.view.cache_id, e.message)
            self.view = None
        if self.cache is not None:
            try:
                if self.gpu is not None:
                    self.gpu.close()
                else:
                    self.client.deallocate_cache(self.cache.cache_id, timeout=5.0)
            except LlmError as e:  # the lease frees it anyway
                log.warning("kvbroker connector: could not free KV cache %d (%s)", self.cache.cache_id, e.message)
            self.cache = None
        self.client.close()
